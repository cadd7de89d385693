"""A new exercise, ready to grade: ``python -m autograder scaffold NN_topic SLUG``.

Writes the four files of exercise ``SLUG`` in chapter ``NN_topic`` from the templates in
``autograder/scaffold_templates/`` (a working example: ``SLUG(tensor)`` returns the sum of a
tensor over the ranks, graded by one visible and one hidden test cell), then creates the rest as
an instructor would:

* ``solutions/NN_topic/SLUG.nb.py``, and its notebook by ``jupytext --sync``;
* ``ddpcourse/grading/exercises/SLUG.py`` (the visible Case: observe in the ranks, judge by an
  invariant of the observations; ``TRUSTED_VERDICTS = True``);
* ``autograder/hidden/SLUG.py`` (the hidden cases and the grader's reference);
* ``tests/test_grading_SLUG.py`` (the solution passes; wrong answers fail in the kernel and through
  the trusted grader; malformed reports fail the rank);
* the release ``exercises/NN_topic/`` (``python -m autograder release``, for this assignment);
* ``SLUG`` in chapter NN's row of README.md's course map;

and prints what to fill in, file by file. As written, the exercise keeps every authoring rule and
is graded as it is: its solution earns every point, its stub none
(tests/test_exercise_scaffold.py grades one with the instructor's command).

Refused, with exit code 2 and nothing written: a slug that is not a lowercase Python identifier
(or is a keyword, or a name the templates use), a slug some exercise, checks module, hidden module
or test file already has, and a chapter that is not a folder of ``chapters/``.
"""

from __future__ import annotations

import keyword
import re
import string
import sys
from dataclasses import dataclass
from pathlib import Path

from autograder.sources import REPO, TEXT_TWIN_SUFFIX

TEMPLATES = Path(__file__).resolve().parent / "scaffold_templates"
CHAPTER = re.compile(r"^(\d\d)_[a-z0-9_]+$")
SLUG = re.compile(r"^[a-z][a-z0-9_]*$")
# Names the generated notebook and modules use where the slug is a name too (the notebook's
# function, the observation's argument): a slug of one of them would shadow it.
RESERVED = frozenset({"torch", "dist", "checks", "hidden", "integrity", "setup_notebook",
                      "run_ranks", "together", "try_it", "tensor", "total", "make_tensor",
                      "run_student", "safe_text", "type_name", "rank", "world_size", "cases",
                      "length", "dtype", "seed", "held", "got", "returned", "calls"})


class ScaffoldRefused(ValueError):
    """Nothing was written; the message says why."""


@dataclass(frozen=True)
class Scaffold:
    """Where each file of exercise ``slug`` of assignment ``assignment`` goes, under ``root``."""

    root: Path
    assignment: str
    slug: str

    @property
    def twin(self) -> Path:
        return self.root / "solutions" / self.assignment / f"{self.slug}{TEXT_TWIN_SUFFIX}"

    @property
    def notebook(self) -> Path:
        return self.root / "solutions" / self.assignment / f"{self.slug}.ipynb"

    @property
    def checks(self) -> Path:
        return self.root / "ddpcourse" / "grading" / "exercises" / f"{self.slug}.py"

    @property
    def hidden(self) -> Path:
        return self.root / "autograder" / "hidden" / f"{self.slug}.py"

    @property
    def test(self) -> Path:
        return self.root / "tests" / f"test_grading_{self.slug}.py"

    @property
    def release(self) -> Path:
        return self.root / "exercises" / self.assignment / f"{self.slug}.ipynb"

    def files(self) -> dict[str, Path]:
        """Template name -> the file it becomes."""
        return {"solution.nb.py": self.twin, "checks.py": self.checks,
                "hidden.py": self.hidden, "test_grading.py": self.test}

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))


def refusal(root: Path, assignment: str, slug: str) -> str | None:
    """Why ``scaffold(assignment, slug)`` must not write anything, or None."""
    chapters = sorted(p.name for p in (root / "chapters").glob("*")
                      if p.is_dir() and CHAPTER.match(p.name))
    if assignment not in chapters:
        return (f"{assignment!r} is not a chapter: chapters/{assignment}/ does not exist "
                f"(the chapters: {', '.join(chapters)})")
    if not SLUG.match(slug) or keyword.iskeyword(slug) or slug in RESERVED:
        return (f"{slug!r} cannot name an exercise: a slug is a lowercase Python identifier "
                f"(letters, digits, _; it names the notebook, the function and the modules), "
                f"neither a keyword nor a name the generated code uses (RESERVED in "
                f"autograder/scaffold.py: torch, dist, checks, tensor, ...)")
    taken = Scaffold(root, assignment, slug)
    existing = [taken.rel(path) for path in taken.files().values() if path.exists()]
    existing += sorted(str(p.relative_to(root)) for p in (root / "solutions").glob(f"*/{slug}.*"))
    if existing:
        return (f"{slug!r} is taken ({', '.join(sorted(set(existing)))}): choose another slug; "
                f"an existing exercise is edited as CONTRIBUTING.md's 'Editing an exercise' says")
    return None


def fill(template: str, made: Scaffold) -> str:
    """A template with this exercise's names (``$slug``, ``$assignment``, ``$number``,
    ``$topic``, ``$grade_id`` of the solution cell) and the installed jupytext's version."""
    import jupytext

    return string.Template((TEMPLATES / template).read_text()).substitute(
        slug=made.slug, assignment=made.assignment, number=made.assignment[:2],
        topic=made.assignment[3:].replace("_", " "), grade_id=made.slug.replace("_", "-"),
        jupytext_version=jupytext.__version__)


