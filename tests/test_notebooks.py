"""Every lesson notebook executes top to bottom on CPU, and the pictures it draws render.

Notebooks are committed without outputs (tests/test_notebooks.py checks that too); here each is
executed in a fresh kernel from its own folder, as a student would open it. This is the run's one
execution of each lesson: its executed copy is kept at ``build/executed/<path>.ipynb`` (e.g.
``build/executed/chapters/05_allreduce/05_allreduce.ipynb``) for whatever reads a lesson's
outputs after the suite (the course site), and only when the notebook passed.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from course_layout import LESSONS

from ddpcourse.kernels import execute_notebook

ROOT = Path(__file__).resolve().parent.parent
EXECUTED = ROOT / "build" / "executed"
CELL_TIMEOUT_S = 300


def executed_copy(path: Path) -> Path:
    """Where the run keeps the executed copy of the lesson ``path``."""
    return EXECUTED / path.relative_to(ROOT)


def test_lesson_notebooks_are_committed_without_outputs():
    for path in LESSONS:
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.relative_to(ROOT)}: cells {dirty} carry outputs; strip them"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_lesson_notebook_executes_and_draws_its_figures(path):
    kept = executed_copy(path)
    kept.unlink(missing_ok=True)  # no stale copy survives a failing run
    nb = nbformat.read(path, as_version=4)
    execute_notebook(nb, path.parent, CELL_TIMEOUT_S)
    draws = [c for c in nb.cells if c.cell_type == "code" and "plt." in c.source]
    for cell in draws:
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert images, f"a cell that plots shows no figure:\n{cell.source[:300]}"
    kept.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, kept)
