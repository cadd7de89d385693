"""Load the course's nbgrader configuration and drive nbgrader through its Python API.

Each grading worker and the release builder get their own course directory (and gradebook), so
any number can run at once: nbgrader's sqlite gradebook allows no parallel writers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

AUTOGRADER_DIR = Path(__file__).resolve().parent
REPO = AUTOGRADER_DIR.parent

# nbgrader runs the `alembic` and `jupyter` executables of its environment: make sure they are
# found also when this Python was started by path, without activating its virtual environment.
_bin = str(Path(sys.executable).parent)
if _bin not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = os.pathsep.join([_bin, os.environ.get("PATH", "")])


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
