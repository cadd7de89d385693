"""``python -m autograder student-repo``: the repository a private class's students get holds every
lesson and released exercise, no solution and no hidden check, and its self-check still works.

One export of this repository's HEAD is shared by the tests that read it; the refusals and
``--update`` run on a tiny git repository of their own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from autograder import student_repo
from autograder.__main__ import main
from autograder.sources import TEXT_TWIN_SUFFIX, exercises
from ddpcourse.grading.authoring_marks import HIDDEN_MARK

ROOT = student_repo.REPO
SELF_CHECKED = "exercises/00_setup/health_check.ipynb"  # one kernel, 4 visible + 2 hidden cells
GIT_USER = ("-c", "user.name=course", "-c", "user.email=course@example.invalid")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *GIT_USER, *args], capture_output=True,
                          text=True, check=True).stdout


def committed_files(repo: Path = ROOT) -> list[str]:
    return git(repo, "ls-tree", "-r", "--name-only", "HEAD").splitlines()


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and ".git" not in p.relative_to(folder).parts)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("students") / "ddp-course"
    assert main(["student-repo", str(out)]) == 0
    return out


# --- what it holds ------------------------------------------------------------------------------


def test_holds_the_lessons_the_released_exercises_and_the_package_and_nothing_private(export):
    written = files_under(export)
    committed = committed_files()
    for prefix in ("chapters/", "exercises/", "ddpcourse/", "benchmarks/results/"):
        assert [f for f in written if f.startswith(prefix)] == sorted(
            f for f in committed if f.startswith(prefix)), prefix
    assert {"README.md", "pyproject.toml", "environment.yml"} <= set(written)
    for exercise in exercises():
        assert (export / exercise.release.relative_to(ROOT)).is_file(), exercise.slug
    private = [f for f in written if f.split("/")[0] in ("solutions", "autograder", "tests", ".ci")
               or f in ("CONTRIBUTING.md", "benchmarks/grading_throughput.py")
               or f.startswith("exercises/") and f.endswith(TEXT_TWIN_SUFFIX)]
    assert private == []
    assert all(student_repo.is_student_file(f) for f in written)


def test_no_file_holds_a_solution_region_or_hidden_check_or_imports_the_grader(export):
    hits = {f: student_repo.private_markers_in((export / f).read_text(errors="replace"))
            for f in files_under(export)}
    assert {f: m for f, m in hits.items() if m} == {}
    hidden_sources = {p.stem: p.read_text() for p in (ROOT / "autograder" / "hidden").glob("*.py")
                      if p.stem != "__init__"}
    # each hidden module's own data (its case lists, its situations) appears nowhere
    hidden_lines = {line.strip() for text in hidden_sources.values() for line in text.splitlines()
                    if re.match(r"\s*\(\"|\s*[0-9]+: \[", line)}
    assert len(hidden_lines) > 10
    student_text = "\n".join((export / f).read_text(errors="replace") for f in files_under(export))
    assert [line for line in hidden_lines if line in student_text] == []


def _blocks(code: str) -> list[str]:
    """The solution regions of a source notebook's twin, each as its code lines without
    comments or indentation, joined: a copy survives re-indenting, not a rewrite. Regions of
    under 40 characters of code (a one-word return) could be any lesson's line, and are left out."""
    regions, current = [], None
    for line in code.splitlines():
        text = line.strip()
        if text == "### BEGIN SOLUTION":
            current = []
        elif text == "### END SOLUTION":
            regions.append(current)
            current = None
        elif current is not None and text and not text.startswith("#"):
            current.append(text)
    return ["\n".join(region) for region in regions if len("".join(region)) >= 40]


def _code_lines(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines()
                     if line.strip() and not line.strip().startswith("#"))


def test_no_file_holds_a_solution_regions_code_even_without_its_markers(export):
    twins = {e.slug: e.twin.read_text() for e in exercises()}
    blocks = {slug: _blocks(code) for slug, code in twins.items()}
    assert all(blocks.values())  # every exercise has a region this test can look for ...
    for slug, code in twins.items():  # ... and finds it where it is
        assert all(block in _code_lines(code) for block in blocks[slug]), slug
    found = []
    for name in files_under(export):
        text = _code_lines((export / name).read_text(errors="replace"))
        if name.endswith(".ipynb"):
            text = _code_lines("\n".join(c.source for c in nbformat.reads(
                (export / name).read_text(), as_version=4).cells))
        found += [f"{slug} in {name}" for slug, regions in blocks.items()
                  for block in regions if block in text]
    assert found == []


