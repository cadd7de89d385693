"""Generate the student release from the nbgrader source notebooks.

    python -m autograder release    # solutions/NN_topic/*.ipynb -> exercises/NN_topic/ (nbgrader)

Deterministic, so the committed release can be checked for drift (tests/test_notebook_sources.py).
The text twins (``*.nb.py``) hold the solutions and never reach the release (nbgrader_config.py
ignores them).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from autograder.nbgrader_api import api_for, check, load_config
from autograder.sources import EXERCISES, SOLUTIONS, assignments


def generate_release(assignment: str, into: Path, solutions_dir: Path = SOLUTIONS) -> Path:
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


def release_all(into: Path = EXERCISES) -> list[Path]:
    return [generate_release(assignment, into) for assignment in assignments()]
