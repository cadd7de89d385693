"""Hidden checks for chapter 07's ``evaluate``: 1, 3 and 4 ranks, empty data sets, one sample,
fewer samples than ranks (also with a DDP-wrapped model, where calling the wrapper's forward
deadlocks), batches larger than the data set, tensor labels, a model whose modules are not all in
one mode (BatchNorm frozen in eval mode: each module's mode must come back as it was). Every check runs the visible
module's Case (the situations are passed as data), so it runs only in the trusted grader."""

from __future__ import annotations

from ddpcourse.grading.exercises.global_metrics import run_situations, situation

ONE_RANK = [situation(7, 3, seed=11), situation(0, 4, seed=12),
            situation(5, 5, seed=13, mode="eval", ddp=True)]
THREE_RANKS = [situation(2, 1, seed=14, ddp=True), situation(0, 2, seed=15, mode="eval"),
               situation(1, 4, seed=16, labels="tensor")]
FOUR_RANKS = [
    situation(3, 2, seed=17), situation(13, 2, seed=18, labels="tensor"),
    situation(4, 100, seed=19, mode="eval"), situation(1, 1, seed=20), situation(0, 3, seed=21),
    situation(10, 3, seed=22, ddp=True), situation(17, 4, seed=23, mode="eval"),
    situation(9, 4, seed=24, mode="frozen_norm", ddp=True),
]


def check_evaluate(evaluate) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size, situations in [(1, ONE_RANK), (3, THREE_RANKS), (4, FOUR_RANKS)]:
        run_situations(world_size, evaluate, situations, hide_internals=True)
