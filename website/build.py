"""Build the course site: ``python -m website`` writes ``build/site/`` (open ``build/site/index.html``).

The site is Sphinx with myst-nb and sphinx-book-theme, all from PyPI, and needs no network: no
theme, font or script comes from another host, at build time or when a page is read.

What goes in, from the repository as it is:

* each chapter's lesson **with its outputs**: the executed copy ``build/executed/<path>.ipynb``
  that ``tests/test_notebooks.py`` keeps (the suite's one execution of each lesson). A copy
  counts only while its cells are those of the committed lesson; a lesson without one is
  executed here, once, and kept there the same way (``--no-execute`` instead builds its page
  without outputs, under a banner that says so);
* every chapter script's source, one page each, linked from its chapter;
* the exercises as students get them (``exercises/``: no solutions, no hidden tests);
* ``chapters/CLAIMS.md``, the instructor and contributor documents;
* the chapter 11 memory calculator (``website/calculator.md``, ``website/_static/calculator.js``).

The pages are staged in ``build/site_src/`` (the repository's layout, so relative links keep
working) and built from there with warnings as errors: a link to a file that does not exist
fails the build.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
EXECUTED = ROOT / "build" / "executed"
STAGE = ROOT / "build" / "site_src"
OUT = ROOT / "build" / "site"
CELL_TIMEOUT_S = 300  # as tests/test_notebooks.py

DOCS = {  # (section, [repository files]) in the order of the site's navigation
    "The course": ["chapters/CLAIMS.md"],
    "For instructors": ["autograder/README.md", "autograder/TERM.md",
                        "autograder/PRIVATE_CLASS.md", "slurm/README.md"],
    "For contributors": ["CONTRIBUTING.md"],
}
TOOLS = {"11_beyond_ddp": ("calculator", "This chapter's memory and traffic calculator")}
WIDGET = "application/vnd.jupyter.widget-view+json"
SCRIPT_SUFFIXES = (".py", ".sh", ".sbatch")
LANGUAGES = {".py": "python", ".sh": "bash", ".sbatch": "bash", ".yaml": "yaml", ".yml": "yaml",
             ".json": "json", ".toml": "toml", ".cfg": "ini", ".md": "markdown"}
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")  # [words](target)
PRIVATE = ("solutions/", "autograder/hidden/")  # never shown on the site
NOT_EXECUTED = ("```{warning}\nThis page shows the lesson **without its outputs**: it was not "
                "executed for this build (`python -m website --no-execute`, or its notebook "
                "failed). Run `python -m website` to execute it, or open the notebook in "
                "Jupyter.\n```")


def lessons() -> list[Path]:
    """The lesson notebooks, in course order (as tests/course_layout.py's LESSONS)."""
    return sorted((ROOT / "chapters").glob("*/*.ipynb"))


def chapter_scripts(chapter: Path) -> list[Path]:
    """What a student launches or reads in ``chapter``: its scripts, less private modules
    (``_*.py``) and the lesson's text twin (``*.nb.py``)."""
    return sorted(p for p in chapter.iterdir()
                  if p.suffix in SCRIPT_SUFFIXES and not p.name.startswith("_")
                  and not p.name.endswith(".nb.py"))


def executed_copy(lesson: Path) -> Path:
    """Where the suite keeps the executed copy of ``lesson``."""
    return EXECUTED / lesson.relative_to(ROOT)


def _cells(nb) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def is_current(copy: Path, lesson: Path) -> bool:
    """Whether ``copy`` is an execution of ``lesson`` as committed now: the same cells, in the
    same order (an executed copy of an older lesson is stale)."""
    if not copy.exists():
        return False
    try:
        executed = nbformat.read(copy, as_version=4)
    except Exception:  # a torn or foreign file is no copy
        return False
    return _cells(executed) == _cells(nbformat.read(lesson, as_version=4))


def execute_lesson(lesson: Path) -> Path:
    """Execute ``lesson`` in a fresh kernel from its own folder, as tests/test_notebooks.py does,
    and keep the copy where the suite keeps it; returns the copy's path."""
    from ddpcourse.kernels import execute_notebook

    nb = nbformat.read(lesson, as_version=4)
    execute_notebook(nb, lesson.parent, CELL_TIMEOUT_S)
    kept = executed_copy(lesson)
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(".partial")
    nbformat.write(nb, partial)
    partial.replace(kept)  # a reader never sees half a notebook
    return kept


@dataclass
class Built:
    """What a build did: the site's folder, which lessons it executed, which lack outputs."""
    out: Path
    not_to_execute: frozenset[str] = frozenset()
    executed: list[str] = field(default_factory=list)
    without_outputs: list[str] = field(default_factory=list)
    seconds: float = 0.0


class Stage:
    """The staged source tree: files copied in the repository's layout, links rewritten so that
    each one reaches a page of the site."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pages: set[str] = set()  # repository paths that are pages (md, ipynb)
        self.sources: set[str] = set()  # repository paths shown as a source page

    def add_page(self, rel: str, text: str) -> None:
        target = self.root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        self.pages.add(rel)

    def source_page(self, rel: str) -> str:
        """The page that shows the repository file ``rel`` (made once); returns its path."""
        page = rel + ".md"
        if rel not in self.sources:
            self.sources.add(rel)
            path = ROOT / rel
            target = self.root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            language = LANGUAGES.get(path.suffix, "text")
            head = _launch_lines(path)
            (self.root / page).write_text(
                f"---\norphan: true\n---\n\n# `{rel}`\n\n{head}"
                f"```{{literalinclude}} {path.name}\n:language: {language}\n:linenos:\n```\n")
        return page

    def rewrite_links(self, text: str, rel: str) -> str:
        """``text`` of the repository file ``rel`` with each relative link pointed at a page: a
        lesson's text twin (``NN.nb.py``) at its lesson, a folder at its README's page, any other
        file that is not a page at its source page. A link into what students must not see
        (``solutions/``, ``autograder/hidden/``) keeps its text and loses its target. A link to
        nothing is left as it is, and the build fails on it."""
        base = (ROOT / rel).parent

        def repoint(found: re.Match) -> str:
            words, target = found.group(1), found.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                return found.group(0)
            path_part, _, anchor = target.partition("#")
            path = (base / path_part).resolve()
            try:
                repo_rel = path.relative_to(ROOT).as_posix()
            except ValueError:
                return found.group(0)
            if repo_rel.startswith(PRIVATE):
                return words
            if path.name.endswith(".nb.py"):
                new = self.root / repo_rel[: -len(".nb.py")]
                new = new.with_name(new.name + ".ipynb")
            elif repo_rel in self.pages:
                return found.group(0)
            elif path.is_dir() and f"{repo_rel}/README.md" in self.pages:
                new = self.root / repo_rel / "README.md"
            elif path.is_file():
                new = self.root / self.source_page(repo_rel)
            else:
                return found.group(0)
            relative = Path(_relpath(new, self.root / rel)).as_posix()
            return f"[{words}]({relative}{'#' + anchor if anchor else ''})"

        return LINK.sub(repoint, text)


def _relpath(target: Path, from_file: Path) -> str:
    return os.path.relpath(target, from_file.parent)


def _launch_lines(path: Path) -> str:
    """A script's launch command (the first lines of its docstring), as a sentence above it."""
    if path.suffix != ".py":
        return ""
    text = path.read_text()
    found = re.match(r'\s*(?:#[^\n]*\n\s*)*(?:"""|\'\'\')(.*?)(?:"""|\'\'\')', text, re.S)
    if not found:
        return ""
    first = found.group(1).strip().split("\n\n")[0].strip()
    return f"```text\n{first}\n```\n\n" if first else ""


def stage_lesson(stage: Stage, lesson: Path, built: Built, execute: bool) -> None:
    rel = lesson.relative_to(ROOT).as_posix()
    copy = executed_copy(lesson)
    if not is_current(copy, lesson) and execute and rel not in built.not_to_execute:
        print(f"executing {rel} (no current executed copy in {EXECUTED.relative_to(ROOT)})",
              flush=True)
        execute_lesson(lesson)
        built.executed.append(rel)
    if is_current(copy, lesson):
        nb = nbformat.read(copy, as_version=4)
    else:
        nb = nbformat.read(lesson, as_version=4)
        nb.cells.insert(1, nbformat.v4.new_markdown_cell(NOT_EXECUTED))
        built.without_outputs.append(rel)
        print(f"{rel}: no executed copy, its page has no outputs", flush=True)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = stage.rewrite_links(cell.source, rel)
        elif cell.cell_type == "code":
            cell.outputs = [_static_output(o, lesson.parent.name) for o in cell.outputs]
    nb.metadata.pop("widgets", None)  # their state would bring the widget scripts
    scripts = chapter_scripts(lesson.parent)
    if scripts:
        lines = ["## This chapter's scripts", "",
                 "Each page shows a script's source; its first lines say how to launch it "
                 "(from the repository root).", ""]
        for script in scripts:
            page = stage.source_page(script.relative_to(ROOT).as_posix())
            lines.append(f"- [`{script.name}`]({Path(page).name})")
        if lesson.parent.name in TOOLS:
            page, what = TOOLS[lesson.parent.name]
            lines += ["", f"{what}, in a page: [{page}](../../{page}.md)."]
        nb.cells.append(nbformat.v4.new_markdown_cell("\n".join(lines)))
    (stage.root / rel).parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, stage.root / rel)
    stage.pages.add(rel)


