"""Hidden checks for chapter 11's build_2d_groups: 1, 2 and 4 ranks, every tp_size, and sizes
that must be refused; judged with the grader's reference grid (the exercise's answer, here only)."""

from __future__ import annotations

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.build_2d_groups import REFUSAL, judge_against, observe_groups


def reference_grid(world_size: int, tp_size: int) -> dict[str, list[list[int]]]:
    """Each rank's members of its dp and tp groups: tp groups of contiguous ranks, dp groups of
    the ranks at the same position in each tp group."""
    return {"tp": [list(range(r - r % tp_size, r - r % tp_size + tp_size))
                   for r in range(world_size)],
            "dp": [list(range(r % tp_size, world_size, tp_size)) for r in range(world_size)]}


def judge_with_reference(observations, world_size, tp_size):
    judge_against(observations, world_size, tp_size, reference_grid(world_size, tp_size))


GROUPS = Case(observe_groups, judge_with_reference)
HIDDEN_CASES = [(GROUPS, 1, 1), (GROUPS, 2, 1), (GROUPS, 2, 2), (GROUPS, 4, 1), (GROUPS, 4, 4),
                (REFUSAL, 4, 3), (REFUSAL, 2, 0), (REFUSAL, 4, 8)]


def check_build_2d_groups(build_2d_groups) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for case, world_size, tp_size in HIDDEN_CASES:
        run_student(case, world_size, build_2d_groups, tp_size, hide_internals=True)
