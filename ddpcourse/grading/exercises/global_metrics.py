"""Chapter 07, the training loop: visible checks for ``evaluate``, and the case the hidden checks
reuse.

The contract is the docstring of ``evaluate`` in solutions/07_training_loop/global_metrics.nb.py
(students: exercises/07_training_loop/global_metrics.ipynb). It runs on every rank of a gloo group:
each rank gets the same model (same seed) and the same data set, evaluates only its own share, and
every rank must return the metrics of the WHOLE data set.

Each check is one :class:`~ddpcourse.grading.checks.Case` over a list of situations (sample count,
batch size, the mode the model is in, a DDP wrapper or not, how labels come). In every rank, around
each call, the rank only records: the input of every forward of the model (a forward pre-hook, as
in ddp_same_as_one_process), whether the model was in training mode and gradients were on at that
moment, how often the DDP wrapper's own forward ran, what the call returned (its keys, each value's
type, the number), and the model afterwards (its modes, its parameters and buffers, which
parameters have a ``.grad``). Two mistakes stop the call at once, from those pre-hooks: a forward
in training mode and a forward of the DDP wrapper (see :class:`StoppedByTheCheck`). Then every rank
waits for every other at a barrier of the check's own group, so each situation ends before the next
begins and a rank that skipped a collective shows up as a deadlock in that situation, not as
garbage in the next.

The judge never runs the student's code. It rebuilds the model and the data set (the inputs), takes
one process's values (logits of all samples in one forward, per-sample cross-entropy in float32,
summed in float64) and decides, situation by situation, in this order: each forward ran on rows of the data
set, in eval mode, without gradients, through the module (not the wrapper), in batches of at most
``batch_size``; no rank evaluated more than ``ceil(n / world_size)`` samples; together the ranks
evaluated every sample exactly once; the model is as it was handed in (modes, parameters and
buffers bit for bit, no ``.grad``); the result is a dict of Python numbers; every rank returned the
same; and these equal the one-process values: ``count`` exactly, ``accuracy`` to ``ACCURACY_ATOL``,
``loss`` to ``LOSS_ATOL + LOSS_RTOL * |loss|``.

Why these tolerances. ``accuracy`` is a ratio of counts: neighbouring counts differ by ``1 / n``,
at least ``1 / 17`` here, while float32 division of the right counts is off by at most ~6e-8, so
``1e-7`` accepts float32 and float64 arithmetic and nothing else. The loss is a sum of float32
per-sample losses added in another order (per batch, per rank, then across ranks) than the judge
adds them, and a row's logits may differ in the last bits between batch sizes. Measured over every
situation of these checks, with strided and contiguous shares and float32 accumulation throughout,
the largest difference is 1.1% of the allowed ``1e-6 + 1e-5 * |loss|``; the smallest wrong answer
the checks look for, the mean of the ranks' mean losses, is off by at least 386 times the allowance
wherever the shares are uneven (tests/test_grading_global_metrics.py asserts below 5% and above 100
times). The judge also refuses (RuntimeError, a course bug) a situation whose top-2 logits of some
sample are closer than ``MIN_MARGIN``, where argmax could flip with the last bits.

This module holds no evaluation of the model (the ranks import it, and it is the answer): each
visible situation's per-sample losses and correctness are written out (:data:`VISIBLE_VALUES`),
held by tests/test_grading_global_metrics.py to the one-process reference of the hidden checks
(autograder/hidden/global_metrics.py), which judge their own situations with it.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, Case, CheckFailed, cut_text,
                                      judge_each_rank, observed, reported_calls, run_student,
                                      safe_text, type_name)
from ddpcourse.grading.left_unchanged import judge_left_unchanged

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel

FEATURES, HIDDEN, CLASSES = 6, 16, 4
LOSS_ATOL, LOSS_RTOL = 1e-6, 1e-5
ACCURACY_ATOL = 1e-7
MIN_MARGIN = 1e-4  # between a sample's two largest logits, in the judge's own data
RESULT_KEYS = ("loss", "accuracy", "count")
MAX_FORWARDS = 128  # recorded per rank and situation; more is reported by its count only
MAX_ROWS = 256  # of one recorded forward input
MAX_TEXT = 300  # characters of any text a rank reports, in a message


# --- the model and the data: built the same way in every rank and in the judge ----------------


class ModeSensitiveClassifier(nn.Module):
    """A small classifier (logits of ``CLASSES`` classes) whose output depends on its mode: in
    training mode Dropout zeroes random features and BatchNorm normalises with the batch's own
    statistics (and moves its running ones); in eval mode it is a fixed function of each row."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                                  nn.Dropout(0.3))
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(seed: int) -> ModeSensitiveClassifier:
    """The same weights and BatchNorm statistics for a seed, whatever the global random state."""
    generator = torch.Generator().manual_seed(seed)
    model = ModeSensitiveClassifier()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(0.6 * torch.randn(parameter.shape, generator=generator))
        norm = model.body[1]
        norm.running_mean.copy_(0.5 * torch.randn(HIDDEN, generator=generator))
        norm.running_var.copy_(0.5 + torch.rand(HIDDEN, generator=generator))
        norm.num_batches_tracked.fill_(10)
    return model


