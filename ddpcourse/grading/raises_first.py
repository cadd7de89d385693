"""A shared judge: a bad argument raises ``ValueError`` *first*, before anything changes.

Several contracts say "raises ValueError for X, before the model changes" (chapter 07's
``train_steps``, chapter 10's ``tune_this_job``). The observation and the verdict are the same
for each: :func:`call_with_bad_argument` runs the student's call in the rank and records what it
raised and whether the model's parameters were left as they were (plain data);
:func:`judge_raised_first` is the judge's half, with the exercise's own words for the call.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ddpcourse.grading.checks import CheckFailed, cut_text, observed, safe_text
from ddpcourse.grading.left_unchanged import copy_of, identical

_MAX_TEXT = 200


def call_with_bad_argument(call: Callable[[], object], model: nn.Module) -> dict:
    """Run ``call()`` (the student's function with a bad argument) in the rank: whether it
    raised ValueError, what it raised or returned instead, and whether ``model``'s parameters are
    as they were before it."""
    before = copy_of(dict(model.named_parameters()))
    try:
        returned, raised = call(), None
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        returned, raised = None, exc
    return {"value_error": isinstance(raised, ValueError),
            "raised": None if raised is None else type(raised).__name__,
            "returned_text": safe_text(lambda: repr(returned), _MAX_TEXT),
            "unchanged": identical(copy_of(dict(model.named_parameters())), before)}


def judge_raised_first(calls: object, values: list, what: Callable[[object], str],
                       rule: str, first: str) -> None:
    """One rank's calls, as :func:`call_with_bad_argument` recorded them, one per bad value in
    ``values``: each must have raised ValueError and left the model unchanged. ``what(value)``
    names the call; ``rule`` says what the argument must be; ``first`` says what to do first."""
    if not isinstance(calls, list) or len(calls) != len(values):
        raise CheckFailed("the rank's report has the wrong number of calls")
    for call, value in zip(calls, values):
        if observed(call, "value_error", bool) is not True:
            raised = observed(call, "raised", (str, type(None)))
            got = (f"it raised {cut_text(raised, 80)}" if raised else
                   f"it returned {cut_text(observed(call, 'returned_text', str), _MAX_TEXT)}")
            raise CheckFailed(f"{what(value)}: expected ValueError ({rule}), {got}")
        if observed(call, "unchanged", bool) is not True:
            raise CheckFailed(f"{what(value)}: the model changed before the ValueError; {first}")
