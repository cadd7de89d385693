"""Where the course's files are, for the repository's tests: one definition of each list."""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from autograder.sources import TEXT_TWIN_SUFFIX

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "chapters").glob("*/*.ipynb"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TESTED_TORCH = PYPROJECT["tool"]["ddpcourse"]["torch"]  # the one place the pinned version is written


def chapter_scripts() -> list[Path]:
    """The scripts a student launches: a chapter's .py files, less private modules (``_*.py``)
    and the lessons' text twins (``*.nb.py``)."""
    return sorted(path for path in (ROOT / "chapters").glob("*/*.py")
                  if not path.name.startswith("_") and not path.name.endswith(TEXT_TWIN_SUFFIX))
