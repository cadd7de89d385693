"""Grading never loses results: re-grading some students updates their rows, feedback and logs
in OUT and leaves everyone else's byte for byte; a notebook not handed in is visible in the CSV
and in feedback; the CSV's columns follow the assignment's notebooks, with their maximums.

One real grading costs about half a minute per submission here, so the end-to-end test grades two of
the fake class's students (tests/fake_class), then re-grades one of them beside a late student whose
tamper flag was cleared: two grading commands. Everything else runs grade.py's own planning,
staging, CSV and feedback writers and the update, with a stand-in for the workers (``_grade_all``),
without grading.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import chromium_page
import nbformat
import pytest
from PIL import Image
from test_autograder import (AVERAGE_CELLS, RING_CELLS,
                             assert_small_feedback_without_hidden_checks, by_grade_id,
                             processes_marked)

from autograder import grade as grade_module
from autograder import gradesheet
from autograder.__main__ import main
from autograder.sources import SOLUTIONS, assignments
from fake_class import (ASSIGNMENT, CORRECT, EXPECTED, LAYOUT, MAX_POINTS, build,
                        gradebook_submissions, handed_in, write_class)

ROOT = Path(__file__).resolve().parent.parent
PART1_POINTS = LAYOUT["allreduce_by_hand"].points  # what a right allreduce_by_hand earns
pytestmark = pytest.mark.timeout(900)


def read_csv(path: Path) -> tuple[list[str], dict[str, dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), {row["student_id"]: row for row in reader}


def csv_lines(path: Path) -> dict[str, bytes]:
    """Each student's line of grades.csv as bytes (student ids are the fake class's: no commas)."""
    lines = path.read_bytes().split(b"\r\n")
    header = lines[0].split(b",")
    at = header.index(b"student_id")
    return {line.split(b",")[at].decode(): line for line in lines[1:] if line}


def files_of(out: Path, student: str) -> dict[str, bytes]:
    """Every file of a student's feedback and autograded notebooks, and their log."""
    files = {str(p.relative_to(out)): p.read_bytes() for kind in ("feedback", "autograded")
             for p in sorted((out / kind / student).rglob("*")) if p.is_file()}
    files["log"] = (out / "work" / f"{student}.log").read_bytes()
    return files


def log_inode(out: Path, student: str) -> int:
    return (out / "work" / f"{student}.log").stat().st_ino


# --- the layout of the CSV ----------------------------------------------------------------------

def test_the_columns_follow_the_notebooks_with_their_maximums():
    """Read here from the source notebooks themselves: per notebook (in the order of their
    names), its subtotal column, then its graded cells in the notebook's order, each column with
    its maximum in its name; the assignment's maximum is the sum of its notebooks'."""
    for assignment in assignments():
        expected, maximum = [], 0.0
        for path in sorted((SOLUTIONS / assignment).glob("*.ipynb")):
            cells = [(cell.metadata.nbgrader["grade_id"], float(cell.metadata.nbgrader["points"]))
                     for cell in nbformat.read(path, as_version=4).cells
                     if cell.metadata.get("nbgrader", {}).get("grade")]
            assert cells, path
            points = sum(p for _, p in cells)
            expected += [f"{path.stem} ({points:g})"] + [
                f"{path.stem}:{grade_id} ({p:g})" for grade_id, p in cells]
            maximum += points
        assert gradesheet.layout_columns(assignment) == expected, assignment
        assert gradesheet.max_points(assignment) == maximum, assignment
    # in the notebook's order, not sorted: the ring's first cell after the average's three
    columns = gradesheet.layout_columns(ASSIGNMENT)
    at = columns.index(f"allreduce_by_hand ({PART1_POINTS:g})")
    assert columns[at + 1] == "allreduce_by_hand:test-average-gradients-two-ranks (2)"
    assert columns[at + 4] == "allreduce_by_hand:test-ring-allreduce-two-ranks (2)"


# --- grade.py's writers and the update, with stand-in workers ------------------------------------

