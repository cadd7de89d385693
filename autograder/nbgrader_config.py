"""nbgrader configuration for the course (nbgrader 0.9.6).

Used two ways:
* ``python -m autograder ...`` loads this file and points the course directory at a private work
  folder per student (see autograder/grade.py);
* instructors may also call nbgrader's own commands from the repository root, naming this file
  without its ``.py`` (nbgrader 0.9.6 has no ``--config`` option; see autograder/README.md, "Using
  nbgrader's own commands"):
  ``nbgrader autograde 05_allreduce --JupyterApp.config_file=autograder/nbgrader_config``.
  Then the course directory is the repository, submissions are read from
  ``autograder/course/submitted/`` and the course gradebook is ``autograder/course/gradebook.db``.

Timeouts, from the inside out: a check's ``run_ranks`` call gives up after 15 s
(ddpcourse.grading.checks.CHECK_TIMEOUT_S); a test cell makes at most 12 such calls, one at a time,
but stops at the first failure, so a hanging submission fails a cell after ~15 s and a correct one
passes in a few seconds. Each cell gets ``Execute.timeout`` = 240 s; the whole submission gets a
hard deadline in the grading worker (autograder/grade.py).

Output caps: autograde executes with ``autograder.capped_execute.CappedExecute`` instead of
nbgrader's ``Execute``, so what a submission prints, displays or writes to its file descriptors is
capped in this process, where it arrives, not only inside the student's kernel.
"""

import sys
from pathlib import Path

c = get_config()  # noqa: F821 - provided by traitlets when nbgrader loads this file

REPO = Path(__file__).resolve().parent.parent

# `nbgrader autograde` (its script's folder first on sys.path) must import autograder/ too.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ddpcourse.kernels import FAST_EXIT_ARGUMENT  # noqa: E402 - the path above first

# The student's kernel must import the hidden checks (`from autograder.hidden import SLUG`), which
# are not an installed package: ipykernel runs this line before the notebook (nbclient passes
# `extra_arguments` to the kernel's command line). First on the path, so that a folder named
# `autograder` handed in with a submission (copied next to the notebook) cannot stand in for them.
# The second line: the kernel exits without collecting torch's objects (ddpcourse/kernels.py).
c.Execute.extra_arguments = [
    f"--IPKernelApp.exec_lines=__import__('sys').path.insert(0, {str(REPO)!r})",
    FAST_EXIT_ARGUMENT]

# The gradebook's folder (ignored by git): sqlite creates the file, not its folder.
try:
    (REPO / "autograder/course").mkdir(exist_ok=True)
except OSError:  # a read-only checkout: nbgrader says so when it opens the gradebook
    pass

c.CourseDirectory.root = str(REPO)
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "exercises"
c.CourseDirectory.submitted_directory = "autograder/course/submitted"
c.CourseDirectory.autograded_directory = "autograder/course/autograded"
c.CourseDirectory.feedback_directory = "autograder/course/feedback"
c.CourseDirectory.db_url = f"sqlite:///{REPO / 'autograder/course/gradebook.db'}"
# The text twins (*.nb.py, see jupytext.toml) are the solutions in plain text: never released.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "*.db", "*.db-journal",
                            "*.nb.py"]

c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

c.Execute.timeout = 240
c.Execute.interrupt_on_timeout = True
c.Execute.startup_timeout = 120  # these Execute settings apply to CappedExecute too

# After nbgrader's own sanitizing (which restores the test cells from the gradebook), refuse to
# grade a notebook whose hidden-test cells would fail to import their checks: an error, not 0 points.
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput",
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "nbgrader.preprocessors.OverwriteCells",
    "nbgrader.preprocessors.CheckCellMetadata",
    "autograder.nbgrader_api.RequireHiddenChecks",
]
# nbgrader's own list (nbgrader.converters.Autograde), with Execute replaced by CappedExecute.
c.Autograde.autograde_preprocessors = [
    "autograder.capped_execute.CappedExecute",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
c.CappedExecute.max_cell_output_bytes = 200_000  # = notebook_guard.MAX_CELL_OUTPUT_BYTES
c.CappedExecute.max_notebook_output_bytes = 2_000_000

# A deleted test cell comes back (and is graded), instead of silently losing its points.
c.OverwriteCells.add_missing_cells = True
c.LimitOutput.max_lines = 300
c.LimitOutput.max_traceback = 80

# Late penalties: nbgrader's AssignLatePenalties (above) asks this plugin for each notebook of a
# submission whose timestamp.txt is past the assignment's due date. Set the due date in the course
# gradebook with nbgrader's own `nbgrader db assignment add NN_topic --duedate="YYYY-MM-DD HH:MM:SS
# UTC" --JupyterApp.config_file=autograder/nbgrader_config` (or formgrader); without one, nothing
# is late. The policy: a share of the notebook's score per day started (autograder/late_penalty.py);
# nbgrader's built-in ones are `LateSubmissionPlugin` with penalty_method "none" or "zero".
c.AssignLatePenalties.plugin_class = "autograder.late_penalty.PercentPerDay"
c.PercentPerDay.percent_per_day = 10.0
