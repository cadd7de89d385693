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
