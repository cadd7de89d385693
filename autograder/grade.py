"""Grade a class: one isolated worker per submission, several at once, one CSV at the end.

    python -m autograder grade SUBMISSIONS --assignment 05_allreduce [--out autograder/course]
                               [--student NAME ...] [--shard I/N]

``SUBMISSIONS`` is nbgrader's ``submitted/`` layout: ``SUBMISSIONS/{student}/{assignment}/*.ipynb``.
Each student is graded by ``autograder/worker.py`` in its own process session, course directory and
gradebook, so submissions run in parallel with nothing shared (the ranks of every test meet through
private FileStores: no ports). A worker that passes ``--student-timeout`` is killed with everything
it started; this process is a child subreaper, so even processes a kernel leaves behind come back to
it and are killed. Results: ``OUT/grades.csv`` (nbgrader export's columns, then ``status``,
``flags``, ``notes``, and each notebook's subtotal and test cells: see
``autograder/gradesheet.py``), ``OUT/feedback/{student}/{assignment}/*.html`` (a page for every
notebook of the assignment, handed in or not, each opening with the assignment's total),
``OUT/autograded/{student}/{assignment}/`` (the graded notebooks, where formgrader opens them for
manual grading), ``OUT/work/``, ``OUT/summary.json`` (each student's result, with the seconds
each step of their grading took: ``steps``), ``OUT/gradebook.db`` (the course gradebook:
nbgrader's own database, where ``nbgrader export``, formgrader and ``generate_feedback`` find every
student's grades; autograder/nbgrader_config.py points nbgrader at
``autograder/course/gradebook.db``, the default OUT's), and a summary table on stdout.

**Nothing is lost.** A run grades into folders of its own inside ``OUT`` (the sandbox hides ``OUT``
from the students' kernels, these folders included) and touches ``OUT``'s results only once every
submission is graded: then it replaces the feedback, autograded notebooks, log and work folder of
each student it graded, records their submissions in the course gradebook in place of their old
ones, and rewrites ``grades.csv`` and ``summary.json`` with their new rows and everyone else's rows
as they were (``autograder/merge.py``'s :func:`update_output`). So ``--student bob`` re-grades bob
alone, and grading a few late submissions into the class's ``OUT`` adds their rows. Every file is
replaced by a rename, ``summary.json`` last; an interrupted run leaves ``OUT``'s results as they
were. ``--shard I/N`` grades one shard of the class; ``python -m autograder merge`` joins the
shards' outputs.
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
import uuid
from pathlib import Path

import nbformat

from autograder import gradesheet
from autograder.merge import (DEFAULT_EXPORT_COLUMNS, FIXED_COLUMNS, GRADEBOOK, MergeError,
                              Shard, check_updatable, load, record_into_copy, update_output)
from autograder.nbgrader_api import REPO, hold_for_review
from autograder.notices import (GRADER_NOTE, add_summary, assignment_summary, make_readable,
                               write_missing_notice, write_notice)
from autograder.overrides import FILE as OVERRIDES
from autograder.overrides import (CLEARED_FLAGS, OverrideError, apply_overrides,
                                  read_cleared_flags, read_overrides)
from autograder.roster import with_roster_columns
from ddpcourse.launcher.processes import kill_process_group, live_descendants, process_table

_PR_SET_CHILD_SUBREAPER = 36
MAX_LOG_BYTES = 1_000_000
# How often the workers are looked at: each look reads the process table (~3 ms of CPU), and a
# submission takes tens of seconds, so half a second costs little latency and little CPU.
POLL_S = 0.5


def _become_subreaper() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class GradingRefused(Exception):
    """Why a grading run would grade nothing, or could not keep OUT's results: nothing written."""


def _student_folders(submissions: Path) -> list[Path]:
    if (submissions / "submitted").is_dir():
        submissions = submissions / "submitted"
    if not submissions.is_dir():
        return []
    return sorted(p for p in submissions.iterdir() if p.is_dir())


def find_submissions(submissions: Path, assignment: str) -> dict[str, Path]:
    return {student_dir.name: student_dir / assignment
            for student_dir in _student_folders(submissions)
            if (student_dir / assignment).is_dir()}


def _assignments_found(submissions: Path) -> str:
    counts: dict[str, int] = {}
    for student_dir in _student_folders(submissions):
        for folder in student_dir.iterdir():
            if folder.is_dir():
                counts[folder.name] = counts.get(folder.name, 0) + 1
    if not counts:
        return (f"{submissions} holds no submission at all (nbgrader's layout: "
                "SUBMISSIONS/{student}/{assignment}/*.ipynb)")
    return f"{submissions} holds: " + ", ".join(
        f"{name} ({count} student{'s' if count > 1 else ''})"
        for name, count in sorted(counts.items()))