def make_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows, and labels that the model of the same seed gets right about 70% of the time (its
    own prediction for 60% of the rows, a random class for the rest)."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(samples, FEATURES, generator=generator)
    with torch.no_grad():
        predicted = make_model(seed).eval()(x).argmax(dim=1)
    guessed = torch.randint(0, CLASSES, (samples,), generator=generator)
    y = torch.where(torch.rand(samples, generator=generator) < 0.6, predicted, guessed)
    return x, y


class LabelledRows(Dataset):
    """A map-style data set: ``dataset[i]`` is ``(x_i, y_i)``, ``x_i`` a float32 row of
    ``FEATURES`` values, ``y_i`` a class label, a Python int or (``labels="tensor"``) a 0-d int64
    tensor, as ``TensorDataset`` gives."""

    def __init__(self, samples: int, seed: int, labels: str = "int"):
        self.x, self.y = make_data(samples, seed)
        self.labels = labels

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        i = operator.index(index)
        label = self.y[i] if self.labels == "tensor" else int(self.y[i])
        return self.x[i], label


def situation(samples: int, batch_size: int, seed: int = 0, mode: str = "train",
              ddp: bool = False, labels: str = "int") -> dict:
    """One call of ``evaluate``: ``mode`` is the mode the model is handed in ("train", "eval",
    or "frozen_norm": training mode with its BatchNorm in eval mode, as when fine-tuning with
    frozen statistics); ``ddp``: the model is handed in wrapped in DistributedDataParallel."""
    return {"samples": samples, "batch_size": batch_size, "seed": seed, "mode": mode, "ddp": ddp,
            "labels": labels}


def describe(s: dict, world_size: int) -> str:
    model = "a DDP-wrapped model" if s["ddp"] else "a model"
    labels = ", labels as 0-d tensors" if s["labels"] == "tensor" else ""
    mode = ("train mode with its BatchNorm in eval mode" if s["mode"] == "frozen_norm"
            else f"{s['mode']} mode")
    return (f"evaluate({model} in {mode}, {s['samples']} samples{labels}, "
            f"batch_size={s['batch_size']}) on {world_size} rank{'s' * (world_size > 1)}")


def share_bound(samples: int, world_size: int) -> int:
    """The most samples one rank may evaluate: an even split, as DistributedSampler's shares."""
    return math.ceil(samples / world_size)


# --- in the ranks: record only ------------------------------------------------------------------


def _recorded_input(args: tuple) -> torch.Tensor | str:
    first = args[0] if args else None
    if (isinstance(first, torch.Tensor) and first.layout == torch.strided and first.dim() >= 1
            and first.shape[0] <= MAX_ROWS and first.numel() <= 64 * MAX_ROWS):
        return first.detach().to("cpu").clone()
    if isinstance(first, torch.Tensor):
        return f"a tensor of shape {tuple(first.shape)}"
    return type_name(first)


def _described_value(value: Any) -> dict:
    number = value if type(value) in (int, float) else None
    return {"type": type_name(value), "number": number,
            "text": safe_text(lambda: repr(value)[:120], MAX_TEXT)}


