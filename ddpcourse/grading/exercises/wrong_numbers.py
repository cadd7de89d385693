"""Chapter 09, debugging: wrong numbers. Visible checks for the three functions of exercise
wrong_numbers, and the cases the hidden checks reuse.

The contracts are the docstrings of ``accuracy``, ``train_epochs`` and ``train_clipped`` in
solutions/09_debugging/wrong_numbers.nb.py (students: exercises/09_debugging/wrong_numbers.ipynb).
Each runs on every rank of a gloo group and finishes without an error even when it is wrong: only
the numbers tell. Each lab is one :class:`~ddpcourse.grading.checks.Case`: in the ranks,
``observe_*`` builds the inputs, calls the student's function and returns plain data; the judge,
which never runs the student's code, compares it with the truth of the situation.

This module ships to students and is importable where their code runs, so it computes no truth:
no one-process reference run, no sampler order, no count of right answers. Each judge takes the
truth as an argument (``judge_*_against(truth, ...)``). The visible cases' truths are written
out in :data:`WRITTEN_OUT` (counts, orders, norms, and each tensor as its sum and norm); the
hidden cases' are computed on the grader's side by autograder/hidden/wrong_numbers.py, whose
functions also print :data:`WRITTEN_OUT` (``python -m autograder.hidden.wrong_numbers``) and are
held to it by tests/test_grading_wrong_numbers.py. Besides the truth, a judge uses only what the
observations show themselves: ranks that must agree, the share each rank evaluated, how many
optimizer steps and gradient all-reduces there were, a clipped gradient's norm.

* ``ACCURACY`` (lab 7, an evaluation that is slightly off). A rank records the input of every
  forward of the model (a forward pre-hook) and what came back. The judge maps each forwarded row
  back to its sample, requires that no rank evaluated more than ``ceil(n / world_size)`` samples,
  that together they evaluated every sample, that every rank returned the same float, and that it
  is the exact accuracy ``right / n`` within ``ACCURACY_ATOL``: a ratio of counts, whose
  neighbours differ by ``1 / n`` (at least ``1 / 13`` here), while float32 division of the right
  counts is off by at most ~6e-8. So the check is exact on the count.
* ``EPOCHS`` (lab 8, every epoch in the same order). A rank records the rows of every forward.
  The judge requires every batch of every epoch to hold exactly the samples of torch's own
  ``DistributedSampler`` for that rank and epoch (the truth's orders; they differ between epochs,
  so passing implies that the order changes every epoch). Then the replicas must be bit-identical
  and equal one process that trains rank 0's initial model on each step's global batch (every
  rank's batch of that step), within ``ATOL + RTOL * |w|``.
* ``CLIPPED`` (lab 9, clipping with gradient accumulation). A rank records the gradients at every
  ``optimizer.step()`` (an optimizer step pre-hook: the gradient the step applies), the weights
  afterwards, what the function returned, and the communication
  (:func:`~ddpcourse.grading.checks.audited_traffic`; when a class is graded, the grader's broker
  counts instead). The judge requires one optimizer step per group of micro-batches and exactly
  as many gradient all-reduces (all-reduced bytes in units of one full gradient), gradients at
  every step bit-identical on all ranks and of norm at most ``max_norm``, the returned norms alike
  on every rank and equal to the truth's (the norm of the group's averaged gradient before
  clipping), then the gradients and final weights of one process on the same accumulated,
  clipped steps.

Why that tolerance. The ranks add the same terms as one process, in another order, and float32
addition is not associative. Measured over every situation of these checks and the hidden ones:
the notebook's solutions are at most ~1e-7 from one process, weights, gradients and norms alike
(tests/test_grading_wrong_numbers.py asserts below ``ATOL / 10``). The wrong loops are far
outside (clipping inside ``no_sync()`` moves the weights by 1e-3 or more), and most never get that
far: a wrong order, a wrong count of steps or all-reduces, gradients that differ between ranks
or norms that differ between ranks are exact findings, judged first. A tensor written out as its
sum and norm is compared within ``numel * ATOL + RTOL * sqrt(numel) * norm``, which bounds what
an element-wise ``ATOL + RTOL * |w|`` allows.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, Case, CheckFailed, audited_traffic,
                                      cut_text, every_ranks_calls, judge_each_rank, observed,
                                      run_student, safe_text, type_name)
from ddpcourse.grading.collective_names import all_reduce_bytes, reported_collective_calls
from ddpcourse.grading.written_out import sum_and_norm, table_lookup

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
AUDITED_CASES_BUILD_DDP = True  # the grader's one-rank hosts preload what DDP imports
# None of these labs hangs when right, but a wrong fix can (uneven shares under DDP): fail it fast.
# A right solution needs well under a second in warm ranks.
DEADLINE_S = min(CHECK_TIMEOUT_S, 10.0)
ACCURACY_ATOL = 1e-7
ATOL, RTOL = 1e-5, 1e-5
CLASSES, EVAL_FEATURES = 3, 4
IN_FEATURES, HIDDEN, OUT_FEATURES = 6, 16, 3
_MAX_TEXT = 300  # of a text a rank reports, in a message
_MIN_MARGIN = 1e-3  # between the top two logits of every evaluation sample (no near ties)

# A situation's truth: what the judge compares with (see the module docstring).
Truth = Callable[[dict, int], dict]


def rank_seed(seed: int, rank: int) -> int:
    """Every rank builds its model from a seed of its own: only DDP's broadcast makes them alike."""
    return 7919 * seed + 104729 * rank + 17


