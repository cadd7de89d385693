"""Every assignment, graded end to end by the instructor's command (issue 42).

The assignments are found from ``solutions/`` (:func:`autograder.sources.assignments`), so one
added later is graded here without an edit. Each gets a small class, graded with ``python -m
autograder grade`` as an instructor grades one:

* ``reference``: the student release with every solution cell filled in from the source
  notebook, as a student who solved everything hands it in: every test cell scores its points;
* ``stub``: the release as handed out: status "graded" (no grader error, not dropped, not
  flagged) and the points a stub earns, which is none;
* the chapters' gaming students (``tests/test_grading_gaming.py``,
  ``tests/test_grading_gaming_09.py``), who guess the situation and call whatever reference they
  can import: graded in the same run, so the class costs one command, not two.

The assignment of the most notebooks (where a grader problem of one notebook used to take the
whole assignment down) is graded through the shard path instead of one run: ``--shard 1/2`` and
``--shard 2/2`` at once, then ``python -m autograder merge``, the path SLURM's arrays take
(``tests/test_slurm_cluster.py`` runs the array itself on 11_beyond_ddp). Two assignments are
graded at a time: grading mostly waits on kernels and ranks.

Before any grading, the cheap structural check: the worker prepares every notebook of every
assignment (its test cells read by :mod:`autograder.cell_grammar`, every check found), as it does
for each submission. And a grader-side failure is made to happen, in a copy of the repository
whose one notebook has a test cell the grader cannot read: the other notebook is graded, that one
is reported, and ``grade`` exits non-zero saying it is the grader's fault.
"""

from __future__ import annotations

import concurrent.futures
import csv
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import test_grading_gaming as gaming
import test_grading_gaming_09 as gaming_09
from fake_class import solved_release
from grading_commands import run_at_once

from autograder import gradesheet, sandbox, worker
from autograder.__main__ import GRADER_FAILED
from autograder.sources import assignments, exercises, grade_id

ROOT = Path(__file__).resolve().parent.parent
ASSIGNMENTS = assignments()
AT_ONCE = 2  # assignments graded at the same time
THROUGH_SHARDS = max(ASSIGNMENTS, key=lambda a: (len(gradesheet.layout(a)), a))
pytestmark = pytest.mark.timeout(1500)


def gamers(assignment: str) -> dict[str, dict[str, nbformat.NotebookNode]]:
    """The gaming students of an assignment: student -> {notebook slug: notebook}."""
    found = {}
    if assignment in gaming.CHAPTERS:
        notebook, cells, _ = gaming.CHAPTERS[assignment]
        found[gaming.STUDENT] = {notebook: gaming.submission(assignment, notebook, cells)}
    if assignment == "09_debugging":
        found[f"{gaming_09.STUDENT}09"] = {"wrong_numbers": gaming_09.submission()}
    return found


# A cell that rebinds what the notebook's own test cells call, so that every visible test cell of
# the self-check passes whatever the functions do (spelt so that the static scan may miss it).
REBIND = """
for _name in [name for name in vars(checks) if name.startswith("check_")]:
    vars(checks)[_name] = lambda *args, **kwargs: None
vars(integrity)["assert_untampered"] = lambda *args, **kwargs: None
"""
REBINDERS = {"10_performance": "fit_cost_model", "11_beyond_ddp": "build_2d_groups"}


def rebinder(assignment: str) -> dict[str, nbformat.NotebookNode]:
    """The release of one notebook, stubs left as they are, with :data:`REBIND` after setup."""
    [exercise] = [e for e in exercises() if e.slug == REBINDERS[assignment]]
    notebook = nbformat.read(exercise.release, as_version=4)
    setup = next(i for i, cell in enumerate(notebook.cells) if grade_id(cell) == "setup")
    notebook.cells.insert(setup + 1, nbformat.v4.new_code_cell(REBIND.strip()))
    return {exercise.slug: notebook}