def add_to_course_map(readme: Path, assignment: str, slug: str) -> bool:
    """Name ``slug`` in the status column of chapter NN's row of README.md's course map (``ready;
    exercise `a``` becomes ``ready; exercises `a`, `slug```); False where there is no such row."""
    number = assignment[:2]
    lines = readme.read_text().splitlines(keepends=True)
    for index, line in enumerate(lines):
        if not line.startswith(f"| {number} |"):
            continue
        before, status, after = line.rsplit("|", 2)
        status = status.strip()
        listed = re.search(r"exercises? ((?:`\w+`(?:, )?)+)$", status)
        names = re.findall(r"`(\w+)`", listed.group(1)) if listed else []
        kept = status[:listed.start()] if listed else status + ("; " if status else "")
        names.append(slug)
        word = "exercise" if len(names) == 1 else "exercises"
        status = kept + f"{word} " + ", ".join(f"`{name}`" for name in names)
        lines[index] = f"{before}| {status} |{after}"
        readme.write_text("".join(lines))
        return True
    return False


def scaffold(assignment: str, slug: str, root: Path | None = None) -> Scaffold:
    """Write exercise ``slug`` of ``assignment`` in the repository ``root`` (default: this one; see
    the module docstring); ScaffoldRefused, with nothing written, when it cannot be made."""
    root = root or REPO
    why = refusal(root, assignment, slug)
    if why:
        raise ScaffoldRefused(why)
    made = Scaffold(root, assignment, slug)
    texts = {path: fill(template, made) for template, path in made.files().items()}
    for path, text in texts.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    from jupytext.cli import jupytext as jupytext_command

    jupytext_command(["--sync", "--quiet", str(made.twin)])
    from autograder.release import generate_release

    generate_release(assignment, root / "exercises", root / "solutions")
    add_to_course_map(root / "README.md", assignment, slug)
    return made


def what_to_fill_in(made: Scaffold, in_course_map: bool) -> str:
    slug, assignment = made.slug, made.assignment
    grade = f"pytest tests/test_grading_every_assignment.py -k {assignment}"
    row = f"chapter {assignment[:2]}'s row of the course map"
    course_map = f"{row} now names {slug}" if in_course_map else f"add {slug} to {row}"
    return f"""\
Exercise {slug} of {assignment} is written. As it stands it is a working example
({slug}(tensor) sums a tensor over the ranks): its solution earns every point, its stub none.
Make it yours, file by file:

  {made.rel(made.twin)}
      the intro and the task (markdown cells); the contract, once, in the stub's docstring;
      the solution between ### BEGIN SOLUTION / ### END SOLUTION; a Try-it cell; the test
      cells (each says its points in its first comment; a hidden-test cell starts with
      '# Hidden tests: ...'; the grammar: autograder/cell_grammar.py). Then
      `jupytext --sync {made.rel(made.twin)}` and `python -m autograder release`.
  {made.rel(made.checks)}
      observe_{slug} (in the rank: build the inputs, call the function, report plain data),
      the visible cases and their judge, which uses only invariants of the observations or
      values written out for its cases, never a reference; keep TRUSTED_VERDICTS = True.
  {made.rel(made.hidden)}
      the reference (reference_sum), the hidden cases (world sizes 1-4, odd lengths, dtypes,
      seeds, forbidden shortcuts), judged through judge_{slug}_with.
  {made.rel(made.test)}
      the wrong answers each check catches, in the kernel and through the trusted grader
      (fixture `host`); every value the visible module writes out, held to the reference;
      the malformed reports (DAMAGE).
  README.md
      {course_map}
  {made.rel(made.release)}
      generated: never edit it; `python -m autograder release` after each change of the source.

Check it (CONTRIBUTING.md, 'Adding an exercise with the scaffold'):
  pytest -n 0 tests/test_exercise_authoring.py tests/test_notebook_sources.py -k {slug}
  pytest -n 0 tests/test_exercises.py tests/test_grading_{slug}.py -k {slug}
  {grade}
then commit all of these files (tests/test_student_repo.py exports the committed HEAD).
"""


def run(opts) -> int:
    try:
        made = scaffold(opts.assignment, opts.slug)
    except ScaffoldRefused as refused:
        print(f"Refusing to scaffold: {refused}", file=sys.stderr)
        return 2
    readme = (made.root / "README.md").read_text()
    in_map = any(line.startswith(f"| {opts.assignment[:2]} |") and f"`{opts.slug}`" in line
                 for line in readme.splitlines())
    print(what_to_fill_in(made, in_map), end="")
    return 0


def add_command(sub) -> None:
    what = ("write a new exercise's four files (a working example to fill in), its notebook "
            "and release, and say what to fill in")
    command = sub.add_parser("scaffold", help=what, description=what[0].upper() + what[1:] + (
        "; refuses (exit 2, nothing written) a slug that is taken or no identifier, and a "
        "chapter that does not exist. CONTRIBUTING.md: 'Adding an exercise with the scaffold'."))
    command.add_argument("assignment", metavar="NN_topic",
                         help="the chapter, a folder of chapters/ (e.g. 04_process_groups)")
    command.add_argument("slug", metavar="SLUG",
                         help="the exercise's one name: its notebook, function, checks and tests")
