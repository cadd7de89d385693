"""Every notebook is its text twin: lessons and exercise sources are edited as ``NAME.nb.py``
(jupytext py:percent, paired by jupytext.toml) or in Jupyter, and the two must agree.

* each ``.ipynb`` equals what its twin gives, cell for cell (type, source, metadata);
* syncing an unchanged pair changes no byte (cell ids are kept, so diffs stay clean);
* a notebook saved from Jupyter (jupytext's contents manager) updates its twin;
* each student release is what nbgrader generates from the sources now, and holds no twin.

A red test names the file and the command that brings it back in step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jupytext
from jupytext.cli import jupytext as jupytext_command
import nbformat
import pytest
from course_layout import LESSONS

from autograder.release import generate_release
from autograder.sources import TEXT_TWIN_SUFFIX, assignments, exercises

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [exercise.source for exercise in exercises()]
NOTEBOOKS = LESSONS + SOURCES


def twin(notebook: Path) -> Path:
    return notebook.with_suffix(TEXT_TWIN_SUFFIX)


def cells(nb) -> list[tuple]:
    return [(cell.cell_type, cell.source, dict(cell.metadata)) for cell in nb.cells]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_every_notebook_has_a_text_twin_and_every_twin_a_notebook():
    assert NOTEBOOKS
    for notebook in NOTEBOOKS:
        assert twin(notebook).is_file(), f"{rel(notebook)} has no twin: run `jupytext --sync {rel(notebook)}`"
    twins = sorted((ROOT / "chapters").glob(f"*/*{TEXT_TWIN_SUFFIX}")) + sorted(
        (ROOT / "solutions").glob(f"*/*{TEXT_TWIN_SUFFIX}"))
    orphans = [rel(t) for t in twins if not t.with_name(t.name[:-len(TEXT_TWIN_SUFFIX)] + ".ipynb").is_file()]
    assert not orphans, f"text twins without a notebook: {orphans}; run `jupytext --sync` on each"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=rel)
def test_the_notebook_is_what_its_text_twin_gives(notebook):
    committed = nbformat.read(notebook, as_version=4)
    from_text = jupytext.read(twin(notebook))
    hint = (f"{rel(notebook)} and {rel(twin(notebook))} differ: run "
            f"`jupytext --sync {rel(twin(notebook))}` (the newer of the two wins)")
    assert len(committed.cells) == len(from_text.cells), hint
    for i, (mine, theirs) in enumerate(zip(cells(committed), cells(from_text))):
        assert mine == theirs, f"{hint}; first difference in cell {i}"
    assert committed.metadata.get("kernelspec") == from_text.metadata.get("kernelspec"), hint


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=rel)
def test_syncing_an_unchanged_pair_changes_no_byte(notebook, tmp_path):
    shutil.copy(ROOT / "jupytext.toml", tmp_path)
    pair = [shutil.copy(path, tmp_path) for path in (notebook, twin(notebook))]
    before = [Path(p).read_bytes() for p in pair]
    jupytext_command(["--sync", "--quiet", str(pair[1])])
    assert [Path(p).read_bytes() for p in pair] == before, (
        f"rebuilding {rel(notebook)} from its twin changes it: run `jupytext --sync "
        f"{rel(twin(notebook))}` and commit both")


def test_a_notebook_saved_in_jupyter_updates_its_text_twin(tmp_path):
    """What Jupyter does on save when jupytext is installed: its contents manager writes both."""
    from jupytext import TextFileContentsManager

    lesson = LESSONS[0]
    shutil.copy(ROOT / "jupytext.toml", tmp_path)
    for path in (lesson, twin(lesson)):
        shutil.copy(path, tmp_path)
    manager = TextFileContentsManager(root_dir=str(tmp_path))
    model = manager.get(lesson.name)
    nb = nbformat.from_dict(model["content"])
    nb.cells.append(nbformat.v4.new_markdown_cell("A sentence written in Jupyter."))
    manager.save({"type": "notebook", "content": nb}, lesson.name)
    text = (tmp_path / twin(lesson).name).read_text()
    assert text.rstrip().endswith("# A sentence written in Jupyter.")
    saved = nbformat.read(tmp_path / lesson.name, as_version=4)
    assert cells(saved) == cells(jupytext.read(tmp_path / twin(lesson).name))


@pytest.fixture(scope="module")
def fresh_release(tmp_path_factory) -> Path:
    """Each assignment released once, for the drift checks below (05 has two notebooks)."""
    root = tmp_path_factory.mktemp("release")
    for assignment in assignments():
        generate_release(assignment, root)
    return root


def comparable(path: Path) -> str:
    return json.dumps(nbformat.read(path, as_version=4), sort_keys=True, indent=1)


@pytest.mark.parametrize("exercise", exercises(), ids=lambda e: e.slug)
def test_the_committed_release_is_what_nbgrader_generates_now(exercise, fresh_release):
    fresh = fresh_release / exercise.assignment / exercise.release.name
    assert exercise.release.is_file(), f"{rel(exercise.release)} is missing: run `python -m autograder release`"
    assert comparable(fresh) == comparable(exercise.release), (
        f"{rel(exercise.release)} is not what nbgrader makes of {rel(exercise.source)}: run "
        "`python -m autograder release`")


def test_the_release_holds_exactly_the_notebooks_and_no_text_twin(fresh_release):
    for assignment in assignments():
        shipped = sorted(p.name for p in (fresh_release / assignment).iterdir())
        committed = sorted(p.name for p in (ROOT / "exercises" / assignment).iterdir()
                           if p.name != "__pycache__")
        sources = sorted(e.release.name for e in exercises() if e.assignment == assignment)
        assert shipped == sources, (assignment, shipped)
        assert committed == sources, (assignment, committed)