def write_class(root: Path, assignment: str, with_gamers: bool) -> Path:
    submitted = root / "submitted"
    students: dict[str, dict[str, nbformat.NotebookNode]] = {"reference": {}, "stub": {}}
    for exercise in exercises():
        if exercise.assignment == assignment:
            students["reference"][exercise.slug] = solved_release(exercise)
            students["stub"][exercise.slug] = nbformat.read(exercise.release, as_version=4)
    if with_gamers:
        students.update(gamers(assignment))
    if assignment in REBINDERS:
        students["rebinder"] = rebinder(assignment)
    for student, notebooks in students.items():
        folder = submitted / student / assignment
        folder.mkdir(parents=True)
        for slug, notebook in notebooks.items():
            nbformat.write(notebook, folder / f"{slug}.ipynb")
    return submitted


@dataclass
class Graded:
    """One assignment's class, graded: the commands' exit codes and output, and OUT's rows."""

    assignment: str
    out: Path
    said: dict[str, tuple[int, str]]  # command -> (exit code, stdout + stderr)
    rows: dict[str, dict[str, str]]
    summary: dict

    def assert_every_command_succeeded(self) -> None:
        assert all(code == 0 for code, _ in self.said.values()), "\n".join(
            f"--- {name} (exit code {code}):\n{text[-4000:]}"
            for name, (code, text) in self.said.items())


def grade_command(submitted: Path, assignment: str, out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "autograder", "grade", str(submitted), "--assignment",
            assignment, "--out", str(out), "--cell-timeout", "240", "--student-timeout", "600",
            "--sandbox", SANDBOX, *options]


def grade_assignment(root: Path, assignment: str) -> Graded:
    submitted = write_class(root, assignment, with_gamers=SANDBOX == "require")
    env = dict(os.environ, DDPCOURSE_CHECK_TIMEOUT_S="60")  # no student here hangs
    out = root / "out"
    if assignment != THROUGH_SHARDS:
        said = run_at_once({"grade": grade_command(submitted, assignment, out, "--jobs", "2")},
                           ROOT, env, timeout=1200)
    else:
        shards = {f"{i}/2": root / f"shard-{i}-of-2" for i in (1, 2)}
        said = run_at_once({f"grade --shard {shard}": grade_command(
            submitted, assignment, folder, "--jobs", "1", "--shard", shard)
            for shard, folder in shards.items()}, ROOT, env, timeout=1200)
        if all(code == 0 for code, _ in said.values()):
            said.update(run_at_once({"merge": [sys.executable, "-m", "autograder", "merge",
                                               *map(str, shards.values()), "--out", str(out)]},
                                    ROOT, env, timeout=1200))
    rows, summary = {}, {}
    if (out / "grades.csv").exists():
        with open(out / "grades.csv", newline="") as f:
            rows = {row["student_id"]: row for row in csv.DictReader(f)}
        summary = json.loads((out / "summary.json").read_text())
    return Graded(assignment, out, said, rows, summary)


SANDBOX = "require" if sandbox.resolve("warn")[0] else "warn"


@pytest.fixture(scope="module")
def graded(request, tmp_path_factory) -> dict[str, Graded]:
    """The selected assignments' classes, graded, two assignments at a time."""
    wanted = sorted({item.callspec.params["assignment"] for item in request.session.items
                     if item.module is request.module and hasattr(item, "callspec")
                     and "assignment" in item.callspec.params
                     and "graded" in item.fixturenames})
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        futures = {assignment: pool.submit(grade_assignment,
                                           tmp_path_factory.mktemp(assignment), assignment)
                   for assignment in wanted}
        return {assignment: future.result() for assignment, future in futures.items()}


def cell_scores(row: dict, notebook: gradesheet.Notebook) -> dict[str, str]:
    return {cell: row.get(notebook.cell_column(cell, points)) for cell, points in notebook.cells}


# --- cheap, first: the worker can prepare every notebook ----------------------------------------

