"""Every exercise: its solution passes all its tests (hidden ones too), its student release fails
them, and the release gives away neither solutions nor hidden checks. (That the committed
notebooks are what their text twins and nbgrader give: tests/test_notebook_sources.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient.exceptions import DeadKernelError

from autograder.sources import exercises
from ddpcourse.grading.notebook_runner import (DEFAULT_CELL_TIMEOUT_S, CellResult,
                                               graded_cell_results, is_plain_code_cell,
                                               run_test_cells)
from ddpcourse.kernels import execute_notebook

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = exercises()


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_the_solution_passes_every_test_cell_including_hidden(exercise):
    results = run_test_cells(exercise.source, extra_pythonpath=[str(ROOT)])
    assert results and all(r.passed for r in results), [(r.grade_id, r.message) for r in results
                                                        if not r.passed]


def graded_cells_of_every_release() -> nbformat.NotebookNode:
    """One notebook of every release's cells but its plain demos, each release's preceded by a
    cell that moves into its folder (where a student's kernel starts), in course order. A first
    cell imports every exercise's checks: the integrity snapshot is the first setup cell's, and
    each release's checks must already be in it, as they are in a kernel of its own."""
    preload = nbformat.v4.new_code_cell(
        "import importlib, pkgutil\nimport ddpcourse.grading.comm_audit\n"
        "import ddpcourse.grading.exercises as package\n"
        "for module in pkgutil.iter_modules(package.__path__):\n"
        "    importlib.import_module(f'{package.__name__}.{module.name}')")
    preload.id, preload.metadata["exercise"] = "preload", ""
    cells = [preload]
    for exercise in EXERCISES:
        release = nbformat.read(exercise.release, as_version=4)
        chdir = nbformat.v4.new_code_cell(f"import os\nos.chdir({str(exercise.release.parent)!r})")
        graded = [c for c in release.cells if c.cell_type == "code" and not is_plain_code_cell(c)]
        for number, cell in enumerate([chdir, *graded]):
            cell.id = f"{exercise.slug}-{number}"
            cell.metadata["exercise"] = exercise.slug
            cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells, metadata=release.metadata)  # one kernel for all


@pytest.fixture(scope="module")
def stub_results() -> dict[str, list[CellResult]]:
    """Every release's graded cells, run in one kernel (a kernel and a warm rank server per
    release cost more than all their cells): each exercise's test cell results. What a shared
    kernel could hide, a name one release's cells use and only an earlier one defines, the
    solution's own kernel shows (the test above: the same setup and test cells)."""
    nb = graded_cells_of_every_release()
    died = ""
    try:
        execute_notebook(nb, ROOT / "exercises", DEFAULT_CELL_TIMEOUT_S, allow_errors=True,
                         interrupt_on_timeout=True)
    except DeadKernelError as exc:
        died = f"the kernel died ({exc}); cells after that point did not run"
    return {exercise.slug: graded_cell_results(
        [c for c in nb.cells if c.metadata["exercise"] == exercise.slug], died)
        for exercise in EXERCISES}


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_the_released_stubs_fail_every_visible_test(exercise, stub_results):
    """The release's own cells, less its plain demo cells: those are the solution's notebook's
    cells, executed by the test above (and a release's whole notebook, by the student self-check
    below); here they would only rerun the given code's deadlines and call stubs that raise.
    Each visible test cell must fail, and by the stub's NotImplementedError, not by something
    an earlier release left behind in the shared kernel."""
    release = nbformat.read(exercise.release, as_version=4)
    solution = nbformat.read(exercise.source, as_version=4)
    demos = [c.source for c in release.cells if is_plain_code_cell(c)]
    assert demos == [c.source for c in solution.cells if is_plain_code_cell(c)]
    results = stub_results[exercise.slug]
    assert [r.grade_id for r in results] == [
        c.metadata["nbgrader"]["grade_id"] for c in release.cells
        if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]
    visible = [r for r in results if r.passed is not None]
    assert visible and not any(r.passed for r in visible)
    assert all("NotImplementedError" in r.message for r in visible), [
        (r.grade_id, r.message[-500:]) for r in visible if "NotImplementedError" not in r.message]
    assert any(r.passed is None for r in results), "hidden-test cells show as not yet run"


def test_release_has_no_solution_and_no_hidden_test_code():
    for exercise in EXERCISES:
        text = exercise.release.read_text()
        for secret in ["BEGIN SOLUTION", "BEGIN HIDDEN TESTS", "from autograder.hidden import",
                       "dist.isend(chunks"]:
            assert secret not in text


def test_student_self_check_reports_each_visible_test_cell(tmp_path):
    """`pytest exercises/05_allreduce`, on a notebook half done (average_gradients written,
    ring_allreduce still the stub): each visible test cell is a test of its own, passed or failed
    with the cell's error, and the hidden ones are skipped. One notebook runs without
    pytest-xdist's worker processes although ``-n auto`` asks for them (exercises/conftest.py;
    benchmarks/results/self_check.json). That the untouched release fails every visible cell:
    test_the_released_stubs_fail_every_visible_test."""
    from fake_class import AVERAGE, build

    folder = tmp_path / "exercises" / "05_allreduce"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "exercises" / "conftest.py", tmp_path / "exercises" / "conftest.py")
    nbformat.write(build({"average-gradients": AVERAGE}), folder / "allreduce_by_hand.ipynb")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_AUTO_NUM_WORKERS"}
    done = subprocess.run([sys.executable, "-m", "pytest", str(folder), "-n", "auto", "-q", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 failed, 2 passed, 2 skipped" in done.stdout, done.stdout
    assert "bringing up nodes" not in done.stdout, done.stdout  # what xdist prints with -q
    for cell in ("two-ranks", "world-sizes", "bandwidth"):
        assert f"test-ring-allreduce-{cell} failed:" in done.stdout, done.stdout
    assert "NotImplementedError" in done.stdout
