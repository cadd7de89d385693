"""Grading a class in shards (``grade --shard I/N``) and merging them (``merge``) gives what one run
gives; the merge refuses what it cannot merge; the SLURM template refuses an array with gaps (it
grades a class on real SLURM in tests/test_slurm_cluster.py).

One real grading costs about half a minute per submission here, so the end-to-end test grades two
of the fake class's students (tests/fake_class), chosen for different statuses, flags and notes
and a notebook not handed in: the whole run and both shards at once, three grading commands side
by side. Everything else runs on outputs written by grade.py's own writers, without grading.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from grading_commands import run_at_once
from test_autograder import (PART2_CELLS, assert_missing_notebooks_score_zero,
                             assert_small_feedback_without_hidden_checks, by_grade_id, full_marks,
                             processes_marked)

from autograder.__main__ import build_parser, main
from autograder.grade import _write_csv
from autograder.merge import DEFAULT_EXPORT_COLUMNS, Shard
from autograder.roster import with_roster_columns
from fake_class import ASSIGNMENT, EXPECTED, LAYOUT, gradebook_submissions, handed_in, write_class

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "autograder" / "slurm"
# mallory: flagged for tampering (flags, notes); oscar: graded, hands in only the second notebook
STUDENTS = ["mallory", "oscar"]
pytestmark = pytest.mark.timeout(900)


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


# --- the fake class, graded whole and in two concurrent shards -----------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The class graded by one run and by shards 1/2 and 2/2, all three at once; then merged."""
    root = write_class(tmp_path_factory.mktemp("class"), STUDENTS)
    mark = uuid.uuid4().hex
    # no submission here hangs: a roomy check deadline keeps a loaded machine from failing a check
    env = dict(os.environ, DDPCOURSE_CHECK_TIMEOUT_S="60", DDPCOURSE_GRADING_TEST=mark)
    outs = {"whole": root / "whole", "1/2": root / "shard-1", "2/2": root / "shard-2"}
    commands = {
        name: [sys.executable, "-m", "autograder", "grade", str(root / "submitted"),
               "--assignment", ASSIGNMENT, "--out", str(out), "--jobs", "2" if name == "whole"
               else "1", "--cell-timeout", "120", "--student-timeout", "600",
               *([] if name == "whole" else ["--shard", name])]
        for name, out in outs.items()}
    started = time.monotonic()
    said = run_at_once(commands, ROOT, env, timeout=800)
    elapsed = time.monotonic() - started
    logs = {name: output for name, (_, output) in said.items()}
    for name, (code, output) in said.items():
        assert code == 0, f"{name}:\n{output}"
    time.sleep(1.0)
    assert not processes_marked(mark), "grading left processes running"
    merged = root / "merged"
    assert main(["merge", str(outs["1/2"]), str(outs["2/2"]), "--out", str(merged)]) == 0
    print(f"three grading commands at once: {elapsed:.0f} s")
    return outs, merged, logs


def test_each_shard_grades_its_part_of_the_sorted_class(runs):
    outs, _, logs = runs
    for name, students in (("1/2", ["mallory"]), ("2/2", ["oscar"])):
        summary = json.loads((outs[name] / "summary.json").read_text())
        assert [r["student"] for r in summary["results"]] == students
        assert summary["shard"] == {"index": int(name[0]), "count": 2, "class": STUDENTS}
        assert f"shard {name}: 1 of the class's 2 students" in logs[name]


def test_the_merged_csv_is_the_single_runs(runs):
    outs, merged, _ = runs
    header, rows = read_csv(merged / "grades.csv")
    whole_header, whole_rows = read_csv(outs["whole"] / "grades.csv")
    assert header == whole_header
    assert [r["student_id"] for r in rows] == STUDENTS
    # scores, statuses, flags, notes and every cell: separate runs grade the same submissions alike
    assert rows == whole_rows
    assert {r["student_id"]: (float(r["score"]), r["status"]) for r in rows} == {
        s: (float(EXPECTED[s][0]), EXPECTED[s][1]) for s in STUDENTS}
    assert rows[0]["flags"] and "tampering" in rows[0]["notes"]


def test_tampering_gains_nothing_and_is_flagged(runs):
    """mallory patches what the tests use, edits one test cell and deletes another (the fake
    class's one student graded here alone: tests/test_autograder.py grades the others)."""
    outs, _, _ = runs
    mallory = by_grade_id(read_csv(outs["whole"] / "grades.csv")[1][0])
    assert mallory["student_id"] == "mallory"
    assert all(call in mallory["flags"] for call in ("dist.all_reduce", "run_ranks", "setattr"))
    # the edited test cell was restored and the deleted one re-added: both graded, both 0
    assert mallory["test-average-gradients-two-ranks"] == "0"
    assert mallory["test-ring-allreduce-world-sizes"] == "0"


