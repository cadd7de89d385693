"""The grading command line: what it accepts and what it refuses, before any grading starts."""

from __future__ import annotations

import pytest

from autograder import gradesheet
from autograder.__main__ import main
from autograder.sources import SOLUTIONS, assignments, exercises


def test_the_assignments_are_the_folders_of_solutions():
    """Each folder of solutions/ with a notebook is an assignment, and each of its notebooks (not
    their .nb.py twins) an exercise, in the order of their names: the grader's layout too."""
    folders = sorted(p.name for p in SOLUTIONS.iterdir() if p.is_dir() and list(p.glob("*.ipynb")))
    assert assignments() == folders
    assert {e.assignment for e in exercises()} == set(folders)
    for folder in folders:
        notebooks = sorted(p.name.removesuffix(".ipynb")
                           for p in (SOLUTIONS / folder).iterdir() if p.name.endswith(".ipynb"))
        assert [e.slug for e in exercises() if e.assignment == folder] == notebooks, folder
        assert [notebook.slug for notebook in gradesheet.layout(folder)] == notebooks, folder
    # an assignment may hold several exercises (05_allreduce does)
    assert any(len(gradesheet.layout(folder)) > 1 for folder in folders)


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


def test_the_grade_commands_own_process_does_not_import_torch(tmp_path):
    """`grade` hands the students to workers; its own process needs no torch (importing it costs
    a second or more of CPU, once per run and per shard). Run up to its refusal of an empty
    class, past every import the command makes."""
    import subprocess
    import sys

    probe = ("import sys\nfrom autograder.__main__ import main\n"
             f"code = main(['grade', {str(tmp_path)!r}, '--assignment', '00_setup', '--out', "
             f"{str(tmp_path / 'out')!r}, '--sandbox', 'off'])\n"
             "print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert "holds no submission" in done.stderr, done.stderr
    assert done.stdout.strip() == "2 []", done.stdout