def stand_in_workers(scores: dict[str, dict[str, float]], status: dict[str, str] = {}):
    """A ``_grade_all`` that writes what a worker writes (feedback pages of the notebooks handed
    in, an nbgrader export, a log) with ``scores[student]`` (grade id -> score) for its cells."""
    points = {grade_id: p for nb in gradesheet.layout(ASSIGNMENT) for grade_id, p in nb.cells}

    def grade_all(chosen, found, assignment, root, jobs, cell_timeout, student_timeout,
                  duedate=None, cleared_flags=None):
        results = []
        for student in chosen:
            work = root / student
            feedback = work / "feedback" / student / assignment
            feedback.mkdir(parents=True)
            slugs = {nb.slug for nb in gradesheet.layout(assignment)}
            for notebook in sorted(found[student].glob("*.ipynb")):
                if notebook.stem not in slugs:
                    continue  # nbgrader grades only the assignment's notebooks
                (feedback / f"{notebook.stem}.html").write_text(
                    f"<html><body><h1>{notebook.stem} of {student}</h1></body></html>")
            cells = {grade_id: [score, points[grade_id]]
                     for grade_id, score in scores[student].items()}
            total = sum(score for score, _ in cells.values())
            maximum = gradesheet.max_points(assignment)
            (work / "grades.csv").write_text(
                "assignment,duedate,timestamp,student_id,last_name,first_name,email,raw_score,"
                f"late_submission_penalty,score,max_score\n{assignment},,,{student},,,,{total:g},"
                f"0.0,{total:g},{maximum:g}\n")
            (root / f"{student}.log").write_text(f"graded {student}: {total:g}")
            results.append({"student": student, "assignment": assignment,
                            "status": status.get(student, "graded"), "score": total,
                            "max_score": maximum, "cells": cells, "flags": [], "notes": [],
                            "feedback": str(feedback), "seconds": 1.0})
        return results, jobs or 1, 2.0

    return grade_all


def submit(root: Path, student: str, notebooks=None, assignment: str = ASSIGNMENT) -> None:
    """Hand in ``notebooks`` (names), by default every notebook of the assignment."""
    folder = root / "submitted" / student / assignment
    folder.mkdir(parents=True, exist_ok=True)
    if notebooks is None:
        notebooks = [notebook.slug for notebook in gradesheet.layout(assignment)]
    for name in notebooks:
        (folder / f"{name}.ipynb").write_text("{}")


PART1 = {"test-average-gradients-two-ranks": 2.0, "test-ring-allreduce-two-ranks": 0.0}
PART2 = {"test-bucketed-ddp-hidden": 3.0}


@pytest.fixture
def small_class(tmp_path, monkeypatch):
    """ann hands in every notebook, ben only the first (and a draft); graded with stand-in
    workers."""
    submit(tmp_path, "ann")
    submit(tmp_path, "ben", ["allreduce_by_hand", "draft"])
    monkeypatch.setattr(grade_module, "_grade_all", stand_in_workers(
        {"ann": {**PART1, **PART2}, "ben": PART1}))
    out = tmp_path / "out"
    assert main(["grade", str(tmp_path / "submitted"), "--assignment", ASSIGNMENT,
                 "--out", str(out), "--sandbox", "off"]) == 0
    return tmp_path, out


def test_the_csv_has_subtotals_notebook_order_maximums_and_missing_notes(small_class):
    _, out = small_class
    header, rows = read_csv(out / "grades.csv")
    assert header[header.index("notes") + 1:] == gradesheet.layout_columns(ASSIGNMENT)
    ann, ben = rows["ann"], rows["ben"]
    part1, part2 = LAYOUT["allreduce_by_hand"].column, LAYOUT["bucketed_ddp"].column
    assert (ann[part1], ann[part2], ann["score"]) == ("2", "3", "5")
    assert all(ann[notebook.column] == "0" for slug, notebook in LAYOUT.items()
               if slug not in ("allreduce_by_hand", "bucketed_ddp"))  # handed in, no score
    assert ann["allreduce_by_hand:test-average-gradients-two-ranks (2)"] == "2"
    assert ann["allreduce_by_hand:test-ring-allreduce-two-ranks (2)"] == "0"
    assert ann["allreduce_by_hand:test-ring-allreduce-hidden (3)"] == ""  # no score: empty
    assert ann["notes"] == "" and ann["max_score"] == ben["max_score"] == f"{MAX_POINTS:g}"
    assert ben[part2] == "0" and ben["score"] == "2"
    for slug, notebook in LAYOUT.items():  # every notebook but the first is missing
        missing = f"missing: {slug} (not handed in: 0 of {notebook.points:g})"
        assert (missing in ben["notes"]) == (slug != "allreduce_by_hand"), (slug, ben["notes"])
    assert "not graded: draft.ipynb" in ben["notes"]