def test_the_second_notebook_alone_is_graded_and_the_missing_one_scores_zero(runs):
    """oscar hands in only bucketed_ddp, whose buckets wait for the end of backward."""
    outs, _, _ = runs
    oscar = by_grade_id(read_csv(outs["whole"] / "grades.csv")[1][1])
    assert oscar["student_id"] == "oscar"
    # no overlap: only the overlap cell is lost; part 1 (and any other notebook) not handed in
    assert {c: oscar[c] for c in PART2_CELLS} == full_marks(
        "bucketed_ddp", "test-bucketed-ddp-overlaps-backward")
    assert list(handed_in("oscar")) == ["bucketed_ddp"]
    assert_missing_notebooks_score_zero(oscar, "oscar")
    assert (outs["whole"] / "feedback" / "oscar" / ASSIGNMENT / "bucketed_ddp.html").exists()


def test_their_feedback_is_small_and_without_the_hidden_checks(runs):
    outs, merged, _ = runs
    for out in (outs["whole"], merged):
        for student in STUDENTS:
            assert_small_feedback_without_hidden_checks(out, student)


def test_the_merged_gradebook_is_the_single_runs(runs):
    """Every student's submission in nbgrader's database: scores per cell, flags (mallory's
    tampering holds her at 0 there as in the CSV)."""
    outs, merged, _ = runs
    whole = gradebook_submissions(outs["whole"])
    assert sorted(whole) == STUDENTS
    assert gradebook_submissions(merged) == whole
    assert whole["mallory"][:2] == (0.0, True)


def test_the_merged_summary_is_the_single_runs(runs):
    outs, merged, _ = runs
    summary = json.loads((merged / "summary.json").read_text())
    whole = json.loads((outs["whole"] / "summary.json").read_text())

    def comparable(result, out):
        return dict(result, seconds=None, steps=None,  # timings differ from run to run
                    feedback=str(Path(result["feedback"]).relative_to(out)))

    assert [comparable(r, merged) for r in summary["results"]] == [
        comparable(r, outs["whole"]) for r in whole["results"]]
    assert (summary["submissions"], summary["assignment"], summary["shard"]) == (
        whole["submissions"], whole["assignment"], whole["shard"])
    assert [part["shard"] for part in summary["merged_from"]] == ["1/2", "2/2"]


def test_everyone_has_the_feedback_of_the_single_run(runs):
    outs, merged, _ = runs

    def pages(out):
        return sorted(str(p.relative_to(out)) for p in (out / "feedback").rglob("*.html"))

    # a page for each notebook of the assignment, handed in or not
    assert pages(merged) == pages(outs["whole"]) == sorted(
        f"feedback/{student}/{ASSIGNMENT}/{slug}.html" for student in STUDENTS for slug in LAYOUT)
    for page in pages(merged):
        shard = outs["1/2"] if "mallory" in page else outs["2/2"]
        assert (merged / page).read_bytes() == (shard / page).read_bytes()
        scores = [re.findall(r"Score: [0-9.]+(?: / [0-9.]+)?", (out / page).read_text())
                  for out in (merged, outs["whole"])]
        assert scores[0] == scores[1] and scores[0], page
    assert sorted(p.name for p in (merged / "work").iterdir()) == ["mallory.log", "oscar.log"]


# --- the merge on outputs written by grade.py's writers, without grading -------------------------

NBGRADER_COLUMNS = ["assignment", "duedate", "timestamp", "student_id", "last_name", "first_name",
                    "email", "raw_score", "late_submission_penalty", "score", "max_score"]


def result_of(student: str, cells: dict, assignment: str = "05_allreduce") -> dict:
    status = "graded" if cells else "grading timed out"
    return {"student": student, "assignment": assignment, "status": status,
            "score": float(sum(score for score, _ in cells.values())),
            "max_score": 4.0 if cells else None, "cells": cells,
            "flags": ["cell 3: calls setattr()"] if student == "eve" else [],
            "notes": [] if cells else ["the submission ran past --student-timeout,\nkilled"],
            "feedback": "", "seconds": 1.0}


# eve and gil have an nbgrader export; tim timed out (no export); cells differ between students
CLASS = {"eve": {"test-a": [1.0, 2.0], "test-b": [2.0, 2.0]}, "gil": {"test-c": [0.0, 2.0]},
         "tim": {}, "zoe": {"test-a": [2.0, 2.0]}}