def _described_result(result: Any) -> dict:
    """What came back, as data: never the student's object itself."""
    if not isinstance(result, dict):
        return {"type": type_name(result), "keys": None, "values": None,
                "text": safe_text(lambda: repr(result)[:200], MAX_TEXT)}
    keys = [safe_text(lambda k=k: repr(k), 100) for k in list(result)[:10]]
    values = {key: _described_value(result[key]) for key in RESULT_KEYS if key in result}
    return {"type": "dict", "keys": keys, "values": values, "text": ""}


def _build(rank: int, s: dict):
    model = make_model(s["seed"])
    handed_in = model
    if s["ddp"]:
        from torch.nn.parallel import DistributedDataParallel

        handed_in = DistributedDataParallel(model)  # a collective: every rank builds it
    handed_in.train(s["mode"] != "eval")  # the wrapper and every module of the model alike
    if s["mode"] == "frozen_norm":
        model.body[1].eval()
    return model, handed_in, LabelledRows(s["samples"], s["seed"], s["labels"])


def modes_handed_in(s: dict) -> list[bool]:
    """The ``training`` flag of every module handed in (the wrapper first, where there is one),
    in ``modules()`` order, as :func:`_build` sets them; built without a process group."""
    model = make_model(s["seed"]).train(s["mode"] != "eval")
    if s["mode"] == "frozen_norm":
        model.body[1].eval()
    return [s["mode"] != "eval"] * s["ddp"] + [m.training for m in model.modules()]


class StoppedByTheCheck(RuntimeError):
    """Raised by the check's forward pre-hooks in a rank, inside the student's call. Not a
    CheckFailed: run_student turns that into a value the rank returns, and a rank that returns
    waits for its peers, which may be waiting in the student's all_reduce for a rank that has
    no samples. An exception ends the rank, and the launcher stops the others at once."""


def observe_call(rank: int, world_size: int, evaluate, s: dict) -> dict:
    """One call, recorded. Two mistakes stop the call at once, in the forward pre-hooks, with the
    judge's words: a forward in training mode (BatchNorm would raise on a batch of one, or the
    run would go on to a wrong verdict) and a forward of the DDP wrapper (its buffer broadcast
    would deadlock when a rank has no samples). The records still say it, should the student's
    code swallow the exception."""
    model, handed_in, dataset = _build(rank, s)
    what = describe(s, world_size)
    forwards: list[dict] = []
    calls = [0, 0]  # the module's forwards, the wrapper's

    def record(module, args):
        calls[0] += 1
        training = sum(m.training for m in module.modules())
        if len(forwards) < MAX_FORWARDS:
            forwards.append({"rows": _recorded_input(args), "training_modules": training,
                             "grad_enabled": torch.is_grad_enabled()})
        if training:
            raise StoppedByTheCheck(training_mode_message(what, len(forwards) - 1))

    def count_wrapper(module, args):
        calls[1] += 1
        raise StoppedByTheCheck(wrapper_message(what, calls[1]))

    hooks = [model.register_forward_pre_hook(record)]
    if handed_in is not model:
        hooks.append(handed_in.register_forward_pre_hook(count_wrapper))
    try:
        result = evaluate(handed_in, dataset, s["batch_size"])
    finally:
        for hook in hooks:
            hook.remove()
        grad_enabled_after = torch.is_grad_enabled()
        torch.set_grad_enabled(True)  # as every call finds it, whatever the last one left
    return {
        "grad_enabled_after": grad_enabled_after,
        "forward_calls": calls[0], "wrapper_forward_calls": calls[1], "forwards": forwards,
        "result": _described_result(result),
        "modes": [m.training for m in handed_in.modules()],
        "state": {name: t.detach().clone() for name, t in model.state_dict().items()},
        "with_grad": [name for name, p in model.named_parameters() if p.grad is not None],
        "frozen": [name for name, p in model.named_parameters() if not p.requires_grad],
    }


def wait_for_every_rank_to_return_from_evaluate(group) -> None:
    """The check's own barrier, on its own group: a rank stuck here while a peer is stuck in one
    of the student's collectives means the ranks did not call the same collectives."""
    dist.barrier(group=group)


def observe_evaluate(rank: int, world_size: int, evaluate, situations: list) -> dict:
    finish_line = dist.new_group()  # never mixes with the student's collectives on the default
    calls = []
    for s in situations:
        calls.append(observe_call(rank, world_size, evaluate, s))
        wait_for_every_rank_to_return_from_evaluate(finish_line)
    return {"calls": calls}


