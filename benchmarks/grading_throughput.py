"""How fast does the autograder grade a class, and what does grading in parallel buy?

    python benchmarks/grading_throughput.py                 # 10 correct submissions, --jobs 1 then 2
    python benchmarks/grading_throughput.py --students 4 --jobs 1 4

Every submission is the correct solution of 05_allreduce (so every test cell runs to the end);
each is graded in its own worker with its own gradebook, and all of them start real process
groups at the same time without sharing a port. Prints seconds per submission and the speed-up
over one at a time, and checks that every submission got full marks.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fake_class import SUBMISSIONS  # noqa: E402

import nbformat  # noqa: E402


def write_class(root: Path, students: int) -> Path:
    for i in range(students):
        folder = root / "submitted" / f"student{i:02d}" / "05_allreduce"
        folder.mkdir(parents=True)
        nbformat.write(SUBMISSIONS["alice"], folder / "allreduce_by_hand.ipynb")
    return root / "submitted"


def grade(submitted: Path, out: Path, jobs: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "autograder", "grade", str(submitted), "--out", str(out),
                    "--jobs", str(jobs)], cwd=ROOT, check=True, capture_output=True, timeout=7200)
    elapsed = time.perf_counter() - start
    with open(out / "grades.csv") as f:
        scores = [float(row["score"]) for row in csv.DictReader(f)]
    assert scores and all(s == 13 for s in scores), f"not every submission got 13/13: {scores}"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=10)
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddpcourse-grading-bench-") as tmp:
        submitted = write_class(Path(tmp), opts.students)
        print(f"{opts.students} correct submissions of 05_allreduce")
        print(f"{'jobs':>4} {'total s':>8} {'s/submission':>13} {'speed-up':>9}")
        baseline = None
        for jobs in opts.jobs:
            elapsed = grade(submitted, Path(tmp) / f"out-{jobs}", jobs)
            baseline = baseline or elapsed
            print(f"{jobs:>4} {elapsed:>8.1f} {elapsed / opts.students:>13.1f} "
                  f"{baseline / elapsed:>9.2f}")


if __name__ == "__main__":
    main()