HANG_HINTS = {
    "accuracy": "every rank must call the same collectives, as often and in the same order: a "
                "collective inside a loop over a share that is longer on some ranks, or under "
                "`if rank == ...`, leaves the others waiting",
    "epochs": "under DDP every backward is an all-reduce, so every rank must run as many "
              "batches as every other: shares of uneven length (e.g. range(rank, n, world_size)) "
              "leave a rank waiting in DDP's all-reduce",
    "clipped": "every rank must sync (run a forward and backward outside no_sync()) at the "
               "same micro-batches, and step as often as the others",
}


def run_lab(case: Case, lab: str, world_size: int, fn, situations, **kwargs) -> None:
    """``run_student`` with ``DEADLINE_S``, and the lab's hint added to a hang."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    kwargs.setdefault("timeout", DEADLINE_S)
    try:
        run_student(case, world_size, fn, situations, **kwargs)
    except CheckFailed as failed:
        if "did not finish within" in str(failed):
            raise CheckFailed(f"{failed}\nHint: {HANG_HINTS[lab]}") from None
        raise


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _raised(exc: BaseException | None) -> dict | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": safe_text(lambda: exc, _MAX_TEXT)}


def _judge_raised(call: dict, what: str) -> None:
    raised = observed(call, "raised", (dict, type(None)))
    if raised is not None:
        raise CheckFailed(f"{what}: your code raised {cut_text(observed(raised, 'type', str), 80)}"
                          f": {cut_text(observed(raised, 'message', str), _MAX_TEXT)}")


def _rows_to_samples(inputs: list, x: torch.Tensor, what: str) -> list[list[int]]:
    """Each recorded forward input as the indices of the data set's rows it holds."""
    batches = []
    for number, rows in enumerate(inputs):
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != x.shape[1]:
            raise CheckFailed(f"{what}: forward {number} of the model got no batch of the data "
                              f"set's rows (a {x.shape[1]}-feature tensor of rows)")
        indices = []
        for row in rows:
            found = (x == row).all(dim=1).nonzero()
            if len(found) == 0:
                raise CheckFailed(f"{what}: forward {number} of the model got a row that is not "
                                  "one of the data set's samples (pass the samples as they are)")
            indices.append(int(found[0]))
        batches.append(indices)
    return batches


def _recording_inputs(module: nn.Module, into: list):
    """A forward pre-hook on ``module`` that keeps a copy of every input."""
    def record(_module, args):
        into.append(args[0].detach().clone() if args and isinstance(args[0], torch.Tensor)
                    else None)
    return module.register_forward_pre_hook(record)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# How a tensor of a visible case's truth is written out: its sum and its 2-norm (float64).
digest = sum_and_norm


def _judge_replicas(states: list[dict], what: str) -> None:
    """Bit for bit: every rank applied the same averaged gradients."""
    for rank, state in enumerate(states[1:], start=1):
        for name, tensor in state.items():
            if not torch.equal(tensor, states[0][name]):
                diff = (tensor.double() - states[0][name].double()).abs().max().item()
                raise CheckFailed(f"{what}: after training, rank {rank}'s {name!r} differs from "
                                  f"rank 0's by up to {diff:.3g}: the replicas are no longer "
                                  "identical (some step used gradients that were not "
                                  "all-reduced)")


def _reported_state(call: dict, key: str, shapes: dict[str, torch.Size], what: str) -> dict:
    state = observed(call, key, dict)
    if set(state) != set(shapes) or not all(
            isinstance(t, torch.Tensor) and t.shape == shapes[n] for n, t in state.items()):
        raise CheckFailed(f"{what}: the report of the model's parameters is not "
                          f"{sorted(shapes)} as tensors")
    return state


def _shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {name: p.shape for name, p in module.named_parameters()}


def _largest_difference(state: dict, truth: dict) -> tuple[float, str, bool]:
    """How far ``state`` (tensors) is from ``truth``: tensors (element-wise ``ATOL + RTOL *
    |w|``) or, for a visible case, each tensor's :func:`digest` (see the module docstring).
    (largest difference, where, within the tolerance)."""
    worst, where, close = 0.0, "", True
    for name, expected in truth.items():
        got = state[name]
        if isinstance(expected, torch.Tensor):
            close &= torch.allclose(got, expected, rtol=RTOL, atol=ATOL)
            diff = (got.double() - expected.double()).abs().max().item()
        else:
            mine = digest(got)
            diff = max(abs(a - b) for a, b in zip(mine, expected))
            close &= diff <= ATOL * got.numel() + RTOL * math.sqrt(got.numel()) * expected[1]
        if diff >= worst:
            worst, where = diff, name
    return worst, where, close


# === lab 7: an evaluation that is slightly off =====================================================


