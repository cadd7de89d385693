"""Grade a class: one isolated worker per submission, several at once, one CSV at the end.

    python -m autograder grade SUBMISSIONS --assignment 05_allreduce [--out autograder/course]
                               [--shard I/N]

``SUBMISSIONS`` is nbgrader's ``submitted/`` layout: ``SUBMISSIONS/{student}/{assignment}/*.ipynb``.
Each student is graded by ``autograder/worker.py`` in its own process session, course directory
and gradebook, so submissions run in parallel with nothing shared (the ranks of every test meet
through private FileStores: no ports). A worker that passes ``--student-timeout`` is killed with
everything it started; this process is a child subreaper, so even processes a kernel leaves behind
come back to it and are killed. Results: ``OUT/grades.csv`` (nbgrader export's columns, then
``status``, ``flags``, ``notes`` and one column per test cell), ``OUT/feedback/{student}/
{assignment}/*.html``, and a summary table on stdout. ``--shard I/N`` grades one shard of the
class; ``python -m autograder merge`` joins the shards' outputs (``autograder/merge.py``).
"""

from __future__ import annotations

import csv
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from autograder.merge import DEFAULT_EXPORT_COLUMNS, Shard
from autograder.nbgrader_api import REPO
from autograder.notices import write_notice
from ddpcourse.launcher.processes import kill_process_group, live_descendants, process_table

_PR_SET_CHILD_SUBREAPER = 36
MAX_LOG_BYTES = 1_000_000


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def find_submissions(submissions: Path, assignment: str) -> dict[str, Path]:
    if (submissions / "submitted").is_dir():
        submissions = submissions / "submitted"
    found = {}
    for student_dir in sorted(p for p in submissions.iterdir() if p.is_dir()):
        folder = student_dir / assignment
        if folder.is_dir():
            found[student_dir.name] = folder
    return found


