"""Hidden checks for ``$slug`` (chapter $number): one rank, three ranks, float64, a tensor of one
element. FILL IN what the hidden cases vary (world sizes 1-4, odd lengths, dtypes, seeds,
forbidden shortcuts).

They reuse the visible module's observation and are judged here with :func:`reference_sum`, the
grader's reference, kept out of the visible module (the ranks import that one, and it ships to
students). tests/test_grading_$slug.py holds every value the visible module writes out to it."""

from __future__ import annotations

import torch

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.$slug import judge_${slug}_with, make_tensor, observe_$slug


def reference_sum(world_size: int, length: int, dtype: str, seed: int) -> torch.Tensor:
    """What every rank must get: the sum of the ranks' inputs, computed here from their generator
    (not from what the ranks report they held)."""
    return torch.stack([make_tensor(rank, length, dtype, seed)
                        for rank in range(world_size)]).sum(0)


def judge_with_the_reference(observations, world_size, cases):
    judge_${slug}_with(
        lambda case, held: reference_sum(world_size, *case), observations, world_size, cases)


JUDGED_BY_THE_REFERENCE = Case(observe_$slug, judge_with_the_reference)

# world size -> (length, dtype, seed) of each case
CASES = {1: [(5, "float32", 2)], 3: [(9, "float64", 3), (1, "float32", 4)]}


def check_$slug($slug) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size, cases in CASES.items():
        run_student(JUDGED_BY_THE_REFERENCE, world_size, $slug, cases, hide_internals=True)
