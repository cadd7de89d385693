"""Hidden checks for chapter 07's train_steps: world sizes 1, 3 and 4; accumulation_steps of 1
and larger than the number of micro-batches; no micro-batches at all; a tail at 3 and 4 ranks;
momentum (a missed zero_grad or an extra step shows in every later step); a cross-entropy loss;
bad accumulation_steps. Every situation runs the visible module's Cases (passed as data), so it
runs only in the trusted grader, with the communication counted by its broker, and is judged
with :func:`reference_run`, the one-process run: the grader's reference, kept out of the visible
module (the ranks import it). tests/test_grading_train_steps.py holds the visible module's
written-out results (VISIBLE_EXPECTED) to it."""

from __future__ import annotations

import torch

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.train_steps import (BAD_STEPS, judge_train_steps_with,
                                                     make_loss_fn, make_model, make_optimizer,
                                                     micro_batches, observe_train_steps,
                                                     rank_seed, run_settings, setting)


def reference_run(s: dict, world_size: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, rank 0's initial model, one optimizer step per group of ``k`` micro-batches
    on every rank's micro-batches of that group, concatenated (a mean loss over all their rows)."""
    model = make_model(rank_seed(s["seed"], 0))
    optimizer = make_optimizer(s, model)
    loss_fn = make_loss_fn(s)
    per_rank = [micro_batches(s, rank) for rank in range(world_size)]
    losses = []
    with torch.enable_grad():
        for start in range(0, s["micro"], s["k"]):
            group = [batch for batches in per_rank for batch in batches[start:start + s["k"]]]
            x = torch.cat([b[0] for b in group])
            y = torch.cat([b[1] for b in group])
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses


def own_gradients_sq(s: dict, world_size: int) -> list[list[float]]:
    """At each optimizer step of the one-process run, each rank's own accumulated gradient's sum
    of squares: the mean loss over its micro-batches of the group, at the run's weights."""
    model = make_model(rank_seed(s["seed"], 0))
    optimizer = make_optimizer(s, model)
    loss_fn = make_loss_fn(s)
    per_rank = [micro_batches(s, rank) for rank in range(world_size)]
    params = list(model.parameters())
    own = []
    with torch.enable_grad():
        for start in range(0, s["micro"], s["k"]):
            groups = [batches[start:start + s["k"]] for batches in per_rank]
            sums = []
            for group in groups:
                loss = sum(loss_fn(model(x), y) for x, y in group) / len(group)
                sums.append(float(sum(g.double().square().sum()
                                      for g in torch.autograd.grad(loss, params))))
            own.append(sums)
            x = torch.cat([b[0] for group in groups for b in group])
            y = torch.cat([b[1] for group in groups for b in group])
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return own


def reference(s: dict, world_size: int):
    """What the judge compares with: one process's weights and losses, each rank's gradients."""
    weights, losses = reference_run(s, world_size)
    return weights, losses, own_gradients_sq(s, world_size)


def judge_with_reference(observations, world_size, s):
    judge_train_steps_with(reference, observations, world_size, s)


TRAIN_STEPS = Case(observe_train_steps, judge_with_reference, audit_traffic=True)

ONE_RANK = [setting(5, 2, seed=11), setting(3, 5, seed=12)]
THREE_RANKS = [setting(7, 3, seed=13, momentum=0.9), setting(4, 1, seed=14, loss="cross_entropy"),
               setting(0, 2, seed=15)]
FOUR_RANKS = [setting(6, 4, rows=2, seed=16, loss="cross_entropy", momentum=0.5),
              setting(2, 8, seed=17)]
BAD_VALUES = [0, -2]


def check_train_steps(train_steps) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, settings in [(1, ONE_RANK), (3, THREE_RANKS), (4, FOUR_RANKS)]:
        run_settings(train_steps, world_size, settings, TRAIN_STEPS, hide_internals=True)
    run_student(BAD_STEPS, 2, train_steps, BAD_VALUES, hide_internals=True)
