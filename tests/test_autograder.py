"""The grading pipeline, end to end, on a fake class (tests/fake_class): every way a student can go
wrong is graded within bounded time, scored as earned, and leaves no process behind.

The class includes the hostile submissions of tests/fake_class/hostile.py (the last section here):
one grading run serves both, since grading a class is the slowest thing the suite does. Three
students of the fake class are graded end to end by other files, which assert on their cells
there, and so are not graded here again: bob (a wrong average, tests/test_autograder_regrade.py),
mallory (tampering, tests/test_autograder_shards.py) and oscar (only the second notebook, both)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from fake_class import ASSIGNMENT, EXPECTED, LAYOUT, MAX_POINTS, handed_in, write_class

ROOT = Path(__file__).resolve().parent.parent
# allreduce_by_hand's test cells of each function (a wrong function loses exactly these)
AVERAGE_CELLS = ["test-average-gradients-two-ranks", "test-average-gradients-skips-missing",
                 "test-average-gradients-hidden"]
RING_CELLS = ["test-ring-allreduce-two-ranks", "test-ring-allreduce-world-sizes",
              "test-ring-allreduce-bandwidth", "test-ring-allreduce-hidden"]
PART2_CELLS = [grade_id for grade_id, _ in LAYOUT["bucketed_ddp"].cells]
GRADED_ELSEWHERE = ("bob", "mallory", "oscar")
CLASS = [student for student in EXPECTED if student not in GRADED_ELSEWHERE]
# Grading the class is the slowest thing the suite does (each worker's steps and their seconds are
# in OUT/summary.json); --jobs 3: the hanging students mostly wait for their deadlines, so a third
# job overlaps them.
pytestmark = pytest.mark.timeout(900)


def processes_marked(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if mark.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def grade(class_root: Path, out: Path, jobs: int = 3) -> tuple[dict[str, dict], float, str]:
    mark = f"DDPCOURSE_GRADING_TEST={uuid.uuid4().hex}"
    env = dict(os.environ, DDPCOURSE_CHECK_TIMEOUT_S="10", DDPCOURSE_GRADING_TEST=mark.split("=")[1])
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "autograder", "grade", str(class_root / "submitted"),
         "--assignment", ASSIGNMENT, "--out", str(out), "--jobs", str(jobs),
         "--cell-timeout", "30", "--student-timeout", "600"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr
    time.sleep(1.0)
    assert not processes_marked(mark), "grading left processes running"
    with open(out / "grades.csv") as f:
        rows = {row["student_id"]: by_grade_id(row) for row in csv.DictReader(f)}
    return rows, elapsed, done.stdout


def by_grade_id(row: dict) -> dict:
    """A CSV row with each test cell also under its bare grade id (the CSV's column is
    ``NOTEBOOK:GRADE_ID (POINTS)``, autograder/gradesheet.py)."""
    cells = {}
    for column, value in row.items():
        notebook, colon, rest = column.partition(":")
        if colon and rest.endswith(")"):
            cells[rest.rsplit(" (", 1)[0]] = value
    return {**row, **cells}


def full_marks(slug: str, *lost: str) -> dict[str, str]:
    """Each test cell of notebook ``slug`` with its points as the CSV writes them, 0 in ``lost``."""
    return {grade_id: "0" if grade_id in lost else f"{points:g}"
            for grade_id, points in LAYOUT[slug].cells}


def assert_missing_notebooks_score_zero(row: dict, student: str) -> None:
    """Every notebook of the assignment that ``student`` did not hand in: its subtotal and each
    of its cells 0 in the student's CSV row."""
    for slug, notebook in LAYOUT.items():
        if slug not in handed_in(student):
            assert row[notebook.column] == "0", (student, slug)
            assert all(row[notebook.cell_column(grade_id, points)] == "0"
                       for grade_id, points in notebook.cells), (student, slug)


