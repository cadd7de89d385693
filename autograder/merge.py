"""Grade a class in shards (one per cluster job) and merge their outputs into one.

    python -m autograder grade SUBMISSIONS --assignment A --out OUT_2 --shard 2/4
    python -m autograder merge OUT_1 OUT_2 OUT_3 OUT_4 --out OUT

**The split.** Shard I of N grades the students at positions I, I+N, I+2N, ... of the class's
student ids sorted by code point (round robin), so shard sizes differ by at most one and the
split depends only on which students SUBMISSIONS holds: not on the order a file system lists
them, the locale, the machine or the run. Every shard reads the same SUBMISSIONS folder, so
every student is graded by exactly one shard. A stable hash of each id would also keep a
student's shard when others join the class, but on a class of tens its shards are uneven (a
binomial spread), and nothing needs that: each shard records the whole class it saw, and the
merge refuses shards that saw different classes. ``--shard 1/1`` (the default) is a whole run.

**The merge** gives what one run of the whole class gives: the same ``grades.csv`` (rows sorted by
student, nbgrader export's columns, then status, flags, notes and every test cell, sorted),
``feedback/{student}/{assignment}/`` and ``autograded/{student}/{assignment}/`` for everyone, each
worker's log ``work/{student}.log``, and a ``summary.json`` whose results are the single run's
(their ``seconds`` are each student's own grading time); its run-level ``jobs`` and ``seconds`` add
up and take the longest of the shards, and ``merged_from`` says where each part came from. It
refuses, before writing anything, outputs for different assignments, a student in two outputs, a
shard that is missing, doubled or saw another class, and a folder that is not a finished grading
output. The outputs merged need not be shards: any grading outputs of one assignment with no student
in common merge the same way. Each kind of result is merged by a step of its own
(:data:`MERGE_STEPS`), the course gradebook (``gradebook.db``, nbgrader's database) included: the
merged one holds every part's submissions.

**The update** (:func:`update_output`) is how ``grade`` writes its results into ``OUT``, and the
one place where a student already in ``OUT`` is replaced rather than refused: the run's output
(staged inside ``OUT``) brings its students' rows, feedback, logs and gradebook submissions,
and ``OUT`` keeps every other student's as they were (rows, feedback and logs byte for byte;
:func:`check_updatable` says which outputs may be updated by which runs). ``merge`` still
refuses a student in two outputs: two grading outputs do not say which of their rows is the one
to keep; a re-grading run does.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from autograder import gradesheet
from autograder.roster import join_roster, read_roster, with_roster_columns

FIXED_COLUMNS = ["status", "flags", "notes"]  # between nbgrader export's columns and the cells
# a CSV's first columns where no student of the run has an nbgrader export (grade.py's _write_csv)
DEFAULT_EXPORT_COLUMNS = ["assignment", "student_id", "raw_score", "score", "max_score"]


class MergeError(Exception):
    """Why some grading outputs cannot be merged into one."""


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based), and which students it grades."""

    index: int = 1
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"I/N"`` with 1 <= I <= N, as ``--shard`` takes it."""
        index, slash, count = text.strip().partition("/")
        try:
            shard = cls(int(index), int(count))
        except ValueError:
            shard = None
        if not slash or shard is None or not 1 <= shard.index <= shard.count:
            raise argparse.ArgumentTypeError(
                f"--shard wants I/N, shard I of N with 1 <= I <= N (e.g. 2/4); got {text!r}")
        return shard

    def select(self, students) -> list[str]:
        """This shard's students: every ``count``-th of the sorted ids, from the ``index``-th."""
        return sorted(students)[self.index - 1::self.count]

    def record(self, students) -> dict:
        """What a grading run writes into its summary, for the merge to check."""
        return {"index": self.index, "count": self.count, "class": sorted(students)}

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass
class GradingOutput:
    """A finished grading run's ``OUT`` folder, read and checked."""

    path: Path
    summary: dict
    header: list[str]
    rows: list[dict]

    @property
    def assignment(self) -> str:
        return self.summary["assignment"]

    @property
    def students(self) -> list[str]:
        return [result["student"] for result in self.summary["results"]]

    @property
    def shard(self) -> Shard:
        return Shard(self.summary["shard"]["index"], self.summary["shard"]["count"])

    @property
    def whole_class(self) -> list[str]:
        return self.summary["shard"]["class"]

    @property
    def base_columns(self) -> list[str]:
        return self.header[:self.header.index(FIXED_COLUMNS[0])]

    @property
    def cell_columns(self) -> list[str]:
        return self.header[self.header.index(FIXED_COLUMNS[-1]) + 1:]


