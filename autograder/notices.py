"""The feedback page a student gets when their notebook could not be graded normally.

Written by the grading worker (tampering, a dropped notebook) and by the grading command (a
worker that timed out or crashed), so that every student always has a page that says why.
"""

from __future__ import annotations

import html
from pathlib import Path


def write_notice(dest: Path, student: str, assignment: str, title: str, body: str) -> None:
    """A feedback page for a submission that nbgrader gave none: dropped, flagged, timed out."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(assignment)}: {html.escape(student)}</title></head><body>"
        f"<h1>{html.escape(assignment)} &mdash; {html.escape(title)}</h1>"
        f"<p>Student: {html.escape(student)}. Score: 0.</p>"
        f"<pre>{html.escape(body)}</pre>"
        "<p>Fix the cause, check your notebook with <code>pytest exercises/"
        f"{html.escape(assignment)}</code>, and ask your instructor to grade it again.</p>"
        "</body></html>"
    )
