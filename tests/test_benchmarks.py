"""The benchmark scripts run and print their tables (their figures are not asserted: wall-clock
time on a shared 2-core machine is noise for a test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_launcher_overhead_benchmark_prints_every_method():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/launcher_overhead.py"), "--quick"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for method in ["run_ranks, first call", "run_ranks, later calls (warm)",
                   "torch.multiprocessing.spawn", "torchrun --standalone"]:
        line = next(l for l in done.stdout.splitlines() if l.startswith(method))
        median = float(line.split()[-4])
        assert median > 0


def test_the_recorded_self_check_run_is_complete_and_its_sentences_follow_from_it():
    from course_layout import import_by_path
    from ddpcourse.timing import load_reference

    bench = import_by_path("self_check_benchmark", ROOT / "benchmarks/self_check.py")
    record = load_reference("self_check.json")  # machine, date, torch, command, load
    assert set(record["seconds"]) == set(bench.WAYS)
    assert all(len(samples) == record["rounds"] for samples in record["seconds"].values())
    assert (ROOT / record["notebook"]).exists()
    assert record["findings"] == bench.findings(record)