# --- in the judge: the inputs rebuilt, the expected values written out ----------------------------


def situation_key(s: dict) -> tuple:
    """How :data:`VISIBLE_VALUES` names a situation (the values depend on the samples and the
    seed only)."""
    return (s["samples"], s["seed"])


# One process's per-sample cross-entropy (float32 values, written exactly) and whether argmax is
# the label, for every situation with samples that the visible checks run, keyed by
# :func:`situation_key`. Held to the hidden checks' reference by
# tests/test_grading_global_metrics.py.
VISIBLE_VALUES: dict[tuple[int, int], tuple[list[float], list[bool]]] = {
    (11, 1): ([0.0240537729114, 10.8366794586, 0.0285847187042, 0.276596546173, 0.101223349571,
        0.632728278637, 1.39297389984, 0.629918813705, 11.875869751, 0.495650976896,
        0.533444285393],
        [True, False, True, True, True, True, False, True, False, True, True]),
    (8, 2): ([0.639137268066, 0.757886588573, 0.901887178421, 0.966438472271, 2.99182033539,
        0.285788714886, 0.434122204781, 0.928901970387],
        [True, True, True, True, False, True, True, True]),
    (10, 3): ([0.277222394943, 0.246281534433, 0.509566545486, 1.89689552784, 0.645969390869,
        0.496824473143, 4.19817018509, 0.677766561508, 0.6613509655, 0.697465598583],
        [True, True, True, False, True, True, False, True, True, True]),
    (14, 4): ([2.37532281876, 0.568562924862, 1.27646505833, 2.80718970299, 0.607265472412,
        0.358449965715, 0.850395619869, 0.1448802948, 2.17169094086, 0.505725204945,
        0.421575248241, 0.755367457867, 1.43471086025, 0.737759888172],
        [False, True, False, False, True, True, True, True, False, True, True, True, False, True]),
    (5, 5): ([0.724871575832, 1.41489481926, 0.0686411932111, 0.458442628384, 6.47220659256],
        [True, False, True, True, False]),
    (7, 6): ([1.73258364201, 0.712171256542, 1.68712353706, 1.30927348137, 1.00235629082,
        1.31017684937, 3.72858548164],
        [False, True, False, False, True, False, False]),
    (2, 7): ([0.270780026913, 0.875556468964],
        [True, True]),
    (13, 8): ([1.15908896923, 0.0627142339945, 0.582562565804, 0.852516055107, 1.37364900112,
        0.970506250858, 3.6789457798, 0.820835232735, 0.372237682343, 2.36874055862,
        0.513501167297, 0.427207767963, 2.78076934814],
        [False, True, True, True, False, False, False, True, True, False, True, True, False]),
    (10, 9): ([2.65400481224, 0.220647722483, 7.81071281433, 0.525921285152, 0.45078381896,
        0.718329846859, 0.550609707832, 0.924046278, 3.82923793793, 0.0121915396303],
        [False, True, False, True, True, True, True, True, False, True]),
    (7, 10): ([6.38762760162, 10.9098081589, 0.345322132111, 0.378302454948, 11.4994440079,
        4.92133665085, 4.15725898743],
        [False, False, True, True, False, False, False]),
}


def values_from(per_sample_losses: list[float], correct_each: list[bool]) -> dict:
    """The totals a judge compares with, from each sample's loss and correctness."""
    losses = torch.tensor(per_sample_losses, dtype=torch.float64)
    correct = torch.tensor(correct_each, dtype=torch.bool)
    n = len(per_sample_losses)
    right = int(correct.sum())
    return {"losses": losses, "correct_each": correct, "count": n, "correct": right,
            "loss": losses.sum().item() / n if n else math.nan,
            "accuracy": right / n if n else math.nan}


def written_out_values(s: dict) -> dict:
    """A visible situation's values, from :data:`VISIBLE_VALUES` (an empty data set has none)."""
    if s["samples"] == 0:
        return values_from([], [])
    key = situation_key(s)
    if key not in VISIBLE_VALUES:
        raise LookupError(f"grader bug: no written-out values for {key} (samples, seed): add "
                          "them to VISIBLE_VALUES, or judge the situation with the hidden checks")
    losses, correct_each = VISIBLE_VALUES[key]
    return values_from(list(losses), list(correct_each))