def plan(submissions: Path, assignment: str, out: Path, students: list[str] | None = None,
         shard: Shard = Shard()) -> tuple[dict[str, Path], list[str], object]:
    """The class's submissions, the students this run grades, and OUT's earlier results (None
    if it has none); GradingRefused, before anything is written, when there is nothing to grade
    or OUT's results could not be kept."""
    found = find_submissions(submissions, assignment)
    if not found:
        raise GradingRefused(f"no submission of {assignment}: {_assignments_found(submissions)}")
    if students:
        unknown = sorted(set(students) - set(found))
        if unknown:
            raise GradingRefused(
                f"no submission of {assignment} from {', '.join(unknown)} in {submissions}; the "
                f"students who handed it in: {', '.join(sorted(found))}")
        chosen = sorted(set(students))
    else:
        chosen = shard.select(found)
    previous = None
    if (out / "summary.json").exists() or (out / "grades.csv").exists():
        try:
            previous = load(out)
            check_updatable(previous, assignment, shard, sorted(found))
        except MergeError as problem:
            raise GradingRefused(f"--out {out}: {problem}") from None
    return found, chosen, previous


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
    """One student's grading worker. Its files go to ``root`` (a folder directly inside OUT, so
    that the worker's sandbox, which hides the parent of ``root``, hides OUT whole):
    ``root/{student}/`` (its course directory), ``{student}.log``, ``{student}.job.json`` and
    ``{student}.result.json``."""

    def __init__(self, student: str, submission: Path, assignment: str, root: Path,
                 cell_timeout: int | None, student_timeout: float, duedate: str | None = None,
                 cleared_flag: str | None = None, gradebook: Path | None = None):
        self.student = student
        work = root / student
        root.mkdir(parents=True, exist_ok=True)
        self.result_path = root / f"{student}.result.json"
        self.result_path.unlink(missing_ok=True)
        self.log_path = root / f"{student}.log"
        job = {"student": student, "assignment": assignment, "submission": str(submission),
               "work": str(work), "result": str(self.result_path), "cell_timeout": cell_timeout,
               "duedate": duedate, "cleared_flag": cleared_flag,
               "empty_gradebook": str(gradebook) if gradebook else None}
        job_path = root / f"{student}.job.json"
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
        self.root = root

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
        feedback = self.root / self.student / "feedback" / self.student / self.assignment
        for nb in (self.root / self.student / "submitted" / self.student /
                   self.assignment).glob("*.ipynb"):
            write_notice(feedback / f"{nb.stem}.html", self.student, self.assignment, status, why)
        return {"student": self.student, "assignment": self.assignment, "status": status,
                "score": 0.0, "max_score": None, "cells": {}, "flags": [], "notes": [why],
                "feedback": str(feedback), "seconds": round(time.monotonic() - self.started, 1)}


def grade_class(submissions: Path, assignment: str, out: Path, jobs: int | None = None,
                cell_timeout: int | None = None, student_timeout: float = 1800,
                shard: Shard = Shard(), students: list[str] | None = None) -> list[dict]:
    """Grade the chosen students (all, a shard, or ``students``) into ``out``, keeping the rows
    of everyone else already there; return this run's results. GradingRefused: nothing done."""
    _become_subreaper()
    out = out.resolve()
    found, chosen, previous = plan(submissions.resolve(), assignment, out, students, shard)
    try:  # a wrong line is refused before grading
        read_overrides(out / OVERRIDES, assignment)
        cleared_flags = read_cleared_flags(out / CLEARED_FLAGS)
    except OverrideError as wrong:
        raise GradingRefused(str(wrong)) from None
    out.mkdir(parents=True, exist_ok=True)
    # Short names: each student's kernel sockets live below these folders, and a Unix socket's
    # path may not exceed 107 bytes (longer ones fail with ZMQError "File name too long").
    token = uuid.uuid4().hex[:3]
    workers, staged = out / f".g{token}", out / f".s{token}"
    try:
        results, jobs, elapsed = _grade_all(chosen, found, assignment, workers, jobs,
                                            cell_timeout, student_timeout,
                                            duedate=due_date(out / GRADEBOOK, assignment),
                                            cleared_flags=cleared_flags)
        for result in results:
            _explain(result, found[result["student"]], workers)
        _stage(results, assignment, staged, workers, out)
        record = (shard.record(found) if not students else Shard().record(chosen))
        (staged / "summary.json").write_text(json.dumps(
            {"submissions": len(results), "jobs": jobs, "seconds": round(elapsed, 1),
             "results": results, "assignment": assignment, "shard": record}, indent=2))
        for result in results:  # each worker's folder and files, then the results
            for name in (result["student"], f"{result['student']}.job.json",
                         f"{result['student']}.result.json"):
                if (workers / name).exists():
                    _replace(workers / name, out / "work" / name, staged)
        update_output(out, staged)
        apply_overrides(out, assignment)  # checked above: the regraded get theirs back
    finally:
        for folder in (workers, staged):
            shutil.rmtree(folder, ignore_errors=True)
    return results


