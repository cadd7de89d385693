"""Hidden checks for chapter 09's wrong_numbers, and the truth of every situation.

Grader-only (the sandbox hides this folder from the student's code): the functions that compute
what a right answer gives, which the visible module must not hold (GRADING_DESIGN.md):
:func:`accuracy_truth` (the samples a model predicts right, and among DistributedSampler's padded
repeats), :func:`epochs_truth` (torch's DistributedSampler order of every rank and epoch, and the
weights of one process training on each step's global batch) and :func:`clipping_truth` (one
process on the same accumulated, clipped steps). The hidden situations: 3 and 4 ranks, data sets
one sample short of and one sample past a multiple of the world size, other batch sizes and
seeds, more epochs, accumulation_steps of 1 and of 3 with a shorter last group, a max_norm no
step reaches, SGD with momentum. They run the visible module's ``observe_*`` and are judged here
with these truths, in the trusted grader, the communication counted by its broker.

``python -m autograder.hidden.wrong_numbers`` prints the visible cases' truths as the visible
module writes them out (``WRITTEN_OUT``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data.distributed import DistributedSampler

from ddpcourse.grading.checks import Case
from ddpcourse.grading.exercises import wrong_numbers as visible
from ddpcourse.grading.exercises.wrong_numbers import (accuracy_situation, clipping_situation,
                                                       epochs_situation)
from ddpcourse.grading.written_out import table_literal

ACCURACY_SITUATIONS = {  # world_size: [...]; sizes k * world_size - 1 and k * world_size + 1
    3: [accuracy_situation(8, 3, seed=2), accuracy_situation(10, 2, seed=3)],
    4: [accuracy_situation(11, 2, seed=4), accuracy_situation(13, 5, seed=5)],
}
EPOCH_SITUATIONS = {
    3: [epochs_situation(8, 2, 3, seed=6), epochs_situation(10, 4, 4, seed=7, lr=0.05)],
    4: [epochs_situation(11, 3, 3, seed=8), epochs_situation(13, 2, 2, seed=9)],
}
CLIPPING_SITUATIONS = {
    3: [clipping_situation(7, 3, 0.3, seed=10, momentum=0.9),
        clipping_situation(4, 1, 0.2, seed=11)],
    4: [clipping_situation(5, 3, 0.25, seed=12, rows=2),
        clipping_situation(6, 2, 100.0, seed=13)],
}


# --- the truths ----------------------------------------------------------------------------------


def accuracy_truth(s: dict, world_size: int) -> dict:
    """The samples the model predicts right, and how many of DistributedSampler's padded
    repeats (the first samples again, up to a multiple of ``world_size``) it predicts right."""
    x, y = visible.make_eval_data(s["samples"], s["seed"])
    with torch.no_grad():
        right = visible.make_classifier(s["seed"])(x).argmax(dim=1) == y
    n = s["samples"]
    padded = math.ceil(n / world_size) * world_size
    repeats = (list(range(n)) * padded)[:padded - n]
    return {"right": int(right.sum()), "right_in_padding": int(right[repeats].sum())}


def sampler_order(samples: int, world_size: int, rank: int, seed: int, epoch: int) -> list[int]:
    """What ``DistributedSampler(dataset, shuffle=True, seed=seed)`` gives ``rank`` in ``epoch``
    after ``set_epoch(epoch)``: torch's own class, run here."""
    sampler = DistributedSampler(range(samples), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def epochs_truth(s: dict, world_size: int) -> dict:
    """``orders[rank][epoch]`` for one epoch more than trained (RuntimeError when two trained
    epochs of a rank would repeat an order: the situation could not tell a missing set_epoch),
    and the weights of one process: rank 0's initial model; at each step, the global batch
    (every rank's batch of that step, concatenated) with the mean loss; plain SGD."""
    orders = [[sampler_order(s["samples"], world_size, rank, s["seed"], epoch)
               for epoch in range(s["epochs"] + 1)] for rank in range(world_size)]
    for rank_orders in orders:
        trained = rank_orders[:s["epochs"]]
        if len({tuple(order) for order in trained}) != len(trained):
            raise RuntimeError(f"situation {s} repeats an order between epochs")
    model = visible.make_regressor(visible.rank_seed(s["seed"], 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    x, y = visible.make_train_data(s["samples"], s["seed"])
    size = s["batch_size"]
    for epoch in range(s["epochs"]):
        for start in range(0, len(orders[0][epoch]), size):
            rows = [i for rank in range(world_size) for i in orders[rank][epoch][start:start + size]]
            optimizer.zero_grad()
            F.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
    return {"orders": orders, "weights": visible._state(model)}


def clipping_truth(s: dict, world_size: int) -> dict:
    """One process, rank 0's initial model: for each group of ``k`` micro-batches (the last may
    be shorter), every rank's micro-batches of the group concatenated, the mean loss, the
    gradient clipped to ``max_norm`` (its norm before clipping kept), one step. The norms, the
    clipped gradients of each step, and the weights at the end."""
    model = visible.make_regressor(visible.rank_seed(s["seed"], 0))
    optimizer = visible.make_optimizer(s, model)
    per_rank = [visible.micro_batches(s, rank) for rank in range(world_size)]
    norms, gradients = [], []
    for start in range(0, s["micro"], s["k"]):
        group = [batch for batches in per_rank for batch in batches[start:start + s["k"]]]
        optimizer.zero_grad()
        F.mse_loss(model(torch.cat([b[0] for b in group])),
                   torch.cat([b[1] for b in group])).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), s["max_norm"]).item())
        gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
    return {"norms": norms, "gradients": gradients, "weights": visible._state(model)}