def _static_output(output, chapter: str):
    """``output``, or for an interactive widget (it needs a running kernel, and its scripts come
    from a CDN) a note that says where to use it instead."""
    if WIDGET not in output.get("data", {}):
        return output
    note = ("This cell's output is an interactive widget: it needs a running kernel. Open the "
            "notebook in Jupyter to use it")
    if chapter in TOOLS:
        page, _ = TOOLS[chapter]
        note += f', or use <a href="../../{page}.html">the same calculator in a page</a>'
    return nbformat.v4.new_output("display_data", data={
        "text/html": f'<p class="widget-note"><em>{note}.</em></p>',
        "text/plain": output["data"].get("text/plain", "")})


def _title(path: Path) -> str:
    """A page's first heading (its title in the navigation)."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    else:
        text = path.read_text()
    found = re.search(r"^#\s+(.+)$", text, re.M)
    return found.group(1).strip() if found else path.stem


def _include(after: str, before: str) -> str:
    """A MyST include of the README's text between two lines."""
    return (f'```{{include}} _includes/README.md\n:start-after: "{after}"\n'
            f':end-before: "{before}"\n```\n\n')


def home_page(stage: Stage, chapters: list[str], exercises: list[str]) -> str:
    """index.md: the README's "How to take the course" and "Course map", then the navigation."""
    def toctree(caption: str, entries: list[str]) -> str:
        return ("```{toctree}\n:maxdepth: 1\n:caption: " + caption + "\n\n"
                + "\n".join(entries) + "\n```\n")

    docs = "".join(toctree(section, [p for p in paths if p in stage.pages])
                   for section, paths in DOCS.items())
    return (
        "# DDP course: PyTorch DistributedDataParallel, hands-on\n\n"
        "A course for PyTorch developers whose training has outgrown one GPU: every chapter is a "
        "lesson, shown here with the outputs and figures of its run, plus scripts you launch with "
        "`torchrun` and graded exercises you check yourself.\n\n"
        + _include("<!-- how-to-take-the-course -->", "<!-- /how-to-take-the-course -->")
        + _include("## Course map", "## Exercises: self-check")
        + toctree("Lessons", chapters)
        + toctree("Exercises", ["exercises/README", *exercises])
        + toctree("Tools", ["calculator"])
        + docs)


