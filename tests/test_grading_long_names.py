"""Grading does not depend on the length of a student id or of the output folder: the kernel of a
64-character id (e-mail addresses are that long) under a long output path starts and runs.

The kernel talks to nbgrader over Unix sockets, whose paths have at most 107 bytes; they lived
under OUT/work/{student}/kernel/ and a 34-character id under a ~60-character folder was enough
for ``ZMQError: File name too long``, after which nbgrader dropped the submission (0 points,
status "dropped by nbgrader"; measured with ``python -m autograder grade`` on such a path). The
test prepares the submission as the grading worker does (autograder/worker.py) and executes a
notebook with the configuration nbgrader gets, in the sandbox where bubblewrap works."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from autograder import sandbox, worker

ROOT = Path(__file__).resolve().parent.parent
LONG_ID = "firstname.middlename.lastname-of-a-student@faculty.example.ac.uk"


def test_the_kernel_of_a_64_character_student_id_under_a_long_output_path_runs(tmp_path,
                                                                              monkeypatch):
    assert len(LONG_ID) == 64
    deep = tmp_path / ("a-long-folder-name-for-the-course-of-this-term" * 2) / "grading-output"
    submission = deep / "submitted" / LONG_ID / "00_setup"
    submission.mkdir(parents=True)
    shutil.copy(ROOT / "exercises" / "00_setup" / "health_check.ipynb", submission)
    work = deep / "out-of-the-autumn-term" / "work" / LONG_ID
    assert len(str(work / "kernel" / "ipc-1")) > 107  # where the sockets were: too long for one
    works, _ = sandbox.resolve("warn")
    monkeypatch.setenv(sandbox.POLICY_VARIABLE, "require" if works else "off")
    for name in (worker.GRADED_FUNCTIONS, worker.GRADED_FUNCTIONS_DIR):
        monkeypatch.setenv(name, "")  # _prepare sets them for the worker process
    prepared = worker._prepare({"student": LONG_ID, "assignment": "00_setup",
                                "submission": str(submission), "work": str(work)})
    try:
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
        NotebookClient(nb, config=prepared.config, kernel_name="python3", timeout=120,
                       resources={"metadata": {"path": str(prepared.submitted)}}).execute()
        assert nb.cells[0].outputs[0]["text"] == "42\n"
    finally:
        shutil.rmtree(prepared.kernel_dir, ignore_errors=True)