def load(path: Path) -> GradingOutput:
    """Read ``path``'s summary.json and grades.csv; MergeError unless they are a finished grading
    run's. Outputs written before shards existed count as whole runs (shard 1/1)."""
    summary_path, csv_path = path / "summary.json", path / "grades.csv"
    if not path.is_dir():
        raise MergeError(f"{path} is not a folder")
    if not summary_path.is_file() or not csv_path.is_file():
        raise MergeError(f"{path} is not a grading output: it has no summary.json or grades.csv "
                         "(`python -m autograder grade` writes both when it finishes; was this "
                         "run interrupted?)")
    try:
        summary = json.loads(summary_path.read_text())
        results = summary["results"]
        students = [result["student"] for result in results]
        with open(csv_path, newline="") as f:
            reader = csv.DictReader(f)
            header, rows = list(reader.fieldnames or []), list(reader)
    except (ValueError, KeyError, TypeError, csv.Error) as broken:
        raise MergeError(f"{path} is not a grading output: {summary_path.name} or "
                         f"{csv_path.name} cannot be read ({broken!r})") from None
    if not all(column in header for column in FIXED_COLUMNS + ["student_id"]):
        raise MergeError(f"{csv_path} is not a grading output's CSV: its columns are {header}")
    if [row["student_id"] for row in rows] != students:
        raise MergeError(f"{path}: grades.csv and summary.json list different students; "
                         "grade this shard again")
    assignments = {result["assignment"] for result in results}
    if "assignment" in summary:
        assignments.add(summary["assignment"])
    if len(assignments) != 1:
        raise MergeError(f"{path}: cannot tell which assignment it grades "
                         f"({sorted(assignments) or 'no submissions'})")
    summary.setdefault("assignment", assignments.pop())
    summary.setdefault("shard", Shard().record(students))
    return GradingOutput(path, summary, header, rows)


def _export_columns(part: GradingOutput) -> list[str] | None:
    """The part's nbgrader export columns with the roster's (an older output may lack
    ``lms_user_id``); None where its students had no export (the default columns)."""
    columns = with_roster_columns(part.base_columns)
    return None if columns == with_roster_columns(DEFAULT_EXPORT_COLUMNS) else columns


def check_mergeable(parts: list[GradingOutput]) -> None:
    """MergeError unless the parts are of one assignment, share no student, and hold every
    shard of each sharded run, each run over the same class."""
    by_assignment: dict[str, list[str]] = {}
    for part in parts:
        by_assignment.setdefault(part.assignment, []).append(str(part.path))
    if len(by_assignment) > 1:
        raise MergeError("these outputs grade different assignments: " + "; ".join(
            f"{name} in {', '.join(paths)}" for name, paths in sorted(by_assignment.items())))
    _check_shards(parts)
    graded_in: dict[str, Path] = {}
    for part in parts:
        for student in part.students:
            if student in graded_in:
                raise MergeError(f"student {student} is graded in both {graded_in[student]} and "
                                 f"{part.path}: each student must come from one output only")
            graded_in[student] = part.path
    exports = {tuple(columns) for columns in map(_export_columns, parts) if columns}
    if len(exports) > 1:
        raise MergeError(f"these outputs have different nbgrader export columns: {sorted(exports)}")


def _check_shards(parts: list[GradingOutput]) -> None:
    runs: dict[int, list[GradingOutput]] = {}
    for part in parts:
        if part.shard.count > 1:
            runs.setdefault(part.shard.count, []).append(part)
    for count, shards in sorted(runs.items()):
        first = shards[0]
        for part in shards[1:]:
            if part.whole_class != first.whole_class:
                differ = sorted(set(part.whole_class) ^ set(first.whole_class))
                raise MergeError(
                    f"{first.path} (shard {first.shard}) and {part.path} (shard {part.shard}) "
                    f"split different classes ({len(first.whole_class)} and "
                    f"{len(part.whole_class)} students; not in both: {', '.join(differ[:10])}): "
                    "were submissions added between the shards' runs? Grade every shard again")
        seen: dict[int, Path] = {}
        for part in shards:
            if part.shard.index in seen:
                raise MergeError(f"{seen[part.shard.index]} and {part.path} are both shard "
                                 f"{part.shard}")
            seen[part.shard.index] = part.path
            expected = part.shard.select(first.whole_class)
            if part.students != expected:
                odd = sorted(set(expected) ^ set(part.students))
                raise MergeError(f"{part.path} does not hold shard {part.shard}'s students of "
                                 f"its class (missing or extra: {', '.join(odd[:10])})")
        missing = [f"{index}/{count}" for index in range(1, count + 1) if index not in seen]
        if missing:
            raise MergeError(f"shard {', '.join(missing)} of the run split {count} ways is "
                             f"missing (given: {', '.join(str(p.path) for p in shards)})")