def write_output(out: Path, students: list[str], shard: Shard = Shard(),
                 assignment: str = "05_allreduce", whole_class=CLASS) -> Path:
    """What ``grade_class`` writes for ``students`` (its own CSV writer), with a feedback page
    and a log for each."""
    out.mkdir(parents=True)
    results = [result_of(s, CLASS.get(s, {}), assignment) for s in students]
    for result in results:
        student = result["student"]
        if result["cells"]:
            export = out / "work" / student / "grades.csv"
            export.parent.mkdir(parents=True)
            export.write_text(",".join(NBGRADER_COLUMNS) + f"\n{assignment},,,{student},,,,"
                              f"{result['score']:g},0.0,{result['score']:g},4\n")
        feedback = out / "feedback" / student / assignment
        feedback.mkdir(parents=True)
        (feedback / "part.html").write_text(f"<p>{student}</p>")
        (out / "work" / f"{student}.log").parent.mkdir(parents=True, exist_ok=True)
        (out / "work" / f"{student}.log").write_text(f"log of {student}")
        result["feedback"] = str(feedback)
    _write_csv(results, assignment, out)
    (out / "summary.json").write_text(json.dumps(
        {"submissions": len(results), "jobs": 2, "seconds": 3.0, "results": results,
         "assignment": assignment, "shard": shard.record(whole_class)}))
    return out