def test_feedback_shows_the_total_every_notebook_and_a_page_for_the_missing_one(small_class):
    _, out = small_class
    folder = out / "feedback" / "ben" / ASSIGNMENT
    assert sorted(p.name for p in folder.iterdir()) == [f"{slug}.html" for slug in sorted(LAYOUT)]
    for slug, notebook in LAYOUT.items():
        if slug != "allreduce_by_hand":  # ben's missing notebooks
            missing = (folder / f"{slug}.html").read_text()
            assert f"{slug} was not handed in" in missing, slug
            assert f"0 of its {notebook.points:g} points" in missing, slug
            assert "Your submission holds: allreduce_by_hand.ipynb" in missing, slug
    for page in folder.iterdir():
        text = page.read_text()
        assert f"{ASSIGNMENT}: 2 of {MAX_POINTS:g} points" in text
        assert f"<li>allreduce_by_hand: 2 of {PART1_POINTS:g}</li>" in text
        for slug, notebook in LAYOUT.items():
            if slug != "allreduce_by_hand":
                assert f"<li>{slug}: not handed in, 0 of {notebook.points:g}</li>" in text, slug
    graded = (folder / "allreduce_by_hand.html").read_text()  # the summary opens the body
    assert graded.index("assignment-summary") < graded.index("<h1>allreduce_by_hand of ben")
    assert f"<li>bucketed_ddp: 3 of {LAYOUT['bucketed_ddp'].points:g}</li>" in (
        out / "feedback" / "ann" / ASSIGNMENT / "allreduce_by_hand.html").read_text()


def test_regrading_one_student_keeps_everyone_elses_results_byte_for_byte(small_class,
                                                                          monkeypatch, capsys):
    root, out = small_class
    for student in ("ann", "ben"):  # as an earlier run left them (these workers write none)
        earlier = out / "autograded" / student / ASSIGNMENT
        earlier.mkdir(parents=True)
        (earlier / "allreduce_by_hand.ipynb").write_text(f"{student}'s earlier notebook")
    before_csv, before_ann = csv_lines(out / "grades.csv"), files_of(out, "ann")
    before = json.loads((out / "summary.json").read_text())
    submit(root, "ben")  # ben hands in his second notebook late
    monkeypatch.setattr(grade_module, "_grade_all", stand_in_workers({"ben": {**PART1, **PART2}}))
    assert main(["grade", str(root / "submitted"), "--assignment", ASSIGNMENT, "--out", str(out),
                 "--student", "ben", "--sandbox", "off"]) == 0
    assert "holds 2 students: the rows of the 1 not graded in this run are kept" in (
        capsys.readouterr().out)
    after_csv = csv_lines(out / "grades.csv")
    assert after_csv["ann"] == before_csv["ann"] and files_of(out, "ann") == before_ann
    assert after_csv["ben"] != before_csv["ben"]
    _, rows = read_csv(out / "grades.csv")
    assert (rows["ben"]["score"], rows["ben"][LAYOUT["bucketed_ddp"].column],
            rows["ben"]["notes"]) == (
        "5", "3", f"not notebooks of {ASSIGNMENT}, not graded: draft.ipynb")
    assert files_of(out, "ben")["log"] == b"graded ben: 5"
    assert not (out / "autograded/ben" / ASSIGNMENT).exists()  # none from this run: none kept
    summary = json.loads((out / "summary.json").read_text())
    assert [r["student"] for r in summary["results"]] == ["ann", "ben"]
    assert summary["results"][0] == before["results"][0] and summary["regraded"] == ["ben"]
    assert summary["results"][1]["score"] == 5 and summary["results"][1]["missing"] == []
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_an_interrupted_run_leaves_out_as_it_was(small_class, monkeypatch):
    root, out = small_class
    snapshot = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(grade_module, "_grade_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        main(["grade", str(root / "submitted"), "--assignment", ASSIGNMENT, "--out", str(out),
              "--sandbox", "off"])
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*")
            if p.is_file()} == snapshot


