"""``python -m autograder scaffold NN_topic SLUG`` (autograder/scaffold.py), tried as a new
instructor would: in a copy of the parts of the repository the grader reads (``autograder/``,
``ddpcourse/``, one chapter's ``solutions/`` and ``exercises/``, README.md, jupytext.toml), a
throwaway exercise is added to an existing chapter, and then

* its four files, its notebook and its release exist, and no other exercise's file changed;
* it keeps every rule of tests/test_exercise_authoring.py (run here on it) and its notebook is
  what its twin gives;
* the grading worker prepares it (its test cells read, its checks found, graded outside the
  kernel);
* the instructor's command grades it as it is, in one run: a student who hands in the solution
  gets every point, the release as handed out gets none;
* the scaffold refuses an existing slug, a slug that is no identifier, and a chapter that does not
  exist, with exit code 2 and nothing written.

The generated tests/test_grading_SLUG.py is only compiled here: it needs the fixtures of the
whole repository's tests/, and running it would cost ~9 s more of CPU; with the pytest commands
the scaffold prints, in a full copy of the repository, it passes. Cost: one grading run of two
students; ~22 s of CPU on the course's 2-core machine beyond pytest's own start.

And: every exercise is named in its chapter's row of README.md's course map, the one document
that lists each chapter's exercises (the scaffold adds a new one there).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jupytext
import nbformat
import pytest
import test_exercise_authoring as authoring
from fake_class import solved_release

from autograder import sandbox, scaffold, worker
from autograder.__main__ import main
from autograder.sources import exercises, grade_id

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "04_process_groups"  # an existing chapter, of one small exercise (ranks_from_env)
SLUG = "sum_for_the_scaffold_test"  # the throwaway exercise
SANDBOX = "require" if sandbox.resolve("warn")[0] else "warn"
pytestmark = pytest.mark.timeout(900)


def copy_of_the_course(root: Path) -> Path:
    """What the scaffold, the grader and the authoring rules read, without the other chapters'
    exercises (every chapter folder is there, empty but for CHAPTER's)."""
    repo = root / "repo"
    for folder in ("autograder", "ddpcourse"):
        shutil.copytree(ROOT / folder, repo / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "course"))
    for chapter in (ROOT / "chapters").iterdir():
        if chapter.is_dir():
            (repo / "chapters" / chapter.name).mkdir(parents=True)
    for folder in ("solutions", "exercises"):
        shutil.copytree(ROOT / folder / CHAPTER, repo / folder / CHAPTER,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", "jupytext.toml"):
        shutil.copyfile(ROOT / name, repo / name)
    (repo / "tests").mkdir()
    return repo


def digest(repo: Path) -> dict[str, str]:
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(repo.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def in_copy(repo: Path) -> dict:
    return dict(os.environ, DDPCOURSE_CHECK_TIMEOUT_S="60",
                PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def scaffolded(tmp_path_factory):
    """The copy, before and after ``python -m autograder scaffold CHAPTER SLUG``."""
    repo = copy_of_the_course(tmp_path_factory.mktemp("scaffold"))
    before = digest(repo)
    done = subprocess.run([sys.executable, "-m", "autograder", "scaffold", CHAPTER, SLUG],
                          cwd=repo, env=in_copy(repo), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    made = scaffold.Scaffold(repo, CHAPTER, SLUG)
    return SimpleNamespace(repo=repo, made=made, before=before, after=digest(repo),
                           printed=done.stdout)


@contextlib.contextmanager
def the_copys_modules(repo: Path):
    """The copy's checks and hidden checks of SLUG importable here, under their own names, as
    the grader imports them (ddpcourse.grading.exercises.SLUG, autograder.hidden.SLUG)."""
    import autograder.hidden
    import ddpcourse.grading.exercises

    folders = [(ddpcourse.grading.exercises, repo / "ddpcourse" / "grading" / "exercises"),
               (autograder.hidden, repo / "autograder" / "hidden")]
    for package, folder in folders:
        package.__path__.append(str(folder))
    try:
        yield
    finally:
        for package, folder in folders:
            package.__path__.remove(str(folder))
            sys.modules.pop(f"{package.__name__}.{SLUG}", None)
            vars(package).pop(SLUG, None)


def test_it_writes_the_four_files_the_notebook_and_the_release_and_says_what_to_fill_in(
        scaffolded):
    made = scaffolded.made
    written = {made.rel(path) for path in [*made.files().values(), made.notebook, made.release]}
    changed = {path for path, sha in scaffolded.after.items()
               if scaffolded.before.get(path) != sha}
    assert changed == written | {"README.md"}, sorted(changed)  # no other exercise's file
    for path in made.files().values():
        assert made.rel(path) in scaffolded.printed, made.rel(path)
    assert "FILL IN" in made.twin.read_text() and "FILL IN" in made.checks.read_text()
    # tests/test_grading_SLUG.py is Python; it runs (25 tests, ~9 s of CPU) in a whole repository
    compile(made.test.read_text(), str(made.test), "exec")
    row = next(line for line in (scaffolded.repo / "README.md").read_text().splitlines()
               if line.startswith(f"| {CHAPTER[:2]} |"))
    assert row.endswith(f"exercises `ranks_from_env`, `{SLUG}` |"), row
    release = made.release.read_text()
    assert "BEGIN SOLUTION" not in release and "BEGIN HIDDEN TESTS" not in release
    assert "raise NotImplementedError" in release


def test_it_keeps_every_authoring_rule_and_its_notebook_is_its_twin(scaffolded):
    made = scaffolded.made
    exercise = SimpleNamespace(assignment=CHAPTER, slug=SLUG, source=made.notebook,
                               twin=made.twin)
    rules = [rule for name, rule in vars(authoring).items() if name.startswith("test_")
             and list(inspect.signature(rule).parameters) == ["exercise"]]
    assert len(rules) >= 5
    with the_copys_modules(scaffolded.repo):
        for rule in rules:
            rule(exercise)
    notebook, from_twin = nbformat.read(made.notebook, as_version=4), jupytext.read(made.twin)
    assert [(c.cell_type, c.source, c.metadata) for c in notebook.cells] == [
        (c.cell_type, c.source, c.metadata) for c in from_twin.cells]


def test_the_worker_prepares_it_for_grading_outside_the_kernel(scaffolded, monkeypatch):
    monkeypatch.setattr(worker, "REPO", scaffolded.repo)
    with the_copys_modules(scaffolded.repo):
        graded_outside, in_kernel, grader_errors = worker._read_trusted_sources(
            scaffolded.repo / "solutions" / CHAPTER, CHAPTER)
    assert grader_errors == {} and in_kernel == []
    assert sorted(graded_outside) == sorted(["ranks_from_env", SLUG])


def test_the_instructors_command_gives_the_solution_every_point_and_the_stub_none(
        scaffolded, tmp_path):
    """One grading run, two students, of the new notebook only (ranks_from_env not handed in)."""
    made = scaffolded.made
    students = {"solution": solved_release(SimpleNamespace(slug=SLUG, source=made.notebook,
                                                            release=made.release)),
                "stub": nbformat.read(made.release, as_version=4)}
    for student, notebook in students.items():
        folder = tmp_path / "submitted" / student / CHAPTER
        folder.mkdir(parents=True)
        nbformat.write(notebook, folder / f"{SLUG}.ipynb")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "autograder", "grade", str(tmp_path / "submitted"),
         "--assignment", CHAPTER, "--out", str(out), "--jobs", "2", "--cell-timeout", "240",
         "--student-timeout", "600", "--sandbox", SANDBOX],
        cwd=scaffolded.repo, env=in_copy(scaffolded.repo), capture_output=True, text=True,
        timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "grades.csv", newline="") as f:
        rows = {row["student_id"]: row for row in csv.DictReader(f)}
    cells = [(grade_id(c), c.metadata["nbgrader"]["points"])
             for c in nbformat.read(made.notebook, as_version=4).cells
             if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(cells) == 2 and sum(points for _, points in cells) == 3
    for student, earns in (("solution", lambda points: points), ("stub", lambda points: 0)):
        row = rows[student]
        assert (row["status"], row["flags"]) == ("graded", ""), row["notes"]
        assert "GRADER ERROR" not in row["notes"], row["notes"]
        scores = {cell: row[f"{SLUG}:{cell} ({points:g})"] for cell, points in cells}
        assert scores == {cell: f"{earns(points):g}" for cell, points in cells}, (student, row)
    summary = json.loads((out / "summary.json").read_text())
    assert all(not result.get("grader_errors") for result in summary["results"])
    page = (out / "feedback" / "stub" / CHAPTER / f"{SLUG}.html").read_text()
    assert "FAILED" in page and "NotImplementedError" in page


@pytest.mark.parametrize("chapter, slug, why", [
    (CHAPTER, "ranks_from_env", "'ranks_from_env' is taken (autograder/hidden/ranks_from_env.py"),
    (CHAPTER, SLUG, "is taken"),  # the one just made
    (CHAPTER, "diagnoses", "autograder/hidden/diagnoses.py"),  # a module, not an exercise
    (CHAPTER, "Sum-Over", "cannot name an exercise"),
    (CHAPTER, "lambda", "cannot name an exercise"),
    (CHAPTER, "checks", "cannot name an exercise"),
    ("99_nowhere", "sum_again", "is not a chapter"),
])
def test_it_refuses_with_exit_code_2_and_writes_nothing(scaffolded, monkeypatch, capsys, chapter,
                                                       slug, why):
    monkeypatch.setattr(scaffold, "REPO", scaffolded.repo)
    assert main(["scaffold", chapter, slug]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Refusing to scaffold: ") and why in err, err
    assert digest(scaffolded.repo) == scaffolded.after


# --- the documents that list each chapter's exercises ------------------------------------------


def course_map_rows(readme: str) -> dict[str, str]:
    """README.md's course map: chapter number -> its row."""
    return {match[1]: match[0] for match in re.finditer(r"^\| (\d\d) \|.*$", readme, re.M)}


def test_every_exercise_is_named_in_its_chapters_row_of_the_course_map():
    rows = course_map_rows((ROOT / "README.md").read_text())
    missing = [f"{e.slug} ({e.assignment})" for e in exercises()
               if f"`{e.slug}`" not in rows.get(e.assignment[:2], "")]
    assert missing == [], (f"README.md's course map does not name {missing}: add each to its "
                           "chapter's row (python -m autograder scaffold does it for a new one)")


@pytest.mark.parametrize("status, after", [
    ("ready; exercise `a`", "ready; exercises `a`, `new`"),
    ("ready; exercises `a`, `b`", "ready; exercises `a`, `b`, `new`"),
    ("planned", "planned; exercise `new`"),
])
def test_the_scaffold_adds_the_exercise_to_the_course_map(tmp_path, status, after):
    readme = tmp_path / "README.md"
    readme.write_text(f"| #  | x |\n| 03 | c | d | ready; exercise `c` |\n| 04 | t | w | {status} |\n")
    assert scaffold.add_to_course_map(readme, "04_topic", "new")
    assert readme.read_text().splitlines()[1:] == ["| 03 | c | d | ready; exercise `c` |",
                                                   f"| 04 | t | w | {after} |"]
    assert not scaffold.add_to_course_map(readme, "05_other", "new")