@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_the_worker_prepares_every_notebook_of_the_assignment(assignment):
    graded_outside, in_kernel, grader_errors = worker._read_trusted_sources(
        ROOT / "solutions" / assignment, assignment)
    assert grader_errors == {}
    slugs = [notebook.slug for notebook in gradesheet.layout(assignment)]
    assert sorted(graded_outside) == sorted(slugs) and in_kernel == []


# --- the instructor's command, every assignment -------------------------------------------------

@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_the_solutions_get_full_marks_on_every_cell(graded, assignment):
    result = graded[assignment]
    result.assert_every_command_succeeded()
    row = result.rows["reference"]
    assert (row["status"], row["flags"]) == ("graded", ""), row["notes"]
    for notebook in gradesheet.layout(assignment):
        expected = {cell: f"{points:g}" for cell, points in notebook.cells}
        assert cell_scores(row, notebook) == expected, (notebook.slug, row["notes"])
    assert float(row["score"]) == gradesheet.max_points(assignment)
    [reference] = [r for r in result.summary["results"] if r["student"] == "reference"]
    assert not reference.get("grader_errors") and not reference["missing"]


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_the_released_stubs_are_graded_and_earn_nothing(graded, assignment):
    result = graded[assignment]
    result.assert_every_command_succeeded()
    row = result.rows["stub"]
    assert (row["status"], row["flags"]) == ("graded", ""), row["notes"]
    assert "GRADER ERROR" not in row["notes"]
    for notebook in gradesheet.layout(assignment):
        scores = cell_scores(row, notebook)
        assert set(scores.values()) == {"0"}, (notebook.slug, scores)
        page = result.out / "feedback" / "stub" / assignment / f"{notebook.slug}.html"
        assert "FAILED" in page.read_text(), page


@pytest.mark.parametrize("assignment", sorted({*gaming.CHAPTERS, "09_debugging"}))
def test_reading_the_situation_and_calling_a_reference_scores_zero(graded, assignment):
    """The gaming students of tests/test_grading_gaming.py (chapters 05-08) and
    tests/test_grading_gaming_09.py: failed, not flagged (the verdicts did it), and in 09 the
    honest function still earns its points."""
    if SANDBOX != "require":
        pytest.skip(f"the sandbox hides the hidden checks, and it cannot run here: "
                    f"{sandbox.resolve('warn')[1]}")
    result = graded[assignment]
    for student, notebooks in gamers(assignment).items():
        row = result.rows[student]
        assert (row["status"], row["flags"]) == ("graded", ""), row
        for slug in notebooks:
            [notebook] = [nb for nb in gradesheet.layout(assignment) if nb.slug == slug]
            scores = cell_scores(row, notebook)
            honest = {"test-train-epochs": "3"} if slug == "wrong_numbers" else {}
            assert scores == {**{cell: "0" for cell in scores}, **honest}, (student, scores)
        if assignment == "09_debugging":
            page = result.out / "feedback" / student / assignment / "wrong_numbers.html"
            assert "No module named" in page.read_text() or "has no attribute" in page.read_text()


@pytest.mark.parametrize("assignment", sorted(REBINDERS))
def test_rebinding_the_checks_in_the_kernel_gains_nothing(graded, assignment):
    """The self-check runs the test cells in the student's kernel, where a cell can rebind them;
    the graded run's verdicts never come from there (autograder/trusted.py)."""
    row = graded[assignment].rows["rebinder"]
    [notebook] = [nb for nb in gradesheet.layout(assignment) if nb.slug == REBINDERS[assignment]]
    assert set(cell_scores(row, notebook).values()) == {"0"}, row
    assert float(row["score"]) == 0.0 and row["status"] in ("graded", "flagged for tampering")


# --- one notebook the grader cannot read does not take the assignment down ----------------------

BROKEN = "checks.check_mlp(ColumnParallelLinear, layers=RowParallelLinear)"


