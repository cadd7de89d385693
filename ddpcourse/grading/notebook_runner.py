"""Execute an exercise notebook and report each graded test cell: the engine of the self-check.

``pytest exercises/05_allreduce`` (see exercises/conftest.py) and the repository's own tests both
use :func:`run_test_cells`. It executes the notebook once, in a fresh kernel started in the
notebook's folder, with the same per-cell timeout and interrupt behaviour as nbgrader, and then
reads each test cell's outputs.

The repository's check of the student releases (tests/test_exercises.py) reads each release's
results with :func:`graded_cell_results` from one kernel that runs the graded cells of every
release in turn.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient.exceptions import DeadKernelError

from ddpcourse.kernels import execute_notebook

from ddpcourse.grading.authoring_marks import HIDDEN_MARK

DEFAULT_CELL_TIMEOUT_S = 240
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class CellResult:
    grade_id: str
    points: float
    passed: bool | None  # None: a hidden-tests cell of a student release (nothing to run yet)
    message: str
    source: str


def _error_text(cell) -> str:
    for output in cell.get("outputs", []):
        if output.output_type == "error":
            trace = _ANSI.sub("", "\n".join(output.get("traceback", [])))
            return f"{output.ename}: {output.evalue}\n{trace}"
    return ""


def is_plain_code_cell(cell) -> bool:
    """A code cell nbgrader knows nothing of (no ``nbgrader`` metadata): a notebook's demo."""
    return cell.cell_type == "code" and "nbgrader" not in cell.metadata


def run_test_cells(path: Path, cell_timeout: int = DEFAULT_CELL_TIMEOUT_S,
                   extra_pythonpath: list[str] = ()) -> list[CellResult]:
    """Execute the notebook at ``path`` top to bottom and return one result per graded test
    cell."""
    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("PYTHONPATH")
    if extra_pythonpath:
        os.environ["PYTHONPATH"] = os.pathsep.join([*extra_pythonpath, env_before or ""])
    died = ""
    try:
        execute_notebook(nb, path.parent, cell_timeout, allow_errors=True,
                         interrupt_on_timeout=True)
    except DeadKernelError as exc:
        died = f"the notebook's kernel died ({exc}); cells after that point did not run"
    finally:
        if extra_pythonpath:
            if env_before is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = env_before
    return graded_cell_results(nb.cells, died)


def graded_cell_results(cells, died: str = "") -> list[CellResult]:
    """One result per graded test cell of the executed ``cells``; ``died`` says why the cells
    that did not run did not."""
    results = []
    for cell in cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade"):
            continue
        hidden_only = cell.source.startswith(HIDDEN_MARK) and "BEGIN HIDDEN TESTS" not in cell.source
        ran = cell.get("execution_count") is not None
        error = _error_text(cell)
        if hidden_only:
            passed, message = None, "hidden tests: they run when the notebook is graded"
        elif not ran:
            passed, message = False, died or "the cell did not run"
        else:
            passed, message = not error, error
        results.append(CellResult(meta["grade_id"], float(meta.get("points", 0)), passed,
                                  message, cell.source))
    return results
