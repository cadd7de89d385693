"""Chapter 07, the training loop: visible checks for ``train_steps`` (gradient accumulation with
DDP), and the case the hidden checks reuse.

The contract is the docstring of ``train_steps`` in solutions/07_training_loop/train_steps.nb.py
(students: exercises/07_training_loop/train_steps.ipynb).

One :class:`~ddpcourse.grading.checks.Case`, ``TRAIN_STEPS``. Each rank builds the model from a
seed of its own (so only DDP's broadcast of rank 0's state makes the replicas start alike), wraps
it in ``DistributedDataParallel``, makes its own micro-batches and the optimizer, and calls the
student's function inside :func:`~ddpcourse.grading.checks.audited_traffic`. It reports what came
back, the parameters afterwards, and the communication. The judge, which never runs the student's
code, rebuilds rank 0's model and every rank's micro-batches and trains one process on the
equivalent large batches: for each optimizer step, the micro-batches of its group from every rank,
concatenated, with the same loss (a mean over rows) and the same optimizer. It decides:

* the gradients were all-reduced exactly once per optimizer step: the all-reduced bytes (DDP's
  buckets carry every gradient element once per synchronised backward) divided by the bytes of
  the model's gradients is the number of synchronised backwards. When a class is graded the bytes
  come from the grader's broker, which the student's code cannot bypass;
* the returned losses are the global means of each step, the same list on every rank;
* every rank holds bit-identical parameters (DDP's all-reduce hands every rank the same average);
* they equal the one-process run within ``ATOL + RTOL * |w|``: the all-reduce and the accumulation
  add the same terms as one process does, in another order, and float32 addition is not
  associative. Measured for every case of these checks: at most 2.4e-7. Each plausible mistake
  (no division by the number of micro-batches, the tail divided by ``accumulation_steps``, a
  missing ``zero_grad``, one step too many or too few) moves some weight by 1e-3 or more.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcourse.grading.checks import (Case, CheckFailed, audited_traffic, cut_text, expect_close,
                                      judge_each_rank, observed, run_student, safe_text, type_name)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
AUDITED_CASES_BUILD_DDP = True  # the grader's one-rank hosts preload what DDP imports
ATOL, RTOL = 1e-5, 1e-5
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
IN_FEATURES, HIDDEN, OUT_FEATURES = 12, 32, 4
_MAX_TEXT = 300  # of a text a rank reports, in a message


class Net(nn.Module):
    """A small MLP (about 1,000 parameters: a gradient all-reduce is far larger than any loss
    a student may all-reduce for logging)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.mid = nn.Linear(HIDDEN, 16)
        self.out = nn.Linear(16, OUT_FEATURES)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def gradient_bytes(model: nn.Module) -> int:
    """What one synchronised backward all-reduces: every trainable parameter's gradient once."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def setting(micro: int, k: int, rows: int = 3, seed: int = 0, loss: str = "mse",
            momentum: float = 0.0, lr: float = 0.2) -> dict:
    """One situation of the case, as plain data (the ranks and the judge rebuild the rest)."""
    return {"micro": micro, "k": k, "rows": rows, "seed": seed, "loss": loss,
            "momentum": momentum, "lr": lr}


def make_model(seed: int) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net()


def rank_seed(seed: int, rank: int) -> int:
    return 7919 * seed + 104729 * rank + 17


def micro_batches(s: dict, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro-batches: ``s["micro"]`` of ``s["rows"]`` rows each."""
    generator = torch.Generator().manual_seed(rank_seed(s["seed"], rank) + 1)
    batches = []
    for _ in range(s["micro"]):
        x = torch.randn(s["rows"], IN_FEATURES, generator=generator)
        if s["loss"] == "cross_entropy":
            y = torch.randint(0, OUT_FEATURES, (s["rows"],), generator=generator)
        else:
            y = torch.randn(s["rows"], OUT_FEATURES, generator=generator)
        batches.append((x, y))
    return batches


def make_loss_fn(s: dict) -> nn.Module:
    return nn.CrossEntropyLoss() if s["loss"] == "cross_entropy" else nn.MSELoss()


