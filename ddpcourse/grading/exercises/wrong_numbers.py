"""Chapter 09, debugging: wrong numbers. Visible checks for the three functions of exercise
wrong_numbers, and the cases the hidden checks reuse.

The contracts are the docstrings of ``accuracy``, ``train_epochs`` and ``train_accumulated`` in
solutions/09_debugging/wrong_numbers.nb.py (students: exercises/09_debugging/wrong_numbers.ipynb).
Each runs on every rank of a gloo group and finishes without an error even when it is wrong: only
the numbers tell. Each lab is one :class:`~ddpcourse.grading.checks.Case`: in the ranks,
``observe_*`` builds the inputs, calls the student's function and returns plain data; the judge,
which never runs the student's code, rebuilds everything and computes the reference itself.

* ``ACCURACY`` (lab 7, padded evaluation). A rank records the input of every forward of the model
  (a forward pre-hook) and what came back. The judge maps each forwarded row back to its sample,
  requires that no rank evaluated more than ``ceil(n / world_size)`` samples, that together they
  evaluated every sample, that every rank returned the same float, and that it is the exact
  single-process accuracy ``correct / n`` within ``ACCURACY_ATOL``: a ratio of counts, whose
  neighbours differ by ``1 / n`` (at least ``1 / 13`` here), while float32 division of the right
  counts is off by at most ~6e-8. So the check is exact on the count.
* ``EPOCHS`` (lab 8, ``set_epoch``). A rank records the rows of every forward. The judge builds
  torch's own ``DistributedSampler`` for every rank and epoch (``set_epoch(epoch)``, the documented
  way) and requires every batch of every epoch to hold exactly those samples in that order; since
  the judge also refuses situations whose reference orders repeat between epochs
  (``RuntimeError``: a bug of the course), passing implies that the order changes every epoch.
  Then the replicas must be bit-identical and equal one process that trains rank 0's initial
  model on each step's global batch (every rank's batch of that step), within ``ATOL + RTOL * |w|``.
* ``ACCUMULATED`` (lab 9, ``no_sync``). A rank records the gradients at every ``optimizer.step()``
  (an optimizer step pre-hook), the parameters afterwards and the communication
  (:func:`~ddpcourse.grading.checks.audited_traffic`; when a class is graded, the grader's broker
  counts instead, and the student's code cannot bypass it). The judge requires
  ``ceil(micro_batches / accumulation_steps)`` optimizer steps, exactly that many gradient
  all-reduces (all-reduced bytes divided by one full gradient's bytes, as train_steps counts),
  and at every step gradients that are bit-identical on all ranks: a step whose gradients still
  differ between ranks had no all-reduce after its group's last backward, so together the two
  mean one all-reduce per optimizer step, after the group's last micro-batch. Then the step's
  gradients and the final weights must equal one process on the same accumulated steps (every
  rank's micro-batches of a group, concatenated, a mean loss), within ``ATOL + RTOL * |w|``.

Why that tolerance. The ranks add the same terms as one process, in another order, and float32
addition is not associative. Measured over every situation of these checks and the hidden ones:
the notebook's solutions are at most 6e-8 from one process, weights and gradients alike
(tests/test_grading_wrong_numbers.py asserts below ``ATOL / 10``). The wrong loops that the
weights or gradients alone must catch are far outside: the shorter last group's losses divided by
``accumulation_steps`` instead of its size is off by 0.06 to 0.28 wherever there is such a group.
Most wrong loops never get that far: a wrong order, a wrong count of all-reduces or gradients that
differ between ranks are exact findings, judged first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, Case, CheckFailed, audited_traffic,
                                      cut_text, every_ranks_calls, judge_each_rank, observed,
                                      run_student, safe_text, type_name)

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


def rank_seed(seed: int, rank: int) -> int:
    """Every rank builds its model from a seed of its own: only DDP's broadcast makes them alike."""
    return 7919 * seed + 104729 * rank + 17


