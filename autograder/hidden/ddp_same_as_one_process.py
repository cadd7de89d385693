"""Hidden checks for chapter 01: 1, 3 and 4 ranks, batches that do not split, another lr and
step count, and a model with a frozen layer and a buffer."""

from __future__ import annotations

from ddpcourse.grading.exercises.ddp_same_as_one_process import DDP_TRAINING, UNEVEN_BATCH
from ddpcourse.grading.checks import run_student

CASES = [  # world_size, model, rows, steps, lr, seed
    (3, "tiny", 12, 4, 0.1, 2),
    (4, "tiny", 8, 6, 0.05, 3),
    (1, "tiny", 6, 3, 0.2, 4),
    (2, "frozen_shift", 8, 5, 0.1, 5),
    (4, "frozen_shift", 12, 7, 0.05, 6),
]
NOT_DIVISIBLE = [(2, 7), (4, 6), (3, 8)]  # world_size, rows


def _hidden(case, world_size, fn, *args):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, *args, hide_internals=True)


def check_train_with_ddp(train_with_ddp) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, kind, rows, steps, lr, seed in CASES:
        _hidden(DDP_TRAINING, world_size, train_with_ddp, kind, rows, steps, lr, seed)
    for world_size, rows in NOT_DIVISIBLE:
        _hidden(UNEVEN_BATCH, world_size, train_with_ddp, rows)