def refused(capsys, *args) -> str:
    assert main(["grade", *map(str, args), "--sandbox", "off"]) == 2
    return capsys.readouterr().err


def test_nothing_to_grade_is_refused_with_what_there_is(tmp_path, capsys):
    submit(tmp_path, "ann", ["ranks_from_env"], assignment="04_process_groups")
    submit(tmp_path, "ben", ["ranks_from_env"], assignment="04_process_groups")
    err = refused(capsys, tmp_path / "submitted", "--assignment", ASSIGNMENT,
                  "--out", tmp_path / "out")
    assert f"no submission of {ASSIGNMENT}" in err and "04_process_groups (2 students)" in err
    err = refused(capsys, tmp_path / "nowhere", "--assignment", ASSIGNMENT)
    assert "holds no submission at all" in err
    err = refused(capsys, tmp_path / "submitted", "--assignment", "04_process_groups",
                  "--student", "cid", "--student", "ann", "--out", tmp_path / "out")
    assert "from cid in" in err and "who handed it in: ann, ben" in err
    assert not (tmp_path / "out").exists()


def test_results_that_could_not_be_kept_are_refused_before_grading(small_class, capsys):
    root, out = small_class
    snapshot = (out / "grades.csv").read_bytes()
    submit(root, "ann", ["ranks_from_env"], assignment="04_process_groups")
    err = refused(capsys, root / "submitted", "--assignment", "04_process_groups", "--out", out)
    assert f"holds the grades of {ASSIGNMENT}, not 04_process_groups" in err
    err = refused(capsys, root / "submitted", "--assignment", ASSIGNMENT, "--out", out,
                  "--shard", "1/2")
    assert "a shard's output holds exactly its shard's students" in err
    err = refused(capsys, root / "submitted", "--assignment", ASSIGNMENT, "--out", out,
                  "--shard", "1/2", "--student", "ann")
    assert "--student and --shard together" in err
    (out / "summary.json").write_text("{")
    assert "cannot be read" in refused(capsys, root / "submitted", "--assignment", ASSIGNMENT,
                                       "--out", out)
    assert (out / "grades.csv").read_bytes() == snapshot


# --- the fake class, graded, then one student re-graded -----------------------------------------

STUDENTS = ["bob", "oscar"]  # bob: a wrong average_gradients; oscar: only the second notebook