def accuracy_situation(samples: int, batch_size: int, seed: int = 0) -> dict:
    return {"samples": samples, "batch_size": batch_size, "seed": seed}


def make_classifier(seed: int) -> nn.Linear:
    """The model every rank evaluates (the same seed on every rank)."""
    return _seeded(seed, lambda: nn.Linear(EVAL_FEATURES, CLASSES))


def make_eval_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and labels such that ``make_classifier(seed)`` gets about 60% right: sample 0 right
    and sample 1 wrong, so that DistributedSampler's padding (which repeats the first samples)
    changes a count whichever way it is miscounted. RuntimeError when a row's top two logits are
    closer than ``_MIN_MARGIN`` (float32 rounding could then flip a prediction between batch
    sizes): a situation the course must not use."""
    generator = torch.Generator().manual_seed(1000 + seed)
    x = 2 * torch.randn(samples, EVAL_FEATURES, generator=generator)
    with torch.no_grad():
        logits = make_classifier(seed)(x)
    top_two = logits.topk(2, dim=1).values
    if (top_two[:, 0] - top_two[:, 1]).min() < _MIN_MARGIN:
        raise RuntimeError(f"evaluation data ({samples}, seed {seed}) has a near tie")
    predicted = logits.argmax(dim=1)
    right = torch.rand(samples, generator=generator) < 0.6
    right[0] = True
    right[1:2] = False
    return x, torch.where(right, predicted, (predicted + 1) % CLASSES)


def observe_accuracy(rank, world_size, accuracy, situations):
    """Each situation: the model and the whole data set (alike on every rank), the student's
    call; what every forward of the model got, and what came back."""
    calls = []
    for s in situations:
        model = make_classifier(s["seed"])
        inputs: list = []
        handle = _recording_inputs(model, inputs)
        raised, returned = None, None
        try:
            returned = accuracy(model, TensorDataset(*make_eval_data(s["samples"], s["seed"])),
                                s["batch_size"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            raised = exc
        handle.remove()
        calls.append({"raised": _raised(raised), "inputs": inputs,
                      "returned": type_name(returned),
                      "returned_text": safe_text(lambda: repr(returned), _MAX_TEXT),
                      "value": returned if type(returned) is float else None})
    return {"calls": calls}


def _describe_accuracy(s: dict, world_size: int) -> str:
    return (f"accuracy on {s['samples']} samples, batch_size={s['batch_size']}, "
            f"{world_size} rank(s)")


def _miscounts(s: dict, world_size: int, truth: dict) -> list[tuple[float, str]]:
    """The numbers the usual wrong evaluations return, with what each one did (the feedback that
    explains the lab once an answer is wrong)."""
    n = s["samples"]
    padded = math.ceil(n / world_size) * world_size
    pad = padded - n
    counted = truth["right"] + truth["right_in_padding"]
    return [
        (counted / padded,
         f"DistributedSampler(shuffle=False) pads the data set to {padded} samples (a "
         f"multiple of {world_size}) by repeating the first {pad}: those were counted twice, "
         "in the correct answers and in the total"),
        (counted / n, f"the {pad} padded sample(s) (repeats of the first ones) were counted as "
                      "answers, while the total is the data set's size"),
    ]


def _judge_accuracy_call(rank: int, call: Any, s: dict, world_size: int, what: str) -> None:
    _judge_raised(call, what)
    if observed(call, "value", (float, type(None))) is None:
        raise CheckFailed(f"{what}: expected a Python float (`.item()` gives one), got "
                          f"{cut_text(observed(call, 'returned', str), 80)}: "
                          f"{cut_text(observed(call, 'returned_text', str), 200)}")


def judge_accuracy_against(truth: Truth, observations, world_size, situations):
    """Situation by situation: each rank's own call, the share each rank evaluated, the samples
    evaluated together, the value (the same on every rank, ``truth``'s right answers / n).
    ``truth(s, world_size)``: ``{"right": samples the model predicts right, "right_in_padding":
    how many of DistributedSampler's padded repeats it predicts right}``."""
    calls_by_rank = every_ranks_calls(observations, len(situations))
    for number, s in enumerate(situations):
        what = _describe_accuracy(s, world_size)
        calls = [calls[number] for calls in calls_by_rank]
        judge_each_rank(calls, lambda rank, call: _judge_accuracy_call(rank, call, s,
                                                                       world_size, what))
        x, _ = make_eval_data(s["samples"], s["seed"])
        share = math.ceil(s["samples"] / world_size)
        evaluated: set[int] = set()

        def judge_share(rank, call):
            batches = _rows_to_samples(observed(call, "inputs", list), x, what)
            rows = sum(len(batch) for batch in batches)
            if rows > share:
                raise CheckFailed(f"{what}: rank {rank} evaluated {rows} samples; a rank's share "
                                  f"is at most ceil({s['samples']} / {world_size}) = {share}: "
                                  "each rank evaluates its own part of the data set, not all of "
                                  "it")
            evaluated.update(i for batch in batches for i in batch)

        judge_each_rank(calls, judge_share)
        missing = sorted(set(range(s["samples"])) - evaluated)
        if missing:
            kept = s["samples"] - s["samples"] % world_size
            hint = (": that is what DistributedSampler(drop_last=True) leaves out to make the "
                    "shares even" if missing == list(range(kept, s["samples"])) else "")
            raise CheckFailed(f"{what}: no rank evaluated sample(s) {missing[:10]}{hint}; "
                              "together the ranks must evaluate every sample")
        values = [observed(call, "value", float) for call in calls]
        if any(value != values[0] for value in values):
            raise CheckFailed(f"{what}: the ranks returned different accuracies {values}: every "
                              "rank must return the accuracy of the whole data set")
        known = truth(s, world_size)
        exact = known["right"] / s["samples"]
        if abs(values[0] - exact) <= ACCURACY_ATOL:
            continue
        shown = (f"{what}: returned {values[0]:.6g}, the exact accuracy is {known['right']} / "
                 f"{s['samples']} = {exact:.6g}")
        for wrong, why in _miscounts(s, world_size, known):
            if abs(values[0] - wrong) <= ACCURACY_ATOL:
                raise CheckFailed(f"{shown}: {why}. Count each sample exactly once")
        raise CheckFailed(f"{shown}. Count each sample exactly once: sum the correct answers "
                          "and the samples over the ranks (all_reduce), then divide")


# === lab 8: every epoch in the same order =========================================================


def epochs_situation(samples: int, batch_size: int, epochs: int, seed: int = 0,
                     lr: float = 0.1) -> dict:
    return {"samples": samples, "batch_size": batch_size, "epochs": epochs, "seed": seed,
            "lr": lr}


def make_regressor(seed: int) -> nn.Sequential:
    return _seeded(seed, lambda: nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(),
                                               nn.Linear(HIDDEN, OUT_FEATURES)))


def make_train_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + seed)
    return (torch.randn(samples, IN_FEATURES, generator=generator),
            torch.randn(samples, OUT_FEATURES, generator=generator))


