"""How fast does the autograder grade a class: one at a time, in parallel, in shards; and how much
of a submission's time is nbgrader's own.

    python benchmarks/grading_throughput.py                        # 4 students, 3 rounds: ~25 min
    python benchmarks/grading_throughput.py --students 2 --rounds 2
    python benchmarks/grading_throughput.py --out benchmarks/results/grading_throughput.json

Every submission is the correct ``allreduce_by_hand`` of 05_allreduce (the fake class's alice,
tests/fake_class), so every test cell runs to the end; each is graded in its own worker with its
own gradebook. Each round grades the class three ways, in turn, from fresh processes:

* ``--jobs 1`` and ``--jobs 2``: one grading command;
* ``2 shards at once``: ``--shard 1/2`` and ``--shard 2/2`` (``--jobs 1`` each) side by side, then
  ``merge``, timed from the start to the merged output, as a two-node cluster would (here both
  shards share this machine's cores, so on 2 cores this is ``--jobs 2`` plus the shards' start);

and reports students per minute (min and median over the rounds, from the fastest and the
median time), and the peak memory of the grading command's process tree (the sum of every
process's proportional set size, PSS, sampled twice a second), which sizes a cluster task.

Then **nbgrader's own fixed cost per submission**: a fresh process runs nbgrader's
``generate_assignment``, ``autograde``, ``generate_feedback`` and ``export`` with the course's
configuration on a generated one-cell assignment with no multi-rank checks (``answer()`` returns
42), as each grading worker does for its student; beside it, the course's own cost per
submission (the ``--jobs 1`` runs' per-student seconds). Every figure is printed; a record is
written only with ``--out``, and says whether the machine was quiet enough to conclude
(``ddpcourse.timing.judge``).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import nbformat  # noqa: E402

from ddpcourse.launcher.processes import live_descendants  # noqa: E402
from ddpcourse.timing import (  # noqa: E402
    Timing, close_record, command_line, machine_load, reference_header)

ASSIGNMENT = "05_allreduce"
POINTS = 13  # a correct allreduce_by_hand, the only notebook handed in
WAYS = ("--jobs 1", "--jobs 2", "2 shards at once")


def write_class(root: Path, students: int) -> Path:
    from fake_class import SUBMISSIONS

    for i in range(students):
        folder = root / "submitted" / f"student{i:02d}" / ASSIGNMENT
        folder.mkdir(parents=True)
        nbformat.write(SUBMISSIONS["alice"], folder / "allreduce_by_hand.ipynb")
    return root / "submitted"


class PeakMemory:
    """The largest sum of PSS over this process's descendants, sampled every ``interval`` s."""

    def __init__(self, interval: float = 0.5):
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak_bytes = max(self.peak_bytes, sum(map(_pss_bytes, live_descendants())))


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def grade_command(submitted: Path, out: Path, jobs: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "autograder", "grade", str(submitted), "--assignment",
            ASSIGNMENT, "--out", str(out), "--jobs", str(jobs), *extra]


def check_scores(out: Path, students: int) -> None:
    with open(out / "grades.csv") as f:
        scores = [float(row["score"]) for row in csv.DictReader(f)]
    if len(scores) != students or any(score != POINTS for score in scores):
        raise RuntimeError(f"not every submission got {POINTS}/{POINTS}: {scores}")


def grade_way(way: str, submitted: Path, out: Path, students: int) -> tuple[float, int]:
    """Grade the class one way; (seconds from start to grades.csv, peak PSS bytes)."""
    if way.startswith("--jobs"):
        commands = [grade_command(submitted, out, int(way.split()[1]))]
    else:
        commands = [grade_command(submitted, out.with_name(f"{out.name}-shard{i}"), 1,
                                  "--shard", f"{i}/2") for i in (1, 2)]
    with PeakMemory() as memory:
        start = time.perf_counter()
        running = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT) for command in commands]
        try:
            for process in running:
                log = process.communicate(timeout=7200)[0]
                if process.returncode:
                    raise RuntimeError(f"{way}: grading failed:\n{log.decode()[-3000:]}")
        finally:
            for process in running:
                process.kill()
                process.wait()
        if len(commands) > 1:
            subprocess.run([sys.executable, "-m", "autograder", "merge",
                            *(c[c.index("--out") + 1] for c in commands), "--out", str(out)],
                           cwd=ROOT, check=True, capture_output=True, timeout=600)
        elapsed = time.perf_counter() - start
    check_scores(out, students)
    return elapsed, memory.peak_bytes


# --- nbgrader alone, on a one-cell assignment ----------------------------------------------

def _cell(source: str, grade_id: str, solution: bool) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata.nbgrader = {"grade": not solution, "grade_id": grade_id, "locked": not solution,
                              "points": 0 if solution else 1, "schema_version": 3,
                              "solution": solution, "task": False}
    return cell


def write_trivial_course(root: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [_cell("def answer():\n    ### BEGIN SOLUTION\n    return 42\n    ### END SOLUTION",
                      "answer", solution=True),
                _cell("assert answer() == 42", "test-answer", solution=False)]
    for folder in (root / "source" / "trivial", root / "submitted" / "student" / "trivial"):
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / "trivial.ipynb")


