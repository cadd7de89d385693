"""Hidden checks for chapter 07's fix_the_loop: 1, 3 and 4 ranks, other batch sizes, step counts,
learning rates and seeds, every check at once (in place, rows, replicas, weights, losses). They
run the visible module's Case (the situations are passed as data), so they run only in the
trusted grader."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.fix_the_loop import ALL_CHECKS, TRAINING

SITUATIONS = {  # world_size: [(rows per rank, steps, lr, seed), ...]
    1: [(5, 3, 0.3, 2), (4, 2, 1.0, 3)],
    3: [(3, 3, 0.5, 4), (2, 4, 0.8, 5)],
    4: [(2, 3, 0.4, 6), (5, 2, 0.5, 7)],
}


def check_train(train) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size, situations in SITUATIONS.items():
        run_student(TRAINING, world_size, train, situations, ALL_CHECKS, hide_internals=True)
