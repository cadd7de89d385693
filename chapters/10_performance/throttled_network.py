"""A network you can turn down: two torchrun "nodes" on one machine, joined by a rate-limited link.

    python chapters/10_performance/throttled_network.py            # as root (sudo)
    python chapters/10_performance/throttled_network.py --rates unlimited 1gbit 100mbit 20mbit

The lesson's reference run (as root): ``python chapters/10_performance/throttled_network.py --out
benchmarks/results/ch10_throttled_network.json``.

Launch test: custom (tests/test_chapter_10_throttled_network.py runs it, as root, in short mode).

Each "node" is a network namespace of its own (``ip netns``), holding one end of a virtual
Ethernet pair (``veth``); on both ends a token-bucket filter (``tc qdisc ... tbf rate R``) limits
what leaves the interface to ``R``, so the link carries at most ``R`` each way. One torchrun
per namespace (``--nnodes 2 --node_rank 0/1``, rank 0's namespace address as the master) runs
_throttled_worker.py: an all-reduce of 4 MiB and a DDP step of the 1.58 MB-gradient model of
buckets_and_hooks.py, timed, and the same step without DDP (the weak-scaling baseline). For
each rate it prints the measured times, the scaling efficiency (step without DDP / DDP step,
per rank), and what the α–β model (``ddpcourse.cost_model``, β = the rate, α fitted to the
recorded all-reduce run) predicts, with ``--json`` one JSON line per rate.

What it touches, and why that is safe:

* only what it creates: two namespaces and one veth pair, named with this run's own suffix
  (process id and random hex: ``ddp10-<suffix>-a``/``-b``), so parallel runs never share one;
* addresses only inside those namespaces: ``169.254.<x>.1`` and ``.2/24``, link-local (RFC 3927):
  never routed, and a fresh namespace has no other interface (not even the host's) that could
  hold the same range; the port is free for the same reason (nothing else listens there);
* everything is deleted afterwards — deleting a namespace deletes its veth end, and with it the
  pair and its qdiscs — in a ``finally``, also when a run fails, times out (``--timeout``) or is
  interrupted (Ctrl-C, SIGTERM: turned into an exception so that the ``finally`` runs).

Without root, or without ``ip``/``tc``, it says why and exits 0 having done nothing. The kernel
here has ``tbf`` but not ``netem`` (no delay emulation): the rate is the only knob.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from ddpcourse import cost_model as cm  # noqa: E402
from ddpcourse.launcher import interrupts_deferred  # noqa: E402

RATES = {"unlimited": None, "1gbit": 1e9, "100mbit": 1e8}
SHORT_RATES = ["unlimited", "100mbit"]


def parse_rate(text: str) -> float | None:
    """'unlimited' -> None; '100mbit' -> 1e8 bits/s (tc's units: kbit, mbit, gbit)."""
    if text == "unlimited":
        return None
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.lower())
    if not found:
        raise ValueError(f"rate {text!r}: write e.g. 100mbit, 1gbit or unlimited")
    return float(found.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[found.group(2)]


def why_not() -> str | None:
    """Why this machine cannot run it (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and qdiscs): run it with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (Debian: apt-get install iproute2)"
    return None


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


class Link:
    """Two namespaces joined by a veth pair; a context manager that deletes what it made."""

    def __init__(self):
        suffix = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.namespaces = (f"ddp10-{suffix}-a", f"ddp10-{suffix}-b")
        self.devices = (f"v10a{suffix}"[:15], f"v10b{suffix}"[:15])
        subnet = secrets.randbelow(254) + 1  # 169.254.0.0/16 less .0 and .255 subnets
        self.addresses = (f"169.254.{subnet}.1", f"169.254.{subnet}.2")
        self.made: list[str] = []

    def __enter__(self) -> "Link":
        try:
            for ns in self.namespaces:
                sh("ip", "netns", "add", ns)
                self.made.append(ns)
            sh("ip", "link", "add", self.devices[0], "netns", self.namespaces[0], "type", "veth",
               "peer", "name", self.devices[1], "netns", self.namespaces[1])
            for ns, dev, addr in zip(self.namespaces, self.devices, self.addresses):
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, bits_per_s: float | None) -> None:
        """Limit both directions to ``bits_per_s`` (None: take the limit off)."""
        for ns, dev in zip(self.namespaces, self.devices):
            if bits_per_s is None:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev,
                                "root"], capture_output=True, timeout=30)  # none yet: fine
            else:
                # tbf refills its bucket once per timer tick: a burst below what the rate
                # delivers in a tick (~10 ms here) caps the rate below the one asked for
                burst = max(64 * 1024, int(bits_per_s / 8 * 0.01))
                sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                   f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "500ms")

    def close(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()

    def __exit__(self, *exc) -> None:
        self.close()


def run_nodes(link: Link, repeats: int, timeout: float) -> dict:
    """One torchrun per namespace; rank 0's RESULT line, parsed. Kills both on any failure."""
    port = str(20000 + secrets.randbelow(20000))  # nothing else listens in these namespaces
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    procs = []
    try:
        for node, ns in enumerate(link.namespaces):
            # a Ctrl-C (or SIGTERM) while Popen starts a node would leave it running untracked
            with interrupts_deferred((signal.SIGINT, signal.SIGTERM)):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                     "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
                     "--master_addr", link.addresses[0], "--master_port", port,
                     str(HERE / "_throttled_worker.py"), "--repeats", str(repeats)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env={**os.environ, "GLOO_SOCKET_IFNAME": link.devices[node], "PYTHONPATH": path},
                    start_new_session=True))
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"node(s) {failed} failed:\n" + "\n".join(
            f"--- node {i}\n{out[-1500:]}\n{err[-3000:]}" for i, (out, err) in enumerate(outputs)))
    line = next(l for l in outputs[0][0].splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def recorded_alpha() -> float:
    """α of 2 ranks fitted to the recorded all-reduce run (benchmarks/results/ch10_allreduce.json):
    the per-call cost, which a rate limit does not change."""
    from ddpcourse.timing import load_reference
    return load_reference("ch10_allreduce.json")["fit"]["2"]["alpha_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=list(RATES),
                        help="tc rates: unlimited, 1gbit, 100mbit, ...")
    parser.add_argument("--short", action="store_true", help=f"rates {' '.join(SHORT_RATES)}, "
                        "3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (3 with --short)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per rate")
    parser.add_argument("--json", action="store_true", help="also print one JSON line per rate")
    parser.add_argument("--out", type=Path, help="write a reference record (JSON) here")
    parser.add_argument("--note", default="", help="what the reader should know about the run")
    opts = parser.parse_args()
    reason = why_not()
    if reason:
        print(f"SKIPPED: {reason}")
        return 0
    rates = SHORT_RATES if opts.short else opts.rates
    repeats = opts.repeats or (3 if opts.short else 5)

    def interrupted(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    from ddpcourse.timing import machine_load
    load = machine_load(1.0)
    rows = []
    with Link() as link:
        print(f"namespaces {link.namespaces[0]} ({link.addresses[0]}) and {link.namespaces[1]} "
              f"({link.addresses[1]}), one veth pair")
        for rate in rates:
            bits = parse_rate(rate)
            link.set_rate(bits)
            found = run_nodes(link, repeats, opts.timeout)
            rows.append({"rate": rate, "bits_per_s": bits, **found})
    alpha = recorded_alpha()
    print(f"{'rate':>10} {'all-reduce ms':>14} {'predicted':>10} {'DDP step ms':>12} "
          f"{'no DDP ms':>10} {'efficiency':>10}")
    for r in rows:
        nbytes = r["allreduce_bytes"]
        predicted = ""
        if r["bits_per_s"] is not None:
            r["predicted_allreduce_s"] = cm.allreduce_time(nbytes, 2, cm.Link(alpha,
                                                                            r["bits_per_s"] / 8))
            predicted = f"{1e3 * r['predicted_allreduce_s']:.1f}"
        r["efficiency"] = r["step_without_ddp"]["best_s"] / r["ddp_step"]["best_s"]
        print(f"{r['rate']:>10} {1e3 * r['allreduce']['best_s']:>14.1f} {predicted:>10} "
              f"{1e3 * r['ddp_step']['best_s']:>12.1f} "
              f"{1e3 * r['step_without_ddp']['best_s']:>10.1f} {r['efficiency']:>10.2f}")
        if opts.json:
            print("JSON " + json.dumps(r))
    print(f"(best of {repeats}; all-reduce of {rows[0]['allreduce_bytes']} bytes, DDP step of a "
          f"{rows[0]['gradient_bytes']}-byte gradient in one bucket; predicted: α + n/β with "
          f"β = the rate, α = {1e6 * alpha:.0f} µs fitted to the recorded all-reduce run)")
    print("namespaces deleted")
    if opts.out:
        from ddpcourse.timing import command_line, reference_header
        record = reference_header(command_line(), load, opts.note)
        record.update(repeats=repeats, alpha_s=alpha, rows=rows)
        opts.out.write_text(json.dumps(record, indent=1) + "\n")
        print("written:", opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
