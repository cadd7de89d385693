"""The repository a class's students get: ``python -m autograder student-repo OUT``.

    python -m autograder student-repo ../ddp-course-students            # a new, empty folder
    python -m autograder student-repo ../ddp-course-students --update   # a clean git checkout of it

The instructor keeps this repository (solutions, hidden checks, the grader) private and publishes
OUT. OUT holds the files of one commit (``--ref``, default ``HEAD``: uncommitted edits are never
published) that :data:`STUDENT_FILES` allows, nothing else: no ``solutions/``, no ``autograder/``
(hidden checks and grader), no ``tests/`` (the repository's own tests grade the solutions and import
the grader), no ``CONTRIBUTING.md``, no git history. It is an allow-list, so a file added later
outside these patterns stays private until someone adds it here. Before anything is written,
every chosen file is searched for what only the private copy may hold (:data:`PRIVATE_MARKERS`);
one hit refuses the whole export.

What students keep, and why it gives nothing away: the lessons and their scripts (chapters/), the
released exercise notebooks (exercises/, nbgrader has already cut the solution regions and the
hidden-test blocks), the ``ddpcourse`` package including ``ddpcourse.grading`` (the visible checks
the self-check runs, ``pytest exercises/NN_topic``; an exercise's hidden-test cell finds no
``autograder.hidden`` there and shows as skipped), the recorded runs the lessons plot
(benchmarks/), and the install files. How to run a class with it: autograder/PRIVATE_CLASS.md.
"""

from __future__ import annotations

import fnmatch
import io
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# git paths (fnmatch patterns; "*" also crosses "/") of the files a student gets.
STUDENT_FILES = (
    "README.md",
    "pyproject.toml",
    "environment.yml",
    "jupytext.toml",
    ".gitignore",
    "chapters/*",
    "exercises/*",
    "ddpcourse/*",
    "benchmarks/results/*",  # the recorded reference runs the lessons plot beside live ones
    "benchmarks/_*.py",
    "benchmarks/ch[0-9][0-9]_*.py",  # the chapters' measurements (their commands are in lessons)
    "benchmarks/launcher_overhead.py",  # the README's "Running your own function in N ranks"
    "benchmarks/self_check.py",  # the README's self-check timing
)

# Text that only the private copy may hold: nbgrader's solution and hidden-test regions (left in a
# notebook or quoted by a script), and code that imports the grader (hidden checks included).
PRIVATE_MARKERS = (
    "### BEGIN SOLUTION",
    "### END SOLUTION",
    "### BEGIN HIDDEN TESTS",
    "### END HIDDEN TESTS",
    "import autograder",
    "from autograder",
)

README = "README.md"
INSTRUCTORS_SECTION = "## For instructors"
STUDENT_NOTE = """\
> **Your class's copy of the course.** It holds the lessons (`chapters/`), the exercise notebooks
> you hand in (`exercises/`) and the `ddpcourse` package they use. Check one exercise with
> `pytest exercises/NN_topic/SLUG.ipynb` (see "Exercises: self-check" below); a plain `pytest`
> checks every exercise. The instructors' grader, the solutions and the course's own test suite
> are not part of this copy: where this README mentions `solutions/`, `autograder/`, `tests/` or
> `CONTRIBUTING.md`, it describes the instructors' repository. (Built from commit {commit}.)

"""


class StudentRepoError(RuntimeError):
    """The export was refused; nothing was written."""


@dataclass(frozen=True)
class Export:
    out: Path
    commit: str
    files: tuple[str, ...]


def is_student_file(path: str) -> bool:
    """Whether the git path ``path`` belongs in the student repository (:data:`STUDENT_FILES`)."""
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in STUDENT_FILES)


def private_markers_in(text: str) -> list[str]:
    """The :data:`PRIVATE_MARKERS` that ``text`` contains."""
    return [marker for marker in PRIVATE_MARKERS if marker in text]