def grade(root: Path, out: Path, *args: str) -> str:
    mark = uuid.uuid4().hex
    # no submission here hangs: a roomy check deadline keeps a loaded machine from failing a check
    env = dict(os.environ, DDPCOURSE_CHECK_TIMEOUT_S="60", DDPCOURSE_GRADING_TEST=mark)
    done = subprocess.run(
        [sys.executable, "-m", "autograder", "grade", str(root / "submitted"), "--assignment",
         ASSIGNMENT, "--out", str(out), "--cell-timeout", "120", "--student-timeout", "600",
         *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout + done.stderr
    time.sleep(1.0)
    assert not processes_marked(mark), "grading left processes running"
    return done.stdout


DUE = "2026-12-01 17:00:00 UTC"
OSCAR_HANDED_IN = "2026-12-03 05:00:00.000000 UTC"  # 1 day 12 h late: 2 days started, -20 %
OSCAR_PENALTY = round(EXPECTED["oscar"][0] * 0.2, 6)


def set_due_date(out: Path) -> None:
    """As autograder/nbgrader_config.py says to: nbgrader's own command on the course gradebook."""
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "nbgrader"), "db", "assignment", "add", ASSIGNMENT,
         f"--duedate={DUE}", "--JupyterApp.config_file=autograder/nbgrader_config",
         f"--CourseDirectory.db_url=sqlite:///{out / 'gradebook.db'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


ROSTER = "id,first_name,last_name,email,lms_user_id\nbob,Bob,Builder,bob@example.org,u-17\n"


def import_roster(out: Path, roster: Path) -> None:
    """As autograder/roster.py says to: nbgrader's own command on the course gradebook."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "nbgrader"), "db", "student", "import", str(roster),
         "--JupyterApp.config_file=autograder/nbgrader_config",
         f"--CourseDirectory.db_url=sqlite:///{out / 'gradebook.db'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# A right notebook with one harmless eval: the static scan flags it (eval is never needed).
PEGGY = build(CORRECT, extra_after={"ring-allreduce": "print(eval('6 * 7'))"})
CLEARED = "student,reason\npeggy,eval of a constant: harmless\n"


@pytest.fixture(scope="module")
def regraded(tmp_path_factory):
    """The two graded at once, oscar late; then bob fixes his notebook and is re-graded, beside
    peggy, who hands in late and whose tamper flag the instructor cleared ahead of grading."""
    root = write_class(tmp_path_factory.mktemp("class"), STUDENTS)
    out = root / "out"
    set_due_date(out)
    (root / "roster.csv").write_text(ROSTER)  # bob is on it, oscar is not
    import_roster(out, root / "roster.csv")
    (root / "submitted/oscar" / ASSIGNMENT / "timestamp.txt").write_text(OSCAR_HANDED_IN)
    grade(root, out, "--jobs", "2")
    first = {"csv": csv_lines(out / "grades.csv"), "rows": read_csv(out / "grades.csv")[1],
             "oscar": files_of(out, "oscar"), "bob": files_of(out, "bob"),
             "summary": json.loads((out / "summary.json").read_text()),
             "log inodes": {student: log_inode(out, student) for student in STUDENTS},
             "gradebook": gradebook_submissions(out, ASSIGNMENT)}
    nbformat.write(build(CORRECT), root / "submitted/bob" / ASSIGNMENT / "allreduce_by_hand.ipynb")
    (root / "submitted/peggy" / ASSIGNMENT).mkdir(parents=True)
    nbformat.write(PEGGY, root / "submitted/peggy" / ASSIGNMENT / "allreduce_by_hand.ipynb")
    (out / "cleared_flags.csv").write_text(CLEARED)
    stdout = grade(root, out, "--student", "bob", "--student", "peggy", "--jobs", "2")
    return first, out, stdout


def test_the_first_run_grades_both_and_shows_the_missing_notebook(regraded):
    first, out, _ = regraded
    rows = first["rows"]
    assert {s: (float(r["score"]), r["status"]) for s, r in rows.items()} == {
        "bob": (float(EXPECTED["bob"][0]), EXPECTED["bob"][1]),
        "oscar": (pytest.approx(EXPECTED["oscar"][0] - OSCAR_PENALTY), EXPECTED["oscar"][1])}
    for student in STUDENTS:  # every notebook not handed in is named in the notes
        for slug, notebook in LAYOUT.items():
            missing = f"missing: {slug} (not handed in: 0 of {notebook.points:g})"
            assert (missing in rows[student]["notes"]) == (slug not in handed_in(student)), (
                student, slug, rows[student]["notes"])
    oscar = EXPECTED["oscar"][0]  # all of it from bucketed_ddp
    assert list(handed_in("oscar")) == ["bucketed_ddp"]
    assert {slug: rows["oscar"][notebook.column] for slug, notebook in LAYOUT.items()} == {
        slug: f"{oscar:g}" if slug == "bucketed_ddp" else "0" for slug in LAYOUT}
    pages = {name: text.decode() for name, text in first["oscar"].items() if name.endswith(".html")}
    assert sorted(Path(name).name for name in pages) == [f"{slug}.html" for slug in sorted(LAYOUT)]
    for name, text in pages.items():
        assert f"{ASSIGNMENT}: {oscar - OSCAR_PENALTY:g} of {MAX_POINTS:g} points" in text, name
        for slug, notebook in LAYOUT.items():
            if slug != "bucketed_ddp":
                assert f"<li>{slug}: not handed in, 0 of {notebook.points:g}</li>" in text, name


def test_a_wrong_answer_loses_exactly_the_points_of_its_cells(regraded):
    """bob's average_gradients sums instead of averaging; his ring is right (the fake class's
    other students: tests/test_autograder.py)."""
    first, _, _ = regraded
    bob = by_grade_id(first["rows"]["bob"])
    assert all(bob[c] == "0" for c in AVERAGE_CELLS)
    assert [bob[c] for c in RING_CELLS] == ["2", "2", "2", "3"]


def test_the_first_runs_feedback_is_small_and_without_the_hidden_checks(regraded, tmp_path):
    first, _, _ = regraded
    for student in STUDENTS:
        for name, text in first[student].items():
            if name.endswith(".html"):
                (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / name).write_bytes(text)
        assert_small_feedback_without_hidden_checks(tmp_path, student)


def test_feedback_wraps_its_output_and_names_every_graded_cell(regraded):
    first, _, _ = regraded
    page = first["oscar"][f"feedback/oscar/{ASSIGNMENT}/bucketed_ddp.html"].decode()
    assert "white-space: pre-wrap" in page.split("</head>")[0]
    assert ">Test cell<" not in page
    assert f"{ROOT}/" not in page and f"{sys.prefix}/" not in page  # no path of the machine
    for grade_id, _ in LAYOUT["bucketed_ddp"].cells:
        assert f'<a href="#{grade_id}">{grade_id}</a> (test cell)' in page


@chromium_page.needs_chromium
def test_every_feedback_page_fits_a_1280_pixel_window_in_chromium(regraded, tmp_path):
    """Each page of both students (failures with long lines, a notebook not handed in, a full
    score) in Chromium, 1280 pixels wide: no element runs off the window or scrolls sideways.
    The screenshots stay in this test's temporary folder for a person to look at."""
    first, out, _ = regraded
    pages = {f"first run: {name}": text for student in ("oscar", "bob")
             for name, text in first[student].items() if name.endswith(".html")}
    pages |= {f"re-graded: {p.relative_to(out)}": p.read_bytes()
              for p in sorted((out / "feedback" / "bob").rglob("*.html"))}
    # each student's page of every notebook; bob's again after his re-grade
    assert len(pages) == 3 * len(LAYOUT)
    for number, (name, text) in enumerate(pages.items()):
        page = tmp_path / f"page{number}.html"
        page.write_bytes(text)
        laid_out = chromium_page.layout(page, tmp_path / f"measured{number}.html", width=1280)
        assert laid_out["window"] == 1280, name
        assert laid_out["page"] <= 1280 and not laid_out["wider"], (name, laid_out)
        with Image.open(tmp_path / f"measured{number}.png") as shot:
            assert shot.size == (1280, 900), name
            assert shot.convert("L").getextrema()[0] < 128, f"{name}: nothing drawn"