def nbgrader_once(root: Path) -> dict:
    """In a fresh process: what a grading worker asks of nbgrader, step by step (seconds)."""
    from autograder.nbgrader_api import api_for, check, load_config

    steps, start = {}, time.perf_counter()
    config = load_config(root, source_directory="source", submitted_directory="submitted",
                         autograded_directory="autograded", feedback_directory="feedback",
                         release_directory="release")
    api = api_for(config)
    steps["import and configure"] = time.perf_counter() - start
    for name, call in (("generate_assignment", lambda: api.generate_assignment(
                            "trivial", force=True, create=True)),
                       ("autograde", lambda: api.autograde("trivial", "student", force=True,
                                                           create=True)),
                       ("generate_feedback", lambda: api.generate_feedback(
                           "trivial", "student", force=True))):
        t = time.perf_counter()
        check(call(), name)
        steps[name] = time.perf_counter() - t
    t = time.perf_counter()
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    with Gradebook(config.CourseDirectory.db_url) as gb:
        CsvExportPlugin(to=str(root / "grades.csv"), assignment=["trivial"]).export(gb)
        score = gb.find_submission("trivial", "student").score
    steps["export"] = time.perf_counter() - t
    if score != 1:
        raise RuntimeError(f"the trivial submission scored {score}, not 1")
    return steps


def nbgrader_fixed_cost(tmp: Path, round_: int) -> tuple[float, dict]:
    root = tmp / f"trivial-{round_}"
    write_trivial_course(root)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--nbgrader-once", str(root)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=True)
    return time.perf_counter() - start, json.loads(done.stdout.splitlines()[-1])


# --- the report ------------------------------------------------------------------------------

def findings(record: dict) -> list[str]:
    """The record's figures in words, computed from its numbers."""
    students, lines = record["students"], []
    for way in WAYS:
        t = Timing.of(record["seconds"][way])
        lines.append(f"{way}: {60 * students / t.min:.1f} students/min at best, "
                     f"{60 * students / t.median:.1f} median ({t.min:.0f}/{t.median:.0f} s for "
                     f"{students}); peak memory {max(record['peak_pss_mib'][way]):.0f} MiB")
    nbgrader = Timing.of(record["nbgrader_seconds"])
    course = Timing.of(record["course_seconds_per_submission"])
    lines.append(f"nbgrader alone, one-cell notebook, per submission: min {nbgrader.min:.1f} s, "
                 f"median {nbgrader.median:.1f} s; the course's grading of one submission "
                 f"(--jobs 1): min {course.min:.1f} s, median {course.median:.1f} s "
                 f"(nbgrader's fixed part: {100 * nbgrader.median / course.median:.0f}% of the "
                 "median)")
    if not record["conclusive"]:
        lines.append("not conclusive (see the verdict): read these as this run's figures only")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the record here as JSON")
    parser.add_argument("--note", default="", help="what the reader should know about the run")
    parser.add_argument("--nbgrader-once", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nbgrader_once:
        print(json.dumps(nbgrader_once(args.nbgrader_once)))
        return 0

    load = machine_load(2.0)
    record = reference_header(command_line(), load, args.note)
    record.update(assignment=ASSIGNMENT, students=args.students, rounds=args.rounds,
                  seconds={way: [] for way in WAYS}, peak_pss_mib={way: [] for way in WAYS},
                  course_seconds_per_submission=[], nbgrader_seconds=[], nbgrader_steps=[])
    with tempfile.TemporaryDirectory(prefix="ddpcourse-grading-bench-") as tmp:
        submitted = write_class(Path(tmp), args.students)
        for round_ in range(args.rounds):
            for way in WAYS:
                out = Path(tmp) / f"out-{round_}-{WAYS.index(way)}"
                seconds, peak = grade_way(way, submitted, out, args.students)
                record["seconds"][way].append(round(seconds, 2))
                record["peak_pss_mib"][way].append(round(peak / 2**20))
                if way == "--jobs 1":
                    results = json.loads((out / "summary.json").read_text())["results"]
                    record["course_seconds_per_submission"] += [r["seconds"] for r in results]
                print(f"round {round_}: {way}: {seconds:.1f} s, "
                      f"{60 * args.students / seconds:.1f} students/min, "
                      f"peak {peak / 2**20:.0f} MiB", flush=True)
            seconds, steps = nbgrader_fixed_cost(Path(tmp), round_)
            record["nbgrader_seconds"].append(round(seconds, 2))
            record["nbgrader_steps"].append({k: round(v, 2) for k, v in steps.items()})
            print(f"round {round_}: nbgrader alone: {seconds:.1f} s (" + ", ".join(
                f"{k} {v:.1f}" for k, v in steps.items()) + ")", flush=True)
    timings = {way: Timing.of(s) for way, s in record["seconds"].items()}
    timings["nbgrader alone"] = Timing.of(record["nbgrader_seconds"])
    close_record(record, timings, load, statistic="median")
    record["findings"] = findings(record)
    print("\n".join(record["findings"]))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print("written:", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
