"""Chapter $number ($topic): visible checks for ``$slug``. FILL IN: what they catch.

The contract is the docstring of ``$slug`` in solutions/$assignment/$slug.nb.py (students:
exercises/$assignment/$slug.ipynb).

Each check is a :class:`~ddpcourse.grading.checks.Case`. In every rank, :func:`observe_$slug`
builds the rank's input, calls the student's function and reports, as plain data, what it saw;
the judge compares, in the grader's process when a class is graded. The ranks import this module
and it ships to students, so it holds no reference answer: :func:`judge_$slug` uses only an
invariant of the observations (every rank got the sum of what the ranks held before the call).
The hidden checks (autograder/hidden/$slug.py) judge their cases with the grader's reference,
through :func:`judge_${slug}_with`.
"""

from __future__ import annotations

import torch

from ddpcourse.grading.checks import (Case, CheckFailed, cut_text, expect_close, judge_each_rank,
                                      observed, reported_calls, run_student, safe_text, type_name)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
MAX_TEXT = 500  # characters of any text a rank reports


def make_tensor(rank: int, length: int, dtype: str, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input in a case ``(length, dtype, seed)``, the same on every run.
    (A rank can compute the other ranks' inputs with it too: where that would let a student skip
    the communication the exercise is about, draw each rank's input from a salt it keeps to
    itself, as chapter 05 does.)"""
    generator = torch.Generator().manual_seed(1_000 * seed + rank)
    return torch.randn(length, generator=generator).to(getattr(torch, dtype))


# --- in the rank: what the call gave, as data --------------------------------------------------


def observe_$slug(rank, world_size, $slug, cases):
    """Each case ``(length, dtype, seed)``: this rank's input before the call, whether the call
    left it unchanged, and what came back (a tensor, or the type and text of what else it was)."""
    calls = []
    for length, dtype, seed in cases:
        tensor = make_tensor(rank, length, dtype, seed)
        held = tensor.clone()
        got = $slug(tensor)
        returned = type(got) is torch.Tensor
        calls.append({"held": held, "unchanged": bool(torch.equal(tensor, held)),
                      "result": got.detach().cpu().clone() if returned else None,
                      "type": type_name(got),
                      "text": "" if returned else safe_text(lambda: repr(got), MAX_TEXT)})
    return {"calls": calls}


# --- in the judge: the reports are untrusted data ----------------------------------------------


def _reported_tensor(call, key: str, length: int, dtype: str, what: str) -> torch.Tensor | None:
    """``call[key]``: None, or a dense CPU tensor of ``length`` elements of ``dtype``."""
    value = observed(call, key, (torch.Tensor, type(None)))
    if value is not None and (value.layout != torch.strided or value.device.type != "cpu"
                              or tuple(value.shape) != (length,)
                              or value.dtype != getattr(torch, dtype)):
        raise CheckFailed(f"{what}: expected a {dtype} tensor of shape ({length},), got a "
                          f"{value.dtype} tensor of shape {tuple(value.shape)}")
    return value


def _held(call, length: int, dtype: str, what: str) -> torch.Tensor:
    held = _reported_tensor(call, "held", length, dtype, what)
    if held is None:
        raise CheckFailed("the rank's report lacks its input (did the code replace the check's "
                          "own functions?)")
    return held


def _judge_call(call, want: torch.Tensor, length: int, dtype: str, what: str) -> None:
    got = _reported_tensor(call, "result", length, dtype, what)
    if got is None:
        raise CheckFailed(f"{what}: expected a tensor, got "
                          f"{cut_text(observed(call, 'type', str), 100)}: "
                          f"{cut_text(observed(call, 'text', str), MAX_TEXT)}")
    if not observed(call, "unchanged", bool):
        raise CheckFailed(f"{what}: the tensor passed in was changed; leave it as it was and "
                          "return a new one")
    expect_close(got, want, what)


def judge_$slug(observations, world_size, cases):
    """The visible cases: every rank must get the sum of what the ranks held before the call."""
    judge_${slug}_with(
        lambda case, held: torch.stack(held).sum(0), observations, world_size, cases)


def judge_${slug}_with(expected, observations, world_size, cases):
    """Case by case, in order; the first case that fails is reported, on every rank where it
    failed. ``expected(case, held)`` is the sum every rank must get in ``case``, given every
    rank's reported input ``held``."""
    reports: list = []
    judge_each_rank(observations, lambda rank, observation: reports.append(
        reported_calls(observation, len(cases))))
    for number, case in enumerate(cases):
        length, dtype, _ = case
        what = f"{world_size} ranks, a {dtype} tensor of {length} elements"
        calls = [report[number] for report in reports]
        held: list = []
        judge_each_rank(calls, lambda rank, call: held.append(_held(call, length, dtype, what)))
        want = expected(case, held)
        judge_each_rank(calls, lambda rank, call: _judge_call(call, want, length, dtype, what))


SUMMED = Case(observe_$slug, judge_$slug)

# (length, dtype, seed) of each visible case
VISIBLE_CASES = [(4, "float32", 0), (7, "float32", 1)]


def check_${slug}_two_ranks($slug) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(SUMMED, 2, $slug, VISIBLE_CASES)
