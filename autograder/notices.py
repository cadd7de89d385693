"""The feedback pages a student gets besides nbgrader's: a notebook not graded normally or not
handed in, and the assignment's total at the top of every page; nbgrader's own pages made easier
to read (wrapped output, named cells).

Written by the grading worker (tampering, a dropped notebook) and by the grading command (a
worker that timed out or crashed), so that every student always has a page that says why.
"""

from __future__ import annotations

import html
import os
import re
import sys
import sysconfig
import tempfile
from pathlib import Path

# How the grader's own verdict starts a graded cell's output (autograder/trusted.py writes it; the
# grading command reads it back to find the cells whose verdict says a rank did not finish in time).
GRADER_NOTE = "[grader] "


def write_notice(dest: Path, student: str, assignment: str, title: str, body: str) -> None:
    """A feedback page for a submission that nbgrader gave none: dropped, flagged, timed out."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(assignment)}: {html.escape(student)}</title>"
        "<style>pre {white-space: pre-wrap; overflow-wrap: anywhere}</style></head><body>"
        f"<h1>{html.escape(assignment)} &mdash; {html.escape(title)}</h1>"
        f"<p>Student: {html.escape(student)}. Score: 0.</p>"
        f"<pre>{html.escape(body)}</pre>"
        "<p>Fix the cause, check your notebook with <code>pytest exercises/"
        f"{html.escape(assignment)}</code>, and ask your instructor to grade it again.</p>"
        "</body></html>"
    )


def write_missing_notice(dest: Path, student: str, assignment: str, slug: str, points: float,
                         handed_in: list[str]) -> None:
    """The page for a notebook of the assignment that the student did not hand in."""
    others = (f"Your submission holds: {', '.join(handed_in)}." if handed_in
              else "Your submission holds no notebook.")
    write_notice(dest, student, assignment, f"{slug} was not handed in",
                 f"{slug}.ipynb is not in your submission of {assignment}, so it scores 0 of its "
                 f"{points:g} points. {others}\nIf you did hand it in, check its name: it must be "
                 f"exactly {slug}.ipynb, in the {assignment} folder.")


def assignment_summary(assignment: str, total: float, maximum: float,
                       notebooks: list[tuple[str, float | None, float]],
                       late: dict | None = None) -> str:
    """An HTML block with the assignment's total and each notebook's score (None: not handed in),
    put at the top of every feedback page of the assignment; ``late`` ({seconds, penalty}): how
    late it was handed in and what that cost."""
    from autograder.late_penalty import lateness

    items = "".join(
        f"<li>{html.escape(slug)}: "
        + ("not handed in, 0" if score is None else f"{score:g}") + f" of {points:g}</li>"
        for slug, score, points in notebooks)
    return ("<div class='assignment-summary' style='border:1px solid #888;padding:0.5em 1em;"
            "margin:0.5em 0'>"
            f"<strong>{html.escape(assignment)}: {total:g} of {maximum:g} points</strong>"
            + (f" (handed in {lateness(late['seconds'])} after the due date: a late penalty "
               f"of {late['penalty']:g} points, taken from {total + late['penalty']:g})"
               if late else "")
            + f"<ul>{items}</ul></div>")


def add_summary(page: Path, summary: str) -> None:
    """Put ``summary`` first in the body of a feedback page (nbgrader's or one of ours)."""
    text = page.read_text()
    start = text.find("<body")
    end = text.find(">", start) + 1 if start >= 0 else 0
    page.write_text(text[:end] + summary + text[end:])


# Long lines of test output wrap instead of running off the page's right edge, between words
# (the page's Bootstrap breaks a <pre> anywhere, even mid-word) unless a word is wider than the page.
WRAP_OUTPUT = ("<style>div.output_area pre, div.output_subarea pre {white-space: pre-wrap; "
               "word-break: normal; overflow-wrap: anywhere}</style>")
_TOC_ENTRY = re.compile(r'<li><a href="#([^"]+)">(Test cell|Written response|'
                        r'Coding free-response)</a>')


def make_readable(page: Path) -> None:
    """An nbgrader feedback page, easier to read: output wraps at the window's width, the list
    of scores at the top names each graded cell by its grade id (nbgrader's template calls every
    one "Test cell"), and no path says where the grading machine keeps things."""
    text = page.read_text()
    if WRAP_OUTPUT not in text:
        text = text.replace("</head>", WRAP_OUTPUT + "\n</head>", 1)
    text = _TOC_ENTRY.sub(lambda m: f'<li><a href="#{m[1]}">{m[1]}</a> ({m[2].lower()})', text)
    page.write_text(hide_machine_paths(text))


_COURSE_ROOT = Path(__file__).resolve().parents[1]


def _machine_prefixes() -> list[tuple[str, str]]:
    """(where, what a student reads instead), longest first: installed libraries become their
    import path (``torch/distributed/...``), the course's files their path in the repository;
    Python's own directory, temporary files and the home directory are shortened."""
    libraries = {sysconfig.get_paths()[key] for key in ("stdlib", "purelib", "platlib")}
    prefixes = [(directory, "") for directory in libraries]
    prefixes += [(str(_COURSE_ROOT), ""), (sys.prefix, "<python>"), (sys.base_prefix, "<python>"),
                 (tempfile.gettempdir(), "<tmp>"), (str(Path.home()), "~")]
    # both the path as given and the real one (a symlinked home or /tmp)
    prefixes += [(os.path.realpath(where), label) for where, label in prefixes]
    unique = {where.rstrip(os.sep) + os.sep: label + os.sep if label else ""
              for where, label in prefixes if len(where) > 1}
    return sorted(unique.items(), key=lambda item: len(item[0]), reverse=True)


def hide_machine_paths(text: str, in_html: bool = True) -> str:
    """``text`` (an HTML page, or plain text) without the grading machine's absolute paths
    (:func:`_machine_prefixes`)."""
    label = html.escape if in_html else str
    for temporary in {tempfile.gettempdir(), os.path.realpath(tempfile.gettempdir())}:
        # the file IPython gives a notebook cell's code
        kernel_files = re.escape(temporary.rstrip(os.sep) + os.sep) + r"ipykernel_\d+/\d+\.py"
        cell_file = _PATH_START + kernel_files
        text = re.sub(cell_file, label("<notebook cell>"), text)
    prefixes = _machine_prefixes()
    instead = dict(prefixes)
    alternatives = "|".join(re.escape(where) for where, _ in prefixes)
    anywhere = re.compile(f"{_PATH_START}({alternatives})")
    return anywhere.sub(lambda match: label(instead[match[1]]), text)


_PATH_START = r"(?<![\w./~-])"  # where an absolute path can begin: not inside a URL or a word
