"""The exercises, found from the folders: ``solutions/NN_topic/SLUG.ipynb`` is one exercise.

``NN_topic`` is nbgrader's assignment (05_allreduce holds two exercises); ``SLUG`` is the
exercise's one name, used for its notebook, its checks (``ddpcourse.grading.exercises.SLUG``), its
hidden checks (``autograder.hidden.SLUG``) and its tests (``tests/test_grading_SLUG.py``). Each
source notebook is paired with its text twin ``SLUG.nb.py`` (jupytext), which is what authors edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS = REPO / "solutions"
EXERCISES = REPO / "exercises"
TEXT_TWIN_SUFFIX = ".nb.py"  # jupytext.toml pairs every SLUG.ipynb with SLUG.nb.py


@dataclass(frozen=True)
class Exercise:
    assignment: str
    slug: str

    @property
    def source(self) -> Path:
        return SOLUTIONS / self.assignment / f"{self.slug}.ipynb"

    @property
    def twin(self) -> Path:
        return self.source.with_suffix(TEXT_TWIN_SUFFIX)

    @property
    def release(self) -> Path:
        return EXERCISES / self.assignment / f"{self.slug}.ipynb"


def exercises(solutions: Path = SOLUTIONS) -> list[Exercise]:
    """Every exercise, in course order."""
    return [Exercise(path.parent.name, path.stem)
            for path in sorted(solutions.glob("[0-9][0-9]_*/*.ipynb"))]


def assignments(solutions: Path = SOLUTIONS) -> list[str]:
    return sorted({exercise.assignment for exercise in exercises(solutions)})


def grade_id(cell) -> str | None:
    return cell.metadata.get("nbgrader", {}).get("grade_id")


def setup_source(notebook) -> str:
    """The locked setup cell: the first code cell of every exercise notebook."""
    return next(cell.source for cell in notebook.cells if cell.cell_type == "code")


def solution_code(path: Path, cell_id: str) -> str:
    """The reference code of one solution cell, without nbgrader's solution markers."""
    notebook = nbformat.read(path, as_version=4)
    source = next(cell.source for cell in notebook.cells if grade_id(cell) == cell_id)
    return "\n".join(line for line in source.splitlines()
                     if line.strip() not in ("### BEGIN SOLUTION", "### END SOLUTION"))