def inputs_of(s: dict) -> dict:
    """What the judge rebuilds itself: the data set's rows and the model's initial state."""
    x, _ = make_data(s["samples"], s["seed"])
    return {"x": x, "state": {k: v.clone() for k, v in make_model(s["seed"]).state_dict().items()}}


def _text(value: Any) -> str:
    return cut_text(value, MAX_TEXT)


def _row_indices(x: torch.Tensor, seen: torch.Tensor) -> list[int]:
    """Index in x of each row of ``seen`` (-1 for a row that is not one of x's)."""
    if seen.dim() != 2 or seen.shape[1] != FEATURES or seen.dtype != x.dtype:
        return [-1] * (seen.shape[0] if seen.dim() else 1)
    if len(x) == 0:
        return [-1] * seen.shape[0]
    matches = (seen[:, None, :] == x[None, :, :]).all(dim=2)
    return [int(m.nonzero()[0]) if m.any() else -1 for m in matches]


def training_mode_message(what: str, number: int) -> str:
    return (f"{what}: forward {number} ran with the model in training mode (Dropout drops random "
            "features, BatchNorm uses the batch's statistics and moves its running ones): call "
            "model.eval() before evaluating, and restore the mode afterwards")


def wrapper_message(what: str, calls: int) -> str:
    return (f"{what}: the DistributedDataParallel wrapper's forward ran ({calls} call"
            f"{'s' * (calls > 1)}); evaluate `model.module`. The wrapper's forward is a "
            "collective: the first one after training broadcasts rank 0's buffers, so a rank "
            "that runs fewer forwards than its peers (one with fewer or no samples) leaves them "
            "waiting forever")


def _judge_forwards(call, ref: dict, s: dict, world_size: int, what: str) -> list[list[int]]:
    """This rank's batches, as data set indices, after checking how each forward ran."""
    wrapper_calls = observed(call, "wrapper_forward_calls", int)
    if wrapper_calls:
        raise CheckFailed(wrapper_message(what, wrapper_calls))
    calls = observed(call, "forward_calls", int)
    forwards = observed(call, "forwards", list)
    if calls > MAX_FORWARDS:
        raise CheckFailed(f"{what}: the model's forward ran {calls} times on this rank; with "
                          f"batches of {s['batch_size']}, its share needs at most "
                          f"{share_bound(ref['count'], world_size)}")
    if len(forwards) != calls:
        raise CheckFailed(f"{what}: the rank's report has {len(forwards)} forward inputs, not "
                          f"{calls}")
    batches = []
    for number, forward in enumerate(forwards):
        if not isinstance(forward, dict):
            raise CheckFailed(f"{what}: the rank's report of forward {number} is not a dict")
        if observed(forward, "training_modules", int):
            raise CheckFailed(training_mode_message(what, number))
        if observed(forward, "grad_enabled", bool):
            raise CheckFailed(
                f"{what}: forward {number} ran with gradients enabled: wrap the evaluation in "
                "`with torch.no_grad():` (or torch.inference_mode()), else autograd keeps every "
                "activation and the returned loss is part of a graph")
        rows = observed(forward, "rows", (torch.Tensor, str))
        if (not isinstance(rows, torch.Tensor) or rows.layout != torch.strided
                or rows.dim() == 0 or rows.shape[0] > MAX_ROWS):
            shown = (_text(rows) if not isinstance(rows, torch.Tensor)
                     else f"a tensor of shape {tuple(rows.shape)}")
            raise CheckFailed(f"{what}: forward {number} got {shown}, not rows of the data set "
                              "(pass the samples' x, stacked as they are)")
        indices = _row_indices(ref["x"], rows)
        if -1 in indices:
            raise CheckFailed(f"{what}: forward {number} got a row that is not a sample of the "
                              "data set (pass the samples' x as they are, stacked: float32)")
        if len(indices) > s["batch_size"]:
            raise CheckFailed(f"{what}: forward {number} got {len(indices)} samples; batches "
                              f"hold at most batch_size = {s['batch_size']}")
        batches.append(indices)
    evaluated = sum(map(len, batches))
    bound = share_bound(ref["count"], world_size)
    if evaluated > bound:
        hint = (" - this rank evaluated the whole data set: each rank must evaluate only its "
                "own share, then combine sums and counts with all_reduce"
                if evaluated >= ref["count"] and world_size > 1 else
                ": split the samples evenly, e.g. indices range(rank, n, world_size)")
        raise CheckFailed(f"{what}: this rank evaluated {evaluated} samples; its share is at most "
                          f"ceil({ref['count']} / {world_size}) = {bound}{hint}")
    return batches


