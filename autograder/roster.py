"""The class roster in ``grades.csv``: each student's names, email and LMS id, from nbgrader.

The roster lives where nbgrader keeps it, in the course gradebook's students; import it with
nbgrader's own command (a CSV with the columns ``id``, ``first_name``, ``last_name``, ``email``
and ``lms_user_id``; see autograder/README.md)::

    nbgrader db student import roster.csv --JupyterApp.config_file=autograder/nbgrader_config

Grading keeps those students as they are (``nbgrader_api``: a submission only adds a student the
roster lacks), and every ``grades.csv`` that ``grade`` or ``merge`` writes takes the names, email
and LMS id of each row's student from the course gradebook of its OUT, so that the file can go
to an LMS without hand work. A student missing from the roster keeps empty fields.
"""

from __future__ import annotations

from pathlib import Path

ROSTER_COLUMNS = ("last_name", "first_name", "email", "lms_user_id")


def read_roster(gradebook: Path) -> dict[str, dict[str, str]]:
    """Student id -> the roster's fields (only those it fills) in the gradebook ``gradebook``;
    empty when there is no such file."""
    if not gradebook.is_file():
        return {}
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{gradebook}") as book:
        return {student.id: {column: getattr(student, column) for column in ROSTER_COLUMNS
                             if getattr(student, column)}
                for student in book.students}


def with_roster_columns(columns: list[str]) -> list[str]:
    """``columns`` with every roster column it lacks, after the last one it has (or after
    ``student_id``): nbgrader export's columns have the names and email but no ``lms_user_id``."""
    missing = [column for column in ROSTER_COLUMNS if column not in columns]
    anchors = [columns.index(column) for column in (*ROSTER_COLUMNS, "student_id")
               if column in columns]
    at = max(anchors) + 1 if anchors else len(columns)
    return columns[:at] + missing + columns[at:]


def join_roster(rows: list[dict], roster: dict[str, dict[str, str]]) -> list[dict]:
    """The rows with each student's roster fields filled in (what the roster says wins)."""
    return [dict(row, **roster.get(row.get("student_id"), {})) for row in rows]