def test_regrading_one_student_leaves_the_other_byte_for_byte(regraded):
    first, out, stdout = regraded
    again = csv_lines(out / "grades.csv")
    assert again["oscar"] == first["csv"]["oscar"]
    assert files_of(out, "oscar") == first["oscar"]
    assert log_inode(out, "oscar") == first["log inodes"]["oscar"]  # not even rewritten
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"][1] == first["summary"]["results"][1]  # oscar's, unchanged
    assert summary["regraded"] == ["bob", "peggy"] and summary["submissions"] == 3
    assert "2 submissions in" in stdout
    assert "rows of the 1 not graded in this run are kept" in stdout


def test_the_regraded_student_is_updated(regraded):
    first, out, _ = regraded
    _, rows = read_csv(out / "grades.csv")
    # his first notebook right now: every point of it
    assert (first["rows"]["bob"]["score"], rows["bob"]["score"]) == (
        f"{EXPECTED['bob'][0]:g}", f"{PART1_POINTS:g}")
    assert rows["bob"][LAYOUT["allreduce_by_hand"].column] == f"{PART1_POINTS:g}"
    now = files_of(out, "bob")
    # the log may hold the same bytes as before (a clean run prints the same warnings): that it
    # is the new run's shows in the file itself, moved in by a rename
    assert log_inode(out, "bob") != first["log inodes"]["bob"]
    page = now[f"feedback/bob/{ASSIGNMENT}/allreduce_by_hand.html"].decode()
    assert f"{ASSIGNMENT}: {PART1_POINTS:g} of {MAX_POINTS:g} points" in page
    assert (out / "work/bob/autograded/bob" / ASSIGNMENT / "allreduce_by_hand.ipynb").exists()
    assert now[f"autograded/bob/{ASSIGNMENT}/allreduce_by_hand.ipynb"] != first["bob"][
        f"autograded/bob/{ASSIGNMENT}/allreduce_by_hand.ipynb"]  # where formgrader opens it
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_the_course_gradebook_is_updated_for_the_regraded_student_only(regraded):
    first, out, _ = regraded
    _, rows = read_csv(out / "grades.csv")
    now = gradebook_submissions(out, ASSIGNMENT)
    assert {s: score for s, (score, _, _) in first["gradebook"].items()} == {
        s: pytest.approx(float(r["score"])) for s, r in first["rows"].items()}
    assert now["oscar"] == first["gradebook"]["oscar"]
    assert {s: score for s, (score, _, _) in now.items()} == {
        s: pytest.approx(float(r["score"])) for s, r in rows.items()}