def _judge_together(batches_by_rank: list, ref: dict, world_size: int, what: str) -> None:
    counts = Counter(i for batches in batches_by_rank for batch in batches for i in batch)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(ref["count"])) - set(counts))
    if not twice and not missing:
        return
    total = sum(counts.values())
    padded = total == share_bound(ref["count"], world_size) * world_size and twice
    hint = (" - that is DistributedSampler's padding (it repeats samples so every rank gets "
            "ceil(n / world_size)): evaluate each sample once, e.g. indices "
            "range(rank, n, world_size)" if padded else "")
    ranks_of = {i: [r for r, batches in enumerate(batches_by_rank)
                    if any(i in batch for batch in batches)] for i in twice[:5]}
    raise CheckFailed(
        f"{what}: together the ranks must evaluate every sample exactly once; they evaluated "
        f"{total} samples of {ref['count']}: samples {twice[:10]} more than once (on ranks "
        f"{ranks_of}), samples {missing[:10]} never{hint}")


def _judge_model_after(call, ref: dict, s: dict, what: str) -> None:
    grad_after = observed(call, "grad_enabled_after", bool)
    if not grad_after:
        raise CheckFailed(
            f"{what}: after the call, gradients are disabled (torch.is_grad_enabled() is False): "
            "the training loop that called evaluate would go on without autograd. Disable them "
            "only inside the call: `with torch.no_grad():` (or torch.inference_mode()), not "
            "torch.set_grad_enabled(False) left as it is")
    modes = observed(call, "modes", list)
    training = s["mode"] != "eval"
    if not modes or not all(type(m) is bool for m in modes):
        raise CheckFailed("the rank's report has 'modes' that are not a list of bools")
    want = modes_handed_in(s)
    if s["mode"] == "frozen_norm" and modes != want and any(modes) and len(modes) == len(want):
        raise CheckFailed(
            f"{what}: the model came back with {sum(m != w for m, w in zip(modes, want))} "
            "module(s) in another mode than they were handed in (here its BatchNorm, frozen in "
            "eval mode, came back in training mode): model.train(was_training) sets every "
            "module alike; remember and restore each module's own mode (model.modules())")
    if modes != want:
        if training:
            raise CheckFailed(
                f"{what}: the model was handed in in training mode and came back "
                f"{'in eval mode' if not any(modes) else 'partly in eval mode'}: restore the mode "
                "it had (was_training = model.training; ...; model.train(was_training)), or the "
                "training loop goes on without Dropout and with frozen BatchNorm statistics")
        raise CheckFailed(
            f"{what}: the model was handed in in eval mode and came back in training mode: "
            "restore the mode it had (model.train(was_training)), not always training mode")
    judge_left_unchanged(observed(call, "state", dict), ref["state"], what, "the model's",
                         "parameters and buffers", "evaluation must leave parameters and buffers "
                         "exactly as they were")
    with_grad = observed(call, "with_grad", list)
    if with_grad:
        raise CheckFailed(f"{what}: after the call, parameters {_text(with_grad[:5])} have a "
                          ".grad: evaluation computes no gradients (torch.no_grad(), no "
                          "backward)")
    if observed(call, "frozen", list):
        raise CheckFailed(f"{what}: after the call, some parameters no longer require grad: "
                          "leave requires_grad as it was (torch.no_grad() is all you need)")