def observe_epochs(rank, world_size, train_epochs, situations):
    """Each situation: a fresh DDP model (rank-seeded: DDP's constructor broadcasts rank 0's),
    its SGD, the whole data set; the student's call; every forward's input and the weights."""
    calls = []
    for s in situations:
        ddp_model = DistributedDataParallel(make_regressor(rank_seed(s["seed"], rank)))
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=s["lr"])
        inputs: list = []
        handle = _recording_inputs(ddp_model.module, inputs)
        raised = None
        try:
            train_epochs(ddp_model, optimizer, TensorDataset(*make_train_data(s["samples"],
                                                                              s["seed"])),
                         s["epochs"], s["batch_size"], s["seed"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            raised = exc
        handle.remove()
        calls.append({"raised": _raised(raised), "inputs": inputs,
                      "weights": _state(ddp_model.module)})
    return {"calls": calls}


def _describe_epochs(s: dict, world_size: int) -> str:
    return (f"train_epochs on {s['samples']} samples, batch_size={s['batch_size']}, "
            f"{s['epochs']} epochs, seed={s['seed']}, {world_size} rank(s)")


def _judge_order(rank: int, call: Any, s: dict, orders: list, what: str) -> None:
    """``orders[rank][epoch]``: torch's DistributedSampler order of each epoch, one epoch more
    than the situation trains (to name an order that came one epoch late)."""
    _judge_raised(call, what)
    x, _ = make_train_data(s["samples"], s["seed"])
    seen = _rows_to_samples(observed(call, "inputs", list), x, what)
    size = s["batch_size"]
    want = [[order[i:i + size] for i in range(0, len(order), size)]
            for order in orders[rank][:s["epochs"]]]
    wanted = [batch for epoch in want for batch in epoch]
    if [len(b) for b in seen] != [len(b) for b in wanted]:
        raise CheckFailed(f"{what}: rank {rank}'s model ran {len(seen)} forwards of "
                          f"{[len(b) for b in seen][:12]} rows; expected {len(wanted)} batches "
                          f"of {[len(b) for b in wanted][:12]} rows ({s['epochs']} epochs of "
                          "DataLoader(dataset, batch_size, sampler=DistributedSampler(...)))")
    per_epoch = len(want[0])
    for epoch in range(s["epochs"]):
        got = [i for batch in seen[epoch * per_epoch:(epoch + 1) * per_epoch] for i in batch]
        order = list(orders[rank][epoch])
        if got == order:
            continue
        shown = f"{what}: in epoch {epoch}, rank {rank} saw samples {got}; expected {order}"
        same_as = [e for e, known in enumerate(orders[rank]) if list(known) == got]
        if same_as and epoch > 0 and same_as[0] == 0:
            raise CheckFailed(f"{shown}: that is epoch 0's order again. A DistributedSampler "
                              "shuffles with a generator seeded by seed + its epoch, and its "
                              "epoch changes only when you call sampler.set_epoch(epoch) "
                              "(torch/utils/data/distributed.py, DistributedSampler.__iter__): "
                              "call it at the start of each epoch, before iterating the loader")
        if same_as:
            raise CheckFailed(f"{shown}: that is DistributedSampler's order of epoch "
                              f"{same_as[0]}: call sampler.set_epoch(epoch) with this epoch's "
                              "number, before iterating the loader")
        raise CheckFailed(f"{shown} (DistributedSampler(dataset, shuffle=True, seed=seed) after "
                          "set_epoch(epoch): the same seed on every rank, one shuffle per epoch "
                          "shared by all ranks, each rank taking every world_size-th sample)")


def judge_epochs_against(truth: Truth, observations, world_size, situations):
    """Situation by situation: each rank's batches, epoch by epoch, against the truth's orders;
    the replicas; the weights against the truth's. ``truth(s, world_size)``: ``{"orders":
    [rank][epoch] for epochs + 1 epochs, "weights": {name: tensor or digest}}``."""
    calls_by_rank = every_ranks_calls(observations, len(situations))
    shapes = _shapes(make_regressor(0))
    for number, s in enumerate(situations):
        what = _describe_epochs(s, world_size)
        calls = [calls[number] for calls in calls_by_rank]
        known = truth(s, world_size)
        judge_each_rank(calls, lambda rank, call: _judge_order(rank, call, s, known["orders"],
                                                               what))
        states = [_reported_state(call, "weights", shapes, what) for call in calls]
        _judge_replicas(states, what)
        diff, where, close = _largest_difference(states[0], known["weights"])
        if not close:
            raise CheckFailed(f"{what}: the weights are not those of one process training on "
                              f"each step's global batch (largest difference {diff:.3g}, in "
                              f"{where!r}): one optimizer.step() per batch, loss "
                              "F.mse_loss(ddp_model(x), y)")


# === lab 9: gradient clipping with gradient accumulation ===========================================


def clipping_situation(micro: int, k: int, max_norm: float, seed: int = 0, rows: int = 3,
                       lr: float = 0.2, momentum: float = 0.0) -> dict:
    return {"micro": micro, "k": k, "max_norm": max_norm, "seed": seed, "rows": rows, "lr": lr,
            "momentum": momentum}


def micro_batches(s: dict, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro-batches: ``s["micro"]`` of ``s["rows"]`` rows each."""
    generator = torch.Generator().manual_seed(rank_seed(s["seed"], rank) + 1)
    return [(torch.randn(s["rows"], IN_FEATURES, generator=generator),
             torch.randn(s["rows"], OUT_FEATURES, generator=generator))
            for _ in range(s["micro"])]


def make_optimizer(s: dict, model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"])


def gradient_bytes(model: nn.Module) -> int:
    """What one synchronised backward all-reduces: every parameter's gradient once."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def optimizer_steps(s: dict) -> int:
    return math.ceil(s["micro"] / s["k"])


def observe_clipped(rank, world_size, train_clipped, s):
    """One situation (the communication counted is the whole case's): a fresh DDP model
    (rank-seeded), its optimizer, this rank's micro-batches; the student's call, audited; the
    gradients at every optimizer step, the weights afterwards and what came back."""
    ddp_model = DistributedDataParallel(make_regressor(rank_seed(s["seed"], rank)))
    optimizer = make_optimizer(s, ddp_model)
    names = [name for name, _ in ddp_model.module.named_parameters()]
    gradients: list = []

    def record(optimizer_, args, kwargs):
        gradients.append({name: None if p.grad is None else p.grad.detach().clone()
                          for name, p in zip(names, ddp_model.module.parameters())})

    handle = optimizer.register_step_pre_hook(record)
    raised, returned = None, None
    with audited_traffic() as traffic:
        try:
            returned = train_clipped(ddp_model, optimizer, micro_batches(s, rank), s["k"],
                                     s["max_norm"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            raised = exc
    handle.remove()
    norms = None
    if type(returned) is list and all(type(n) is float for n in returned[:256]):
        norms = returned[:256]
    return {"raised": _raised(raised), "gradients": gradients, "norms": norms,
            "returned": type_name(returned),
            "returned_text": safe_text(lambda: repr(returned), _MAX_TEXT),
            "weights": _state(ddp_model.module), "traffic": traffic}


def _describe_clipped(s: dict, world_size: int) -> str:
    extra = f", momentum={s['momentum']}" if s["momentum"] else ""
    return (f"train_clipped with {s['micro']} micro-batches per rank, accumulation_steps="
            f"{s['k']}, max_norm={s['max_norm']}{extra}, {world_size} rank(s)")


def gradient_syncs(call: dict, per_sync: int, what: str) -> tuple[int, int]:
    """(synchronised backwards, all-reduce calls): the all-reduced bytes in units of one full
    gradient exchange (a loss all-reduced for logging is far smaller than one unit)."""
    sizes = all_reduce_bytes(reported_collective_calls(observed(call, "traffic", dict), what))
    return sum(sizes) // per_sync, len(sizes)


def _norm(gradients: dict) -> float:
    """The total 2-norm of a step's gradients (as clip_grad_norm_ measures it), in float64."""
    return math.sqrt(sum(g.double().pow(2).sum().item() for g in gradients.values()))


def _judge_clipped_call(call: Any, s: dict, shapes: dict, per_sync: int, what: str) -> list:
    """One rank alone: it raised nothing, stepped once per group, all-reduced once per step,
    returned one float per step, and every step's gradient exists."""
    _judge_raised(call, what)
    steps = optimizer_steps(s)
    gradients = observed(call, "gradients", list)
    if len(gradients) != steps:
        raise CheckFailed(f"{what}: optimizer.step() ran {len(gradients)} time(s); expected "
                          f"{steps}, one per group of accumulation_steps micro-batches "
                          f"(ceil({s['micro']} / {s['k']}), the last group may be shorter)")
    syncs, _ = gradient_syncs(call, per_sync, what)
    if syncs != steps:
        raise CheckFailed(f"{what}: expected {steps} gradient all-reduce(s), one per optimizer "
                          f"step, but the ranks all-reduced the gradients {syncs} time(s): DDP "
                          "decides in the FORWARD whether the next backward all-reduces, so "
                          "only the last micro-batch of each group may run its forward and "
                          "backward outside `with ddp_model.no_sync():`")
    norms = observed(call, "norms", (list, type(None)))
    if norms is None or len(norms) != steps:
        raise CheckFailed(f"{what}: expected a list of {steps} Python float(s), one norm per "
                          f"optimizer step, got {cut_text(observed(call, 'returned', str), 80)}:"
                          f" {cut_text(observed(call, 'returned_text', str), 200)}")
    for step, grads in enumerate(gradients):
        if not isinstance(grads, dict) or set(grads) != set(shapes) or not all(
                g is None or (isinstance(g, torch.Tensor) and g.shape == shapes[n])
                for n, g in grads.items()):
            raise CheckFailed(f"{what}: the report of the gradients is malformed")
        if any(g is None for g in grads.values()):
            raise CheckFailed(f"{what}: at optimizer step {step} some parameter has no "
                              "gradient (grad is None): step after the group's backwards")
    return gradients


def judge_clipped_against(truth: Truth, observations, world_size, s):
    """Each rank's call (steps, all-reduces, norms returned); per step, the returned norm and the
    gradients alike on every rank, the gradient clipped, both equal to the truth's; the replicas;
    the weights against the truth's. ``truth(s, world_size)``: ``{"norms": [the norm of each
    step's averaged gradient before clipping], "gradients": [{name: tensor or digest}] (after
    clipping), "weights": {name: tensor or digest}}``."""
    what = _describe_clipped(s, world_size)
    shapes = _shapes(make_regressor(0))
    per_sync = gradient_bytes(make_regressor(0))
    gradients: list = []
    judge_each_rank(observations, lambda rank, call: gradients.append(
        _judge_clipped_call(call, s, shapes, per_sync, what)))
    norms = [observations[rank]["norms"] for rank in range(world_size)]
    known = truth(s, world_size)
    for step in range(optimizer_steps(s)):
        for rank in range(1, world_size):
            if norms[rank][step] != norms[0][step]:
                raise CheckFailed(
                    f"{what}: at optimizer step {step}, rank {rank}'s clip measured a gradient "
                    f"norm of {norms[rank][step]:.6g} and rank 0's {norms[0][step]:.6g}: the "
                    "ranks measured different gradients, so at least one was not the averaged "
                    "one. Inside no_sync() a rank's .grad holds only its own micro-batches' "
                    "sum; DDP averages it over the ranks in the backward of the group's last "
                    "micro-batch")
            for name, grad in gradients[rank][step].items():
                if not torch.equal(grad, gradients[0][step][name]):
                    raise CheckFailed(
                        f"{what}: at optimizer step {step}, rank {rank}'s gradient of {name!r} "
                        "differs from rank 0's: the step used gradients that were changed "
                        "after DDP averaged them, or never averaged after the group's last "
                        "backward. DDP all-reduces in the backward of a forward run outside "
                        "no_sync(); what is accumulated after that stays local")
        norm = _norm(gradients[0][step])
        if norm > s["max_norm"] * (1 + RTOL) + ATOL:
            raise CheckFailed(f"{what}: the gradient optimizer step {step} applied has norm "
                              f"{norm:.6g}, more than max_norm={s['max_norm']}: clip it "
                              "(torch.nn.utils.clip_grad_norm_) before optimizer.step()")
        want = known["norms"][step]
        got = norms[0][step]
        if not math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL):
            raise CheckFailed(
                f"{what}: at optimizer step {step} the norm returned is {got:.6g}; the norm of "
                f"the gradient the step applies, before clipping, is {want:.6g}. That is the "
                "norm of the group's gradient AVERAGED over the ranks: it exists only after the "
                "backward of the group's last micro-batch (the synchronised one). A clip inside "
                "no_sync() measures and scales one rank's partial sum, which DDP then averages "
                "with the other ranks' differently scaled sums: clip once per step, after that "
                "backward, and return what clip_grad_norm_ returns")
        diff, where, close = _largest_difference(gradients[0][step], known["gradients"][step])
        if not close:
            raise CheckFailed(f"{what}: the gradients at optimizer step {step} are not one "
                              "process's gradient of the mean loss over that group's "
                              "micro-batches, clipped to max_norm (largest difference "
                              f"{diff:.3g}, in {where!r}): divide each micro-batch's loss by "
                              "the number of micro-batches in its group, clip after the "
                              "group's last backward, and zero the gradients after every step")
    states = [_reported_state(call, "weights", shapes, what) for call in observations]
    _judge_replicas(states, what)
    diff, where, close = _largest_difference(states[0], known["weights"])
    if not close:
        raise CheckFailed(f"{what}: the weights are not those of one process on the same "
                          f"accumulated, clipped steps (largest difference {diff:.3g}, in "
                          f"{where!r})")


def run_clipping(case: Case, train_clipped, world_size: int, situations: list[dict],
                 **kwargs) -> None:
    """One case per situation: the communication the grader counts is the whole case's."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for s in situations:
        run_lab(case, "clipped", world_size, train_clipped, s, **kwargs)


# === the visible cases and their written-out truths ================================================

VISIBLE_ACCURACY = [accuracy_situation(7, 2, seed=0), accuracy_situation(9, 4, seed=1)]
VISIBLE_EPOCHS = [epochs_situation(7, 2, 3, seed=0), epochs_situation(9, 3, 2, seed=5)]
VISIBLE_CLIPPING = [clipping_situation(6, 3, 0.3, seed=0), clipping_situation(5, 2, 0.25, seed=1)]


def situation_key(s: dict, world_size: int) -> str:
    """How :data:`WRITTEN_OUT` names a situation."""
    return f"{world_size} ranks, " + ", ".join(f"{k}={s[k]!r}" for k in sorted(s))


# The truths of the visible cases, as autograder/hidden/wrong_numbers.py computes them (run
# `python -m autograder.hidden.wrong_numbers` to print them again).
WRITTEN_OUT: dict[str, dict[str, dict]] = {
    'accuracy': {
        '2 ranks, batch_size=2, samples=7, seed=0': {
            'right': 3,
            'right_in_padding': 1,
        },
        '2 ranks, batch_size=4, samples=9, seed=1': {
            'right': 4,
            'right_in_padding': 1,
        },
    },
    'epochs': {
        '2 ranks, batch_size=2, epochs=3, lr=0.1, samples=7, seed=0': {
            'orders': [
                [
                    [4, 5, 2, 1],
                    [0, 1, 5, 4],
                    [2, 3, 6, 5],
                    [5, 4, 0, 1],
                ],
                [
                    [0, 3, 6, 4],
                    [6, 3, 2, 0],
                    [4, 0, 1, 2],
                    [3, 6, 2, 5],
                ],
            ],
            'weights': {
                '0.weight': [-4.9606318704318255, 2.3706383740945203],
                '0.bias': [-0.13928881380707026, 0.9850310156985813],
                '2.weight': [-0.9036956254858524, 0.9202420141132397],
                '2.bias': [-0.039714641869068146, 0.5008854989812827],
            },
        },
        '2 ranks, batch_size=3, epochs=2, lr=0.1, samples=9, seed=5': {
            'orders': [
                [
                    [8, 4, 5, 2, 3],
                    [8, 0, 1, 4, 3],
                    [0, 8, 7, 3, 4],
                ],
                [
                    [7, 6, 1, 0, 8],
                    [2, 5, 6, 7, 8],
                    [5, 1, 2, 6, 0],
                ],
            ],
            'weights': {
                '0.weight': [-3.9219064731150866, 2.3684749354204437],
                '0.bias': [1.2380121797323227, 0.8281044393965364],
                '2.weight': [0.36229741023544193, 0.8154323298641419],
                '2.bias': [0.104917720425874, 0.12309711505902171],
            },
        },
    },
    'clipped': {
        '2 ranks, k=3, lr=0.2, max_norm=0.3, micro=6, momentum=0.0, rows=3, seed=0': {
            'norms': [0.7336902022361755, 0.9255504608154297],
            'gradients': [
                {
                    '0.weight': [-0.20519786760269199, 0.1331456122202046],
                    '0.bias': [-0.02426266041584313, 0.03839621194252153],
                    '2.weight': [-0.4076516282511875, 0.25176099350774117],
                    '2.bias': [0.12463180255144835, 0.08610539354862436],
                },
                {
                    '0.weight': [-0.11022352709551342, 0.12882411283745188],
                    '0.bias': [-0.052122654451522976, 0.03811811088095955],
                    '2.weight': [-0.11669999043442658, 0.25369436327243633],
                    '2.bias': [0.029462886974215508, 0.0871225797298447],
                },
            ],
            'weights': {
                '0.weight': [-5.499555773101747, 2.376418426988017],
                '0.bias': [-0.21644463390111923, 1.0054124604506796],
                '2.weight': [-1.385693140560761, 0.942945574275237],
                '2.bias': [-0.16286250948905945, 0.2836882620568677],
            },
        },
        '2 ranks, k=2, lr=0.2, max_norm=0.25, micro=5, momentum=0.0, rows=3, seed=1': {
            'norms': [1.1065610647201538, 1.0651648044586182, 1.3023301362991333],
            'gradients': [
                {
                    '0.weight': [0.014636414722190239, 0.09553902017264404],
                    '0.bias': [-0.011692287866026163, 0.05891828956908364],
                    '2.weight': [0.04054684835136868, 0.17082390562448582],
                    '2.bias': [0.07326838746666908, 0.143944505746828],
                },
                {
                    '0.weight': [-0.004977405842510052, 0.11077678842043011],
                    '0.bias': [0.026748920761747286, 0.028482613600544722],
                    '2.weight': [-0.14856848877388984, 0.21107381389504218],
                    '2.bias': [-0.07540308311581612, 0.06974931574429896],
                },
                {
                    '0.weight': [0.031363684924144763, 0.13313055009543365],
                    '0.bias': [-0.03641547624283703, 0.042422901040664825],
                    '2.weight': [0.04658651973841188, 0.18436465983443884],
                    '2.bias': [-0.01359495334327221, 0.09479525196864039],
                },
            ],
            'weights': {
                '0.weight': [-1.2116595950501505, 2.3158971860982325],
                '0.bias': [0.43652720004320145, 1.0014673769284117],
                '2.weight': [-1.1734542710182723, 0.9519840176325061],
                '2.bias': [-0.08232614398002625, 0.19554605905994762],
            },
        },
    },
}


def written_out(lab: str) -> Truth:
    """The visible cases' truth for ``lab``: their entry of :data:`WRITTEN_OUT`."""
    return table_lookup(WRITTEN_OUT, lab, situation_key)


def judge_accuracy(observations, world_size, situations):
    """The visible cases' judge: their truth written out."""
    judge_accuracy_against(written_out("accuracy"), observations, world_size, situations)


def judge_epochs(observations, world_size, situations):
    """The visible cases' judge: their truth written out."""
    judge_epochs_against(written_out("epochs"), observations, world_size, situations)


def judge_clipped(observations, world_size, s):
    """The visible cases' judge: their truth written out."""
    judge_clipped_against(written_out("clipped"), observations, world_size, s)


ACCURACY = Case(observe_accuracy, judge_accuracy)
EPOCHS = Case(observe_epochs, judge_epochs)
CLIPPED = Case(observe_clipped, judge_clipped, audit_traffic=True)


# === what the notebook's "run it" cells show ======================================================


def watch_accuracy(rank, world_size, accuracy, samples=7, batch_size=2, seed=0):
    """What ``accuracy`` returns on this rank, for the notebook."""
    model = make_classifier(seed)
    return accuracy(model, TensorDataset(*make_eval_data(samples, seed)), batch_size)


def one_process_accuracy() -> float:
    """What one process evaluating the 7 samples of the notebook's run gets (written out)."""
    s = VISIBLE_ACCURACY[0]
    return written_out("accuracy")(s, 2)["right"] / s["samples"]


def watch_epochs(rank, world_size, train_epochs, samples=7, batch_size=2, epochs=3, seed=0):
    """The samples this rank's model saw, epoch by epoch, for the notebook."""
    s = epochs_situation(samples, batch_size, epochs, seed)
    call = observe_epochs(rank, world_size, train_epochs, [s])["calls"][0]
    seen = [i for batch in _rows_to_samples(call["inputs"], make_train_data(samples, seed)[0],
                                            "watch") for i in batch]
    per_epoch = math.ceil(samples / world_size)
    return [seen[e * per_epoch:(e + 1) * per_epoch] for e in range(epochs)]


def watch_clipping(rank, world_size, train_clipped):
    """The notebook's run (the first visible situation): the norms this rank's function
    returned, the steps and gradient all-reduces it made, how far its weights are from the
    other ranks' and, as sum and norm of each tensor, from one process (written out)."""
    s = VISIBLE_CLIPPING[0]
    call = observe_clipped(rank, world_size, train_clipped, s)
    mine = torch.cat([w.reshape(-1) for w in call["weights"].values()])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    one = written_out("clipped")(s, world_size)
    diff, _, _ = _largest_difference(call["weights"], one["weights"])
    return {"norms returned": call["norms"],
            "optimizer steps": len(call["gradients"]),
            "gradient all-reduces": gradient_syncs(call, gradient_bytes(make_regressor(0)),
                                                   "watch")[0],
            "largest difference between ranks": max((o - mine).abs().max().item()
                                                    for o in everyone),
            "one process's norms": one["norms"],
            "weights vs one process (sum, norm)": diff}


# === the visible checks ===========================================================================


def check_accuracy(accuracy) -> None:
    """2 ranks, 7 and 9 samples (DistributedSampler pads both): the exact accuracy."""
    run_lab(ACCURACY, "accuracy", 2, accuracy, VISIBLE_ACCURACY)


def check_train_epochs(train_epochs) -> None:
    """2 ranks, 2-3 epochs: DistributedSampler's order of each epoch, one process's weights."""
    run_lab(EPOCHS, "epochs", 2, train_epochs, VISIBLE_EPOCHS)


def check_train_clipped(train_clipped) -> None:
    """2 ranks, groups of 3 and of 2 with a shorter last group: one all-reduce per step, the
    averaged gradient's norm, one process's clipped steps."""
    run_clipping(CLIPPED, train_clipped, 2, VISIBLE_CLIPPING)
