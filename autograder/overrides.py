"""Instructor overrides: a file of (student, cell, score, reason) that every output obeys.

An instructor who reviews a submission and disagrees with a test's score writes a line in
``OUT/overrides.csv``::

    student,cell,score,reason
    bob,allreduce_by_hand:test-average-gradients-two-ranks,2,"right, within float32 rounding"

``cell`` is ``NOTEBOOK:GRADE_ID``, as in grades.csv's column names (without the points). The
override is nbgrader's own manual score: it is written into the course gradebook
(``Grade.manual_score``, what formgrader writes; nbgrader counts it instead of the automatic
score), the late penalty is computed again (``late_penalty.reassess``), and the student's
grades.csv row and feedback pages are brought in line with the gradebook, with the reason in the
row's notes and on every feedback page. ``python -m autograder override OUT`` applies the file
to what OUT holds; ``grade`` and ``merge`` apply it after every run, so re-grading a student
keeps their overrides. Applying twice changes nothing. Only graded submissions can be
overridden: a flagged, dropped or timed-out one is re-graded first.

A tamper flag the instructor has reviewed and found wrong is cleared in ``OUT/cleared_flags.csv``
(``student,reason``): re-grading that student (``grade ... --student NAME``) then scores the
submission as its tests say, and its notes keep the scan's findings with the reason. The kernel's
own protections (the locked setup cell, the checks run outside the kernel) still hold, so a
cleared flag gives a real tamperer nothing the tests did not.
"""

from __future__ import annotations

import csv
import html
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from autograder import gradesheet

FILE = "overrides.csv"
COLUMNS = ("student", "cell", "score", "reason")
CLEARED_FLAGS = "cleared_flags.csv"
CLEARED_COLUMNS = ("student", "reason")
NOTE = "changed by the instructor"  # starts every note this module writes, and only those
BLOCK = re.compile(r"<div class='overrides'.*?</div>", re.S)


class OverrideError(ValueError):
    """The overrides file cannot be applied as it is; nothing was changed."""


@dataclass(frozen=True)
class Override:
    student: str
    notebook: str
    grade_id: str
    score: float
    reason: str
    points: float  # what the cell is worth

    @property
    def cell(self) -> str:
        return f"{self.notebook}:{self.grade_id}"


def _numbered_lines(path: Path, columns: tuple[str, ...]) -> list[tuple[int, dict]]:
    """The rows of the CSV file ``path`` with their line numbers; OverrideError unless its first
    line names exactly ``columns``."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if list(reader.fieldnames or []) != list(columns):
            raise OverrideError(f"{path}: the first line must be {','.join(columns)} "
                                f"(it is {','.join(reader.fieldnames or [])})")
        return list(enumerate(reader, start=2))


def read_overrides(path: Path, assignment: str) -> list[Override]:
    """The overrides in ``path`` (none when there is no such file), checked against the
    assignment's cells and points; OverrideError names every line that is wrong."""
    if not path.is_file():
        return []
    points = {f"{nb.slug}:{grade_id}": value
              for nb in gradesheet.layout(assignment) for grade_id, value in nb.cells}
    lines = _numbered_lines(path, COLUMNS)
    overrides, problems, seen = [], [], set()
    for number, line in lines:
        where = f"{path.name} line {number}"
        student, cell, reason = (line[c].strip() for c in ("student", "cell", "reason"))
        try:
            score = float(line["score"])
        except (TypeError, ValueError):
            problems.append(f"{where}: the score {line['score']!r} is not a number")
            continue
        if cell not in points:
            problems.append(f"{where}: {assignment} has no cell {cell!r} (its cells: "
                            f"{', '.join(points)})")
        elif not 0 <= score <= points[cell]:
            problems.append(f"{where}: {cell} is worth 0 to {points[cell]:g} points, not {score:g}")
        elif not student or not reason:
            problems.append(f"{where}: every override needs a student and a reason")
        elif (student, cell) in seen:
            problems.append(f"{where}: {student}'s {cell} is overridden twice")
        else:
            seen.add((student, cell))
            notebook, grade_id = cell.split(":", 1)
            overrides.append(Override(student, notebook, grade_id, score, reason, points[cell]))
    if problems:
        raise OverrideError("\n".join(problems))
    return overrides


def read_cleared_flags(path: Path) -> dict[str, str]:
    """student -> why the instructor cleared their tamper flag, from ``path`` (none when there is
    no such file); OverrideError names every line that is wrong."""
    if not path.is_file():
        return {}
    lines = _numbered_lines(path, CLEARED_COLUMNS)
    cleared, problems = {}, []
    for number, line in lines:
        student, reason = ((line[c] or "").strip() for c in CLEARED_COLUMNS)
        if not student or not reason:
            problems.append(f"{path.name} line {number}: every cleared flag needs a student "
                            "and a reason")
        elif student in cleared:
            problems.append(f"{path.name} line {number}: {student}'s flag is cleared twice")
        else:
            cleared[student] = reason
    if problems:
        raise OverrideError("\n".join(problems))
    return cleared