def due_date(course: Path, assignment: str) -> str | None:
    """The assignment's due date in the course gradebook ``course`` (ISO, UTC), if it has one."""
    if not course.is_file():
        return None
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(f"sqlite:///{course}") as gradebook:
        try:
            duedate = gradebook.find_assignment(assignment).duedate
        except MissingEntry:
            return None
        return duedate.isoformat() if duedate else None


EMPTY_GRADEBOOK = "empty-gradebook.db"


def empty_gradebook(path: Path) -> Path:
    """A new, empty nbgrader gradebook at ``path``, made by nbgrader itself.

    A run makes one, and each worker's gradebook and a new course gradebook start as copies of
    it (:func:`autograder.worker._prepare`, :func:`autograder.merge.record_into_copy`): made
    once, stamped once with nbgrader's schema revision
    (:func:`autograder.nbgrader_api.gradebook_schema_revision`)."""
    from nbgrader.api import Gradebook

    path.parent.mkdir(parents=True, exist_ok=True)
    with Gradebook(f"sqlite:///{path}"):
        pass
    return path


def _grade_all(chosen: list[str], found: dict[str, Path], assignment: str, root: Path,
               jobs: int | None, cell_timeout: int | None, student_timeout: float,
               duedate: str | None = None, cleared_flags: dict[str, str] | None = None,
               ) -> tuple[list[dict], int, float]:
    pending = [(student, found[student]) for student in chosen]
    jobs = jobs or os.cpu_count() or 1
    running: list[_Worker] = []
    results: list[dict] = []
    started = time.monotonic()
    template = empty_gradebook(root / EMPTY_GRADEBOOK)
    try:
        while pending or running:
            while pending and len(running) < jobs:
                student, folder = pending.pop(0)
                running.append(_Worker(student, folder, assignment, root, cell_timeout,
                                       student_timeout, duedate,
                                       (cleared_flags or {}).get(student), template))
            for worker in list(running):
                result = worker.poll()
                if result is not None:
                    running.remove(worker)
                    results.append(result)
            _reap_adopted_orphans(running)
            time.sleep(POLL_S)
    finally:
        for worker in running:
            worker.kill()
        _reap_adopted_orphans([])
    results.sort(key=lambda r: r["student"])
    return results, jobs, time.monotonic() - started


def _replace(source: Path, target: Path, scratch: Path) -> None:
    """Put ``source`` at ``target`` by renames (a folder's old copy is moved out of the way
    first, into ``scratch``, which is deleted later)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir() and not target.is_symlink():
        scratch.mkdir(parents=True, exist_ok=True)
        target.rename(scratch / f".old-{uuid.uuid4().hex}")
    os.replace(source, target)


# --- what each result says besides its scores ----------------------------------------------------

TIMED_OUT = "did not finish within"  # ddpcourse.grading.checks: a rank past the check's deadline


def _explain(result: dict, submission: Path, workers: Path) -> None:
    """Add to a result the notebooks not handed in (``missing``) and notes on them, on notebooks
    that are not the assignment's, and on test cells whose ranks timed out."""
    slugs = [notebook.slug for notebook in gradesheet.layout(result["assignment"])]
    handed_in = sorted(path.stem for path in submission.glob("*.ipynb"))
    result["missing"] = [slug for slug in slugs if slug not in handed_in]
    if result.get("max_score") is None:
        result["max_score"] = gradesheet.max_points(result["assignment"])
    notes = result["notes"]
    for notebook in gradesheet.layout(result["assignment"]):
        if notebook.slug in result["missing"]:
            notes.append(f"missing: {notebook.slug} (not handed in: 0 of {notebook.points:g})")
    extra = [name for name in handed_in if name not in slugs]
    if extra:
        notes.append(f"not notebooks of {result['assignment']}, not graded: "
                     + ", ".join(f"{name}.ipynb" for name in extra))
    autograded = (workers / result["student"] / "autograded" / result["student"]
                  / result["assignment"])
    timed_out = [f"{path.stem}:{grade_id}" for path in sorted(autograded.glob("*.ipynb"))
                 for grade_id in _timed_out_cells(path)]
    if timed_out:
        notes.append(f"timed out (ranks past the check's deadline): {', '.join(timed_out)}")


def _timed_out_cells(notebook: Path) -> list[str]:
    """The graded cells whose grader's verdict says a rank did not finish in time."""
    try:
        cells = nbformat.read(notebook, as_version=4).cells
    except Exception:  # noqa: BLE001 - an unreadable notebook has no verdicts to report
        return []
    found = []
    for cell in cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.cell_type != "code" or grade_id is None:
            continue
        verdicts = [output.get("text", "") for output in cell.get("outputs", [])
                    if output.get("output_type") == "stream"
                    and output.get("text", "").startswith(GRADER_NOTE)]
        if any("FAILED" in text and TIMED_OUT in text for text in verdicts):
            found.append(grade_id)
    return found


