"""nbgrader's own commands with the course's configuration, run exactly as autograder/README.md
writes them ("Using nbgrader's own commands"), on a course of one assignment built in a temporary
folder: the assignment's source, the grader's modules and its hidden checks.

A correct submission gets full marks, hidden tests included, and the course gradebook that the
configuration names then serves ``db student list``, ``generate_feedback`` and ``export``;
without the hidden checks, ``autograde`` fails with an error naming the missing module instead of
scoring its cells 0. One shared course, so the grading runs once (~35 s on 2 quiet cores)."""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook
from nbgrader.converters import Autograde
from traitlets import import_item

from autograder.nbgrader_api import (RequireHiddenChecks, define_assignment, hidden_modules,
                                     load_config, record_class_in_course_gradebook)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "autograder/README.md"
SECTION = "## Using nbgrader's own commands"
ASSIGNMENT, SLUG, STUDENT = "00_setup", "health_check", "alice"
SOURCE = ROOT / "solutions" / ASSIGNMENT / f"{SLUG}.ipynb"
COMMAND_DEADLINE_S = 600  # only catches a hang: autograding this notebook takes ~20 s
# What nbgrader prints when it did not load the course's configuration the way it was meant to.
CONFIG_TROUBLE = ("Unrecognized alias", "No nbgrader_config.py file found", "not recognized")


def documented_commands() -> list[str]:
    """The command lines of the README section's first code block."""
    section = README.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```\n(.*?)^```", section, re.S | re.M).group(1)
    return [line for line in block.splitlines() if line.strip()]


def command(subcommand: str) -> str:
    """The documented line of ``nbgrader SUBCOMMAND``."""
    [line] = [line for line in documented_commands()
              if line.startswith(f"nbgrader {subcommand} ")]
    return line


