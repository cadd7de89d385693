"""Hidden checks for chapter 05's DDP exercises: world sizes 1-4, float64, frozen, unused and
tied parameters, a bucket cap far below one parameter. They judge values and buckets; overlap,
judged by its own visible test, is not judged again (one mistake, one lost test).

:func:`reference_buckets` is the grader's reference bucket planner, kept here because it is the
exercise's answer: the visible checks only have their own cases' plans written out
(``VISIBLE_PLANS``), which tests/test_grading_bucketed_ddp.py holds to it. The hidden cases run
the visible module's ``observe`` and are judged here, with this planner. :func:`one_process` is the
one-process training the visible judge's invariants (the mean of the ranks' own gradients, rank 0's
state moved by them) must agree with: tests/test_grading_bucketed_ddp.py holds them to it."""

from __future__ import annotations

import torch
from torch import nn

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.bucketed_ddp import (BROADCAST, LR, MIB, copy_of, global_batch,
                                                      judge_training, observe_bucketed_training,
                                                      reference_net, state_of)


def one_process(world_size: int, variant: str, dtype: torch.dtype, seed: int, steps: int):
    """Rank 0's model trained by one process on the whole batch: its state before training, every
    step's gradients, and the weights after the last step."""
    single = reference_net(variant, dtype, seed)
    state = copy_of(state_of(single))
    x_all, y_all = global_batch(world_size, dtype, seed)
    optimizer = torch.optim.SGD(single.parameters(), lr=LR)
    grads = []
    with torch.enable_grad():
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(single(x_all), y_all).backward()
            grads.append({name: None if p.grad is None else p.grad.detach().clone()
                          for name, p in single.named_parameters()})
            optimizer.step()
    return state, grads, copy_of(dict(single.named_parameters()))


def reference_buckets(module: nn.Module, bucket_cap_mb: float) -> list[list[str]]:
    """The contract's bucket plan, as parameter names: the trainable parameters in reverse order
    of ``named_parameters()``, packed greedily into buckets of at most ``bucket_cap_mb`` MiB."""
    cap = bucket_cap_mb * MIB
    buckets, current, size = [], [], 0
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:  # a bucket may hold exactly the cap
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def judge_with_reference_plan(observations, world_size, *args):
    """The visible judge, with the bucket plan of :func:`reference_buckets`."""
    judge_training(reference_buckets, observations, world_size, *args)


TRAINING_WITH_REFERENCE_PLAN = Case(observe_bucketed_training, judge_with_reference_plan)


def _hidden(case, world_size, fn, *args):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, *args, hide_internals=True)


def check_broadcast_parameters(broadcast_parameters) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, variant, dtype, seed in [(1, "plain", "float32", 3), (4, "batchnorm",
                                             "float32", 4), (2, "unused", "float64", 5),
                                             (4, "tied", "float64", 6)]:
        _hidden(BROADCAST, world_size, broadcast_parameters, variant, dtype, seed)


def check_bucketed_ddp(BucketedDDP) -> None:
    __tracebackhide__ = True  # noqa: F841
    cases = [  # world size, bucket_cap_mb, variant, dtype, seed
        (1, 0.001, "plain", "float32", 3),
        (3, 0.001, "frozen", "float32", 4),
        (4, 1e-9, "plain", "float32", 5),
        (2, 1e-6, "unused", "float32", 6),
        (2, 0.0015, "unused", "float32", 7),
        (3, 1e-6, "tied", "float32", 8),
        (2, 0.002, "tied", "float64", 9),
    ]
    for world_size, bucket_cap_mb, variant, dtype, seed in cases:
        _hidden(TRAINING_WITH_REFERENCE_PLAN, world_size, BucketedDDP, bucket_cap_mb, variant,
                dtype, seed, 3, "values and buckets")  # overlap has its own visible test