def _stage(results: list[dict], assignment: str, staged: Path, workers: Path, out: Path) -> None:
    """This run's output in ``staged``, as merge.load reads it: feedback (with a page for every
    notebook not handed in and the total atop every page), the workers' logs, the autograded
    notebooks (nbgrader's ``autograded/{student}/{assignment}/``), grades.csv."""
    for result in results:
        student = result["student"]
        source = Path(result["feedback"])
        target = staged / "feedback" / student / assignment
        if source.is_dir():
            shutil.copytree(source, target)
        target.mkdir(parents=True, exist_ok=True)
        handed_in = sorted(f"{p.stem}.ipynb" for p in target.glob("*.html"))
        for notebook in gradesheet.layout(assignment):
            if notebook.slug in result["missing"]:
                write_missing_notice(target / f"{notebook.slug}.html", student, assignment,
                                     notebook.slug, notebook.points, handed_in)
        summary = assignment_summary(
            assignment, result["score"], gradesheet.max_points(assignment),
            [(nb.slug, score, nb.points) for nb, score in gradesheet.notebook_scores(result)],
            late=result.get("late"))
        for page in sorted(target.glob("*.html")):
            make_readable(page)
            add_summary(page, summary)
        result["feedback"] = str(out / "feedback" / student / assignment)
        log = workers / f"{student}.log"
        if log.is_file():
            (staged / "work").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, staged / "work" / log.name)
        autograded = workers / student / "autograded" / student / assignment
        if autograded.is_dir():  # where formgrader and nbgrader's generate_feedback read it
            shutil.copytree(autograded, staged / "autograded" / student / assignment)
    _write_csv(results, assignment, staged, exports=workers)
    _record_gradebook(results, assignment, staged / GRADEBOOK, workers, out / GRADEBOOK)


def _record_gradebook(results: list[dict], assignment: str, db: Path, workers: Path,
                      course: Path) -> None:
    """The course gradebook ``course`` (nbgrader's database) as it will be after this run, in
    ``db``: a copy of it (or a new one) with this run's students recorded from each worker's
    gradebook; a student flagged for tampering is held for review with 0 points. Nothing when no
    worker left a gradebook and OUT has none to update."""
    graded = {result["student"]: workers / result["student"] / GRADEBOOK for result in results}
    if not course.is_file() and not any(path.is_file() for path in graded.values()):
        return
    record_into_copy(course, db, assignment, graded, empty=workers / EMPTY_GRADEBOOK)
    flagged = [result["student"] for result in results
               if result["status"] == "flagged for tampering"]
    hold_for_review(f"sqlite:///{db}", assignment, flagged)


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


def _write_csv(results: list[dict], assignment: str, out: Path, exports: Path | None = None
               ) -> None:
    """``out/grades.csv``: each student's nbgrader export row (``exports/{student}/grades.csv``,
    by default ``out/work/...``), then status, flags, notes, and the columns of
    ``autograder/gradesheet.py``, whichever students this run had."""
    exports = exports or out / "work"
    rows, header, columns = [], None, set()
    for result in results:
        export = exports / result["student"] / "grades.csv"
        row = {}
        if export.exists():
            with open(export) as f:
                reader = csv.DictReader(f)
                header = header or reader.fieldnames
                row = next((r for r in reader if r["student_id"] == result["student"]), {})
        row.update(assignment=assignment, student_id=result["student"],
                   score=f"{result['score']:g}", status=result["status"],
                   flags=" | ".join(result["flags"]), notes=" | ".join(result["notes"]),
                   max_score=f"{gradesheet.max_points(assignment):g}")
        if result["status"] != "graded":
            row["raw_score"] = f"{result['score']:g}"
        scores = gradesheet.score_columns(result)
        columns.update(scores)
        row.update(scores)
        rows.append(row)
    base = with_roster_columns(header or DEFAULT_EXPORT_COLUMNS)  # filled by merge_csv
    fields = list(base) + FIXED_COLUMNS + gradesheet.order_columns(assignment, columns)
    out.mkdir(parents=True, exist_ok=True)
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
    print(f"{len(results)} submissions in {summary['seconds']} s with "
          f"{summary['jobs']} at a time; grades: {out / 'grades.csv'}; feedback: "
          f"{out / 'feedback'}")
    kept = summary["submissions"] - len(results)
    if kept:
        print(f"{out / 'grades.csv'} holds {summary['submissions']} students: the rows of the "
              f"{kept} not graded in this run are kept as they were")
