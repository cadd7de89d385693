"""Every exercise: its solution passes all its tests (hidden ones too), its student release fails
them, and the release gives away neither solutions nor hidden checks. (That the committed
notebooks are what their text twins and nbgrader give: tests/test_notebook_sources.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from autograder.sources import exercises
from ddpcourse.grading.notebook_runner import is_plain_code_cell, run_test_cells

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = exercises()


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_the_solution_passes_every_test_cell_including_hidden(exercise):
    results = run_test_cells(exercise.source, extra_pythonpath=[str(ROOT)])
    assert results and all(r.passed for r in results), [(r.grade_id, r.message) for r in results
                                                        if not r.passed]


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_the_released_stubs_fail_every_visible_test(exercise):
    """The release's own cells, less its plain demo cells: those are the solution's notebook's
    cells, executed by the test above (and by the student self-check's release below); here they
    would only rerun the given code's deadlines and call stubs that raise."""
    release = nbformat.read(exercise.release, as_version=4)
    solution = nbformat.read(exercise.source, as_version=4)
    demos = [c.source for c in release.cells if is_plain_code_cell(c)]
    assert demos == [c.source for c in solution.cells if is_plain_code_cell(c)]
    results = run_test_cells(exercise.release, graded_cells_only=True)
    visible = [r for r in results if r.passed is not None]
    assert visible and not any(r.passed for r in visible)
    assert all("NotImplementedError" in r.message for r in visible)
    assert any(r.passed is None for r in results), "hidden-test cells show as not yet run"


def test_release_has_no_solution_and_no_hidden_test_code():
    for exercise in EXERCISES:
        text = exercise.release.read_text()
        for secret in ["BEGIN SOLUTION", "BEGIN HIDDEN TESTS", "from autograder.hidden import",
                       "dist.isend(chunks"]:
            assert secret not in text


def test_student_self_check_reports_each_visible_test_cell(tmp_path):
    """`pytest exercises/05_allreduce`: the stubs fail each visible cell; a finished notebook
    (the solution's code in the release) passes them. One notebook runs without pytest-xdist's
    worker processes (exercises/conftest.py; benchmarks/results/self_check.json)."""
    done = subprocess.run([sys.executable, "-m", "pytest",
                           "exercises/05_allreduce/allreduce_by_hand.ipynb", "-q",
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1, done.stdout
    assert "5 failed, 2 skipped" in done.stdout
    assert "bringing up nodes" not in done.stdout, done.stdout  # what xdist prints with -q
    assert "test-ring-allreduce-bandwidth failed" in done.stdout

    sys.path.insert(0, str(ROOT / "tests"))
    from fake_class import SUBMISSIONS

    folder = tmp_path / "exercises" / "05_allreduce"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "exercises" / "conftest.py", tmp_path / "exercises" / "conftest.py")
    nbformat.write(SUBMISSIONS["alice"], folder / "allreduce_by_hand.ipynb")
    done = subprocess.run([sys.executable, "-m", "pytest", str(folder), "-q", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 passed, 2 skipped" in done.stdout
