"""Hidden checks for chapter 10's tune_this_job, and the grader's reference run (the slow job's
numerics: one process training rank 0's initial model on every rank's micro-batches). It lives
only here: the visible checks have their cases' final weights written out as digests
(``VISIBLE_DIGESTS``), which tests/test_grading_tune_this_job.py holds to :func:`reference_run`.

Hidden situations: one rank, also with no micro-batches at all; 3 ranks and a short last group,
and 4 ranks with a frozen bias and ``accumulation_steps`` larger than the number of
micro-batches, both with data drawn from seeds each rank picks at random (so no rank can rebuild
another's micro-batches: the gradients must travel).
Every situation runs the visible module's ``observe_job``, audited, so when a class is graded
the communication is counted by the grader's broker. Then ``BAD_STEPS`` on 2 ranks:
``accumulation_steps`` 0 and -2 must raise ValueError before the model changes or anything is
sent.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpcourse.grading.checks import Case, expect_close, run_student
from ddpcourse.grading.exercises.tune_this_job import (ATOL, BAD_STEPS, RTOL, initial_model,
                                                       judge_job, micro_batches, observe_job,
                                                       run_settings, setting)


def reference_run(s: dict, world_size: int, data_seeds: list[int]) -> dict[str, torch.Tensor]:
    """What the slow job computes, in one process: for each group of ``k`` micro-batches (the last
    one shorter), one SGD step on the mean loss over the group's micro-batches of every rank
    (they have the same number of rows, so: the rows concatenated)."""
    model = initial_model(s, 0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=s["lr"])
    per_rank = [micro_batches(s, seed) for seed in data_seeds[:world_size]]
    for start in range(0, s["micro"], s["k"]):
        group = [batch for batches in per_rank for batch in batches[start:start + s["k"]]]
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def expect_reference(weights: dict, s: dict, world_size: int, seeds: list, what: str) -> None:
    for name, expected in reference_run(s, world_size, seeds).items():
        expect_close(weights[name], expected, f"{what}: parameter {name!r} after training, "
                     "compared with the slow job's numerics", RTOL, ATOL)


def judge_with_reference(observations, world_size, s) -> None:
    """The visible judge, with every weight compared with :func:`reference_run`."""
    judge_job(expect_reference, observations, world_size, s)


JOB_WITH_REFERENCE = Case(observe_job, judge_with_reference, audit_traffic=True)

HIDDEN = [
    (1, [setting(5, 2, seed=11), setting(0, 2, seed=14)]),
    (3, [setting(7, 3, seed=None, lr=0.2)]),
    (4, [setting(2, 5, rows=3, seed=None, variant="frozen")]),
]
BAD_VALUES = [0, -2]


def check_tune_this_job(tune_this_job) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, settings in HIDDEN:
        run_settings(JOB_WITH_REFERENCE, tune_this_job, world_size, settings,
                     hide_internals=True)
    run_student(BAD_STEPS, 2, tune_this_job, BAD_VALUES, hide_internals=True)
