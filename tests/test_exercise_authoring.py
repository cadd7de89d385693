"""The rules every exercise source notebook (``solutions/NN_topic/SLUG.nb.py``) keeps.

The grading relies on them, and nbgrader does not check them:

* the locked setup cell is the first code cell and sets up this exercise (``setup_notebook(SLUG)``,
  its checks bound to ``checks``), so the kernel is guarded before any student code runs;
* every graded cell is locked, has points (and says how many), and starts with the integrity
  check before it calls anything;
* a visible test cell only calls this exercise's checks; a hidden block only *calls* grader-only
  checks of ``autograder.hidden.SLUG`` (so feedback shows a call, never the checks' source);
* solution cells are editable and mark what the release removes; every grade id is unique.
"""

from __future__ import annotations

import ast
import importlib
import re

import nbformat
import pytest

from autograder.sources import exercises, grade_id
from ddpcourse.grading.authoring_marks import HIDDEN_MARK
from ddpcourse.grading.exercises import CHECKS_PACKAGE, HIDDEN_PACKAGE

BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
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


def is_call_on(node: ast.stmt, name: str) -> bool:
    """``name.something(...)`` as a statement of its own."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Attribute)
            and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == name)


def is_print_passed(node: ast.stmt) -> bool:
    return ast.unparse(node) == "print('passed')"


def imports_module_as(node: ast.stmt, package: str, module: str, alias: str) -> bool:
    return (isinstance(node, ast.ImportFrom) and node.module == package
            and [(a.name, a.asname) for a in node.names] == [(module, alias)])


def assert_only_calls_then_passed(context: str, nodes: list[ast.stmt], alias: str, module) -> None:
    """``nodes`` are ``alias.check(...)`` calls of functions ``module`` has, then print('passed')."""
    assert nodes and is_print_passed(nodes[-1]), f"{context}: ends with print('passed')"
    for node in nodes[:-1]:
        assert is_call_on(node, alias), f"{context}: `{ast.unparse(node)}` - only calls {alias}.*"
        assert hasattr(module, node.value.func.attr), (
            f"{context}: {module.__name__} has no {node.value.func.attr}")


def split_hidden(source: str) -> tuple[str, str]:
    """(the cell's visible code, its hidden block's code)."""
    if BEGIN_HIDDEN not in source:
        return source, ""
    before, rest = source.split(BEGIN_HIDDEN, 1)
    hidden, after = rest.split(END_HIDDEN, 1)
    assert not after.strip(), "nothing may follow the hidden block"
    return before, hidden


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
        visible, _ = split_hidden(cell.source)
        body = statements(visible)
        first_call = next(i for i, node in enumerate(body)
                          if not isinstance(node, (ast.Import, ast.ImportFrom)))
        assert ast.unparse(body[first_call]) == "integrity.assert_untampered()", (
            f"{where(exercise, cell)}: the first thing a test cell runs is "
            "integrity.assert_untampered()")


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_visible_cells_only_call_this_exercises_checks(exercise):
    checks = importlib.import_module(f"{CHECKS_PACKAGE}.{exercise.slug}")
    for cell in graded_cells(notebook(exercise)):
        if BEGIN_HIDDEN in cell.source:
            continue
        body = statements(cell.source)
        calls = [node for node in body if not isinstance(node, (ast.Import, ast.ImportFrom))][1:]
        assert_only_calls_then_passed(where(exercise, cell), calls, "checks", checks)


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_hidden_blocks_only_call_grader_only_checks(exercise):
    hidden_module = importlib.import_module(f"{HIDDEN_PACKAGE}.{exercise.slug}")
    hidden_cells = [c for c in graded_cells(notebook(exercise)) if BEGIN_HIDDEN in c.source]
    assert hidden_cells, f"{exercise.twin.name} has no hidden tests"
    for cell in hidden_cells:
        assert cell.source.startswith(HIDDEN_MARK), (
            f"{where(exercise, cell)}: a hidden-test cell starts with {HIDDEN_MARK!r}")
        _, hidden = split_hidden(cell.source)
        body = statements(hidden)
        assert imports_module_as(body[0], HIDDEN_PACKAGE, exercise.slug, "hidden"), (
            f"{where(exercise, cell)}: the hidden block starts with "
            f"`from {HIDDEN_PACKAGE} import {exercise.slug} as hidden`")
        assert_only_calls_then_passed(where(exercise, cell), body[1:], "hidden", hidden_module)


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
