"""A shared judge: a case's communication was point to point only (no collective at all).

Exercises that rebuild a collective from messages (chapter 05's ring all-reduce, any exercise
whose contract says "send/recv only") judge the same thing: the ``"traffic"`` entry of the
rank's observation, written by the in-rank audit (:func:`ddpcourse.grading.checks.audited_traffic`)
in a notebook or by the grader's broker when a class is graded, lists no collective. Both audits
name collectives alike (:mod:`ddpcourse.grading.collective_names`), so the message names the
call the student made, ``all_reduce``, whichever audit saw it. The judge holds no answer: "no
collective was called" is an invariant of the observation.
"""

from __future__ import annotations

from typing import Any

from ddpcourse.grading.checks import CheckFailed, cut_text, observed

POINT_TO_POINT_CALLS = "send/recv/isend/irecv"


def judge_point_to_point_only(traffic: Any, what: str, function: str) -> None:
    """CheckFailed unless ``traffic["collectives"]`` (a rank's report or the broker's record) is
    empty. ``what`` names the case; ``function`` the student's function, as the message says
    it."""
    collectives = observed(traffic, "collectives", list)
    if collectives:
        called = sorted({cut_text(name, 40) for name in collectives})
        raise CheckFailed(f"{what}: {function} must use point-to-point calls only "
                          f"({POINT_TO_POINT_CALLS}), but it called {cut_text(called, 300)}")
