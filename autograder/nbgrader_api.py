"""Load the course's nbgrader configuration and drive nbgrader through its Python API; and the
one step the configuration adds to nbgrader's own autograde (``RequireHiddenChecks``).

Each grading worker and the release builder get their own course directory (and gradebook), so
any number can run at once: nbgrader's sqlite gradebook allows no parallel writers.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
import warnings
from pathlib import Path

import nbgrader.api
from nbgrader.preprocessors import NbGraderPreprocessor
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

AUTOGRADER_DIR = Path(__file__).resolve().parent
REPO = AUTOGRADER_DIR.parent

# nbgrader runs the `jupyter` executable of its environment (and, left to itself, `alembic`: see
# gradebook_schema_revision): make sure they are found also when this Python was started by path,
# without activating its virtual environment.
_bin = str(Path(sys.executable).parent)
if _bin not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join([_bin, os.environ.get("PATH", "")])


@functools.cache
def gradebook_schema_revision() -> str:
    """The revision nbgrader stamps a new gradebook with: the head of its alembic migrations,
    read here with alembic's own API. nbgrader's ``get_alembic_version`` asks a separate
    ``alembic heads`` process for it, which costs ~2 s of CPU each time a gradebook is made (once
    per grading command, per release of an assignment); the answer is the same (a test checks)."""
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory
    from nbgrader.dbutil import ALEMBIC_DIR

    config = AlembicConfig()
    config.set_main_option("script_location", ALEMBIC_DIR)
    return ScriptDirectory.from_config(config).get_current_head()


nbgrader.api.get_alembic_version = gradebook_schema_revision


def load_config(root: Path, cell_timeout: int | None = None, **directories: str) -> Config:
    """The course config with its course directory moved to ``root``."""
    config = PyFileConfigLoader("nbgrader_config.py", path=str(AUTOGRADER_DIR)).load_config()
    config.CourseDirectory.root = str(root)
    config.CourseDirectory.db_url = f"sqlite:///{root / 'gradebook.db'}"
    for name, value in directories.items():
        config.CourseDirectory[name] = value
    if cell_timeout is not None:
        config.Execute.timeout = cell_timeout
    # Kernels on Unix sockets in this course directory: no TCP ports to collide with other
    # graders' kernels or with gloo (see ddpcourse/kernels.py).
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = str(root / "kernel")
    return config


def api_for(config: Config):
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    return NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)


def check(result: dict, what: str) -> None:
    if not result.get("success"):
        raise RuntimeError(f"nbgrader {what} failed:\n{result.get('error') or result.get('log')}")


HIDDEN_PACKAGE = "autograder.hidden"


class RequireHiddenChecks(NbGraderPreprocessor):
    """Fail autograde, naming the module, when a test cell imports hidden checks that are missing.

    Without them the cell's ``import`` fails in the kernel and nbgrader scores the cell 0, a loss
    nobody sees. nbgrader reports this exception as an error of the submission ("There was an error
    processing assignment") and exits non-zero instead. Runs after nbgrader's ``OverwriteCells``, so
    it reads the test cells as the gradebook holds them, whatever the student handed in. It looks
    the modules up on this process's path, where nbgrader_config.py has put the repository first,
    as it does on the kernel's.
    """

    def preprocess(self, nb, resources):
        for cell in nb.cells:
            nbgrader = cell.metadata.get("nbgrader", {})
            if cell.cell_type != "code" or not nbgrader.get("grade"):
                continue
            for module in hidden_modules(cell.source):
                if not _importable(module):
                    raise ModuleNotFoundError(
                        f"test cell {nbgrader.get('grade_id')!r} imports {module}, which is not "
                        f"in {REPO}: grading would score the cell 0. Grade from the course's "
                        f"private copy, which holds {HIDDEN_PACKAGE.replace('.', '/')}/.",
                        name=module)
        return nb, resources


def hidden_modules(source: str) -> list[str]:
    """The modules of ``HIDDEN_PACKAGE`` that a cell imports (none if it is not valid Python)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_hidden(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == HIDDEN_PACKAGE:
                found += [f"{HIDDEN_PACKAGE}.{alias.name}" for alias in node.names]
            elif _is_hidden(node.module):
                found.append(node.module)
            else:
                found += [name for name in (f"{node.module}.{alias.name}" for alias in node.names)
                          if _is_hidden(name)]
    return found


def _is_hidden(module: str) -> bool:
    return module == HIDDEN_PACKAGE or module.startswith(HIDDEN_PACKAGE + ".")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def record_class_in_course_gradebook(course_db_url: str, assignment: str,
                                     graded: dict[str, Path], solutions: Path | None = None) -> None:
    """Put the results of a grading run into the course gradebook, where nbgrader's own commands
    (``export``, ``generate_feedback``, formgrader, ``db student list``) find them.

    ``graded`` maps each student graded in this run to the gradebook file they were graded in
    (each worker's own: sqlite allows no parallel writers). The assignment is defined in the course
    gradebook from its real source (``solutions/``, as ``nbgrader generate_assignment`` defines it,
    never from a worker's copy, whose test cells are stand-ins); then each student's submission
    there is replaced by theirs (scores, comments, flags, late penalties, timestamp), or removed
    when their gradebook holds none or does not exist (nbgrader dropped it, the worker was
    killed). Everyone else's is kept, so re-grading one student or a subset, and recording shard
    after shard, add up to the whole class. Results graded against other test cells or points than
    the source now has are refused (ValueError).
    """
    from nbgrader.api import Gradebook

    from autograder.sources import SOLUTIONS

    define_assignment(course_db_url, assignment, solutions or SOLUTIONS)
    with Gradebook(course_db_url) as course:
        for student, gradebook in sorted(graded.items()):
            if not Path(gradebook).is_file():  # opening it would create it
                _record_submission(None, course, assignment, student)
                continue
            with Gradebook(f"sqlite:///{Path(gradebook).resolve()}") as grades:
                _record_submission(grades, course, assignment, student)


def define_assignment(course_db_url: str, assignment: str, solutions: Path) -> None:
    """``nbgrader generate_assignment`` into the course gradebook, its release thrown away."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddpcourse-define-") as tmp:
        config = load_config(Path(tmp), source_directory=str(solutions),
                             release_directory=str(Path(tmp) / "release"))
        config.CourseDirectory.db_url = course_db_url
        check(api_for(config).generate_assignment(assignment, force=True, create=True),
              f"generate_assignment {assignment} (the course gradebook)")


def _record_submission(grades, course, assignment: str, student: str) -> None:
    """Replace ``student``'s submission in ``course`` by theirs in ``grades`` (None: no gradebook)."""
    from nbgrader.api import MissingEntry

    submitted = None
    if grades is not None:
        try:
            submitted = grades.find_submission(assignment, student)
        except MissingEntry:
            pass
    if submitted is not None:
        _check_same_cells(grades, course, assignment)
    course.update_or_create_student(student)  # keeps the names and email a roster import gave
    try:
        course.remove_submission(assignment, student)
    except MissingEntry:
        pass
    if submitted is None:
        return
    with warnings.catch_warnings():
        # nbgrader builds the submission's notebooks and grades before it adds the submission to
        # its session, and SQLAlchemy 2 warns that it no longer adds them through the backrefs;
        # adding the submission adds them all (the gradebook tests read every grade back)
        warnings.filterwarnings("ignore", r"Object of type <Submitted\w+> not in session")
        course.add_submission(assignment, student, timestamp=submitted.timestamp,
                              extension=submitted.extension)
    for notebook in submitted.notebooks:
        target = course.find_submission_notebook(notebook.name, assignment, student)
        target.flagged = notebook.flagged
        target.late_submission_penalty = notebook.late_submission_penalty
        for grade in notebook.grades:
            copy = course.find_grade(grade.name, notebook.name, assignment, student)
            copy.auto_score, copy.manual_score = grade.auto_score, grade.manual_score
            copy.extra_credit, copy.needs_manual_grade = grade.extra_credit, grade.needs_manual_grade
        for comment in notebook.comments:
            copy = course.find_comment(comment.name, notebook.name, assignment, student)
            copy.auto_comment, copy.manual_comment = comment.auto_comment, comment.manual_comment
    course.db.commit()


def _check_same_cells(grades, course, assignment: str) -> None:
    """Refuse results graded against other test cells or points than the source defines now."""
    def cells(gradebook):
        return {(notebook.name, cell.name, cell.max_score)
                for notebook in gradebook.find_assignment(assignment).notebooks
                for cell in [*notebook.grade_cells, *notebook.task_cells]}
    graded, defined = cells(grades), cells(course)
    if graded != defined:
        raise ValueError(
            f"{assignment} was graded with test cells (notebook, cell, points) the course's "
            f"source no longer has, or without some it has: graded only "
            f"{sorted(graded - defined)}, source only {sorted(defined - graded)}")


def hold_for_review(course_db_url: str, assignment: str, students: list[str]) -> None:
    """Mark the submissions of students flagged for tampering as nbgrader marks them for review
    (``flagged``), and score them 0 until then by a manual score of 0 on every graded cell:
    nbgrader counts a manual score in place of the automatic one, so ``nbgrader export`` gives the
    0 that grades.csv gives, and an instructor who clears the flag in formgrader and deletes the
    manual scores gets the automatic scores back."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(course_db_url) as course:
        for student in students:
            try:
                submission = course.find_submission(assignment, student)
            except MissingEntry:  # nothing was graded: nothing to hold
                continue
            for notebook in submission.notebooks:
                notebook.flagged = True
                for grade in notebook.grades:
                    grade.manual_score = 0.0
        course.db.commit()