def student_readme(text: str, commit: str) -> str:
    """The README for students: a note on what this copy is, and no "For instructors" section
    (its commands need the grader, which this copy lacks)."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            skipping = line.strip() == INSTRUCTORS_SECTION
        if not skipping:
            kept.append(line)
    title_end = next((i + 1 for i, line in enumerate(kept) if line.startswith("# ")), 0)
    note = STUDENT_NOTE.format(commit=commit[:12])
    return "".join(kept[:title_end]) + "\n" + note + "".join(kept[title_end:]).lstrip("\n")


def _git(*args: str, repo: Path = REPO) -> bytes:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    if done.returncode:
        raise StudentRepoError(f"git {' '.join(args)}: {done.stderr.decode().strip()}")
    return done.stdout


def read_student_files(ref: str = "HEAD", repo: Path = REPO) -> tuple[str, dict[str, tuple[bytes, int]]]:
    """The commit ``ref`` names, and {path: (content, mode)} of its student files, read from
    ``git archive`` (committed content only; symbolic links are not student files)."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}", repo=repo).decode().strip()
    archive = tarfile.open(fileobj=io.BytesIO(_git("archive", "--format=tar", commit, repo=repo)))
    files = {}
    for member in archive.getmembers():
        if member.isfile() and is_student_file(member.name):
            files[member.name] = (archive.extractfile(member).read(), member.mode)
    return commit, files


def _check_no_private_text(files: dict[str, tuple[bytes, int]]) -> None:
    found = []
    for path, (content, _mode) in sorted(files.items()):
        markers = private_markers_in(content.decode("utf-8", errors="replace"))
        if markers:
            found.append(f"  {path}: {', '.join(markers)}")
    if found:
        raise StudentRepoError("these files would give away what only the private copy may hold; "
                               "nothing was written:\n" + "\n".join(found))


def _prepare(out: Path, update: bool) -> None:
    """Make ``out`` ready to receive the export: new or empty; with ``update``, a git checkout with
    nothing uncommitted, whose files (not .git) are removed first, so that git shows what changed."""
    if update:
        if not (out / ".git").exists():
            raise StudentRepoError(f"--update needs a git checkout of the student repository: "
                                   f"{out} has no .git")
        if _git("status", "--porcelain", "--untracked-files=all", repo=out).strip():
            raise StudentRepoError(f"{out} has uncommitted changes; commit or remove them first "
                                   "(--update replaces every file)")
        for entry in out.iterdir():
            if entry.name != ".git":
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    elif out.exists() and any(out.iterdir()):
        raise StudentRepoError(f"{out} is not empty; give a new folder, or --update for a git "
                               "checkout of the student repository")


def build_student_repo(out: Path, ref: str = "HEAD", update: bool = False,
                       repo: Path = REPO) -> Export:
    """Write the student repository of commit ``ref`` to ``out`` (see the module docstring)."""
    out = Path(out).resolve()
    if out == repo.resolve() or repo.resolve() in out.parents:
        raise StudentRepoError(f"{out} is inside the private repository; give a folder outside it")
    commit, files = read_student_files(ref, repo)
    if README in files:
        content, mode = files[README]
        files[README] = (student_readme(content.decode(), commit).encode(), mode)
    _check_no_private_text(files)
    _prepare(out, update)
    for path, (content, mode) in files.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode & 0o777)
    return Export(out, commit, tuple(sorted(files)))


def add_command(subparsers) -> None:
    """Register ``student-repo`` with ``python -m autograder``'s subcommands."""
    command = subparsers.add_parser(
        "student-repo", help="write the repository students get: lessons, released exercises, "
                             "the ddpcourse package; no solutions, hidden checks or grader")
    command.add_argument("out", type=Path, help="a new or empty folder (outside this repository)")
    command.add_argument("--ref", default="HEAD",
                         help="the commit to publish (default HEAD; uncommitted edits never are)")
    command.add_argument("--update", action="store_true",
                         help="OUT is a git checkout of the student repository with nothing "
                              "uncommitted: replace its files, so that `git diff` shows the changes")


def run(opts) -> int:
    """The ``student-repo`` command: 0 when written, 2 when refused (nothing written)."""
    import sys

    try:
        export = build_student_repo(opts.out, opts.ref, opts.update)
    except StudentRepoError as refused:
        print(f"Refusing to write the student repository: {refused}", file=sys.stderr)
        return 2
    print(f"student repository of commit {export.commit[:12]}: {len(export.files)} files in "
          f"{export.out}\npublish that folder; grade from this private repository "
          f"(autograder/PRIVATE_CLASS.md)")
    return 0