HANG_HINTS = {
    "accuracy": "every rank must call the same collectives, as often and in the same order: a "
                "collective inside a loop over a share that is longer on some ranks, or under "
                "`if rank == ...`, leaves the others waiting",
    "epochs": "under DDP every backward is an all-reduce, so every rank must run as many "
              "batches as every other: shares of uneven length (e.g. range(rank, n, world_size)) "
              "leave a rank waiting in DDP's all-reduce. DistributedSampler pads the shares to "
              "equal length for this reason",
    "accumulated": "every rank must sync (run a forward and backward outside no_sync()) at the "
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


def _reported_state(call: dict, key: str, reference: dict, what: str) -> dict:
    state = observed(call, key, dict)
    if set(state) != set(reference) or not all(
            isinstance(t, torch.Tensor) and t.shape == reference[n].shape
            for n, t in state.items()):
        raise CheckFailed(f"{what}: the report of the model's parameters is not "
                          f"{sorted(reference)} as tensors")
    return state


def _largest_difference(state: dict, reference: dict) -> tuple[float, str, bool]:
    worst, where, close = 0.0, "", True
    for name, expected in reference.items():
        got = state[name]
        close &= torch.allclose(got, expected, rtol=RTOL, atol=ATOL)
        diff = (got.double() - expected.double()).abs().max().item()
        if diff >= worst:
            worst, where = diff, name
    return worst, where, close


# === lab 7: padded evaluation =====================================================================


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


def one_process_accuracy(samples: int, seed: int) -> float:
    """The exact accuracy: every sample once, in one process."""
    x, y = make_eval_data(samples, seed)
    with torch.no_grad():
        return (make_classifier(seed)(x).argmax(dim=1) == y).sum().item() / samples


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


def _miscounts(s: dict, world_size: int, right: torch.Tensor) -> list[tuple[float, str]]:
    """The numbers the usual wrong evaluations return, with what each one did."""
    n = s["samples"]
    share = math.ceil(n / world_size)
    padded = list(range(n)) + (list(range(n)) * share)[:share * world_size - n]
    pad = len(padded) - n
    counted = int(right[padded].sum())
    return [
        (counted / len(padded),
         f"DistributedSampler(shuffle=False) pads the data set to {len(padded)} samples (a "
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


def judge_accuracy(observations, world_size, situations):
    """Situation by situation: each rank's own call, the share each rank evaluated, the samples
    evaluated together, the value (the same on every rank, the exact one-process accuracy)."""
    calls_by_rank = every_ranks_calls(observations, len(situations))
    for number, s in enumerate(situations):
        what = _describe_accuracy(s, world_size)
        calls = [calls[number] for calls in calls_by_rank]
        judge_each_rank(calls, lambda rank, call: _judge_accuracy_call(rank, call, s,
                                                                       world_size, what))
        x, y = make_eval_data(s["samples"], s["seed"])
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
        with torch.no_grad():
            right = make_classifier(s["seed"])(x).argmax(dim=1) == y
        exact = int(right.sum()) / s["samples"]
        if abs(values[0] - exact) <= ACCURACY_ATOL:
            continue
        shown = (f"{what}: returned {values[0]:.6g}, the exact accuracy is {int(right.sum())} / "
                 f"{s['samples']} = {exact:.6g}")
        for wrong, why in _miscounts(s, world_size, right):
            if abs(values[0] - wrong) <= ACCURACY_ATOL:
                raise CheckFailed(f"{shown}: {why}. Count each sample exactly once")
        raise CheckFailed(f"{shown}. Count each sample exactly once: sum the correct answers "
                          "and the samples over the ranks (all_reduce), then divide")


ACCURACY = Case(observe_accuracy, judge_accuracy)


# === lab 8: set_epoch ============================================================================


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


def sampler_order(samples: int, world_size: int, rank: int, seed: int, epoch: int) -> list[int]:
    """What ``DistributedSampler(dataset, shuffle=True, seed=seed)`` gives ``rank`` in ``epoch``
    after ``set_epoch(epoch)``: torch's own class, run here."""
    sampler = DistributedSampler(range(samples), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def expected_batches(s: dict, world_size: int) -> list[list[list[list[int]]]]:
    """``[rank][epoch][batch]``: the sample indices of every batch. RuntimeError when two epochs
    of a rank would repeat an order (the situation could not tell a missing set_epoch)."""
    per_rank = []
    for rank in range(world_size):
        orders = [sampler_order(s["samples"], world_size, rank, s["seed"], epoch)
                  for epoch in range(s["epochs"])]
        if len({tuple(order) for order in orders}) != len(orders):
            raise RuntimeError(f"situation {s} repeats an order between epochs")
        per_rank.append([[order[i:i + s["batch_size"]]
                          for i in range(0, len(order), s["batch_size"])] for order in orders])
    return per_rank


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


def epochs_reference(s: dict, world_size: int) -> dict[str, torch.Tensor]:
    """One process: rank 0's initial model; at each step, the global batch (every rank's batch
    of that step, concatenated) with the mean loss; plain SGD."""
    model = make_regressor(rank_seed(s["seed"], 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    x, y = make_train_data(s["samples"], s["seed"])
    batches = expected_batches(s, world_size)
    for epoch in range(s["epochs"]):
        for step in range(len(batches[0][epoch])):
            rows = [i for rank in range(world_size) for i in batches[rank][epoch][step]]
            optimizer.zero_grad()
            F.mse_loss(model(x[rows]), y[rows]).backward()
            optimizer.step()
    return _state(model)


def _describe_epochs(s: dict, world_size: int) -> str:
    return (f"train_epochs on {s['samples']} samples, batch_size={s['batch_size']}, "
            f"{s['epochs']} epochs, seed={s['seed']}, {world_size} rank(s)")


def _judge_order(rank: int, call: Any, s: dict, world_size: int, want: list, what: str) -> None:
    _judge_raised(call, what)
    x, _ = make_train_data(s["samples"], s["seed"])
    seen = _rows_to_samples(observed(call, "inputs", list), x, what)
    wanted = [batch for epoch in want[rank] for batch in epoch]
    if [len(b) for b in seen] != [len(b) for b in wanted]:
        raise CheckFailed(f"{what}: rank {rank}'s model ran {len(seen)} forwards of "
                          f"{[len(b) for b in seen][:12]} rows; expected {len(wanted)} batches "
                          f"of {[len(b) for b in wanted][:12]} rows ({s['epochs']} epochs of "
                          "DataLoader(dataset, batch_size, sampler=DistributedSampler(...)))")
    per_epoch = len(want[rank][0])
    for epoch in range(s["epochs"]):
        got = [i for batch in seen[epoch * per_epoch:(epoch + 1) * per_epoch] for i in batch]
        order = [i for batch in want[rank][epoch] for i in batch]
        if got == order:
            continue
        shown = f"{what}: in epoch {epoch}, rank {rank} saw samples {got}; expected {order}"
        same_as = [e for e in range(s["epochs"] + 1)
                   if sampler_order(s["samples"], world_size, rank, s["seed"], e) == got]
        if same_as and epoch > 0 and same_as[0] == 0:
            raise CheckFailed(f"{shown}: that is epoch 0's order again. Without "
                              "sampler.set_epoch(epoch) a DistributedSampler shuffles every "
                              "epoch with the same generator seed (seed + 0): call "
                              "sampler.set_epoch(epoch) at the start of each epoch, before "
                              "iterating the loader")
        if same_as:
            raise CheckFailed(f"{shown}: that is DistributedSampler's order of epoch "
                              f"{same_as[0]}: call sampler.set_epoch(epoch) with this epoch's "
                              "number, before iterating the loader")
        raise CheckFailed(f"{shown} (DistributedSampler(dataset, shuffle=True, seed=seed) after "
                          "set_epoch(epoch): the same seed on every rank, one shuffle per epoch "
                          "shared by all ranks, each rank taking every world_size-th sample)")


def judge_epochs(observations, world_size, situations):
    """Situation by situation: each rank's batches, epoch by epoch, against torch's sampler; the
    replicas; the weights against one process."""
    calls_by_rank = every_ranks_calls(observations, len(situations))
    for number, s in enumerate(situations):
        what = _describe_epochs(s, world_size)
        calls = [calls[number] for calls in calls_by_rank]
        want = expected_batches(s, world_size)
        judge_each_rank(calls, lambda rank, call: _judge_order(rank, call, s, world_size, want,
                                                               what))
        reference = epochs_reference(s, world_size)
        states = [_reported_state(call, "weights", reference, what) for call in calls]
        _judge_replicas(states, what)
        diff, where, close = _largest_difference(states[0], reference)
        if not close:
            raise CheckFailed(f"{what}: the weights are not those of one process training on "
                              f"each step's global batch (largest difference {diff:.3g}, in "
                              f"{where!r}; allowed {ATOL:g} + {RTOL:g} * |w|): one "
                              "optimizer.step() per batch, loss F.mse_loss(ddp_model(x), y)")


EPOCHS = Case(observe_epochs, judge_epochs)


# === lab 9: gradient accumulation with no_sync ===================================================


def accumulation_situation(micro: int, k: int, seed: int = 0, rows: int = 3, lr: float = 0.2,
                           momentum: float = 0.0) -> dict:
    return {"micro": micro, "k": k, "seed": seed, "rows": rows, "lr": lr, "momentum": momentum}


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


def observe_accumulated(rank, world_size, train_accumulated, s):
    """One situation (the communication counted is the whole case's): a fresh DDP model
    (rank-seeded), its optimizer, this rank's micro-batches; the student's call, audited; the
    gradients at every optimizer step and the weights afterwards."""
    ddp_model = DistributedDataParallel(make_regressor(rank_seed(s["seed"], rank)))
    optimizer = make_optimizer(s, ddp_model)
    names = [name for name, _ in ddp_model.module.named_parameters()]
    gradients: list = []

    def record(optimizer_, args, kwargs):
        gradients.append({name: None if p.grad is None else p.grad.detach().clone()
                          for name, p in zip(names, ddp_model.module.parameters())})

    handle = optimizer.register_step_pre_hook(record)
    raised = None
    with audited_traffic() as traffic:
        try:
            train_accumulated(ddp_model, optimizer, micro_batches(s, rank), s["k"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            raised = exc
    handle.remove()
    return {"raised": _raised(raised), "gradients": gradients,
            "weights": _state(ddp_model.module), "traffic": traffic}


def accumulated_reference(s: dict, world_size: int) -> tuple[list[dict], dict]:
    """One process, rank 0's initial model: for each group of ``k`` micro-batches (the last may
    be shorter), every rank's micro-batches of the group concatenated, the mean loss, one step.
    The gradients at each step, and the weights at the end."""
    model = make_regressor(rank_seed(s["seed"], 0))
    optimizer = make_optimizer(s, model)
    per_rank = [micro_batches(s, rank) for rank in range(world_size)]
    gradients = []
    for start in range(0, s["micro"], s["k"]):
        group = [batch for batches in per_rank for batch in batches[start:start + s["k"]]]
        optimizer.zero_grad()
        F.mse_loss(model(torch.cat([b[0] for b in group])),
                   torch.cat([b[1] for b in group])).backward()
        gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        optimizer.step()
    return gradients, _state(model)


def _describe_accumulated(s: dict, world_size: int) -> str:
    extra = f", momentum={s['momentum']}" if s["momentum"] else ""
    return (f"train_accumulated with {s['micro']} micro-batches per rank, accumulation_steps="
            f"{s['k']}{extra}, {world_size} rank(s)")


def gradient_syncs(call: dict, per_sync: int, what: str) -> tuple[int, int]:
    """(synchronised backwards, all-reduce calls): the all-reduced bytes in units of one full
    gradient exchange (a loss all-reduced for logging is far smaller than one unit)."""
    traffic = observed(call, "traffic", dict)
    calls = observed(traffic, "collective_calls", list)
    total = count = 0
    for entry in calls:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or type(entry[1]) is not int):
            raise CheckFailed(f"{what}: the rank's communication record is malformed")
        if entry[0] == "all_reduce":
            total += entry[1]
            count += 1
    return total // per_sync, count


def _judge_accumulated_call(call: Any, s: dict, reference: dict, per_sync: int,
                            what: str) -> list:
    _judge_raised(call, what)
    steps = optimizer_steps(s)
    gradients = observed(call, "gradients", list)
    if len(gradients) != steps:
        raise CheckFailed(f"{what}: optimizer.step() ran {len(gradients)} time(s); expected "
                          f"{steps}, one per group of accumulation_steps micro-batches "
                          f"(ceil({s['micro']} / {s['k']}), the last group may be shorter)")
    syncs, _ = gradient_syncs(call, per_sync, what)
    if syncs > steps:
        advice = ("one per micro-batch: DDP arms its all-reduce in the FORWARD (the forward "
                  "checks whether it runs inside no_sync()), so a backward alone inside "
                  "no_sync() still all-reduces; run forward AND backward of every micro-batch "
                  "but the group's last inside `with ddp_model.no_sync():`"
                  if syncs == s["micro"] else
                  "only the last micro-batch of each group may run outside no_sync() (its "
                  "forward and its backward)")
        raise CheckFailed(f"{what}: expected {steps} gradient all-reduce(s), one per optimizer "
                          f"step, but the ranks all-reduced the gradients {syncs} time(s): "
                          f"{advice}")
    if syncs < steps:
        raise CheckFailed(f"{what}: expected {steps} gradient all-reduce(s), one per optimizer "
                          f"step, but the ranks all-reduced the gradients {syncs} time(s): the "
                          "last micro-batch of every group (the shorter last group's too) must "
                          "run its forward and backward outside no_sync(), so that DDP "
                          "all-reduces the accumulated gradients before optimizer.step()")
    for step, grads in enumerate(gradients):
        if not isinstance(grads, dict) or set(grads) != set(reference) or not all(
                g is None or (isinstance(g, torch.Tensor) and g.shape == reference[n].shape)
                for n, g in grads.items()):
            raise CheckFailed(f"{what}: the report of the gradients is malformed")
        if any(g is None for g in grads.values()):
            raise CheckFailed(f"{what}: at optimizer step {step} some parameter has no "
                              "gradient (grad is None): step after the group's backwards")
    return gradients


def judge_accumulated(observations, world_size, s):
    """Each rank's call (steps, all-reduces); per step, the gradients alike on every rank and
    equal to one process's; the replicas; the weights against one process."""
    what = _describe_accumulated(s, world_size)
    ref_gradients, reference = accumulated_reference(s, world_size)
    per_sync = gradient_bytes(make_regressor(0))
    gradients: list = []
    judge_each_rank(observations, lambda rank, call: gradients.append(
        _judge_accumulated_call(call, s, reference, per_sync, what)))
    for step in range(optimizer_steps(s)):
        for rank in range(1, world_size):
            for name, grad in gradients[rank][step].items():
                if not torch.equal(grad, gradients[0][step][name]):
                    raise CheckFailed(
                        f"{what}: at optimizer step {step}, rank {rank}'s gradient of {name!r} "
                        "differs from rank 0's: the step used gradients that were not "
                        "all-reduced after the group's last backward. DDP all-reduces in the "
                        "backward of a forward run outside no_sync(); the micro-batches "
                        "accumulated after that stay local. Sync the LAST micro-batch of each "
                        "group (position k - 1, or the last of a shorter group), not the first")
        diff, where, close = _largest_difference(gradients[0][step], ref_gradients[step])
        if not close:
            raise CheckFailed(f"{what}: the gradients at optimizer step {step} are not one "
                              "process's gradient of the mean loss over that group's "
                              f"micro-batches on every rank (largest difference {diff:.3g}, in "
                              f"{where!r}; allowed {ATOL:g} + {RTOL:g} * |g|): divide each "
                              "micro-batch's loss by the number of micro-batches in its group, "
                              "and zero the gradients after every step")
    states = [_reported_state(call, "weights", reference, what) for call in observations]
    _judge_replicas(states, what)
    diff, where, close = _largest_difference(states[0], reference)
    if not close:
        raise CheckFailed(f"{what}: the weights are not those of one process on the same "
                          f"accumulated steps (largest difference {diff:.3g}, in {where!r}; "
                          f"allowed {ATOL:g} + {RTOL:g} * |w|)")


ACCUMULATED = Case(observe_accumulated, judge_accumulated, audit_traffic=True)


def run_accumulation(train_accumulated, world_size: int, situations: list[dict],
                     **kwargs) -> None:
    """One case per situation: the communication the grader counts is the whole case's."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for s in situations:
        run_lab(ACCUMULATED, "accumulated", world_size, train_accumulated, s, **kwargs)


# === what the notebook's "run it" cells show ======================================================


def watch_accuracy(rank, world_size, accuracy, samples=7, batch_size=2, seed=0):
    """What ``accuracy`` returns on this rank, for the notebook."""
    model = make_classifier(seed)
    return accuracy(model, TensorDataset(*make_eval_data(samples, seed)), batch_size)


def watch_epochs(rank, world_size, train_epochs, samples=7, batch_size=2, epochs=3, seed=0):
    """The samples this rank's model saw, epoch by epoch, for the notebook."""
    s = epochs_situation(samples, batch_size, epochs, seed)
    call = observe_epochs(rank, world_size, train_epochs, [s])["calls"][0]
    seen = [i for batch in _rows_to_samples(call["inputs"], make_train_data(samples, seed)[0],
                                            "watch") for i in batch]
    per_epoch = math.ceil(samples / world_size)
    return [seen[e * per_epoch:(e + 1) * per_epoch] for e in range(epochs)]


def watch_accumulation(rank, world_size, train_accumulated, micro=6, k=3, seed=0):
    """Optimizer steps, gradient all-reduces (in-rank audit) and how far the weights are from
    each other and from one process, for the notebook."""
    s = accumulation_situation(micro, k, seed)
    call = observe_accumulated(rank, world_size, train_accumulated, s)
    _, reference = accumulated_reference(s, world_size)
    mine = torch.cat([w.reshape(-1) for w in call["weights"].values()])
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    one = torch.cat([w.reshape(-1) for w in reference.values()])
    return {"optimizer steps": len(call["gradients"]),
            "gradient all-reduces": gradient_syncs(call, gradient_bytes(make_regressor(0)),
                                                   "watch")[0],
            "largest difference between ranks": max((o - mine).abs().max().item()
                                                    for o in everyone),
            "largest difference from one process": (mine - one).abs().max().item()}


# === the visible checks ===========================================================================

VISIBLE_ACCURACY = [accuracy_situation(7, 2, seed=0), accuracy_situation(9, 4, seed=1)]
VISIBLE_EPOCHS = [epochs_situation(7, 2, 3, seed=0), epochs_situation(9, 3, 2, seed=5)]
VISIBLE_ACCUMULATION = [accumulation_situation(6, 3, seed=0), accumulation_situation(5, 2, seed=1)]


def check_accuracy(accuracy) -> None:
    """2 ranks, 7 and 9 samples (DistributedSampler pads both): the exact accuracy."""
    run_lab(ACCURACY, "accuracy", 2, accuracy, VISIBLE_ACCURACY)


def check_train_epochs(train_epochs) -> None:
    """2 ranks, 2-3 epochs: DistributedSampler's order of each epoch, one process's weights."""
    run_lab(EPOCHS, "epochs", 2, train_epochs, VISIBLE_EPOCHS)


def check_train_accumulated(train_accumulated) -> None:
    """2 ranks, groups of 3 and of 2 with a tail: one all-reduce per step, one process's
    weights."""
    run_accumulation(train_accumulated, 2, VISIBLE_ACCUMULATION)