def judge_accuracy(observations, world_size, situations):
    visible.judge_accuracy_against(accuracy_truth, observations, world_size, situations)


def judge_epochs(observations, world_size, situations):
    visible.judge_epochs_against(epochs_truth, observations, world_size, situations)


def judge_clipped(observations, world_size, s):
    visible.judge_clipped_against(clipping_truth, observations, world_size, s)


ACCURACY = Case(visible.observe_accuracy, judge_accuracy)
EPOCHS = Case(visible.observe_epochs, judge_epochs)
CLIPPED = Case(visible.observe_clipped, judge_clipped, audit_traffic=True)


# --- the hidden checks ---------------------------------------------------------------------------


def check_accuracy(accuracy) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size, situations in ACCURACY_SITUATIONS.items():
        visible.run_lab(ACCURACY, "accuracy", world_size, accuracy, situations,
                        hide_internals=True)


def check_train_epochs(train_epochs) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, situations in EPOCH_SITUATIONS.items():
        visible.run_lab(EPOCHS, "epochs", world_size, train_epochs, situations,
                        hide_internals=True)


def check_train_clipped(train_clipped) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, situations in CLIPPING_SITUATIONS.items():
        visible.run_clipping(CLIPPED, train_clipped, world_size, situations,
                             hide_internals=True)


def check_all(accuracy, train_epochs, train_clipped) -> None:
    """The three labs' hidden situations, one after the other."""
    __tracebackhide__ = True  # noqa: F841
    check_accuracy(accuracy)
    check_train_epochs(train_epochs)
    check_train_clipped(train_clipped)


# --- the visible cases' truths, written out -----------------------------------------------------


def written_out() -> dict[str, dict[str, dict]]:
    """The visible cases' truths as ``visible.WRITTEN_OUT`` holds them: counts and orders as
    they are, each tensor as its :func:`~ddpcourse.grading.exercises.wrong_numbers.digest`."""
    def digests(state: dict) -> dict:
        return {name: visible.digest(tensor) for name, tensor in state.items()}

    out: dict[str, dict[str, dict]] = {"accuracy": {}, "epochs": {}, "clipped": {}}
    for s in visible.VISIBLE_ACCURACY:
        out["accuracy"][visible.situation_key(s, 2)] = accuracy_truth(s, 2)
    for s in visible.VISIBLE_EPOCHS:
        truth = epochs_truth(s, 2)
        out["epochs"][visible.situation_key(s, 2)] = {"orders": truth["orders"],
                                                      "weights": digests(truth["weights"])}
    for s in visible.VISIBLE_CLIPPING:
        truth = clipping_truth(s, 2)
        out["clipped"][visible.situation_key(s, 2)] = {
            "norms": truth["norms"], "gradients": [digests(g) for g in truth["gradients"]],
            "weights": digests(truth["weights"])}
    return out


if __name__ == "__main__":
    print(table_literal(written_out()))