def _reported_result(call, what: str) -> tuple[float, float, int]:
    result = observed(call, "result", dict)
    kind = observed(result, "type", str)
    if kind != "dict":
        raise CheckFailed(f"{what}: expected a dict with keys {list(RESULT_KEYS)}, got "
                          f"{_text(kind)}: {_text(observed(result, 'text', str))}")
    keys = observed(result, "keys", list)
    values = observed(result, "values", dict)
    if sorted(keys, key=str) != sorted(repr(k) for k in RESULT_KEYS):
        raise CheckFailed(f"{what}: expected a dict with exactly the keys "
                          f"{list(RESULT_KEYS)}, got keys {_text(keys)}")
    numbers = []
    for key, kinds in zip(RESULT_KEYS, (float, float, int)):
        value = observed(values, key, dict)
        number = observed(value, "number", (int, float, type(None)))
        if type(number) is not kinds:
            shown = _text(observed(value, "type", str))
            hint = (": use .item() to turn a one-element tensor into a Python number"
                    if shown == "Tensor" else "")
            raise CheckFailed(f"{what}: {key!r} must be a Python {kinds.__name__}, got "
                              f"{shown} {_text(observed(value, 'text', str))}{hint}")
        numbers.append(number)
    return numbers[0], numbers[1], numbers[2]


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _judge_agreement(results: list, what: str) -> None:
    if all(_same(a, b) for got in results for a, b in zip(got, results[0])):
        return
    shown = "; ".join(f"rank {rank}: loss {loss!r}, accuracy {accuracy!r}, count {count!r}"
                      for rank, (loss, accuracy, count) in enumerate(results))
    raise CheckFailed(
        f"{what}: the ranks returned different results ({_text(shown)}). Every rank must return "
        "the metrics of the whole data set: combine the sums and counts with all_reduce, which "
        "gives every rank the totals (reduce or gather to rank 0 leaves the others with a part)")


def _loss_close(got: float, want: float) -> bool:
    return abs(got - want) <= LOSS_ATOL + LOSS_RTOL * abs(want)


def _means_over(groups: list[list[int]], values: torch.Tensor) -> float | None:
    means = [values[group].double().mean().item() for group in groups if group]
    return sum(means) / len(means) if means else None


def _judge_values(rank: int, got: tuple, ref: dict, batches_by_rank: list, what: str) -> None:
    loss, accuracy, count = got
    n = ref["count"]
    if count != n:
        own = sum(map(len, batches_by_rank[rank]))
        hint = (" - the count of this rank's own share: all_reduce the count too" if count == own
                else "")
        raise CheckFailed(f"{what}: 'count' must be the number of samples evaluated in total, "
                          f"{n}; got {count}{hint}")
    if n == 0:
        if not (math.isnan(loss) and math.isnan(accuracy)):
            raise CheckFailed(f"{what}: an empty data set has no mean: expected loss and "
                              f"accuracy nan (math.nan), got {loss!r} and {accuracy!r}")
        return
    shares = [[i for batch in batches for i in batch] for batches in batches_by_rank]
    batches = [batch for rank_batches in batches_by_rank for batch in rank_batches]
    _judge_loss(loss, ref, shares, batches, what)
    _judge_accuracy(accuracy, ref, shares, what)


def _judge_loss(loss: float, ref: dict, shares: list, batches: list, what: str) -> None:
    if _loss_close(loss, ref["loss"]):
        return
    hint = ""
    for groups, name in [(shares, "the ranks' own mean losses, which counts a sample of a "
                                  "smaller share more"),
                         (batches, "the batches' mean losses, which counts a sample of a "
                                   "smaller batch more")]:
        means = _means_over(groups, ref["losses"])
        if means is not None and _loss_close(loss, means):
            hint = (f" - that is the mean of {name}: sum the per-sample losses "
                    "(reduction='sum'), all_reduce the sum and the count, then divide once")
            break
    else:
        if _loss_close(loss, ref["loss"] * ref["count"]):
            hint = " - that is the sum: divide by the count"
    raise CheckFailed(f"{what}: 'loss' must be the mean cross-entropy over all {ref['count']} "
                      f"samples, {ref['loss']!r}; got {loss!r} (allowed difference "
                      f"{LOSS_ATOL:g} + {LOSS_RTOL:g} * |loss|){hint}")