def copy_with_a_broken_notebook(root: Path) -> Path:
    """The parts of the repository the grader runs, with 11_beyond_ddp cut to two notebooks,
    one of them (tensor_parallel_linear) with a test cell outside the grammar."""
    repo = root / "repo"
    for folder in ("autograder", "ddpcourse"):
        shutil.copytree(ROOT / folder, repo / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "course"))
    assignment = repo / "solutions" / "11_beyond_ddp"
    assignment.mkdir(parents=True)
    for slug in ("build_2d_groups", "tensor_parallel_linear"):
        shutil.copyfile(ROOT / "solutions" / "11_beyond_ddp" / f"{slug}.ipynb",
                        assignment / f"{slug}.ipynb")
    path = assignment / "tensor_parallel_linear.ipynb"
    notebook = nbformat.read(path, as_version=4)
    [cell] = [c for c in notebook.cells if grade_id(c) == "test-mlp"]
    cell.source = cell.source.replace(
        "checks.check_mlp(together(ColumnParallelLinear, RowParallelLinear))", BROKEN)
    assert BROKEN in cell.source
    nbformat.write(notebook, path)
    return repo


def test_a_notebook_the_grader_cannot_read_is_reported_and_the_others_are_graded(tmp_path):
    repo = copy_with_a_broken_notebook(tmp_path)
    submitted = tmp_path / "submitted"
    folder = submitted / "reference" / "11_beyond_ddp"
    folder.mkdir(parents=True)
    for exercise in exercises():
        if exercise.slug in ("build_2d_groups", "tensor_parallel_linear"):
            nbformat.write(solved_release(exercise), folder / f"{exercise.slug}.ipynb")
    out = tmp_path / "out"
    env = dict(os.environ, DDPCOURSE_CHECK_TIMEOUT_S="60",
               PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(grade_command(submitted, "11_beyond_ddp", out, "--jobs", "1"),
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == GRADER_FAILED, done.stdout[-3000:] + done.stderr[-3000:]
    assert "GRADER ERROR: the grader itself failed, not the students' code" in done.stderr
    assert "reference: tensor_parallel_linear: CellGrammarError" in done.stderr
    assert "cell test-mlp" in done.stderr and "layers=RowParallelLinear" in done.stderr
    with open(out / "grades.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert row["status"] == "graded" and row["notes"].startswith(
        "GRADER ERROR in tensor_parallel_linear (the grader's fault, not the student's")
    columns = {column: value for column, value in row.items() if "(" in column}
    assert columns["build_2d_groups (8)"] == "8"  # the other notebook: graded in full
    assert columns["tensor_parallel_linear (12)"] == "0"
    assert row["score"] == "8"
    page = (out / "feedback" / "reference" / "11_beyond_ddp" /
            "tensor_parallel_linear.html").read_text()
    assert "This notebook was not graded: the grader failed" in page
    assert "not your doing" in page
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["results"][0]["grader_errors"]) == ["tensor_parallel_linear"]


def test_a_worker_that_crashed_is_the_graders_fault_too(capsys):
    """What grade and merge say of the results they end with: nothing when every notebook was
    graded; a crashed worker (status "grader error") and a notebook the grader could not grade
    are named, with exit code GRADER_FAILED."""
    from autograder.__main__ import report_grader_errors

    fine = {"student": "amy", "status": "graded", "notes": [], "grader_errors": {}}
    crashed = {"student": "ben", "status": "grader error",
               "notes": ["the grading worker exited with code 1"]}
    one_notebook = {"student": "cy", "status": "graded", "notes": [],
                    "grader_errors": {"bucketed_ddp": "CellGrammarError: cell test-x: ..."}}
    assert report_grader_errors([fine]) == 0 and capsys.readouterr().err == ""
    assert report_grader_errors([fine, crashed, one_notebook]) == GRADER_FAILED
    err = capsys.readouterr().err
    assert "ben: (all notebooks): the grading worker exited with code 1" in err
    assert "cy: bucketed_ddp: CellGrammarError: cell test-x" in err and "amy" not in err