def apply_overrides(out: Path, assignment: str) -> list[str]:
    """Apply ``out/overrides.csv`` to the gradebook, grades.csv and feedback in ``out``; returns
    the students it names who have no row there (nothing to override yet)."""
    overrides = read_overrides(out / FILE, assignment)
    with open(out / "grades.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    by_student = {row["student_id"]: row for row in rows}
    absent = sorted({o.student for o in overrides} - set(by_student))
    mine = [o for o in overrides if o.student in by_student]
    not_graded = sorted({f"{o.student} ({by_student[o.student]['status']})" for o in mine
                         if by_student[o.student]["status"] != "graded"})
    if not_graded:
        raise OverrideError("only graded submissions can be overridden; re-grade first: "
                            + ", ".join(not_graded))
    if not mine:
        return absent
    totals = _write_to_gradebook(out, assignment, mine)
    results = json.loads((out / "summary.json").read_text())["results"]
    missing = {result["student"]: set(result.get("missing", ())) for result in results}
    for student in {o.student for o in mine}:
        row = by_student[student]
        own = [o for o in mine if o.student == student]
        _update_row(row, assignment, own, totals[student])
        _update_feedback(out / "feedback" / student / assignment, assignment, row,
                         missing.get(student, set()), own, totals[student])
    staged = out / f".{FILE}.grades.csv"
    with open(staged, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(staged, out / "grades.csv")
    return absent


def _write_to_gradebook(out: Path, assignment: str, overrides: list[Override]) -> dict:
    """Each override as the cell's manual score in ``out``'s course gradebook, the late penalty
    reassessed; per student: (automatic scores of the overridden cells, raw score, penalty,
    seconds late)."""
    from nbgrader.api import Gradebook

    from autograder.late_penalty import reassess
    from autograder.nbgrader_api import load_config

    config = load_config(out)  # the course config, with out's gradebook
    url = config.CourseDirectory.db_url
    with Gradebook(url) as book:
        for o in overrides:
            book.find_grade(o.grade_id, o.notebook, assignment, o.student).manual_score = o.score
        book.db.commit()
    totals = {}
    for student in {o.student for o in overrides}:
        reassess(config, assignment, student)
        with Gradebook(url) as book:
            submission = book.find_submission(assignment, student)
            automatic = {o.cell: book.find_grade(o.grade_id, o.notebook, assignment,
                                                 student).auto_score
                         for o in overrides if o.student == student}
            totals[student] = (automatic, submission.score,
                               submission.late_submission_penalty or 0.0,
                               submission.total_seconds_late)
    return totals


def _update_row(row: dict, assignment: str, overrides: list[Override], totals) -> None:
    """The grades.csv row with the overridden cells, subtotals and totals the gradebook has,
    and one note per override (replacing those of an earlier application)."""
    automatic, raw, penalty, _ = totals
    for o in overrides:
        row[f"{o.cell} ({o.points:g})"] = f"{o.score:g}"
    for notebook in gradesheet.layout(assignment):
        if row.get(notebook.column, "") != "":
            row[notebook.column] = f"{_subtotal(row, notebook):g}"
    row["raw_score"] = f"{raw:g}"
    row["late_submission_penalty"] = f"{penalty:g}"
    row["score"] = f"{max(0.0, raw - penalty):g}"
    notes = [n for n in row.get("notes", "").split(" | ") if n and not n.startswith(NOTE)]
    notes += [f"{NOTE}: {o.cell} {_points(automatic[o.cell])} -> {o.score:g} ({o.reason})"
              for o in overrides]
    row["notes"] = " | ".join(notes)


def _subtotal(row: dict, notebook: gradesheet.Notebook) -> float:
    return sum(float(row.get(notebook.cell_column(grade_id, points)) or 0)
               for grade_id, points in notebook.cells)


def _points(score: float | None) -> str:
    return "no score" if score is None else f"{score:g}"


def _update_feedback(folder: Path, assignment: str, row: dict, missing: set[str],
                     overrides: list[Override], totals) -> None:
    """Every feedback page of the submission: the summary's scores as the row now has them
    (``missing``: the notebooks not handed in), and a list of the overrides with their reasons
    under it."""
    from autograder.notices import assignment_summary

    automatic, raw, penalty, seconds_late = totals
    notebooks = [(nb.slug, None if nb.slug in missing else float(row[nb.column] or 0), nb.points)
                 for nb in gradesheet.layout(assignment)]
    late = {"seconds": seconds_late, "penalty": penalty} if penalty else None
    summary = assignment_summary(assignment, max(0.0, raw - penalty),
                                 gradesheet.max_points(assignment), notebooks, late=late)
    items = "".join(f"<li>{html.escape(o.cell)}: {_points(automatic[o.cell])} &rarr; "
                    f"{o.score:g} points: {html.escape(o.reason)}</li>" for o in overrides)
    block = (f"<div class='overrides' style='border:1px solid #888;padding:0.5em 1em;"
             f"margin:0.5em 0'><strong>Scores your instructor changed</strong><ul>{items}</ul>"
             "</div>")
    for page in sorted(folder.glob("*.html")):
        text = BLOCK.sub("", page.read_text())
        text = re.sub(r"<div class='assignment-summary'.*?</ul></div>", lambda _: summary + block,
                      text, count=1, flags=re.S)
        page.write_text(text)
