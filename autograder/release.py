"""Build the nbgrader source notebooks and generate the student release from them.

    python -m autograder build      # autograder/assignments/*.py -> solutions/NN_topic/*.ipynb
    python -m autograder release    # solutions/ -> exercises/ (nbgrader generate_assignment)

Both are deterministic, so the committed notebooks can be checked for drift
(tests/test_exercises.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from autograder.assignments import ALL
from autograder.authoring import write_notebook
from autograder.nbgrader_api import REPO, api_for, check, load_config


def build_sources(solutions_dir: Path = REPO / "solutions") -> list[Path]:
    written = []
    for module in ALL:
        path = solutions_dir / module.ASSIGNMENT / f"{module.NOTEBOOK}.ipynb"
        write_notebook(path, module.cells())
        written.append(path)
    return written


def generate_release(assignment: str, into: Path, solutions_dir: Path = REPO / "solutions") -> Path:
    """Run nbgrader generate_assignment for ``assignment``; put the release in ``into/assignment``."""
    with tempfile.TemporaryDirectory(prefix="ddpcourse-release-") as tmp:
        root = Path(tmp)
        config = load_config(root, source_directory=str(solutions_dir),
                             release_directory=str(root / "release"))
        check(api_for(config).generate_assignment(assignment, force=True, create=True),
              f"generate_assignment {assignment}")
        target = into / assignment
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(root / "release" / assignment, target)
    return target


def release_all(into: Path = REPO / "exercises") -> list[Path]:
    assignments = dict.fromkeys(module.ASSIGNMENT for module in ALL)  # one release per folder
    return [generate_release(assignment, into) for assignment in assignments]
