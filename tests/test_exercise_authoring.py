"""The rules every exercise source notebook (``solutions/NN_topic/SLUG.nb.py``) keeps.

The grading relies on them, and nbgrader does not check them:

* the locked setup cell is the first code cell and sets up this exercise (``setup_notebook(SLUG)``,
  its checks bound to ``checks``), so the kernel is guarded before any student code runs;
* every graded cell is locked and has points (and says how many);
* the grader can read every graded cell (the grammar of autograder/cell_grammar.py, the one the
  grader reads them with): the integrity check before anything, then calls of this exercise's
  checks, or in a hidden block of the grader-only checks of ``autograder.hidden.SLUG`` (so
  feedback shows a call, never the checks' source), each given functions a solution cell defines;
* solution cells are editable and mark what the release removes; every grade id is unique.
"""

from __future__ import annotations

import ast
import importlib
import re

import nbformat
import pytest

from autograder.cell_grammar import BEGIN_HIDDEN, CellGrammarError, parse_graded_cell
from autograder.sources import exercises, grade_id
from ddpcourse.grading.authoring_marks import HIDDEN_MARK
from ddpcourse.grading.exercises import CHECKS_PACKAGE, HIDDEN_PACKAGE

EXERCISES = exercises()


def notebook(exercise):
    return nbformat.read(exercise.source, as_version=4)


def nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def graded_cells(nb):
    return [cell for cell in nb.cells if nbgrader(cell).get("grade")]


def where(exercise, cell) -> str:
    return f"{exercise.twin.name}, cell {grade_id(cell) or '(scratch)'}"


def statements(code: str) -> list[ast.stmt]:
    return ast.parse(code).body


def imports_module_as(node: ast.stmt, package: str, module: str, alias: str) -> bool:
    return (isinstance(node, ast.ImportFrom) and node.module == package
            and [(a.name, a.asname) for a in node.names] == [(module, alias)])


def defined_by_solution_cells(nb) -> set[str]:
    """The top-level functions and classes the notebook's solution cells define."""
    return {node.name for cell in nb.cells if nbgrader(cell).get("solution")
            and cell.cell_type == "code" for node in statements(cell.source)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_the_setup_cell_comes_first_and_sets_up_this_exercise(exercise):
    nb = notebook(exercise)
    setup = next(cell for cell in nb.cells if cell.cell_type == "code")
    meta = nbgrader(setup)
    assert grade_id(setup) == "setup", f"{exercise.twin.name}: the first code cell is not the setup cell"
    assert meta["locked"] and not meta["grade"] and not meta["solution"], meta
    body = statements(setup.source)
    assert any(imports_module_as(node, CHECKS_PACKAGE, exercise.slug, "checks") for node in body), (
        f"{where(exercise, setup)}: import this exercise's checks as "
        f"`from {CHECKS_PACKAGE} import {exercise.slug} as checks`")
    assert ast.unparse(body[-1]) == f"setup_notebook({exercise.slug!r})", (
        f"{where(exercise, setup)}: the last line must be setup_notebook({exercise.slug!r})")


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_every_graded_cell_is_locked_has_points_and_starts_with_the_integrity_check(exercise):
    graded = graded_cells(notebook(exercise))
    assert graded, f"{exercise.twin.name} has no graded cell"
    for cell in graded:
        meta = nbgrader(cell)
        assert cell.cell_type == "code" and meta["locked"] and not meta["solution"], where(exercise, cell)
        assert meta.get("points", 0) > 0, f"{where(exercise, cell)}: no points"
        stated = re.search(r"\((\d+) points?\)", cell.source)
        assert stated and int(stated.group(1)) == meta["points"], (
            f"{where(exercise, cell)}: the header comment must say ({meta['points']} points)")
        # what the cell may run, integrity check first: test_the_grader_can_read_every_test_cell


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_the_grader_can_read_every_test_cell(exercise):
    """Each graded cell is read as the grader reads it (autograder/cell_grammar.py: visible cells
    call this exercise's checks, hidden blocks the grader-only ones, each given the notebook's
    functions by name or together(...)); every check exists; every name a check is given is
    defined by a solution cell, so the student's kernel has it to leave behind."""
    nb = notebook(exercise)
    modules = {f"{CHECKS_PACKAGE}.{exercise.slug}", f"{HIDDEN_PACKAGE}.{exercise.slug}"}
    defined = defined_by_solution_cells(nb)
    for cell in graded_cells(nb):
        try:
            calls = parse_graded_cell(cell.source, exercise.slug, where(exercise, cell))
        except CellGrammarError as wrong:
            pytest.fail(f"the grader cannot read this cell: {wrong}")
        for call in calls:
            assert call.module in modules, where(exercise, cell)
            assert callable(getattr(importlib.import_module(call.module), call.check, None)), (
                f"{where(exercise, cell)}: {call.module} has no {call.check}")
            assert set(call.names) <= defined, (
                f"{where(exercise, cell)}: {sorted(set(call.names) - defined)} is given to "
                f"{call.check} but no solution cell defines it")


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_hidden_cells_are_marked_and_every_exercise_has_one(exercise):
    hidden_cells = [c for c in graded_cells(notebook(exercise)) if BEGIN_HIDDEN in c.source]
    assert hidden_cells, f"{exercise.twin.name} has no hidden tests"
    for cell in hidden_cells:
        assert cell.source.startswith(HIDDEN_MARK), (
            f"{where(exercise, cell)}: a hidden-test cell starts with {HIDDEN_MARK!r}")


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_solution_cells_are_editable_and_mark_what_the_release_removes(exercise):
    nb = notebook(exercise)
    solutions = [cell for cell in nb.cells if nbgrader(cell).get("solution")]
    assert solutions, f"{exercise.twin.name} has nothing for the student to write"
    for cell in solutions:
        assert not nbgrader(cell)["locked"] and not nbgrader(cell)["grade"], where(exercise, cell)
        marks = [line.strip() for line in cell.source.splitlines() if line.strip().startswith("### ")]
        assert marks and len(marks) % 2 == 0 and set(marks) == {"### BEGIN SOLUTION",
                                                                 "### END SOLUTION"}, where(exercise, cell)
    ids = [grade_id(cell) for cell in nb.cells if grade_id(cell)]
    assert len(ids) == len(set(ids)), f"{exercise.twin.name}: grade ids repeat"
    for cell in nb.cells:
        if cell.cell_type == "markdown" and nbgrader(cell):
            assert nbgrader(cell)["locked"], where(exercise, cell)