def test_the_csv_has_the_rosters_names_email_and_lms_id_after_every_run(regraded):
    first, out, _ = regraded
    header, rows = read_csv(out / "grades.csv")
    roster = ["last_name", "first_name", "email", "lms_user_id"]
    assert header[header.index("student_id"):header.index("student_id") + 5] == [
        "student_id", *roster]
    for after in (first["rows"], rows):  # the first run, and after bob was re-graded alone
        assert [after["bob"][column] for column in roster] == [
            "Builder", "Bob", "bob@example.org", "u-17"]
        assert [after["oscar"][column] for column in roster] == ["", "", "", ""]  # not on it


def test_a_late_submission_loses_the_configured_share_per_day_started(regraded):
    """autograder/nbgrader_config.py: 10 % of each notebook's score per day started, computed by
    nbgrader's AssignLatePenalties from timestamp.txt and the gradebook's due date; the score
    graded outside the kernel is the one penalized (autograder/late_penalty.py, reassess)."""
    first, out, _ = regraded
    oscar = first["rows"]["oscar"]
    assert float(oscar["raw_score"]) == EXPECTED["oscar"][0]
    assert float(oscar["late_submission_penalty"]) == pytest.approx(OSCAR_PENALTY)
    assert float(oscar["score"]) == pytest.approx(EXPECTED["oscar"][0] - OSCAR_PENALTY)
    assert "late by 1 day 12 h: -2.2 points" in oscar["notes"]
    page = first["oscar"][f"feedback/oscar/{ASSIGNMENT}/bucketed_ddp.html"].decode()
    assert "handed in 1 day 12 h after the due date: a late penalty of 2.2 points" in page
    assert first["rows"]["bob"]["late_submission_penalty"] in ("", "0.0")  # no timestamp: on time


# --- instructor overrides, applied to a copy of the re-graded output ---------------------------