class CappedLog:
    """A worker's stdout and stderr: a pipe that a thread drains into ``path``, keeping the first
    bytes and the last ``tail`` bytes, ``cap`` in all, and counting what it drops in between.

    A kernel and anything it starts inherit these file descriptors, so a submission that writes
    to them (``os.write(1, ...)``, a subprocess) would otherwise fill the log without limit. The
    thread never stops reading, so a writer never blocks on a full pipe; the tail keeps the end
    of the log, where a crashed worker's traceback is.
    """

    def __init__(self, path: Path, cap: int = MAX_LOG_BYTES, tail: int = 64_000):
        self.path = path
        self.dropped = 0
        self._head_cap = self._head_room = cap - tail
        self._tail_cap = tail
        self._tail = bytearray()
        self._file = open(path, "wb", buffering=0)
        self._read_fd, self.write_fd = os.pipe()
        self._stop_at: float | None = None
        self._thread = threading.Thread(target=self._drain, name=f"log {path.name}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        pipe = select.poll()
        pipe.register(self._read_fd, select.POLLIN)
        try:
            while True:
                # Once the worker has exited, read only what is waiting in the pipe, for at most
                # a second: a process it left behind may hold the pipe open, or keep writing.
                stop_at = self._stop_at
                if stop_at is not None and time.monotonic() > stop_at:
                    break
                if not pipe.poll(0 if stop_at is not None else 200):
                    if stop_at is not None:
                        break
                    continue
                chunk = os.read(self._read_fd, 1 << 16)
                if not chunk:
                    break
                self._store(chunk)
            if self.dropped:
                self._write(f"\n[... {self.dropped:,} bytes dropped here: this log keeps its "
                            f"first {self._head_cap:,} and last {self._tail_cap:,} bytes ...]\n"
                            .encode())
            self._write(bytes(self._tail))
        finally:
            self._file.close()
            os.close(self._read_fd)

    def _store(self, chunk: bytes) -> None:
        if self._head_room > 0:
            head, chunk = chunk[:self._head_room], chunk[self._head_room:]
            self._head_room -= len(head)
            self._write(head)
        self._tail += chunk
        excess = len(self._tail) - self._tail_cap
        if excess > 0:
            del self._tail[:excess]
            self.dropped += excess

    def _write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError:  # a full disk: keep draining the pipe all the same
            self.dropped += len(data)

    def close_write_end(self) -> None:
        """Close this process's copy of the pipe's write end (once the worker has its own)."""
        if self.write_fd >= 0:
            os.close(self.write_fd)
            self.write_fd = -1

    def close(self) -> None:
        """Once the worker has exited: store what it left in the pipe and finish the file."""
        self.close_write_end()
        if self._stop_at is None:
            self._stop_at = time.monotonic() + 1.0
        self._thread.join()

    def tail(self, size: int) -> str:
        return self.path.read_bytes()[-size:].decode(errors="replace")


class _Worker:
    def __init__(self, student: str, submission: Path, assignment: str, out: Path,
                 cell_timeout: int | None, student_timeout: float):
        self.student = student
        work = out / "work" / student
        work.parent.mkdir(parents=True, exist_ok=True)
        self.result_path = out / "work" / f"{student}.result.json"
        self.result_path.unlink(missing_ok=True)
        self.log_path = out / "work" / f"{student}.log"
        job = {"student": student, "assignment": assignment, "submission": str(submission),
               "work": str(work), "result": str(self.result_path), "cell_timeout": cell_timeout}
        job_path = out / "work" / f"{student}.job.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self.log = CappedLog(self.log_path)
        self.started = time.monotonic()
        self.deadline = self.started + student_timeout
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "autograder.worker", str(job_path)], cwd=REPO, env=env,
                stdout=self.log.write_fd, stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            self.log.close()
            raise
        self.log.close_write_end()
        self.assignment = assignment
        self.out = out

    def poll(self) -> dict | None:
        """None while running; the result once finished (or killed)."""
        if self.process.poll() is None:
            if time.monotonic() < self.deadline:
                return None
            self.kill()
            return self._failed("grading timed out", "the submission ran past --student-timeout")
        self.log.close()
        if self.result_path.exists():
            return json.loads(self.result_path.read_text())
        tail = self.log.tail(3000)
        return self._failed("grader error", f"the grading worker exited with code "
                                            f"{self.process.returncode}:\n{tail}")

    def kill(self) -> None:
        family = live_descendants(self.process.pid)
        kill_process_group(self.process.pid, signal.SIGKILL)
        for pid in family:
            kill_process_group(pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()

    def _failed(self, status: str, why: str) -> dict:
        feedback = self.out / "work" / self.student / "feedback" / self.student / self.assignment
        for nb in (self.out / "work" / self.student / "submitted" / self.student /
                   self.assignment).glob("*.ipynb"):
            write_notice(feedback / f"{nb.stem}.html", self.student, self.assignment, status, why)
        return {"student": self.student, "assignment": self.assignment, "status": status,
                "score": 0.0, "max_score": None, "cells": {}, "flags": [], "notes": [why],
                "feedback": str(feedback), "seconds": round(time.monotonic() - self.started, 1)}


def grade_class(submissions: Path, assignment: str, out: Path, jobs: int | None = None,
                cell_timeout: int | None = None, student_timeout: float = 1800,
                shard: Shard = Shard()) -> list[dict]:
    _become_subreaper()
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    found = find_submissions(submissions.resolve(), assignment)
    pending = [(student, found[student]) for student in shard.select(found)]
    jobs = jobs or os.cpu_count() or 1
    running: list[_Worker] = []
    results: list[dict] = []
    started = time.monotonic()
    try:
        while pending or running:
            while pending and len(running) < jobs:
                student, folder = pending.pop(0)
                running.append(_Worker(student, folder, assignment, out, cell_timeout,
                                       student_timeout))
            for worker in list(running):
                result = worker.poll()
                if result is not None:
                    running.remove(worker)
                    results.append(result)
            _reap_adopted_orphans(running)
            time.sleep(0.2)
    finally:
        for worker in running:
            worker.kill()
        _reap_adopted_orphans([])
    elapsed = time.monotonic() - started
    results.sort(key=lambda r: r["student"])
    _collect_feedback(results, out)
    _write_csv(results, assignment, out)
    (out / "summary.json").write_text(json.dumps(
        {"submissions": len(results), "jobs": jobs, "seconds": round(elapsed, 1),
         "results": results, "assignment": assignment, "shard": shard.record(found)}, indent=2))
    return results


def _reap_adopted_orphans(running: list[_Worker]) -> None:
    """Kill and reap processes that a finished worker's kernel left behind and that came back to
    us as their subreaper. Only pids we adopted are reaped: the workers belong to Popen."""
    table = process_table()
    ours = {w.process.pid for w in running}
    for w in running:
        ours |= live_descendants(w.process.pid, table)
    for pid in live_descendants(None, table) - ours:
        try:
            if os.getpgid(pid) == os.getpgid(0):
                continue  # part of this very command (e.g. the caller's pipes), not a leftover
        except ProcessLookupError:
            continue
        kill_process_group(pid, signal.SIGKILL)
        if _parent_of(pid) == os.getpid():
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _collect_feedback(results: list[dict], out: Path) -> None:
    for result in results:
        source = Path(result["feedback"])
        target = out / "feedback" / result["student"] / result["assignment"]
        if target.exists():
            shutil.rmtree(target)
        if source.is_dir():
            shutil.copytree(source, target)
        result["feedback"] = str(target)


def _write_csv(results: list[dict], assignment: str, out: Path) -> None:
    cell_names = sorted({name for r in results for name in r["cells"]})
    rows, header = [], None
    for result in results:
        export = out / "work" / result["student"] / "grades.csv"
        row = {}
        if export.exists():
            with open(export) as f:
                reader = csv.DictReader(f)
                header = header or reader.fieldnames
                row = next((r for r in reader if r["student_id"] == result["student"]), {})
        row.update(assignment=assignment, student_id=result["student"],
                   score=f"{result['score']:g}", status=result["status"],
                   flags=" | ".join(result["flags"]), notes=" | ".join(result["notes"]))
        if result["status"] != "graded":
            row["raw_score"] = f"{result['score']:g}"
        if result.get("max_score") is not None:
            row["max_score"] = f"{result['max_score']:g}"
        for name in cell_names:
            score = result["cells"].get(name)
            row[name] = "" if score is None else f"{score[0]:g}"
        rows.append(row)
    base = header or DEFAULT_EXPORT_COLUMNS
    fields = list(base) + ["status", "flags", "notes"] + cell_names
    with open(out / "grades.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def print_results(results: list[dict]) -> None:
    print(f"{'student':<16} {'score':>7} {'max':>5} {'secs':>6}  status")
    for r in results:
        max_score = "" if r["max_score"] is None else f"{r['max_score']:g}"
        print(f"{r['student']:<16} {r['score']:>7g} {max_score:>5} {r['seconds']:>6}  "
              f"{r['status']}")


def print_summary(results: list[dict], out: Path) -> None:
    summary = json.loads((out / "summary.json").read_text())
    print_results(results)
    shard = summary["shard"]
    if shard["count"] > 1:
        print(f"shard {shard['index']}/{shard['count']}: {len(results)} of the class's "
              f"{len(shard['class'])} students")
    print(f"{summary['submissions']} submissions in {summary['seconds']} s with "
          f"{summary['jobs']} at a time; grades: {out / 'grades.csv'}; feedback: "
          f"{out / 'feedback'}")
