"""Where the course's files are, for the repository's tests: one definition of each list."""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from autograder.sources import TEXT_TWIN_SUFFIX, exercises
from ddpcourse.imports import import_by_path  # noqa: F401  (the tests import it from here)

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "chapters").glob("*/*.ipynb"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TESTED_TORCH = PYPROJECT["tool"]["ddpcourse"]["torch"]  # the one place the pinned version is written


def chapter_scripts() -> list[Path]:
    """The scripts a student launches: a chapter's .py files, less private modules (``_*.py``)
    and the lessons' text twins (``*.nb.py``)."""
    return sorted(path for path in (ROOT / "chapters").glob("*/*.py")
                  if not path.name.startswith("_") and not path.name.endswith(TEXT_TWIN_SUFFIX))


CHAPTERS = sorted(path.name for path in (ROOT / "chapters").iterdir() if path.is_dir())
CHAPTER_NUMBERS = [name[:2] for name in CHAPTERS]
# What names a chapter in a test's id: its folder (05_allreduce), its exercises' slugs, and the
# chapter test files (test_chapter_05_...).
_CHAPTER_TOKENS = {**{name: name[:2] for name in CHAPTERS},
                   **{e.assignment: e.assignment[:2] for e in exercises()},
                   **{e.slug: e.assignment[:2] for e in exercises()}}
_TOKEN = re.compile(r"(?<![A-Za-z0-9])(%s)(?![A-Za-z0-9])" % "|".join(
    sorted(map(re.escape, _CHAPTER_TOKENS), key=len, reverse=True)))


def chapter_of(nodeid: str) -> str | None:
    """The two-digit chapter a test belongs to, from its file and parameters; None if general."""
    found = re.search(r"test_chapter_(\d\d)_", nodeid)
    if found:
        return found.group(1)
    found = _TOKEN.search(nodeid)
    return _CHAPTER_TOKENS[found.group(1)] if found else None

