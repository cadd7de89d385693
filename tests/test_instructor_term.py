"""autograder/TERM.md, run: every command block of the instructor's walkthrough of a term, in
order, on a copy of the course, with two students (alice answers the exercises as the solution
does, bob hands in the release untouched) and a temporary exchange.

Two things differ from a real term, and only these: the exchange is a temporary folder (the
settings block's ``/srv/nbgrader/exchange`` is replaced), and both students share this test's
account, so each runs their blocks with a home of their own (nbgrader keeps a student's
submissions in a cache in their home) and with ``--CourseDirectory.student_id`` added to their
nbgrader commands (a real student's id is their account name). ~60 s on 2 quiet cores."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from test_autograder import processes_marked
from test_nbgrader_invocation import solved

from autograder import gradesheet

ROOT = Path(__file__).resolve().parent.parent
TERM = ROOT / "autograder/TERM.md"
ASSIGNMENT, SLUG = "00_setup", "health_check"
STUDENT_MARK = "# each student, in their own account:"
ROSTER = ("id,first_name,last_name,email,lms_user_id\n"
          "alice,Alice,Liddell,alice@example.org,u-1\nbob,Bob,Builder,bob@example.org,u-2\n")
# SLUG in the assignment's layout (autograder/gradesheet.py): its cells and points
NOTEBOOK = next(notebook for notebook in gradesheet.layout(ASSIGNMENT) if notebook.slug == SLUG)
OVERRIDDEN = "test-self-test-healthy-group"  # the cell of SLUG whose score TERM.md sets: 1 for bob
BLOCK_DEADLINE_S = 900  # only catches a hang: grading the two takes ~30 s


def blocks() -> list[str]:
    """The ```sh blocks of TERM.md, in order."""
    return re.findall(r"^```sh\n(.*?)^```", TERM.read_text(), re.S | re.M)


def as_student(block: str, student: str) -> str:
    return re.sub(r"^(nbgrader .*)$", rf"\1 --CourseDirectory.student_id={student}", block,
                  flags=re.M)


def run_block(block: str, settings: str, cwd: Path, env: dict) -> str:
    script = f"set -euo pipefail\n{settings}\n{block}"
    done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=BLOCK_DEADLINE_S)
    assert done.returncode == 0, f"{block}\nfailed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


def build_course(root: Path) -> None:
    """The parts of the repository that a term of ``ASSIGNMENT`` reads, as the course root."""
    shutil.copytree(ROOT / "autograder", root / "autograder",
                    ignore=shutil.ignore_patterns("course", "__pycache__"))
    shutil.copytree(ROOT / "ddpcourse", root / "ddpcourse",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("solutions", "exercises"):
        shutil.copytree(ROOT / folder / ASSIGNMENT, root / folder / ASSIGNMENT)
    (root / "roster.csv").write_text(ROSTER)


@pytest.fixture(scope="module")
def term(tmp_path_factory):
    """The course and the students' homes after every block of TERM.md."""
    base = tmp_path_factory.mktemp("term")
    course, exchange = base / "course", base / "exchange"
    build_course(course)
    exchange.mkdir()
    settings, *steps = blocks()
    assert "/srv/nbgrader/exchange" in settings
    settings = settings.replace("/srv/nbgrader/exchange", str(exchange))
    mark = uuid.uuid4().hex
    env = dict(os.environ, DDPCOURSE_GRADING_TEST=mark,
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    homes = {student: base / "home" / student for student in ("alice", "bob")}
    outputs = []
    for step in steps:
        if step.startswith(STUDENT_MARK):  # the students at once, each in their own account
            for home in homes.values():
                home.mkdir(parents=True, exist_ok=True)
            with ThreadPoolExecutor(len(homes)) as students:
                outputs += students.map(
                    lambda student, home: run_block(as_student(step, student), settings, home,
                                                    dict(env, HOME=str(home))),
                    homes, homes.values())
            if "fetch_assignment" in step:
                fetched = homes["alice"] / ASSIGNMENT / f"{SLUG}.ipynb"
                nbformat.write(solved(fetched), fetched)  # answered as the source answers
        else:
            outputs.append(run_block(step, settings, course, env))
    assert not processes_marked(mark), "the term left processes running"
    return course, homes, outputs


def read_rows(path: Path) -> dict[str, dict]:
    with open(path, newline="") as f:
        return {row["student_id"]: row for row in csv.DictReader(f)}


def test_every_block_ran_and_both_students_were_graded(term):
    course, _, _ = term
    rows = read_rows(course / "autograder/course/grades.csv")
    assert sorted(rows) == ["alice", "bob"]
    assert all(row["status"] == "graded" for row in rows.values())
    # every point of her notebook, hidden tests included
    assert float(rows["alice"]["raw_score"]) == NOTEBOOK.points
    assert (rows["bob"]["last_name"], rows["bob"]["lms_user_id"]) == ("Builder", "u-2")


def test_the_override_reached_the_csv(term):
    course, _, _ = term
    bob = read_rows(course / "autograder/course/grades.csv")["bob"]
    column = NOTEBOOK.cell_column(OVERRIDDEN, dict(NOTEBOOK.cells)[OVERRIDDEN])
    assert bob[column] == "1" and float(bob["raw_score"]) == 1.0
    assert "the idea is right; checked by hand" in bob["notes"]


def test_nbgrader_export_gives_the_scores_of_grades_csv(term):
    course, _, _ = term
    ours = read_rows(course / "autograder/course/grades.csv")
    exported = read_rows(course / "autograder/course/export.csv")
    assert {s: float(r["score"]) for s, r in exported.items()} == {
        s: pytest.approx(float(r["score"])) for s, r in ours.items()}


def test_each_student_fetched_only_their_own_feedback_with_the_total(term):
    _, homes, _ = term
    maximum = gradesheet.max_points(ASSIGNMENT)
    for student, home in homes.items():
        pages = sorted((home / ASSIGNMENT / "feedback").glob("*/*.html"))
        assert [page.name for page in pages] == [
            f"{notebook.slug}.html" for notebook in gradesheet.layout(ASSIGNMENT)], (student, pages)
        for page in pages:
            assert re.search(rf"{ASSIGNMENT}: [\d.]+ of {maximum:g} points", page.read_text()), (
                student, page.name)
    bob = next((homes["bob"] / ASSIGNMENT / "feedback").glob(f"*/{SLUG}.html")).read_text()
    assert "the idea is right; checked by hand" in bob


def test_formgrader_lists_every_submission_as_autograded_with_the_csvs_scores(term):
    """What formgrader's pages read (nbgrader's NbGraderAPI with the course's configuration): both
    students autograded, not waiting for autograding, with grades.csv's scores, and each graded
    notebook where formgrader's manual grading opens it."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    course, _, _ = term
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course / "autograder")).load_config()
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    rows = read_rows(course / "autograder/course/grades.csv")
    submissions = {s["student"]: s for s in api.get_submissions(ASSIGNMENT)}
    assert sorted(submissions) == ["alice", "bob"]
    for student, submission in submissions.items():
        assert submission["autograded"] and not submission["needs_manual_grade"], submission
        assert submission["score"] == pytest.approx(float(rows[student]["raw_score"]))
    for notebook in api.get_notebook_submissions(ASSIGNMENT, SLUG):
        folder = api.coursedir.format_path(api.coursedir.autograded_directory,
                                           notebook["student"], ASSIGNMENT)
        assert (Path(folder) / f"{SLUG}.ipynb").is_file(), notebook["student"]