def _judge_accuracy(accuracy: float, ref: dict, shares: list, what: str) -> None:
    if abs(accuracy - ref["accuracy"]) <= ACCURACY_ATOL:  # nan is never close
        return
    hint = ""
    rank_mean = _means_over(shares, ref["correct_each"].double())
    if rank_mean is not None and abs(accuracy - rank_mean) <= ACCURACY_ATOL:
        hint = (" - that is the mean of the ranks' own accuracies, which counts a sample of a "
                "smaller share more: all_reduce the number correct and the count, then divide")
    n = ref["count"]
    raise CheckFailed(f"{what}: 'accuracy' must be the fraction of all {n} samples classified "
                      f"correctly, {ref['correct']}/{n} = {ref['accuracy']!r}; got "
                      f"{accuracy!r}{hint}")


def judge_situation(calls: list, world_size: int, s: dict, expected=written_out_values) -> None:
    """``expected(s)``: one process's values (see :func:`values_from`)."""
    what = describe(s, world_size)
    ref = {**inputs_of(s), **expected(s)}
    batches_by_rank: list = [None] * len(calls)

    def forwards_of(rank, call):
        batches_by_rank[rank] = _judge_forwards(call, ref, s, world_size, what)

    judge_each_rank(calls, forwards_of)
    _judge_together(batches_by_rank, ref, world_size, what)
    judge_each_rank(calls, lambda rank, call: _judge_model_after(call, ref, s, what))
    results: list = [None] * len(calls)

    def result_of(rank, call):
        results[rank] = _reported_result(call, what)

    judge_each_rank(calls, result_of)
    _judge_agreement(results, what)
    judge_each_rank(results, lambda rank, got: _judge_values(rank, got, ref, batches_by_rank,
                                                             what))


def judge_evaluate(observations: list, world_size: int, situations: list) -> None:
    """The visible situations' judge: their values are written out."""
    judge_evaluate_with(written_out_values, observations, world_size, situations)


def judge_evaluate_with(expected, observations: list, world_size: int, situations: list) -> None:
    """Situation by situation, in order; the first that fails is the one reported."""
    reports: list = []
    judge_each_rank(observations,
                    lambda rank, o: reports.append(reported_calls(o, len(situations))))
    for number, s in enumerate(situations):
        judge_situation([report[number] for report in reports], world_size, s, expected)


EVALUATE = Case(observe_evaluate, judge_evaluate)


def run_situations(world_size: int, evaluate, situations: list, *,
                   timeout: float = CHECK_TIMEOUT_S, hide_internals: bool = False,
                   case: Case = EVALUATE) -> None:
    """Run and judge ``situations``; a deadline says which of them leave a rank without samples."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    try:
        run_student(case, world_size, evaluate, situations, timeout=timeout,
                    hide_internals=hide_internals)
    except CheckFailed as failed:
        lonely = [describe(s, world_size) for s in situations if s["samples"] < world_size]
        if "did not finish within" not in str(failed) or not lonely:
            raise
        raise CheckFailed(
            f"{failed}\nThis check has fewer samples than ranks in: {'; '.join(lonely)}. A rank "
            "with no samples must still call the same collectives as its peers, in the same "
            "order (all_reduce its zeros); a rank that skips them, or calls the DDP wrapper's "
            "forward where a peer does not, leaves the others waiting forever") from None


def check_evaluate_matches_one_process(evaluate) -> None:
    """2 and 3 ranks, uneven shares, models in train and eval mode, int and tensor labels:
    the values of one process, on every rank, and the model as it was."""
    run_situations(2, evaluate, [situation(11, 4, seed=1),
                                 situation(8, 3, seed=2, mode="eval", labels="tensor")])
    run_situations(3, evaluate, [situation(10, 4, seed=3),
                                 situation(14, 5, seed=4, mode="eval", labels="tensor")])


def check_evaluate_counts_each_sample_once(evaluate) -> None:
    """Batches larger than a share and of 1, fewer samples than ranks: each sample evaluated
    exactly once in total, by the rank whose share it is."""
    run_situations(2, evaluate, [situation(5, 64, seed=5), situation(7, 1, seed=6)])
    run_situations(3, evaluate, [situation(2, 1, seed=7), situation(13, 2, seed=8)])


def check_evaluate_with_a_ddp_model(evaluate) -> None:
    """3 ranks, the model wrapped in DistributedDataParallel: evaluate its module."""
    run_situations(3, evaluate, [situation(10, 3, seed=9, ddp=True),
                                 situation(7, 2, seed=10, mode="eval", ddp=True)])