def merge_refused(capsys, *args) -> str:
    assert main(["merge", *map(str, args)]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("count", [3, 5])  # 5 shards of 4 students: one shard is empty
def test_merged_shards_are_byte_for_byte_the_single_runs_csv(tmp_path, count):
    whole = write_output(tmp_path / "whole", sorted(CLASS))
    shards = [write_output(tmp_path / f"s{i}", Shard(i, count).select(CLASS), Shard(i, count))
              for i in range(1, count + 1)]
    assert main(["merge", *map(str, shards), "--out", str(tmp_path / "merged")]) == 0
    merged = (tmp_path / "merged" / "grades.csv").read_bytes()
    assert merged == (whole / "grades.csv").read_bytes()
    # cells the assignment's source does not have come after its columns, sorted
    assert b"\r\n" in merged and merged.split(b"\r\n")[0].endswith(
        b"test-a (2),test-b (2),test-c (2)")
    # shard 3 of 3 held only tim, with no export (and shard 5 of 5 no one): their CSVs have
    # grade.py's default columns
    default = with_roster_columns(DEFAULT_EXPORT_COLUMNS)
    assert read_csv(shards[2 if count == 3 else 4] / "grades.csv")[0][:len(default)] == default
    assert (tmp_path / "merged/feedback/tim/05_allreduce/part.html").read_text() == "<p>tim</p>"
    summary = json.loads((tmp_path / "merged/summary.json").read_text())
    assert summary["shard"] == Shard().record(CLASS) and summary["submissions"] == len(CLASS)


def test_outputs_written_before_shards_existed_merge_as_whole_runs(tmp_path):
    parts = [write_output(tmp_path / name, students, whole_class=students)
             for name, students in (("a", ["eve", "gil"]), ("b", ["tim", "zoe"]))]
    for part in parts:
        summary = json.loads((part / "summary.json").read_text())
        del summary["assignment"], summary["shard"]
        (part / "summary.json").write_text(json.dumps(summary))
    assert main(["merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 0
    whole = write_output(tmp_path / "whole", sorted(CLASS))
    assert (tmp_path / "merged/grades.csv").read_bytes() == (whole / "grades.csv").read_bytes()


def test_merge_refuses_outputs_of_different_assignments(tmp_path, capsys):
    a = write_output(tmp_path / "a", ["eve"], whole_class=["eve"])
    b = write_output(tmp_path / "b", ["gil"], assignment="04_process_groups", whole_class=["gil"])
    err = merge_refused(capsys, a, b, "--out", tmp_path / "out")
    assert "different assignments" in err and "05_allreduce" in err and "04_process_groups" in err
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_student_graded_twice(tmp_path, capsys):
    a = write_output(tmp_path / "a", ["eve", "gil"], whole_class=["eve", "gil"])
    b = write_output(tmp_path / "b", ["gil"], whole_class=["gil"])
    err = merge_refused(capsys, a, b, "--out", tmp_path / "out")
    assert "student gil is graded in both" in err


def test_merge_refuses_what_is_not_a_finished_grading_output(tmp_path, capsys):
    good = write_output(tmp_path / "good", ["eve"], whole_class=["eve"])
    (tmp_path / "empty").mkdir()
    assert "not a grading output" in merge_refused(capsys, good, tmp_path / "empty",
                                                   "--out", tmp_path / "out")
    assert "not a folder" in merge_refused(capsys, good, tmp_path / "nowhere",
                                           "--out", tmp_path / "out")
    broken = shutil.copytree(good, tmp_path / "broken")
    (broken / "summary.json").write_text("{")
    assert "cannot be read" in merge_refused(capsys, broken, "--out", tmp_path / "out")
    other = shutil.copytree(good, tmp_path / "other")
    (other / "grades.csv").write_text("name,points\neve,3\n")
    assert "not a grading output's CSV" in merge_refused(capsys, other, "--out", tmp_path / "out")
    assert "one of the outputs" in merge_refused(capsys, good, "--out", good)
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_missing_doubled_or_foreign_shard(tmp_path, capsys):
    s1, s2, s3 = (write_output(tmp_path / f"s{i}", Shard(i, 3).select(CLASS), Shard(i, 3))
                  for i in (1, 2, 3))
    assert "shard 2/3 of the run split 3 ways is missing" in merge_refused(
        capsys, s1, s3, "--out", tmp_path / "out")
    again = shutil.copytree(s2, tmp_path / "again")
    assert "are both shard 2/3" in merge_refused(capsys, s1, s2, again, "--out", tmp_path / "o")
    later = write_output(tmp_path / "later", Shard(3, 3).select(CLASS), Shard(3, 3),
                         whole_class=[*CLASS, "amy"])
    err = merge_refused(capsys, s1, s2, later, "--out", tmp_path / "out")
    assert "split different classes" in err and "amy" in err
    short = write_output(tmp_path / "short", Shard(1, 3).select(CLASS)[1:], Shard(1, 3))
    err = merge_refused(capsys, short, s2, s3, "--out", tmp_path / "out")
    assert "does not hold shard 1/3's students" in err and Shard(1, 3).select(CLASS)[0] in err


# --- the split ----------------------------------------------------------------------------------

def test_every_student_is_in_exactly_one_shard_of_balanced_size():
    for size in (0, 1, 2, 7, 31):
        students = [f"s{(i * 7919) % 1000:03d}x{i}" for i in range(size)]
        for count in (1, 2, 3, 8):
            shards = [Shard(i, count).select(reversed(students)) for i in range(1, count + 1)]
            assert sorted(s for shard in shards for s in shard) == sorted(students)
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert Shard(1, 1).select(["b", "a", "B"]) == ["B", "a", "b"]  # code points, not the locale


@pytest.mark.parametrize("text", ["0/2", "3/2", "2", "1/0", "a/b", "-1/2", "1/2/3", ""])
def test_grade_refuses_a_shard_that_is_not_i_of_n(text, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["grade", str(tmp_path), "--assignment", "05_allreduce", f"--shard={text}"])
    assert stop.value.code == 2
    assert "--shard wants I/N" in capsys.readouterr().err


def test_no_shard_is_shard_1_of_1():
    parser = build_parser()
    unsharded = parser.parse_args(["grade", "x", "--assignment", "05_allreduce"])
    assert unsharded.shard == parser.parse_args(
        ["grade", "x", "--assignment", "05_allreduce", "--shard", "1/1"]).shard == Shard(1, 1)


# --- the SLURM template's own checks ------------------------------------------------------------
# submit_grading.sh and grade_array.sbatch grade a class on a real SLURM cluster in
# tests/test_slurm_cluster.py; here, without SLURM, only what a real run cannot show: the refusal
# of an array whose task ids are not consecutive.

def test_an_array_with_gaps_is_refused(tmp_path):
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="2", SLURM_ARRAY_TASK_MIN="0",
               SLURM_ARRAY_TASK_MAX="4", SLURM_ARRAY_TASK_COUNT="3", PYTHON="false")
    done = subprocess.run(["bash", str(SLURM / "grade_array.sbatch"), str(tmp_path),
                           "05_allreduce", str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "consecutive" in done.stderr


def test_everyone_has_the_autograded_notebooks_of_the_single_run(runs):
    """Where formgrader opens them: ``autograded/{student}/{assignment}/``, the shard's own files."""
    outs, merged, _ = runs

    def notebooks(out):
        return sorted(str(p.relative_to(out)) for p in (out / "autograded").rglob("*.ipynb"))

    assert notebooks(merged) == notebooks(outs["whole"])
    assert {Path(path).parts[1] for path in notebooks(merged)} == set(STUDENTS)
    for path in notebooks(merged):
        shard = outs["1/2"] if "mallory" in path else outs["2/2"]
        assert (merged / path).read_bytes() == (shard / path).read_bytes()
