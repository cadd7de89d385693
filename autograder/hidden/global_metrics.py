"""Hidden checks for chapter 07's ``evaluate``: 1, 3 and 4 ranks, empty data sets, one sample,
fewer samples than ranks (also with a DDP-wrapped model, where calling the wrapper's forward
deadlocks), batches larger than the data set, tensor labels, a model whose modules are not all in
one mode (BatchNorm frozen in eval mode: each module's mode must come back as it was). Every
check runs the visible module's observation (the situations are passed as data), so it runs only in
the trusted grader, and is judged with :func:`reference`, one process evaluating the whole data set:
the grader's reference, kept out of the visible module (the ranks import it).
tests/test_grading_global_metrics.py holds the visible module's written-out values to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpcourse.grading.checks import Case
from ddpcourse.grading.exercises.global_metrics import (MIN_MARGIN, inputs_of,
                                                        judge_evaluate_with, make_data,
                                                        make_model, observe_evaluate,
                                                        run_situations, situation, values_from)


def reference_values(s: dict) -> dict:
    """One process: each sample's loss and correctness, and the totals (see values_from)."""
    x, y = make_data(s["samples"], s["seed"])
    model = make_model(s["seed"]).eval()
    with torch.no_grad():
        logits = model(x)
    per_sample = F.cross_entropy(logits, y, reduction="none")
    if len(x):
        top2 = logits.topk(2, dim=1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        if margin < MIN_MARGIN:
            raise RuntimeError(f"{s}: two logits of a sample are {margin:.2g} apart; argmax could "
                               "flip with the last bits: choose another seed")
    return values_from(per_sample.double().tolist(), (logits.argmax(dim=1) == y).tolist())


def reference(s: dict) -> dict:
    """One process: the data set, the model's initial state, each sample's loss and the totals."""
    return {**inputs_of(s), **reference_values(s)}


def judge_with_reference(observations, world_size, situations):
    judge_evaluate_with(reference_values, observations, world_size, situations)


EVALUATE = Case(observe_evaluate, judge_with_reference)

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
        run_situations(world_size, evaluate, situations, hide_internals=True, case=EVALUATE)