def stage_all(execute: bool, built: Built) -> Stage:
    shutil.rmtree(STAGE, ignore_errors=True)
    STAGE.mkdir(parents=True)
    stage = Stage(STAGE)
    # every page first, so links between them are known to be pages
    md_files = ["exercises/README.md"] + [p for ps in DOCS.values() for p in ps]
    md_files = [p for p in md_files if (ROOT / p).exists()]
    stage.pages.update(md_files)
    # the home page includes two sections of the README (links written as from the root)
    (STAGE / "_includes").mkdir()
    (STAGE / "_includes" / "README.md").write_text(
        stage.rewrite_links((ROOT / "README.md").read_text(), "README.md"))
    exercises = sorted((ROOT / "exercises").glob("*/*.ipynb"))
    stage.pages.update(p.relative_to(ROOT).as_posix() for p in exercises)
    for rel in md_files:
        stage.add_page(rel, stage.rewrite_links((ROOT / rel).read_text(), rel))
    for lesson in lessons():
        stage_lesson(stage, lesson, built, execute)
    for exercise in exercises:
        rel = exercise.relative_to(ROOT).as_posix()
        (STAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(exercise, STAGE / rel)
    shutil.copyfile(HERE / "calculator.md", STAGE / "calculator.md")
    chapters = [lesson.relative_to(ROOT).with_suffix("").as_posix() for lesson in lessons()]
    (STAGE / "index.md").write_text(home_page(
        stage, chapters, [e.relative_to(ROOT).with_suffix("").as_posix() for e in exercises]))
    return stage


def build(execute: bool = True, out: Path = OUT,
          not_to_execute: frozenset[str] = frozenset()) -> Built:
    """Stage the pages and build the site into ``out``. ``execute``: execute the lessons that
    have no current executed copy, except those named (repository paths) in ``not_to_execute``.
    Raises CalledProcessError (Sphinx's messages printed) when Sphinx warns or fails."""
    start = time.monotonic()
    built = Built(out=out, not_to_execute=frozenset(not_to_execute))
    stage_all(execute, built)
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
               "-c", str(HERE), "-d", str(ROOT / "build" / "site_doctrees"), str(STAGE), str(out)]
    subprocess.run(command, check=True, cwd=ROOT)
    built.seconds = time.monotonic() - start
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m website", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-execute", action="store_true",
                        help="do not execute lessons that have no current executed copy; their "
                             "pages show no outputs, under a banner that says so")
    args = parser.parse_args(argv)
    try:
        built = build(execute=not args.no_execute)
    except subprocess.CalledProcessError as error:
        print(f"the site did not build (Sphinx exited {error.returncode}; its messages are "
              "above)", file=sys.stderr)
        return 1
    print(f"built {built.out.relative_to(ROOT)}/ in {built.seconds:.1f} s; open "
          f"{(built.out / 'index.html').relative_to(ROOT)} in a browser")
    if built.executed:
        print(f"executed {len(built.executed)} lessons: {', '.join(built.executed)}")
    if built.without_outputs:
        print(f"WITHOUT OUTPUTS: {', '.join(built.without_outputs)}")
    return 0
