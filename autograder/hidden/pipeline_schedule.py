"""Hidden checks for chapter 11's pipeline_schedule, and the grader's reference schedules.

The reference (:func:`reference_schedule`) is the exercise's answer: it lives only here, where the
sandbox hides it. The judge does not need it (a schedule is judged by its properties, the same for
every correct answer: see ddpcourse.grading.exercises.pipeline_schedule); the tests hold the
lesson's written-out schedules (chapters/11_beyond_ddp/pipeline_schedules.json) to it.
"""

from __future__ import annotations

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.pipeline_schedule import SCHEDULES


def gpipe(num_stages: int, num_microbatches: int) -> list[list[str]]:
    """Every stage: all forwards, then all backwards, each in micro-batch order."""
    return [[f"F{i}" for i in range(num_microbatches)]
            + [f"B{i}" for i in range(num_microbatches)] for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[str]]:
    """Stage s: min(p - 1 - s, m) warm-up forwards, then one forward and one backward in turn,
    then the remaining backwards (PipeDream-Flush, Narayanan et al. 2021)."""
    order = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        steps = [f"F{i}" for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < num_microbatches:
            steps += [f"F{forward}", f"B{backward}"]
            forward, backward = forward + 1, backward + 1
        steps += [f"B{i}" for i in range(backward, num_microbatches)]
        order.append(steps)
    return order


def reference_schedule(num_stages: int, num_microbatches: int, kind: str) -> list[list[str]]:
    return {"gpipe": gpipe, "1f1b": one_f_one_b}[kind](num_stages, num_microbatches)


def _hidden(world_size, fn, cases):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(SCHEDULES, world_size, fn, cases, hide_internals=True)


# Run for real on 1, 2 and 4 ranks: one stage (nothing to send), one micro-batch (the bubble is
# (p-1)/p), fewer micro-batches than stages, many more; the others are judged by their timeline.
HIDDEN_CASES = {
    1: ((1, 1, "gpipe"), (1, 3, "1f1b"), (1, 1, "1f1b"), (5, 1, "gpipe"), (5, 1, "1f1b"),
        (6, 13, "1f1b"), (6, 13, "gpipe"), (8, 3, "1f1b"), (7, 7, "1f1b"),
        (3, 5, "interleaved"), (3, 5, "GPipe"), (3, 5, ""), (0, 4, "gpipe"), (3, 0, "1f1b"),
        (-2, 4, "1f1b")),
    2: ((2, 1, "gpipe"), (2, 1, "1f1b"), (2, 7, "1f1b"), (2, 7, "gpipe")),
    4: ((4, 3, "1f1b"), (4, 3, "gpipe"), (4, 9, "1f1b"), (4, 5, "gpipe")),
}


def check_pipeline_schedule(pipeline_schedule) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, cases in HIDDEN_CASES.items():
        _hidden(world_size, pipeline_schedule, cases)