def run(line: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run one command line in ``cwd`` with this environment's executables, killing whatever it
    started if it outlives the deadline."""
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                 os.environ.get("PATH", "")]))
    process = subprocess.Popen(shlex.split(line), cwd=cwd, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=COMMAND_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{line!r} still ran after {COMMAND_DEADLINE_S} s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(line, process.returncode, output)


def succeeded(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, f"{done.args!r} failed:\n{done.stdout[-5000:]}"
    trouble = [text for text in CONFIG_TROUBLE if text in done.stdout]
    assert not trouble, f"{done.args!r}: {trouble}\n{done.stdout[-3000:]}"
    return done.stdout


def build_course(root: Path) -> None:
    """The repository's parts that grading one assignment reads, as the course directory."""
    (root / "autograder/hidden").mkdir(parents=True)
    for module in (ROOT / "autograder").glob("*.py"):
        shutil.copy(module, root / "autograder")
    for module in ("__init__.py", f"{SLUG}.py"):
        shutil.copy(ROOT / "autograder/hidden" / module, root / "autograder/hidden")
    shutil.copytree(ROOT / "solutions" / ASSIGNMENT, root / "solutions" / ASSIGNMENT)


def solved(release: Path) -> nbformat.NotebookNode:
    """The released notebook with every solution cell answered as the source answers it."""
    answers = {cell.metadata.nbgrader["grade_id"]: cell.source
               for cell in nbformat.read(SOURCE, as_version=4).cells
               if cell.metadata.get("nbgrader", {}).get("solution")}
    notebook = nbformat.read(release, as_version=4)
    filled = set()
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell.source = answers[grade_id]
            filled.add(grade_id)
    assert filled == set(answers), "the release lost a solution cell"
    return notebook


def graded_cells() -> tuple[dict[str, float], set[str]]:
    """The source's test cells with their points, and those that import hidden checks."""
    cells = [cell for cell in nbformat.read(SOURCE, as_version=4).cells
             if cell.metadata.get("nbgrader", {}).get("grade")]
    points = {cell.metadata.nbgrader["grade_id"]: float(cell.metadata.nbgrader["points"])
              for cell in cells}
    hidden = {cell.metadata.nbgrader["grade_id"] for cell in cells if hidden_modules(cell.source)}
    return points, hidden


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """The course after the documented commands, with the output of each; the autograde line is
    run first without the hidden checks (it must fail), then with them."""
    root = tmp_path_factory.mktemp("course")
    build_course(root)
    outputs = {"generate_assignment": succeeded(run(command("generate_assignment"), root))}
    submitted = root / "autograder/course/submitted" / STUDENT / ASSIGNMENT
    submitted.mkdir(parents=True)
    nbformat.write(solved(root / "exercises" / ASSIGNMENT / f"{SLUG}.ipynb"),
                   submitted / f"{SLUG}.ipynb")

    hidden_checks = root / "autograder/hidden" / f"{SLUG}.py"
    hidden_checks.rename(hidden_checks.with_suffix(".away"))
    outputs["autograde without hidden checks"] = run(command("autograde"), root)
    hidden_checks.with_suffix(".away").rename(hidden_checks)

    for subcommand in ("autograde", "db student list", "generate_feedback", "export"):
        outputs[subcommand] = succeeded(run(command(subcommand), root))
    return root, outputs


def test_autograde_without_the_hidden_checks_is_an_error_not_lost_points(course):
    _, outputs = course
    done = outputs["autograde without hidden checks"]
    _, hidden = graded_cells()
    assert done.returncode != 0, done.stdout[-3000:]
    named = re.findall(r"ModuleNotFoundError: test cell '([^']+)' imports "
                       rf"autograder\.hidden\.{SLUG}, which is not in ", done.stdout)
    assert named and set(named) <= hidden, done.stdout[-3000:]


def test_a_correct_submission_gets_full_marks_hidden_tests_included(course):
    root, _ = course
    points, hidden = graded_cells()
    assert hidden, f"{SLUG} has no hidden test cell to check"
    with Gradebook(f"sqlite:///{root / 'autograder/course/gradebook.db'}") as gradebook:
        notebook = gradebook.find_submission_notebook(SLUG, ASSIGNMENT, STUDENT)
        scores = {grade.name: grade.score for grade in notebook.grades}
    assert scores == points
    autograded = nbformat.read(root / "autograder/course/autograded" / STUDENT / ASSIGNMENT
                               / f"{SLUG}.ipynb", as_version=4)
    errors = {cell.metadata.nbgrader["grade_id"]: output.get("evalue")
              for cell in autograded.cells if cell.cell_type == "code"
              for output in cell.outputs if output.output_type == "error"}
    assert not errors


def test_the_course_gradebook_serves_nbgraders_other_commands(course):
    root, outputs = course
    total = sum(graded_cells()[0].values())
    assert re.search(rf"^{STUDENT} \(", outputs["db student list"], re.M), outputs["db student list"]
    feedback = root / "autograder/course/feedback" / STUDENT / ASSIGNMENT / f"{SLUG}.html"
    assert f"{SLUG} (Score: {total} / {total})" in feedback.read_text()
    with open(root / "autograder/course/grades.csv", newline="") as exported:
        rows = [(row["assignment"], row["student_id"], row["score"], row["max_score"])
                for row in csv.DictReader(exported)]
    assert rows == [(ASSIGNMENT, STUDENT, str(total), str(total))]


def test_a_config_option_or_a_py_suffix_is_not_how_nbgrader_takes_the_file(course):
    """Why the README's lines read as they do (nbgrader 0.9.6)."""
    root, _ = course
    listing = command("db student list")
    with_option = run(listing.replace("--JupyterApp.config_file=", "--config "), root)
    assert "Unrecognized alias: 'config'" in with_option.stdout
    assert STUDENT not in with_option.stdout.split("students in the database:")[-1]
    with_suffix = run(listing.replace("nbgrader_config", "nbgrader_config.py"), root)
    assert "No nbgrader_config.py file found" in with_suffix.stdout
    assert re.search(rf"^{STUDENT} \(", with_suffix.stdout, re.M)


def test_autograde_checks_the_hidden_imports_after_nbgraders_own_sanitizing(tmp_path):
    configured = Autograde(config=load_config(tmp_path)).sanitize_preprocessors
    assert [import_item(p) if isinstance(p, str) else p for p in configured] == [
        *Autograde().sanitize_preprocessors, RequireHiddenChecks]


@pytest.mark.parametrize("source, modules", [
    ("from autograder.hidden import health_check as hidden", ["autograder.hidden.health_check"]),
    ("import autograder.hidden.a, os\nfrom autograder.hidden.b import check",
     ["autograder.hidden.a", "autograder.hidden.b"]),
    ("from autograder import hidden, grade", ["autograder.hidden"]),
    ("import autograder.hiddenness\nfrom . import hidden\nfrom autograder import sources", []),
    ("%time from autograder.hidden import a", []),  # not Python: nbgrader reports it when run
])
def test_the_hidden_imports_a_cell_makes(source, modules):
    assert hidden_modules(source) == modules


def _scores(db: Path) -> dict[str, dict[str, float | None]]:
    """Each student's score per test cell of ASSIGNMENT (empty: no submission)."""
    with Gradebook(f"sqlite:///{db}") as gradebook:
        result = {student.id: {} for student in gradebook.students}
        for submission in gradebook.find_assignment(ASSIGNMENT).submissions:
            result[submission.student.id] = {grade.name: grade.score
                                            for notebook in submission.notebooks
                                            for grade in notebook.grades}
    return result


# nbgrader's own Gradebook.add_submission warns so (as it does in `nbgrader autograde`); recording
# a run in the course gradebook does not pass the warning on to the instructor's terminal.
@pytest.mark.filterwarnings("ignore:Object of type <Submitted")
def test_a_grading_runs_gradebooks_are_recorded_in_the_course_gradebook_keeping_the_others(
        course, tmp_path):
    root, _ = course
    graded = root / "autograder/course/gradebook.db"
    course_db = tmp_path / "gradebook.db"
    define_assignment(f"sqlite:///{course_db}", ASSIGNMENT, root / "solutions")
    with Gradebook(f"sqlite:///{course_db}") as gradebook:  # graded in an earlier run
        gradebook.add_student("zed", first_name="Zed", email="zed@example.org")
        gradebook.add_student(STUDENT, first_name="Alice")
        gradebook.add_submission(ASSIGNMENT, "zed")
        first_cell = next(iter(graded_cells()[0]))
        gradebook.find_grade(first_cell, SLUG, ASSIGNMENT, "zed").auto_score = 1.0
        gradebook.db.commit()
    zed = _scores(course_db)["zed"]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record_class_in_course_gradebook(f"sqlite:///{course_db}", ASSIGNMENT, {STUDENT: graded},
                                         solutions=root / "solutions")
    assert not [str(w.message) for w in caught if "not in session" in str(w.message)]
    recorded = _scores(course_db)
    assert recorded == {STUDENT: _scores(graded)[STUDENT], "zed": zed}
    assert recorded[STUDENT] == graded_cells()[0]
    with Gradebook(f"sqlite:///{course_db}") as gradebook:
        assert gradebook.find_student(STUDENT).first_name == "Alice"  # the roster's, kept
        assert gradebook.find_student("zed").email == "zed@example.org"

    # Re-graded, and this time nbgrader dropped the submission: no stale scores stay.
    record_class_in_course_gradebook(f"sqlite:///{course_db}", ASSIGNMENT,
                                     {STUDENT: tmp_path / "no-gradebook.db"},
                                     solutions=root / "solutions")
    assert _scores(course_db) == {STUDENT: {}, "zed": zed}
    assert not (tmp_path / "no-gradebook.db").exists()


def test_every_hidden_test_cell_of_the_course_is_one_the_check_sees():
    """RequireHiddenChecks finds a hidden block's checks by its imports: every exercise's hidden
    block must import them in a form it reads, from a module that exists."""
    sources = sorted((ROOT / "solutions").glob("*/*.ipynb"))
    assert sources
    for source in sources:
        hidden_blocks = [cell.source for cell in nbformat.read(source, as_version=4).cells
                         if "### BEGIN HIDDEN TESTS" in cell.source]
        for block in hidden_blocks:
            modules = hidden_modules(block)
            assert modules, f"{source.name}: a hidden block imports no hidden checks:\n{block}"
            assert all(importlib.util.find_spec(module) for module in modules), modules


def test_a_gradebook_made_by_the_grader_has_the_revision_nbgraders_alembic_heads_gives(tmp_path):
    """The grader reads the schema revision in-process (``gradebook_schema_revision``); nbgrader
    alone, in a process that never imported the grader, asks ``alembic heads``: the same answer,
    and it is what a new gradebook is stamped with."""
    import sqlite3

    from autograder.grade import empty_gradebook

    asked = subprocess.run(
        [sys.executable, "-c", "import nbgrader.api; print(nbgrader.api.get_alembic_version())"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    path = empty_gradebook(tmp_path / "gradebook.db")
    with sqlite3.connect(path) as db:
        [(stamped,)] = db.execute("SELECT version_num FROM alembic_version").fetchall()
    assert stamped == asked.stdout.strip()
