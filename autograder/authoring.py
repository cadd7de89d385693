"""Write nbgrader source notebooks from Python, so an assignment's cells are reviewable as code.

An assignment module (``autograder/assignments/*.py``) lists its cells with :func:`markdown`,
:func:`setup`, :func:`solution`, :func:`tests` and :func:`scratch`; :func:`write_notebook` turns
them into ``solutions/NN_topic/NAME.ipynb`` with nbgrader's cell metadata (schema 3).
``python -m autograder build`` rewrites every source notebook; a test fails when a committed one
differs from what its module builds.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat

SCHEMA_VERSION = 3
from ddpcourse.grading.authoring_marks import HIDDEN_MARK


def _meta(grade_id: str, *, grade=False, solution=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked,
            "schema_version": SCHEMA_VERSION, "solution": solution, "task": False}
    if points is not None:
        meta["points"] = points
    return {"nbgrader": meta}


def _clean(source: str) -> str:
    return textwrap.dedent(source).strip("\n")


def markdown(grade_id: str, text: str):
    return nbformat.v4.new_markdown_cell(_clean(text), metadata=_meta(grade_id, locked=True))


def setup(grade_id: str, code: str):
    """A locked code cell that must run before any student code."""
    return nbformat.v4.new_code_cell(_clean(code), metadata=_meta(grade_id, locked=True))


def solution(grade_id: str, code: str):
    """Student-editable code; ``### BEGIN SOLUTION`` / ``### END SOLUTION`` mark what is removed."""
    return nbformat.v4.new_code_cell(_clean(code), metadata=_meta(grade_id, solution=True))


def scratch(code: str):
    """An ordinary cell for the student to try things in; not graded, not locked."""
    return nbformat.v4.new_code_cell(_clean(code))


def tests(grade_id: str, points: int, code: str, hidden: str | None = None):
    """A graded, locked test cell. ``hidden`` code is wrapped in nbgrader's hidden-test markers:
    removed from the student release, restored when grading."""
    source = _clean(code)
    if hidden is not None:
        source = "\n".join([HIDDEN_MARK, source, "### BEGIN HIDDEN TESTS", _clean(hidden),
                            "### END HIDDEN TESTS"])
    return nbformat.v4.new_code_cell(
        source, metadata=_meta(grade_id, grade=True, locked=True, points=points))


def visible_test(grade_id: str, points: int, what: str, checks_module: str, call: str):
    """A visible test cell: check integrity, then one check from ``ddpcourse.grading.<module>``."""
    plural = "s" if points != 1 else ""
    return tests(grade_id, points, "\n".join([
        f"# Test ({points} point{plural}): {what}",
        f"from ddpcourse.grading import {checks_module}, integrity",
        "integrity.assert_untampered()",
        f"{checks_module}.{call}",
        'print("passed")',
    ]))


def hidden_test(grade_id: str, points: int, what: str, checks_module: str, call: str):
    """A test cell whose checks live in the grader-only ``autograder.hidden.<module>``."""
    plural = "s" if points != 1 else ""
    visible = "\n".join([f"# ({points} point{plural}) {what}",
                         "from ddpcourse.grading import integrity",
                         "integrity.assert_untampered()"])
    hidden = "\n".join([f"from autograder.hidden import {checks_module} as hidden",
                        f"hidden.{call}", 'print("passed")'])
    return tests(grade_id, points, visible, hidden=hidden)


def write_notebook(path: Path, cells: list) -> None:
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python",
                                 "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids keep regenerated notebooks diff-free
        cell["id"] = cell.metadata.get("nbgrader", {}).get("grade_id", f"cell-{i}")
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
