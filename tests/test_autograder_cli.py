"""The grading command line: what it accepts and what it refuses, before any grading starts."""

from __future__ import annotations

import pytest

from autograder.__main__ import main
from autograder.sources import SOLUTIONS, assignments, exercises


def test_the_assignments_are_the_folders_of_solutions():
    folders = sorted(p.name for p in SOLUTIONS.iterdir() if p.is_dir() and list(p.glob("*.ipynb")))
    assert assignments() == folders
    assert {e.assignment for e in exercises()} == set(folders)
    assert [e.slug for e in exercises() if e.assignment == "05_allreduce"] == [
        "allreduce_by_hand", "bucketed_ddp"]


def test_grade_refuses_to_guess_the_assignment(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["grade", str(tmp_path)])
    assert stop.value.code == 2
    assert "--assignment" in capsys.readouterr().err


def test_grade_lists_the_assignments_when_given_one_that_does_not_exist(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["grade", str(tmp_path), "--assignment", "99_nowhere"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "99_nowhere" in err and all(name in err for name in assignments())


def test_grade_refuses_to_run_unsandboxed_unless_told(tmp_path, capsys, monkeypatch):
    from autograder import sandbox

    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bubblewrap is not installed.")
    code = main(["grade", str(tmp_path), "--assignment", "05_allreduce", "--out",
                 str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "Refusing to grade" in err and "bubblewrap is not installed" in err
    assert not (tmp_path / "out").exists()  # nothing graded, nothing written
