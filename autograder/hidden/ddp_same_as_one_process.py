"""Hidden checks for chapter 01: 1, 3 and 4 ranks, batches that do not split, another lr and
step count, and a model with a frozen layer and a buffer.

:func:`reference_run` (one process training rank 0's initial model on the whole batch) is the
grader's reference, kept here because it yields the expected weights of any case: the visible
module only has its visible case's digests written out (VISIBLE_WEIGHTS), which
tests/test_grading_ddp_same_as_one_process.py holds to it."""

from __future__ import annotations

import torch
from torch import nn

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.ddp_same_as_one_process import (UNEVEN_BATCH, _state,
                                                                 judge_ddp_with, make_batch,
                                                                 make_model, observe_ddp,
                                                                 rank_model_seed)

CASES = [  # world_size, model, rows, steps, lr, seed
    (3, "tiny", 12, 4, 0.1, 2),
    (4, "tiny", 8, 6, 0.05, 3),
    (1, "tiny", 6, 3, 0.2, 4),
    (2, "frozen_shift", 8, 5, 0.1, 5),
    (4, "frozen_shift", 12, 7, 0.05, 6),
]
NOT_DIVISIBLE = [(2, 7), (4, 6), (3, 8)]  # world_size, rows


def reference_run(kind: str, rows: int, steps: int, lr: float, seed: int) -> dict:
    """One process's final state: rank 0's initial model, the full batch, plain SGD on the
    mean-squared error (without moving the caller's random state)."""
    with torch.random.fork_rng(devices=[]):
        x, y = make_batch(rows, seed)
        model = make_model(kind, rank_model_seed(seed, 0))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        with torch.enable_grad():
            for _ in range(steps):
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
    return _state(model)


def judge_with_reference(observations, world_size, *args):
    """The visible judge, with the reference run's weights."""
    judge_ddp_with(reference_run, observations, world_size, *args)


DDP_TRAINING = Case(observe_ddp, judge_with_reference)


def _hidden(case, world_size, fn, *args):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, *args, hide_internals=True)


def check_train_with_ddp(train_with_ddp) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, kind, rows, steps, lr, seed in CASES:
        _hidden(DDP_TRAINING, world_size, train_with_ddp, kind, rows, steps, lr, seed)
    for world_size, rows in NOT_DIVISIBLE:
        _hidden(UNEVEN_BATCH, world_size, train_with_ddp, rows)
