"""Load the course's nbgrader configuration and drive nbgrader through its Python API; and the
one step the configuration adds to nbgrader's own autograde (``RequireHiddenChecks``).

Each grading worker and the release builder get their own course directory (and gradebook), so
any number can run at once: nbgrader's sqlite gradebook allows no parallel writers.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

from nbgrader.preprocessors import NbGraderPreprocessor
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
