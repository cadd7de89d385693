"""Late penalties, computed by nbgrader's own machinery with a policy the course config chooses.

nbgrader takes a submission's time from its ``timestamp.txt`` (written by ``nbgrader submit``,
kept by ``collect``) and the assignment's due date from the gradebook (``nbgrader db assignment
add NAME --duedate=...`` or formgrader), and asks the configured ``LateSubmissionPlugin`` for each
notebook's penalty (``AssignLatePenalties`` in nbgrader/preprocessors/latesubmissions.py). Its
built-in policies are none and zero; :class:`PercentPerDay` takes a share of the notebook's score
per day started, which autograder/nbgrader_config.py selects.

:func:`reassess` asks the same plugin again once every score is final: a notebook graded outside
the student's kernel (autograder/trusted.py) gets its scores after nbgrader's autograde has run,
so the penalty nbgrader computed then was of a stand-in score.
"""

from __future__ import annotations

import math

from nbgrader.plugins import LateSubmissionPlugin
from traitlets import Float

DAY_S = 86_400


class PercentPerDay(LateSubmissionPlugin):
    """A late notebook loses ``percent_per_day`` of its score for every day (or part of one)
    past the due date, at most all of it."""

    percent_per_day = Float(10.0, help="The share of the score lost per day started, in percent"
                            ).tag(config=True)

    def late_submission_penalty(self, student_id: str, score: float,
                                total_seconds_late: float) -> float | None:
        if total_seconds_late <= 0:
            return None
        days = math.ceil(total_seconds_late / DAY_S)
        return min(score, score * self.percent_per_day / 100 * days)


def reassess(config, assignment: str, student: str) -> None:
    """Each notebook's late penalty from its final score, in the gradebook ``config`` names, as
    ``AssignLatePenalties`` computes it (the configured plugin, the penalty kept between 0 and
    the score)."""
    from nbgrader.api import Gradebook, MissingEntry
    from nbgrader.preprocessors import AssignLatePenalties

    plugin = AssignLatePenalties(config=config).plugin_class(config=config)
    with Gradebook(config.CourseDirectory.db_url) as gradebook:
        try:
            submission = gradebook.find_submission(assignment, student)
        except MissingEntry:
            return
        late = submission.total_seconds_late
        for notebook in submission.notebooks:
            penalty = (plugin.late_submission_penalty(student, notebook.score, late)
                       if late > 0 else None)
            notebook.late_submission_penalty = (
                None if penalty is None else max(0.0, min(penalty, notebook.score)))
        gradebook.db.commit()


def lateness(seconds: float) -> str:
    """``1 day 12 h``: how late, for people."""
    days, rest = divmod(int(seconds), DAY_S)
    hours, rest = divmod(rest, 3600)
    parts = [f"{days} day{'s' if days != 1 else ''}"] if days else []
    if hours or not days:
        parts.append(f"{hours} h" if hours else f"{max(1, rest // 60)} min")
    return " ".join(parts)