def test_the_readme_says_what_this_copy_is_and_drops_the_instructors_commands(export):
    readme = (export / "README.md").read_text()
    assert student_repo.INSTRUCTORS_SECTION in (ROOT / "README.md").read_text()
    assert student_repo.INSTRUCTORS_SECTION not in readme and "python -m autograder" not in readme
    assert readme.startswith("# ") and "Your class's copy of the course" in readme
    assert git(ROOT, "rev-parse", "HEAD")[:12] in readme
    assert "## Exercises: self-check" in readme and "## Quickstart" in readme


def test_the_allow_list_keeps_new_private_files_private():
    for path in ("NOTES.md", "grading_key.csv", "autograder/hidden/new_exercise.py",
                 "solutions/10_performance/buckets.nb.py", "tests/test_new.py",
                 "benchmarks/grading_throughput.py", "private/answers.md", "CONTRIBUTING.md"):
        assert not student_repo.is_student_file(path), path
    for path in ("chapters/10_performance/10_performance.ipynb", "exercises/10_performance/x.ipynb",
                 "ddpcourse/grading/exercises/buckets.py", "benchmarks/ch10_overlap.py"):
        assert student_repo.is_student_file(path), path


# --- the student's self-check in the student repository -----------------------------------------


def test_the_self_check_runs_there_the_stub_fails_its_checks_and_hidden_cells_skip(export, tmp_path):
    """As a student runs it, with this copy's ddpcourse first on the path (as its `pip install
    -e .` would put it) and no grader anywhere the kernel can import."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
           "PYTHONPATH": str(export)}  # not this run's pytest-xdist worker settings
    notebook = export / SELF_CHECKED
    where = subprocess.run(
        [sys.executable, "-c", "import ddpcourse, importlib.util as u; "
         "print(ddpcourse.__file__); print(u.find_spec('autograder'))"],
        cwd=notebook.parent, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where == [str(export / "ddpcourse" / "__init__.py"), "None"]

    report = tmp_path / "report.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", SELF_CHECKED,
                           f"--junitxml={report}"], cwd=export, env=env, capture_output=True,
                          text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "ModuleNotFoundError" not in output and "ImportError" not in output, output
    cases = {case.get("name"): case for case in ET.parse(report).iter("testcase")}
    cells = [c for c in nbformat.read(notebook, as_version=4).cells
             if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("grade")]
    hidden = {c.metadata.nbgrader.grade_id for c in cells if c.source.startswith(HIDDEN_MARK)}
    visible = {c.metadata.nbgrader.grade_id for c in cells} - hidden
    assert hidden and visible and set(cases) == hidden | visible
    for name in visible:
        failure = cases[name].find("failure")
        assert failure is not None and "NotImplementedError" in failure.get("message", ""), name
    for name in hidden:
        skipped = cases[name].find("skipped")
        assert skipped is not None and "run when the notebook is graded" in skipped.get("message")


# --- refusals and --update, on a tiny repository ------------------------------------------------


@pytest.fixture
def tiny_repo(tmp_path) -> Path:
    repo = tmp_path / "private"
    for path, text in {"README.md": "# Course\n\n## Quickstart\nrun it\n\n## For instructors\n"
                                    "python -m autograder grade\n\n## Layout\nchapters\n",
                       "chapters/01_x/lesson.py": "print('lesson')\n",
                       "solutions/01_x/task.nb.py": "### BEGIN SOLUTION\nanswer = 42\n",
                       "autograder/hidden/task.py": "CASES = [1]\n",
                       "NOTES.md": "private notes\n"}.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "course")
    return repo


def test_a_tiny_repository_exports_its_allowed_files_only(tiny_repo, tmp_path):
    export = student_repo.build_student_repo(tmp_path / "out", repo=tiny_repo)
    assert export.files == ("README.md", "chapters/01_x/lesson.py")
    assert files_under(tmp_path / "out") == list(export.files)
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "## Quickstart" in readme and "## Layout" in readme
    assert "## For instructors" not in readme and "python -m autograder" not in readme


def test_refuses_when_a_student_file_holds_a_solution_and_writes_nothing(tiny_repo, tmp_path):
    (tiny_repo / "chapters/01_x/lesson.py").write_text("# ### BEGIN SOLUTION\nanswer = 42\n")
    uncommitted = student_repo.build_student_repo(tmp_path / "a", repo=tiny_repo)
    assert "BEGIN" not in (uncommitted.out / "chapters/01_x/lesson.py").read_text()  # HEAD's file
    git(tiny_repo, "commit", "-qam", "a lesson quotes the solution")
    with pytest.raises(student_repo.StudentRepoError, match="lesson.py: ### BEGIN SOLUTION"):
        student_repo.build_student_repo(tmp_path / "b", repo=tiny_repo)
    assert not (tmp_path / "b").exists()


def test_refuses_a_folder_that_is_not_empty_or_inside_the_repository(tiny_repo, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep me")
    assert main(["student-repo", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert files_under(tmp_path / "full") == ["mine.txt"]
    with pytest.raises(student_repo.StudentRepoError, match="inside the private repository"):
        student_repo.build_student_repo(tiny_repo / "students", repo=tiny_repo)


def test_update_replaces_a_clean_checkouts_files_so_git_shows_the_changes(tiny_repo, tmp_path):
    out = tmp_path / "students"
    student_repo.build_student_repo(out, repo=tiny_repo)
    git(out, "init", "-q")
    git(out, "add", ".")
    git(out, "commit", "-qm", "term 1")
    (out / "stale.md").write_text("gone next term")
    with pytest.raises(student_repo.StudentRepoError, match="uncommitted"):
        student_repo.build_student_repo(out, update=True, repo=tiny_repo)
    git(out, "add", ".")
    git(out, "commit", "-qm", "a file the course no longer has")
    (tiny_repo / "chapters/01_x/lesson.py").write_text("print('lesson, term 2')\n")
    git(tiny_repo, "commit", "-qam", "term 2")

    student_repo.build_student_repo(out, update=True, repo=tiny_repo)
    changes = sorted(git(out, "status", "--porcelain").splitlines())
    assert changes == [" D stale.md", " M README.md", " M chapters/01_x/lesson.py"]
    with pytest.raises(student_repo.StudentRepoError, match="no .git"):
        student_repo.build_student_repo(tmp_path / "plain", update=True, repo=tiny_repo)


# --- the instructor's walk-through, run as written ----------------------------------------------

DOC = ROOT / "autograder" / "PRIVATE_CLASS.md"
DOC_STUDENTS = "../ddp-course-students"
DOC_REMOTE = "git@example.org:your-class/ddp-course.git"


def doc_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), re.S | re.M)


def test_private_class_walkthrough_runs_as_written(tmp_path):
    """Publish, a later update, and the grading check, with the checkout and the Git host
    replaced by folders here. Between the two publications someone edited the published
    repository by hand: the update undoes it, so there is a change to commit and push."""
    publish, update, grading = doc_blocks()
    students, remote = tmp_path / "students", tmp_path / "host.git"
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(remote))
    env = {**os.environ, "GIT_AUTHOR_NAME": "course", "GIT_AUTHOR_EMAIL": "course@example.invalid",
           "GIT_COMMITTER_NAME": "course", "GIT_COMMITTER_EMAIL": "course@example.invalid",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def run(block: str) -> str:
        script = block.replace(DOC_STUDENTS, str(students)).replace(DOC_REMOTE, str(remote))
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{script}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    run(publish)
    published = files_under(students)
    assert git(remote, "ls-tree", "-r", "--name-only", "main").splitlines() == published
    edited = tmp_path / "edited"
    git(tmp_path, "clone", "-q", str(remote), str(edited))
    (edited / "chapters" / "hand_edit.md").write_text("edited on the host")
    git(edited, "add", ".")
    git(edited, "commit", "-qm", "a hand edit")
    git(edited, "push", "-q")

    status = [line for line in run(update).splitlines() if re.match(r"[ MADRCU?]{2} \S", line)]
    assert status == ["D  chapters/hand_edit.md"]
    assert git(remote, "ls-tree", "-r", "--name-only", "main").splitlines() == published
    assert git(remote, "log", "--format=%s", "main").splitlines()[0] == (
        "DDP course: this term's changes")
    run(grading)
