"""Every exercise: its solution passes all its visible tests in the notebook's kernel, as the
student's self-check runs them (the hidden ones, and the visible ones again, pass in the
grader's run of every solution: tests/test_grading_every_assignment.py), its student release
fails them, and the release gives away neither solutions nor hidden checks. (That the committed
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

from autograder.cell_grammar import BEGIN_HIDDEN
from autograder.sources import exercises
from ddpcourse.grading.notebook_runner import (DEFAULT_CELL_TIMEOUT_S, CellResult,
                                               graded_cell_results, is_plain_code_cell)
from ddpcourse.kernels import execute_notebook

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = exercises()


PRELOAD_CHECKS = (
    "import importlib, os, pkgutil, sys, torch\n"
    "import ddpcourse.grading.comm_audit\n"
    "import ddpcourse.grading.exercises as package\n"
    "for module in pkgutil.iter_modules(package.__path__):\n"
    "    importlib.import_module(f'{package.__name__}.{module.name}')\n")
# What a fresh kernel starts with, kept where %reset does not reach, and put back before each
# solution (its folder as the working directory, its environment, torch's RNG, dtype, grad mode).
REMEMBER_FRESH_KERNEL = (
    "sys._fresh_kernel = {'environ': dict(os.environ), 'rng': torch.random.get_rng_state(),\n"
    "                     'dtype': torch.get_default_dtype()}\n")
FRESH_START = """get_ipython().run_line_magic('reset', '-f')
import os, sys, torch
os.chdir({folder!r})
os.environ.clear()
os.environ.update(sys._fresh_kernel['environ'])
torch.random.set_rng_state(sys._fresh_kernel['rng'])
torch.set_default_dtype(sys._fresh_kernel['dtype'])
torch.set_grad_enabled(True)
del os, sys, torch"""


def every_solution_in_one_kernel(selected) -> nbformat.NotebookNode:
    """The ``selected`` solutions' notebooks, whole, in one kernel: each preceded by a cell that
    empties the namespace (``%reset -f``) and puts back what a fresh kernel starts with, so a
    name that only an earlier notebook defines is missing here as in a kernel of its own. A
    kernel, its imports and its warm rank server cost seconds of CPU; 24 of them were a tenth
    of what this file cost. A first cell imports every exercise's checks, as the stubs' kernel
    does (the integrity snapshot is the first setup cell's)."""
    preload = nbformat.v4.new_code_cell(PRELOAD_CHECKS + REMEMBER_FRESH_KERNEL)
    preload.id, preload.metadata["exercise"] = "preload", ""
    cells, metadata = [preload], {}
    for exercise in selected:
        solution = nbformat.read(exercise.source, as_version=4)
        metadata = solution.metadata  # every solution names the same kernel
        start = nbformat.v4.new_code_cell(FRESH_START.format(folder=str(exercise.source.parent)))
        code = [without_hidden_block(c) for c in solution.cells if c.cell_type == "code"]
        for number, cell in enumerate([start, *code]):
            cell.id = f"{exercise.slug}-{number}"
            cell.metadata["exercise"] = exercise.slug
            cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells, metadata=metadata)


def without_hidden_block(cell) -> nbformat.NotebookNode:
    """A hidden-test cell as the student's release has it (its hidden block cut): the hidden
    checks of every solution run where they count, in the grader's own run of the solutions
    through the instructor's command (tests/test_grading_every_assignment.py); in a kernel they
    would only repeat it."""
    if BEGIN_HIDDEN in cell.source:
        cell.source = cell.source.split(BEGIN_HIDDEN, 1)[0].rstrip("\n")
    return cell


@pytest.fixture(scope="module")
def solution_results(request) -> dict[str, list[CellResult]]:
    """Each selected solution's test cell results (the hidden blocks cut), from one kernel."""
    wanted = {item.callspec.params["exercise"].slug for item in request.session.items
              if getattr(item, "originalname", "") == "test_the_solution_passes_every_visible_"
              "test_cell" and hasattr(item, "callspec")}
    selected = [exercise for exercise in EXERCISES if exercise.slug in wanted]
    nb = every_solution_in_one_kernel(selected)
    env_before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env_before]))
    died = ""
    try:
        execute_notebook(nb, ROOT / "solutions", DEFAULT_CELL_TIMEOUT_S, allow_errors=True,
                         interrupt_on_timeout=True)
    except DeadKernelError as exc:
        died = f"the kernel died ({exc}); cells after that point did not run"
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
    return {exercise.slug: graded_cell_results(
        [c for c in nb.cells if c.metadata["exercise"] == exercise.slug], died)
        for exercise in selected}


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.slug)
def test_the_solution_passes_every_visible_test_cell(exercise, solution_results):
    """As the student's self-check runs them, in the notebook's kernel; the hidden ones: in the
    grader's run of the solutions (tests/test_grading_every_assignment.py)."""
    results = solution_results[exercise.slug]
    visible = [r for r in results if r.passed is not None]
    assert visible and all(r.passed for r in visible), [(r.grade_id, r.message)
                                                        for r in visible if not r.passed]
    assert any(r.passed is None for r in results), "the hidden-test cells are not run here"


def test_a_name_an_earlier_solution_defined_is_gone_in_the_next_one(tmp_path):
    """What keeps one kernel for every solution honest: after the fresh start, the namespace is
    empty, and the environment, working directory, torch's RNG, default dtype and grad mode are
    what the kernel started with."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    state = ("import os, torch\n"
             "print(sorted(n for n in dir() if not n.startswith('_') and n not in ('In', 'Out', "
             "'exit', 'quit', 'open', 'get_ipython', 'os', 'torch')), "
             "os.path.basename(os.getcwd()), 'LEFT_BEHIND' in os.environ, "
             "torch.get_default_dtype(), torch.is_grad_enabled(), torch.rand(2).tolist())")
    cells = [PRELOAD_CHECKS + REMEMBER_FRESH_KERNEL,
             FRESH_START.format(folder=str(first)), state,
             "left_behind = 1\nos.environ['LEFT_BEHIND'] = '1'\n"
             "torch.set_default_dtype(torch.float64)\ntorch.set_grad_enabled(False)",
             FRESH_START.format(folder=str(second)), state]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    execute_notebook(nb, tmp_path, 60)
    before, after = (nb.cells[i].outputs[0]["text"] for i in (2, 5))
    assert before.startswith("[] first False torch.float32 True [")
    assert after == before.replace("first", "second")


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
    solutions' run shows (the tests above: the same setup and test cells, each notebook starting
    from an empty namespace)."""
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