def merge_csv(parts: list[GradingOutput], out: Path, roster_from: Path | None = None) -> None:
    """One grades.csv as a single run writes it (grade.py's ``_write_csv``): nbgrader export's
    columns (the default five where no student had an export) with the roster's, status, flags,
    notes, the notebooks' subtotal and test cell columns in ``autograder/gradesheet.py``'s order
    (empty where a student has no score), rows sorted by student, each with its student's names,
    email and LMS id from the course gradebook ``roster_from`` (default: ``out``'s)."""
    exports = [columns for columns in map(_export_columns, parts) if columns]
    cells = gradesheet.order_columns(parts[0].assignment,
                                     {cell for part in parts for cell in part.cell_columns})
    fields = (exports or [with_roster_columns(DEFAULT_EXPORT_COLUMNS)])[0] + FIXED_COLUMNS + cells
    rows = sorted((row for part in parts for row in part.rows), key=lambda row: row["student_id"])
    rows = join_roster(rows, read_roster(roster_from or out / GRADEBOOK))
    with open(out / "grades.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def merge_feedback(parts: list[GradingOutput], out: Path) -> None:
    """Copy each student's feedback folder, autograded notebooks and worker's log, replacing
    older ones."""
    for part in parts:
        for student in part.students:
            for relative in _student_folders(student, part.assignment):
                target = out / relative
                if target.exists():
                    shutil.rmtree(target)
                if (part.path / relative).is_dir():
                    shutil.copytree(part.path / relative, target)
            log = part.path / "work" / f"{student}.log"
            if log.is_file():
                (out / "work").mkdir(parents=True, exist_ok=True)
                shutil.copyfile(log, out / "work" / log.name)


def merge_summary(parts: list[GradingOutput], out: Path) -> None:
    """A summary.json with the single run's results; each result's feedback points into ``out``."""
    results = []
    for part in parts:
        for result in part.summary["results"]:
            results.append(dict(result, feedback=str(out / "feedback" / result["student"] /
                                                      result["assignment"])))
    results.sort(key=lambda result: result["student"])
    whole_class = sorted({student for part in parts for student in part.whole_class})
    summary = {
        "submissions": len(results),
        "jobs": sum(part.summary.get("jobs", 0) for part in parts),
        "seconds": max(part.summary.get("seconds", 0) for part in parts),
        "results": results,
        "assignment": parts[0].assignment,
        "shard": Shard().record(whole_class),
        "merged_from": [{"path": str(part.path), "shard": str(part.shard),
                         "submissions": len(part.students), "jobs": part.summary.get("jobs"),
                         "seconds": part.summary.get("seconds")} for part in parts],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


GRADEBOOK = "gradebook.db"


def merge_gradebook(parts: list[GradingOutput], out: Path) -> None:
    """One course gradebook holding every part's submissions (a student whose part has no
    gradebook is recorded without one); none when no part has a gradebook."""
    if not any((part.path / GRADEBOOK).is_file() for part in parts):
        return
    updated = out / f".{GRADEBOOK}.new"
    graded = {student: part.path / GRADEBOOK for part in parts for student in part.students}
    record_into_copy(out / GRADEBOOK, updated, parts[0].assignment, graded)
    os.replace(updated, out / GRADEBOOK)


def record_into_copy(course: Path, copy: Path, assignment: str, graded: dict[str, Path],
                     empty: Path | None = None) -> None:
    """Write to ``copy`` the course gradebook ``course`` (a new one where there is none, else its
    roster, due dates and other students kept) with ``graded``'s submissions recorded: student ->
    the gradebook they were graded in. ``course`` itself is not touched. ``empty``: an empty
    gradebook that a new one starts as a copy of (:func:`autograder.grade.empty_gradebook`)."""
    from autograder.nbgrader_api import record_class_in_course_gradebook

    if course.is_file():
        shutil.copyfile(course, copy)
    elif empty is not None and empty.is_file():
        shutil.copyfile(empty, copy)
    record_class_in_course_gradebook(f"sqlite:///{copy}", assignment, graded)


MERGE_STEPS = (merge_feedback, merge_csv, merge_gradebook, merge_summary)


def merge_outputs(paths: list[Path], out: Path) -> dict:
    """Check every output, then merge them into ``out``; return the merged summary."""
    out = out.resolve()
    paths = [path.resolve() for path in paths]
    if not paths:
        raise MergeError("nothing to merge: name the grading outputs")
    if out in paths:
        raise MergeError(f"--out {out} is one of the outputs to merge: merge into a new folder")
    parts = [load(path) for path in paths]
    check_mergeable(parts)
    out.mkdir(parents=True, exist_ok=True)
    for step in MERGE_STEPS:
        step(parts, out)
    return json.loads((out / "summary.json").read_text())


# --- a grading run's results written into OUT, keeping everyone else's ---------------------------

def check_updatable(previous: GradingOutput, assignment: str, shard: Shard,
                    whole_class: list[str]) -> None:
    """MergeError unless a run of ``assignment`` (shard ``shard`` of ``whole_class``) may write
    its results into ``previous``'s folder: the same assignment, and, where either is a shard,
    the same shard of the same class (a shard's output holds exactly its shard's students)."""
    if previous.assignment != assignment:
        raise MergeError(f"it holds the grades of {previous.assignment}, not {assignment}: grade "
                         "each assignment into a folder of its own")
    if previous.shard.count == 1 and shard.count == 1:
        return
    if previous.shard != shard or previous.whole_class != sorted(whole_class):
        raise MergeError(
            f"it holds shard {previous.shard} of a class of {len(previous.whole_class)}, and this "
            f"run is shard {shard} of a class of {len(whole_class)}: a shard's output holds "
            "exactly its shard's students. Grade shards into folders of their own, or merge the "
            "shards first and re-grade students into the merged output")


def _without(part: GradingOutput, students: set[str]) -> GradingOutput:
    summary = dict(part.summary, results=[result for result in part.summary["results"]
                                          if result["student"] not in students])
    rows = [row for row in part.rows if row["student_id"] not in students]
    return dataclasses.replace(part, summary=summary, rows=rows)


def _student_folders(student: str, assignment: str) -> list[Path]:
    """A student's folders in a grading output: feedback pages, and the autograded notebooks
    where nbgrader's formgrader and generate_feedback look for them."""
    return [Path(kind) / student / assignment for kind in ("feedback", "autograded")]


def _replace_folder(staged: Path, out: Path, relative: Path, scratch: Path) -> None:
    """``out / relative`` becomes ``staged / relative`` (none, where the run has none)."""
    target = out / relative
    if target.exists():
        target.rename(scratch / "-".join(relative.parts))
    if (staged / relative).is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        (staged / relative).rename(target)


def update_output(out: Path, staged: Path) -> dict:
    """Write the grading output ``staged`` (a folder inside ``out``) into ``out``: its students'
    feedback and logs replace theirs, grades.csv and summary.json get their new rows beside the
    rows of every other student ``out`` had, unchanged. Each file moves by a rename, summary.json
    last. Returns the new summary."""
    new = load(staged)
    previous = load(out) if (out / "summary.json").exists() else None
    if previous:
        check_updatable(previous, new.assignment, new.shard, new.whole_class)
    # a shard's new output has the same students as its old one (check_updatable): all replaced
    kept = [_without(previous, set(new.students))] if previous and new.shard.count == 1 else []
    if kept:  # a shard's own output is complete as it is; with kept rows: no student twice
        check_mergeable(kept + [new])
    scratch = staged / ".replaced"
    scratch.mkdir()
    for student in new.students:
        for relative in _student_folders(student, new.assignment):
            _replace_folder(staged, out, relative, scratch)
        log = Path("work") / f"{student}.log"
        if (staged / log).is_file():
            (out / "work").mkdir(parents=True, exist_ok=True)
            os.replace(staged / log, out / log)
    if (staged / GRADEBOOK).is_file():  # OUT's, with this run's students recorded (grade.py)
        os.replace(staged / GRADEBOOK, out / GRADEBOOK)
    merge_csv(kept + [new], staged, roster_from=out / GRADEBOOK)
    os.replace(staged / "grades.csv", out / "grades.csv")
    summary = new.summary
    if kept:
        results = kept[0].summary["results"] + new.summary["results"]
        results.sort(key=lambda result: result["student"])
        summary = dict(previous.summary, results=results, submissions=len(results),
                       jobs=new.summary.get("jobs"), seconds=new.summary.get("seconds"),
                       regraded=new.students,
                       shard=(new.summary["shard"] if new.shard.count > 1 else
                              Shard().record(result["student"] for result in results)))
    (staged / "summary.json").write_text(json.dumps(summary, indent=2))
    os.replace(staged / "summary.json", out / "summary.json")
    return summary
