"""How long a student's self-check of one exercise notebook takes, as JSON.

    python benchmarks/self_check.py                  # about three minutes on 2 cores
    python benchmarks/self_check.py --rounds 2 --out /tmp/self_check.json

A student runs ``pytest exercises/NN_topic/SLUG.ipynb`` (or the folder) after every edit, so its
start-up cost is paid again and again. The repository's pytest settings say ``-n auto``, which
``exercises/conftest.py`` turns into no worker processes for one notebook (``tests/`` still gets
two). This times, from a fresh process each time, the self-check of the released stub of
``--notebook`` (what a student runs first: every visible test fails at once with
NotImplementedError) both ways: as the settings now run it, and with ``-n 2`` (two pytest-xdist
workers, the settings' earlier default). The two take turns, round after round, so that other
work on the machine disturbs them alike; the record says whether the repeats agreed
(``ddpcourse.timing.judge``) and whether the target (at most 15 s on 2 cores) was met.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpcourse.timing import (  # noqa: E402
    Timing, close_record, command_line, machine_load, reference_header, write_record)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "self_check.json"
DEFAULT_NOTEBOOK = "exercises/06_data_loading/sampler_by_hand.ipynb"
TARGET_S = 15.0
WAYS = {"as configured (-n auto: one process)": [], "-n 2 (two xdist workers)": ["-n", "2"]}


def self_check_seconds(notebook: str, extra: list[str]) -> float:
    """One self-check from a fresh process, as a student types it; its wall-clock seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *extra, notebook], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if "NotImplementedError" not in done.stdout or " failed" not in done.stdout:
        raise RuntimeError(f"the self-check did not report the stub's failures:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def findings(record: dict) -> list[str]:
    """The record's conclusions, computed from its numbers."""
    lines = []
    for way, samples in record["seconds"].items():
        timing = Timing.of(samples)
        lines.append(f"{way}: min {timing.min:.1f} s, median {timing.median:.1f} s")
    configured = Timing.of(record["seconds"][next(iter(WAYS))])
    if not record["conclusive"]:
        lines.append("no conclusion is drawn: the verdict says this run is not conclusive")
    else:
        met = "met" if configured.median <= record["target_s"] else "NOT met"
        lines.append(f"target of {record['target_s']:g} s for one notebook on "
                     f"{record['machine']['usable_cores']} cores: {met} (median "
                     f"{configured.median:.1f} s)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", default=DEFAULT_NOTEBOOK)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--note", default="", help="what the reader should know about the run")
    args = parser.parse_args()
    load = machine_load(2.0)
    record = reference_header(command_line(), load, args.note)
    record.update(notebook=args.notebook, rounds=args.rounds, target_s=TARGET_S,
                  seconds={way: [] for way in WAYS})
    for round_ in range(args.rounds):
        for way, extra in WAYS.items():
            seconds = self_check_seconds(args.notebook, extra)
            record["seconds"][way].append(round(seconds, 3))
            print(f"round {round_}: {way}: {seconds:.1f} s", flush=True)
    close_record(record, {way: Timing.of(s) for way, s in record["seconds"].items()}, load,
                 statistic="median")
    record["findings"] = findings(record)
    print("\n".join(record["findings"]))
    write_record(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