def override(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autograder", "override", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_overrides_reach_the_csv_the_gradebook_and_the_feedback_and_apply_once(regraded,
                                                                                tmp_path):
    """bob: a cell of his lowered; oscar (late): a cell of his raised, so his late penalty grows
    with his score; a student the output does not have is reported, not refused."""
    _, out, _ = regraded
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    _, before = read_csv(copy / "grades.csv")
    bob_id, bob_points = LAYOUT["allreduce_by_hand"].cells[0]
    oscar_cells = LAYOUT["bucketed_ddp"].cells
    oscar_id, oscar_points = next(
        ((g, p) for g, p in oscar_cells
         if float(before["oscar"][LAYOUT["bucketed_ddp"].cell_column(g, p)]) < p), oscar_cells[0])
    (copy / "overrides.csv").write_text(
        "student,cell,score,reason\n"
        f"bob,allreduce_by_hand:{bob_id},0,\"copied, says the honour-code review\"\n"
        f"oscar,bucketed_ddp:{oscar_id},{oscar_points:g},right on review\n"
        "zoe,bucketed_ddp:" + oscar_id + ",1,not graded here\n")
    for _ in range(2):  # applying twice gives what applying once gives
        done = override(copy)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "zoe" in done.stdout
    _, rows = read_csv(copy / "grades.csv")
    bob, oscar = rows["bob"], rows["oscar"]
    assert bob[f"allreduce_by_hand:{bob_id} ({bob_points:g})"] == "0"
    assert float(bob[LAYOUT["allreduce_by_hand"].column]) == float(bob["score"]) == (
        PART1_POINTS - bob_points)
    assert bob["notes"].count("changed by the instructor") == 1
    assert (f"changed by the instructor: allreduce_by_hand:{bob_id} {bob_points:g} -> 0 "
            "(copied, says the honour-code review)") in bob["notes"]
    raw = float(before["oscar"]["raw_score"]) - float(
        before["oscar"][f"bucketed_ddp:{oscar_id} ({oscar_points:g})"]) + oscar_points
    assert float(oscar["raw_score"]) == pytest.approx(raw)
    assert float(oscar["late_submission_penalty"]) == pytest.approx(raw * 0.2)  # 2 days started
    assert float(oscar["score"]) == pytest.approx(raw * 0.8)
    assert {s: score for s, (score, _, _) in gradebook_submissions(copy, ASSIGNMENT).items()} == {
        s: pytest.approx(float(r["score"])) for s, r in rows.items()}  # nbgrader export's score
    page = (copy / "feedback/bob" / ASSIGNMENT / "allreduce_by_hand.html").read_text()
    assert f"{ASSIGNMENT}: {PART1_POINTS - bob_points:g} of {MAX_POINTS:g} points" in page
    assert page.count("Scores your instructor changed") == 1
    assert "copied, says the honour-code review" in page
    assert (out / "grades.csv").read_bytes() != (copy / "grades.csv").read_bytes()


def test_a_wrong_override_is_refused_and_changes_nothing(regraded, tmp_path):
    _, out, _ = regraded
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    snapshot = (copy / "grades.csv").read_bytes()
    for line, why in [("bob,allreduce_by_hand:no-such-cell,1,x", "has no cell"),
                      ("bob,bucketed_ddp:" + LAYOUT["bucketed_ddp"].cells[0][0]
                       + ",99,x", "is worth 0 to"),
                      ("bob,allreduce_by_hand:" + LAYOUT["allreduce_by_hand"].cells[0][0]
                       + ",1,", "needs a student and a reason")]:
        (copy / "overrides.csv").write_text("student,cell,score,reason\n" + line + "\n")
        done = override(copy)
        assert done.returncode == 2 and why in done.stderr, done.stderr
        assert (copy / "grades.csv").read_bytes() == snapshot


# --- a tamper flag that the instructor reviewed and cleared --------------------------------------



def test_a_cleared_tamper_flag_scores_the_submission_as_its_tests_say(regraded):
    _, out, _ = regraded
    peggy = read_csv(out / "grades.csv")[1]["peggy"]
    # her one notebook is right: every point of it
    assert (peggy["status"], float(peggy["score"])) == ("graded", PART1_POINTS), peggy
    assert "eval" in peggy["flags"]  # the scan's findings stay on record
    assert "cleared by the instructor (eval of a constant: harmless)" in peggy["notes"]
    page = (out / "feedback/peggy" / ASSIGNMENT / "allreduce_by_hand.html").read_text()
    assert "flagged for review" not in page
    assert f"{ASSIGNMENT}: {PART1_POINTS:g} of {MAX_POINTS:g} points" in page
    assert gradebook_submissions(out, ASSIGNMENT)["peggy"][0] == pytest.approx(PART1_POINTS)


def test_a_wrong_cleared_flags_file_is_refused_before_grading(tmp_path, capsys):
    root, out = write_class(tmp_path / "class", ["bob"]), tmp_path / "out"
    out.mkdir()
    for text, why in [("student\nbob\n", "the first line must be student,reason"),
                      ("student,reason\nbob,\n", "needs a student and a reason"),
                      ("student,reason\nbob,x\nbob,y\n", "cleared twice")]:
        (out / "cleared_flags.csv").write_text(text)
        assert main(["grade", str(root / "submitted"), "--assignment", ASSIGNMENT,
                     "--out", str(out)]) == 2
        assert why in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["cleared_flags.csv"]  # nothing written