def make_optimizer(s: dict, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"])


def optimizer_steps(micro: int, k: int) -> int:
    return math.ceil(micro / k) if k >= 1 else 0


# --- in the rank: what the call did, as data ---------------------------------------------------


def _losses_as_data(value: Any) -> list[float] | None:
    if type(value) is not list or not all(type(v) is float for v in value):
        return None
    return list(value)


def observe_train_steps(rank, world_size, train_steps, s):
    """One situation: a fresh DDP model (rank-seeded: DDP's constructor broadcasts rank 0's),
    this rank's micro-batches, the optimizer; the student's call, its communication audited."""
    ddp_model = DistributedDataParallel(make_model(rank_seed(s["seed"], rank)))
    batches = micro_batches(s, rank)
    optimizer = make_optimizer(s, ddp_model)
    raised = None
    with audited_traffic() as traffic:
        try:
            returned = train_steps(ddp_model, batches, optimizer, make_loss_fn(s), s["k"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            returned, raised = None, exc
    return {
        "raised": None if raised is None else {
            "type": type(raised).__name__, "message": safe_text(lambda: raised, _MAX_TEXT)},
        "returned": type_name(returned),
        "returned_text": safe_text(lambda: repr(returned), _MAX_TEXT),
        "losses": _losses_as_data(returned),
        "weights": {name: p.detach().clone() for name, p in ddp_model.module.named_parameters()},
        "traffic": traffic,
    }


# --- in the judge: the one-process reference, and the verdict --------------------------------


def reference_run(s: dict, world_size: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, rank 0's initial model, one optimizer step per group of ``k`` micro-batches
    on every rank's micro-batches of that group, concatenated (a mean loss over all their rows)."""
    model = make_model(rank_seed(s["seed"], 0))
    optimizer = make_optimizer(s, model)
    loss_fn = make_loss_fn(s)
    per_rank = [micro_batches(s, rank) for rank in range(world_size)]
    losses = []
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


def _shown(s: dict, world_size: int) -> str:
    extra = [f"{key}={s[key]}" for key in ("loss", "momentum") if s[key] != setting(1, 1)[key]]
    return (f"train_steps with {s['micro']} micro-batches of {s['rows']} rows per rank, "
            f"accumulation_steps={s['k']}, {world_size} rank(s)"
            + (f" ({', '.join(extra)})" if extra else ""))


def _gradient_syncs(call: dict, per_sync: int, what: str) -> int:
    """Synchronised backwards: the bytes all-reduced, in units of one full gradient exchange.
    Losses all-reduced for logging are far smaller than one unit, so they do not count."""
    traffic = observed(call, "traffic", dict)
    calls = observed(traffic, "collective_calls", list)
    total = 0
    for entry in calls:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or type(entry[1]) is not int):
            raise CheckFailed(f"{what}: the rank's communication record is malformed")
        if entry[0] == "all_reduce":
            total += entry[1]
    return total // per_sync


def _judge_call(call: Any, s: dict, reference: dict, ref_losses: list[float], per_sync: int,
                what: str) -> list[float]:
    """What one rank's call did on its own: raised, returned, communicated."""
    raised = observed(call, "raised", (dict, type(None)))
    if raised is not None:
        raise CheckFailed(f"{what}: your code raised {cut_text(observed(raised, 'type', str), 80)}"
                          f": {cut_text(observed(raised, 'message', str), _MAX_TEXT)}")
    losses = observed(call, "losses", (list, type(None)))
    if losses is None or not all(type(v) is float for v in losses):
        raise CheckFailed(f"{what}: expected a list of Python floats (one per optimizer step; "
                          "`loss.item()` gives one), got "
                          f"{cut_text(observed(call, 'returned', str), 80)}: "
                          f"{cut_text(observed(call, 'returned_text', str), 200)}")
    steps = len(ref_losses)
    syncs = _gradient_syncs(call, per_sync, what)
    if syncs != steps:
        advice = ("a micro-batch whose forward AND backward run outside `ddp_model.no_sync()` "
                  "all-reduces the gradients; only the last micro-batch of each group may"
                  if syncs > steps else
                  "the last micro-batch of every group (the tail's too) must run its forward and "
                  "backward outside `no_sync()`, so that DDP all-reduces the accumulated "
                  "gradients before `optimizer.step()`")
        raise CheckFailed(f"{what}: expected {steps} gradient all-reduce(s), one per optimizer "
                          f"step, but the ranks all-reduced the gradients {syncs} time(s): "
                          f"{advice}")
    if len(losses) != steps:
        raise CheckFailed(f"{what}: expected {steps} losses (one per optimizer step: "
                          f"ceil({s['micro']} / {s['k']})), got {len(losses)}")
    weights = observed(call, "weights", dict)
    if set(weights) != set(reference) or not all(
            isinstance(w, torch.Tensor) for w in weights.values()):
        raise CheckFailed(f"{what}: the report of the model's parameters is not "
                          f"{sorted(reference)} as tensors")
    return losses


def _judge_weights(call: Any, reference: dict, what: str) -> None:
    weights = observed(call, "weights", dict)
    for name, expected in reference.items():
        expect_close(weights[name], expected, f"{what}: parameter {name!r} after training, "
                     "compared with one process on the same micro-batches of every rank",
                     RTOL, ATOL)


def _judge_losses(losses: list[float], ref_losses: list[float], what: str) -> None:
    for step, (got, expected) in enumerate(zip(losses, ref_losses)):
        if not math.isclose(got, expected, rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL):
            raise CheckFailed(f"{what}: the loss of optimizer step {step} should be {expected:.6g}"
                              f" (the mean over that step's micro-batches on every rank), got "
                              f"{got:.6g}. Losses expected {[round(v, 6) for v in ref_losses]}, "
                              f"got {[round(v, 6) for v in losses]}")


def judge_train_steps(observations, world_size, s):
    """Each rank's own call; the replicas; the weights against one process; the losses against
    one process, and alike on every rank."""
    what = _shown(s, world_size)
    reference, ref_losses = reference_run(s, world_size)
    per_sync = gradient_bytes(make_model(0))
    returned: list = []
    judge_each_rank(observations, lambda rank, call: returned.append(
        _judge_call(call, s, reference, ref_losses, per_sync, what)))
    _judge_replicas(observations, what)
    judge_each_rank(observations, lambda rank, call: _judge_weights(call, reference, what))
    judge_each_rank(returned, lambda rank, losses: _judge_losses(losses, ref_losses, what))
    if any(losses != returned[0] for losses in returned):
        raise CheckFailed(f"{what}: every rank must return the same global losses, got "
                          f"{[[round(v, 6) for v in losses] for losses in returned]}")


def _judge_replicas(calls: list, what: str) -> None:
    """Bit for bit: every rank applied the same averaged gradients."""
    first = observed(calls[0], "weights", dict)
    for rank, call in enumerate(calls[1:], start=1):
        for name, tensor in observed(call, "weights", dict).items():
            if not torch.equal(tensor, first[name]):
                diff = (tensor.double() - first[name].double()).abs().max().item()
                raise CheckFailed(f"{what}: rank {rank}'s {name!r} differs from rank 0's by up "
                                  f"to {diff:.3g}: the replicas are no longer identical (did "
                                  "every rank's optimizer step use all-reduced gradients?)")


def observe_bad_steps(rank, world_size, train_steps, values):
    """``train_steps`` with each bad ``accumulation_steps``: what it raised."""
    calls = []
    for k in values:
        s = setting(2, 1)
        ddp_model = DistributedDataParallel(make_model(rank_seed(0, rank)))
        before = {n: p.detach().clone() for n, p in ddp_model.module.named_parameters()}
        try:
            returned = train_steps(ddp_model, micro_batches(s, rank),
                                   make_optimizer(s, ddp_model), make_loss_fn(s), k)
            raised = None
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            returned, raised = None, exc
        calls.append({"value_error": isinstance(raised, ValueError),
                      "raised": None if raised is None else type(raised).__name__,
                      "returned_text": safe_text(lambda: repr(returned), _MAX_TEXT),
                      "unchanged": all(torch.equal(p, before[n])
                                       for n, p in ddp_model.module.named_parameters())})
    return {"calls": calls}


def judge_bad_steps(observations, world_size, values):
    def judge_rank(rank, observation):
        calls = observed(observation, "calls", list)
        if len(calls) != len(values):
            raise CheckFailed("the rank's report has the wrong number of calls")
        for call, k in zip(calls, values):
            what = f"train_steps(..., accumulation_steps={k!r})"
            if observed(call, "value_error", bool) is not True:
                raised = observed(call, "raised", (str, type(None)))
                got = (f"it raised {cut_text(raised, 80)}" if raised else
                       f"it returned {cut_text(observed(call, 'returned_text', str), 200)}")
                raise CheckFailed(f"{what}: expected ValueError (accumulation_steps must be an "
                                  f"int >= 1), {got}")
            if observed(call, "unchanged", bool) is not True:
                raise CheckFailed(f"{what}: the model changed before the ValueError; check the "
                                  "argument first")

    judge_each_rank(observations, judge_rank)


TRAIN_STEPS = Case(observe_train_steps, judge_train_steps, audit_traffic=True)
BAD_STEPS = Case(observe_bad_steps, judge_bad_steps)


def run_settings(train_steps, world_size: int, settings: list[dict], **kwargs) -> None:
    """One case per situation: the communication the grader counts is the whole case's."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for s in settings:
        run_student(TRAIN_STEPS, world_size, train_steps, s, **kwargs)


def check_accumulation_matches_one_process(train_steps) -> None:
    run_settings(train_steps, 2, [setting(4, 2), setting(6, 3, seed=1)])


def check_one_all_reduce_per_optimizer_step(train_steps) -> None:
    run_settings(train_steps, 2, [setting(6, 3, seed=2), setting(3, 1, seed=3)])


def check_the_tail(train_steps) -> None:
    """5 micro-batches in groups of 2: the last optimizer step has one micro-batch."""
    run_settings(train_steps, 2, [setting(5, 2, seed=4), setting(7, 3, seed=5)])
