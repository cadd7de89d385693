"""Chapter 10 (performance): ``throttled_network.py``, two torchrun nodes over a rate-limited link.

As root (CI is), the script runs in short mode: its all-reduce over 100 Mbit/s cannot beat the
bytes over the rate (a bound the qdisc enforces, not a timing that load can flip), and it leaves
no namespace and no process behind — also when interrupted with Ctrl-C while its nodes run.
Without root these tests are skipped with the reason; the parsing and the refusal run anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chapter_launch import launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "chapters" / "10_performance" / "throttled_network.py"
sys.path.insert(0, str(SCRIPT.parent))

import throttled_network as tn  # noqa: E402

needs_root = pytest.mark.skipif(tn.why_not() is not None, reason=f"throttled_network.py "
                                f"{tn.why_not()}")


def our_namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("ddp10-")}


def workers_alive() -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"_throttled_worker.py" in (entry / "cmdline").read_bytes():
                alive.append(int(entry.name))
        except OSError:
            pass
    return alive


def test_rates_are_read_as_tc_writes_them():
    assert tn.parse_rate("unlimited") is None
    assert tn.parse_rate("100mbit") == 1e8 and tn.parse_rate("1gbit") == 1e9
    assert tn.parse_rate("2.5kbit") == 2500
    with pytest.raises(ValueError, match="100mbit"):
        tn.parse_rate("100MB/s")


@needs_root
def test_a_slower_link_takes_the_bytes_over_its_rate_and_nothing_is_left_behind():
    before = our_namespaces()
    done = launch([SCRIPT, "--short", "--json"], timeout=600)
    rows = {r["rate"]: r for r in (json.loads(l[5:]) for l in done.stdout.splitlines()
                                   if l.startswith("JSON "))}
    assert set(rows) == {"unlimited", "100mbit"}
    slow = rows["100mbit"]
    # each rank sends 2(N-1)/N = 1x the buffer through a 1e8 bit/s link, less what tbf's burst
    # (10 ms of the rate, at least 64 KiB) lets through at once
    burst = max(64 * 1024, 1e8 / 8 * 0.01)
    assert slow["allreduce"]["best_s"] >= 0.9 * (slow["allreduce_bytes"] - burst) * 8 / 1e8
    assert slow["ddp_step"]["best_s"] >= 0.9 * (slow["gradient_bytes"] - burst) * 8 / 1e8
    assert "169.254." in done.stdout and "namespaces deleted" in done.stdout
    assert our_namespaces() == before and not workers_alive()


@needs_root
def test_ctrl_c_while_the_nodes_run_deletes_the_namespaces_and_stops_the_nodes():
    before = our_namespaces()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--short"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not workers_alive() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert workers_alive(), "the nodes never started"
        assert our_namespaces() - before
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0  # interrupted, not finished
    assert our_namespaces() == before
    time.sleep(1)
    assert not workers_alive()


def test_without_root_it_says_why_and_touches_nothing(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in tn.why_not()


def test_the_recorded_run_takes_the_bytes_over_each_rate_as_the_model_says():
    from ddpcourse import cost_model as cm
    from ddpcourse.timing import load_reference

    record = load_reference("ch10_throttled_network.json")
    assert [r["rate"] for r in record["rows"]] == ["unlimited", "1gbit", "100mbit"]
    for r in record["rows"][1:]:
        link = cm.Link(record["alpha_s"], r["bits_per_s"] / 8)
        assert r["predicted_allreduce_s"] == pytest.approx(
            cm.allreduce_time(r["allreduce_bytes"], 2, link))
        burst = max(64 * 1024, r["bits_per_s"] / 8 * 0.01)
        assert r["allreduce"]["best_s"] >= (r["allreduce_bytes"] - burst) * 8 / r["bits_per_s"]