def repository_digest() -> dict[str, str]:
    """A hash of every file the grader or the course reads (not the virtual environment)."""
    digests = {}
    for folder in ("autograder", "ddpcourse", "solutions", "exercises", "tests"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digests[str(path.relative_to(ROOT))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = write_class(tmp_path_factory.mktemp("class"), CLASS)
    out = root / "out"
    before = repository_digest()
    rows, elapsed, stdout = grade(root, out)
    changed = {path for path, digest in repository_digest().items() if before.get(path) != digest}
    return rows, out, stdout, elapsed, changed


def test_every_student_is_in_the_csv_with_the_points_they_earned(graded):
    rows = graded[0]
    assert sorted(rows) == sorted(CLASS)
    got = {s: (float(r["score"]), r["status"]) for s, r in rows.items()}
    assert got == {s: (float(EXPECTED[s][0]), EXPECTED[s][1]) for s in CLASS}
    assert all(r["max_score"] == f"{MAX_POINTS:g}" for r in rows.values())


def test_every_notebook_handed_in_is_graded_and_a_missing_one_scores_zero(graded):
    """alice hands in both of the fake class's notebooks, everyone else here only the first
    (oscar, who hands in only the second: tests/test_autograder_shards.py); every other notebook
    of the assignment is missing for all of them."""
    rows, out = graded[:2]
    alice = rows["alice"]
    assert set(handed_in("alice")) == {"allreduce_by_hand", "bucketed_ddp"}
    assert {c: alice[c] for c in PART2_CELLS} == full_marks("bucketed_ddp")
    assert alice[LAYOUT["bucketed_ddp"].column] == f"{LAYOUT['bucketed_ddp'].points:g}"
    for student in CLASS:
        assert_missing_notebooks_score_zero(rows[student], student)
    assert (out / "feedback" / "alice" / ASSIGNMENT / "bucketed_ddp.html").exists()


def test_a_wrong_answer_loses_exactly_the_points_of_its_cells(graded):
    """A hanging average_gradients here; bob's wrong one: tests/test_autograder_regrade.py."""
    rows = graded[0]
    dave = rows["dave"]  # hanging average_gradients, correct ring
    assert all(dave[c] == "0" for c in AVERAGE_CELLS)
    assert [dave[c] for c in RING_CELLS] == ["2", "2", "2", "3"]
    carol = rows["carol"]  # deadlocking ring
    assert [carol[c] for c in AVERAGE_CELLS] == ["2", "1", "1"]
    assert all(carol[c] == "0" for c in RING_CELLS)


def test_students_whose_kernel_died_or_blocked_still_get_a_row_and_feedback(graded):
    rows, out = graded[:2]
    assert "kernel died" in rows["heidi"]["notes"]
    assert "could not be interrupted" in rows["ivan"]["notes"]
    for student in ("heidi", "ivan"):
        page = (out / "feedback" / student / "05_allreduce" / "allreduce_by_hand.html").read_text()
        assert "could not be graded" in page and "Score: 0" in page


def assert_small_feedback_without_hidden_checks(out: Path, student: str) -> None:
    """A page for each notebook of the student, handed in or not (tests/test_autograder_regrade.py),
    each under 3 MB and without a line of the hidden checks' code. Also asserted of the students
    other files grade (bob, mallory, oscar)."""
    hidden_source = "\n".join((ROOT / "autograder/hidden" / f"{slug}.py").read_text()
                              for slug in LAYOUT)
    secret_lines = [line.strip() for line in hidden_source.splitlines()
                    if line.strip().startswith("(") or "_hidden(" in line]
    pages = sorted((out / "feedback" / student / ASSIGNMENT).glob("*.html"))
    assert [page.stem for page in pages] == sorted(LAYOUT), student
    for page in pages:
        assert page.stat().st_size < 3_000_000, f"{student}'s {page.name}: {page.stat().st_size} B"
        text = page.read_text()
        for line in secret_lines:
            assert line not in text, f"hidden check code shown to {student}: {line}"


def test_the_cell_that_stopped_the_kernel_is_named_without_executing_the_notebook_again(graded):
    """Where autograde's execution stopped is recorded (autograder/capped_execute.py, STOPS):
    the worker names that cell without a second execution, which for ivan would wait out the
    30-second cell timeout once more (the step's seconds are in summary.json)."""
    rows, out = graded[:2]
    steps = {r["student"]: r["steps"] for r in json.loads((out / "summary.json").read_text())[
        "results"]}
    assert "code cell 11 (of the notebook's 16 cells): it blocked the kernel" in rows["ivan"][
        "notes"] and "dist.TCPStore(" in rows["ivan"]["notes"]
    assert "the notebook's kernel died while running it" in rows["heidi"]["notes"]
    assert "os.kill(os.getpid(), signal.SIGKILL)" in rows["heidi"]["notes"]
    for student in ("heidi", "ivan"):
        assert steps[student]["why nbgrader dropped it"] < 30, steps[student]
    for student in CLASS:  # every step of every worker, its start-up included
        assert {"start-up", "prepare", "generate_assignment", "autograde (the student's kernel)",
                "export"} <= set(steps[student]), (student, steps[student])


def test_every_student_gets_a_small_feedback_page_without_the_hidden_checks(graded):
    out = graded[1]
    for student in CLASS:
        assert_small_feedback_without_hidden_checks(out, student)


def test_nbgrader_export_of_the_course_gradebook_gives_the_csvs_scores(graded, tmp_path):
    """OUT/gradebook.db is nbgrader's own database: its export, as autograder/README.md gives the
    command, has every student with the score grades.csv has (flagged students held at 0)."""
    rows, out = graded[:2]
    exported = tmp_path / "export.csv"
    done = subprocess.run(
        [str(Path(sys.executable).parent / "nbgrader"), "export",
         "--JupyterApp.config_file=autograder/nbgrader_config",
         f"--CourseDirectory.db_url=sqlite:///{out / 'gradebook.db'}", "--to", str(exported)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with open(exported) as f:
        export = {row["student_id"]: row for row in csv.DictReader(f)}
    assert sorted(export) == sorted(rows)
    for student, row in rows.items():
        assert float(export[student]["score"]) == pytest.approx(float(row["score"])), student
        assert float(export[student]["max_score"]) == float(row["max_score"]), student


def test_the_summary_table_lists_everyone(graded):
    stdout = graded[2]
    for student in CLASS:
        assert student in stdout
    assert f"{len(CLASS)} submissions in" in stdout


# --- hostile submissions (tests/fake_class/hostile.py) -------------------------------------------

HOSTILE = ["kenji", "wanda", "fiona", "threader"]


def test_rebinding_the_checks_inside_the_ranks_gains_nothing(graded):
    rows = graded[0]
    kenji = rows["kenji"]  # empty average_gradients that rebinds the checks; a correct ring
    assert all(kenji[c] == "0" for c in AVERAGE_CELLS)
    assert [kenji[c] for c in RING_CELLS] == ["2", "2", "2", "3"]
    # aliases the static scan cannot follow, and shadowing run_ranks in the notebook is harmless
    # (the tests re-import it): no flag, the verdicts did it
    assert kenji["flags"] == ""


def test_taking_over_the_kernel_changes_no_verdict(graded):
    rows, out = graded[:2]
    kenji = rows["kenji"]  # also wraps every later cell in try/except, no exception reported
    assert all(kenji[c] == "0" for c in AVERAGE_CELLS)
    page = (out / "feedback/kenji/05_allreduce/allreduce_by_hand.html").read_text()
    assert "Graded outside your notebook" in page and "FAILED (0 of 2 points)" in page


def test_collectives_behind_the_in_rank_audit_are_caught(graded):
    rows, out = graded[:2]
    threader = rows["threader"]  # its own gloo group, else all_reduce from a thread + dummy sends
    assert [threader[c] for c in AVERAGE_CELLS] == ["2", "1", "1"]
    assert all(threader[c] == "0" for c in RING_CELLS)
    page = (out / "feedback/threader/05_allreduce/allreduce_by_hand.html").read_text()
    assert "point-to-point calls only" in page and "all_reduce" in page


def test_no_submission_can_write_what_the_grader_or_another_student_reads(graded):
    rows, out, _, _, changed = graded
    assert changed == set(), f"grading changed repository files: {sorted(changed)}"
    notebook = out / "work/wanda/autograded/wanda/05_allreduce/allreduce_by_hand.ipynb"
    printed = "".join(output.get("text", "") for cell in nbformat.read(notebook, as_version=4).cells
                      if cell.cell_type == "code" for output in cell.outputs)
    assert "'OSError'" in printed and "WROTE" not in printed  # every attempt refused
    assert "# tampered" not in (out / "grades.csv").read_text()  # the line her cell appends
    # her honest code, graded as earned: every point of the one notebook she hands in
    assert list(handed_in("wanda")) == ["allreduce_by_hand"]
    assert float(rows["wanda"]["score"]) == LAYOUT["allreduce_by_hand"].points


def test_output_is_capped_below_the_kernels_streams(graded):
    out = graded[1]
    for student in HOSTILE:
        page = out / "feedback" / student / "05_allreduce" / "allreduce_by_hand.html"
        assert page.stat().st_size < 2_500_000, f"{student}: {page.stat().st_size} B"
        log = out / "work" / f"{student}.log"
        assert log.stat().st_size < 1_100_000, f"{student}'s grading log: {log.stat().st_size} B"
    page = (out / "feedback/fiona/05_allreduce/allreduce_by_hand.html").read_text()
    assert "output cut" in page


def test_hidden_checks_solutions_and_history_cannot_be_read(graded):
    rows, out = graded[:2]
    page = (out / "feedback/wanda/05_allreduce/allreduce_by_hand.html").read_text()
    for name in ("allreduce_by_hand.py", "allreduce_by_hand.nb.py", "allreduce_by_hand.ipynb"):
        assert f"cannot read {name}" in page
    assert "cannot import the hidden checks" in page
    hidden_source = (ROOT / "autograder/hidden/allreduce_by_hand.py").read_text()
    for line in hidden_source.splitlines():
        if len(line.strip()) > 30:
            assert line.strip() not in page
    solution = (ROOT / "solutions/05_allreduce/allreduce_by_hand.nb.py").read_text()
    assert "### BEGIN SOLUTION" not in page and solution[-400:] not in page
    assert float(rows["wanda"]["score"]) == LAYOUT["allreduce_by_hand"].points
