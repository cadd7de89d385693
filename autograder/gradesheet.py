"""What an assignment is worth, notebook by notebook, and the CSV columns that say so.

An assignment's layout is read from its source notebooks (``solutions/NN_topic/SLUG.ipynb``,
in the order ``autograder/sources.py`` lists them): each notebook's graded cells, in the order
they appear in it, with their points. ``grades.csv`` has, after nbgrader export's columns and
``status``, ``flags``, ``notes``, one subtotal column per notebook followed by that notebook's
test cells, every column's maximum in its name::

    allreduce_by_hand (13), allreduce_by_hand:test-average-gradients-two-ranks (2), ...,
    bucketed_ddp (13), bucketed_ddp:test-broadcast-parameters-two-ranks (1), ...

Why the maximum is in the name rather than in a second header row: the CSV grade imports whose
documentation we read take the first row for the column names and every later row for a student
(Moodle's ``grade/import/csv`` maps each header to a grade item; Sakai's gradebook wants "the
first row" to hold the headings), as ``csv.DictReader`` and spreadsheets do, so a row of maximums
would be read as a student. One header row imports everywhere, and the points stay visible where
a column is chosen. Every column of the layout is written, even where
no student of a run has a score in it, so that runs of one assignment have the same header
(re-grading one student rewrites nobody else's row, and shards merge byte for byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import nbformat

from autograder.sources import SOLUTIONS, exercises


@dataclass(frozen=True)
class Notebook:
    slug: str
    cells: tuple[tuple[str, float], ...]  # (grade id, points), in the notebook's order

    @property
    def points(self) -> float:
        return sum(points for _, points in self.cells)

    @property
    def column(self) -> str:
        """The notebook's subtotal column."""
        return f"{self.slug} ({self.points:g})"

    def cell_column(self, grade_id: str, points: float) -> str:
        return f"{self.slug}:{grade_id} ({points:g})"


@lru_cache(maxsize=None)
def layout(assignment: str, solutions: Path = SOLUTIONS) -> tuple[Notebook, ...]:
    """The assignment's notebooks, each with its graded cells and their points."""
    notebooks = []
    for exercise in exercises(solutions):
        if exercise.assignment != assignment:
            continue
        cells = []
        for cell in nbformat.read(solutions / assignment / f"{exercise.slug}.ipynb",
                                  as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("grade"):
                cells.append((meta["grade_id"], float(meta.get("points", 0))))
        notebooks.append(Notebook(exercise.slug, tuple(cells)))
    return tuple(notebooks)


def max_points(assignment: str) -> float:
    return sum(notebook.points for notebook in layout(assignment))


def layout_columns(assignment: str) -> list[str]:
    """Every notebook's subtotal column, each followed by its cells' columns."""
    columns = []
    for notebook in layout(assignment):
        columns.append(notebook.column)
        columns += [notebook.cell_column(grade_id, points) for grade_id, points in notebook.cells]
    return columns


def order_columns(assignment: str, columns) -> list[str]:
    """The layout's columns, then any others (cells the source no longer has), sorted."""
    known = layout_columns(assignment)
    return known + sorted(set(columns) - set(known))


def score_columns(result: dict) -> dict[str, str]:
    """One grading result's subtotal and cell columns, as the CSV writes them.

    A cell's column is empty where the student has no score for it (their grading timed out);
    a subtotal is the sum of its cells, or 0 when the status zeroes the whole submission
    (flagged, dropped, timed out), so that subtotals always add up to ``raw_score``."""
    row, known = {}, set()
    graded = result["status"] == "graded"
    for notebook in layout(result["assignment"]):
        subtotal = 0.0
        for grade_id, points in notebook.cells:
            known.add(grade_id)
            score = result["cells"].get(grade_id)
            row[notebook.cell_column(grade_id, points)] = "" if score is None else f"{score[0]:g}"
            subtotal += score[0] if score is not None else 0.0
        row[notebook.column] = f"{subtotal if graded else 0.0:g}"
    for grade_id, (score, points) in result["cells"].items():
        if grade_id not in known:
            row[f"{grade_id} ({points:g})"] = f"{score:g}"
    return row


def notebook_scores(result: dict) -> list[tuple[Notebook, float | None]]:
    """Each notebook of the assignment with the student's score in it (None: not handed in)."""
    missing = set(result.get("missing", ()))
    columns = score_columns(result)
    return [(notebook, None if notebook.slug in missing else float(columns[notebook.column]))
            for notebook in layout(result["assignment"])]
