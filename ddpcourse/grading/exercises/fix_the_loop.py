"""Chapter 07, the DDP training loop: visible checks for ``train`` (exercise fix_the_loop), and
the case the hidden checks reuse.

The contract is the docstring of ``train`` in solutions/07_training_loop/fix_the_loop.nb.py
(students: exercises/07_training_loop/fix_the_loop.ipynb). It runs on every rank of a gloo group;
every rank gets a ``backbone`` and a ``head`` initialised differently (only rank 0's initial
weights may count) and batches of its own.

One :class:`~ddpcourse.grading.checks.Case`. Around each call of the student's function a rank
records only data: the input of every forward of the backbone (a forward pre-hook), how often the
head's forward ran, what the call returned (the logged losses) and both modules' parameters
afterwards. The judge, which never runs the student's code, rebuilds every rank's modules and
batches itself, trains one process on the global batches, and decides, situation by situation:

* (in place) the modules handed in were trained, not copies of them;
* (rows) at step s the backbone's forward ran once, on exactly this rank's batch of step s (no
  extra forward, no other rank's rows);
* (agree) all ranks hold bit-identical backbones and heads: DDP replicas take identical steps;
* (weights) they equal one process training rank 0's initial modules with plain SGD on the global
  batch of each step (all ranks' batches concatenated, mean cross-entropy), within
  ``ATOL + RTOL * |w|``. The ranks add the same numbers in another order than one process does,
  and float32 addition is not associative. Measured for every situation of these checks with three
  right loops (one DDP around both modules, two DDPs, the head averaged by hand): at most 6e-8,
  the replicas bit-identical; the closest wrong loop of the grading tests is off by 2.7e-2
  (the loss divided by the world size), a summed loss by 0.12, a head outside DDP by 0.04;
* (losses) the returned list holds, at every step, the global batch's mean loss before the
  step, on every rank (one process's loss), within ``LOSS_ATOL + LOSS_RTOL * |loss|``: measured
  at most 1.2e-7 off; a rank's own loss is off by 1.6e-2 or more, a sum over the ranks by 0.99.

When something is wrong, the judge replays plausible mistakes on the same data (a head outside
DDP, a head wrapped but bypassed, gradients summed instead of averaged, rank 0's head broadcast
after each step, a summed loss...), N ranks simulated in one process, and names the one that
reproduces what every rank holds.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ddpcourse.grading.checks import (Case, CheckFailed, cut_text, every_ranks_calls,
                                      judge_each_rank, observed, reported_tensors, run_student,
                                      safe_text, type_name)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
ATOL, RTOL = 1e-5, 1e-5  # on the weights
LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-5  # on the logged losses
IN_FEATURES, HIDDEN, CLASSES = 6, 16, 3
MAX_RECORDED_FORWARDS = 64  # of one call; more is reported as a count only
MAX_RECORDED_ROWS = 256  # of one forward's input; a larger input is reported by its shape only
MAX_LOSSES = 64  # of one call's returned list
MAX_TEXT = 300
ALL_CHECKS = ("in_place", "rows", "agree", "weights", "losses")
MODULES = ("backbone", "head")


@dataclass(frozen=True)
class Situation:
    """One call of ``train``: every rank gets ``steps`` batches of ``rows`` rows; ``seed`` picks
    the modules and the data. Travels to the ranks as a plain tuple (rows, steps, lr, seed)."""

    rows: int
    steps: int
    lr: float
    seed: int

    def describe(self, world_size: int) -> str:
        return (f"{world_size} rank{'s' if world_size > 1 else ''}, {self.steps} steps of "
                f"{self.rows} rows per rank, lr {self.lr:g}, seed {self.seed}")


# --- the modules and the data: built the same way in the ranks, the judge and the notebook -----


class Backbone(nn.Module):
    """A small feature extractor; the head maps its HIDDEN features to CLASSES logits."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.Tanh())

    def forward(self, x):
        return self.net(x)


def make_backbone(seed: int) -> Backbone:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Backbone()


def make_head(seed: int) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(HIDDEN, CLASSES)


def module_seeds(seed: int, rank: int) -> tuple[int, int]:
    """(backbone, head) seeds: every rank starts from other modules; rank 0's are the ones that
    count."""
    return 1000 * seed + 17 * rank + 1, 1000 * seed + 17 * rank + 501


def make_batches(seed: int, rank: int, steps: int, rows: int) -> list:
    """``batches[step] = (x, y)``: rank ``rank``'s batch of each step. The labels come from one
    linear teacher, the same on every rank, so there is something to learn."""
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(100_003 * seed + 7919 * rank + 11)
    batches = []
    for _ in range(steps):
        x = torch.randn(rows, IN_FEATURES, generator=generator)
        batches.append((x, (x @ teacher).argmax(dim=1)))
    return batches


def global_batches(world_size: int, rows: int, steps: int, seed: int) -> list:
    """The one-process view: at each step, every rank's batch, concatenated in rank order."""
    per_rank = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
    return [(torch.cat([batches[step][0] for batches in per_rank]),
             torch.cat([batches[step][1] for batches in per_rank])) for step in range(steps)]


def train_one_process(backbone: nn.Module, head: nn.Module, batches: list,
                      lr: float) -> list[float]:
    """The reference: one process, one step per global batch ``(x, y)``, mean cross-entropy,
    plain SGD on both modules. Returns each step's loss (before its update)."""
    optimizer = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(head(backbone(x)), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


@contextlib.contextmanager
def _one_thread():
    """The judge's replays are thousands of tiny ops: on a busy machine, torch's intra-op threads
    cost several times what they save (measured: 0.9 s of CPU instead of 0.2 s to replay 19
    mistakes of one situation)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --- in the ranks: record only -----------------------------------------------------------------


def _recorded_input(args: tuple) -> torch.Tensor | str:
    first = args[0] if args else None
    if (isinstance(first, torch.Tensor) and first.layout == torch.strided and first.dim() == 2
            and first.shape[0] <= MAX_RECORDED_ROWS and first.shape[1] == IN_FEATURES):
        return first.detach().to("cpu").clone()
    if isinstance(first, torch.Tensor):
        return f"a tensor of shape {tuple(first.shape)}"
    return type_name(first)


def _reported_losses(result: Any) -> list[float] | None:
    """The returned losses as floats, when it is a list (or tuple) of real numbers."""
    if not isinstance(result, (list, tuple)):
        return None
    values = []
    for value in result[:MAX_LOSSES]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        values.append(float(value))
    return values


def observe_call(rank: int, train, situation: tuple) -> dict:
    """Build this rank's modules and batches, call ``train`` once, report what it did."""
    rows, steps, lr, seed = situation
    backbone_seed, head_seed = module_seeds(seed, rank)
    backbone, head = make_backbone(backbone_seed), make_head(head_seed)
    batches = make_batches(seed, rank, steps, rows)
    inputs: list = []
    calls = {"backbone": 0, "head": 0}

    def record_backbone(module, args):
        calls["backbone"] += 1
        if len(inputs) < MAX_RECORDED_FORWARDS:
            inputs.append(_recorded_input(args))

    def count_head(module, args):
        calls["head"] += 1

    hooks = [backbone.register_forward_pre_hook(record_backbone),
             head.register_forward_pre_hook(count_head)]
    try:
        result = train(backbone, head, [(x.clone(), y.clone()) for x, y in batches], lr)
    finally:
        for hook in hooks:
            hook.remove()
    return {"backbone_calls": calls["backbone"], "head_calls": calls["head"], "inputs": inputs,
            "losses": _reported_losses(result),
            "returned": type_name(result),
            "returned_length": len(result) if isinstance(result, (list, tuple)) else -1,
            "returned_text": safe_text(lambda: repr(result), 120),
            "backbone": _state(backbone), "head": _state(head)}


def observe_training(rank, world_size, train, situations, checks=ALL_CHECKS):
    """Every situation in turn, in this rank; ``checks`` only matters to the judge."""
    return {"calls": [observe_call(rank, train, situation) for situation in situations]}


# --- in the judge: the reference, the replays and the verdict ------------------------------------


def _text(value: Any) -> str:
    return cut_text(value, MAX_TEXT)


@dataclass
class Expected:
    """What the judge computes for one situation, without any of the student's code."""

    batches: list  # batches[rank][step] = (x, y)
    starts: list  # starts[rank] = {"backbone": state, "head": state}, as handed in
    reference: dict  # {"backbone": state, "head": state} of one process
    losses: list[float]  # one process's loss at each step
    own_losses: list[list[float]]  # own_losses[rank][step]: the rank's batch, right weights
    moved: float  # how far training moves the reference's weights (max over parameters)


def expected_for(world_size: int, situation: Situation) -> Expected:
    rows, steps, lr, seed = situation.rows, situation.steps, situation.lr, situation.seed
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), _one_thread():
        batches = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
        starts = []
        for rank in range(world_size):
            backbone_seed, head_seed = module_seeds(seed, rank)
            starts.append({"backbone": _state(make_backbone(backbone_seed)),
                           "head": _state(make_head(head_seed))})
        backbone, head = _modules_from(starts[0])
        own_losses: list[list[float]] = [[] for _ in range(world_size)]
        optimizer = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=lr)
        losses = []
        for step, (x, y) in enumerate(global_batches(world_size, rows, steps, seed)):
            optimizer.zero_grad()
            logits = head(backbone(x))
            loss = F.cross_entropy(logits, y)
            for rank in range(world_size):
                mine = slice(rank * rows, (rank + 1) * rows)
                own_losses[rank].append(F.cross_entropy(logits[mine], y[mine]).item())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    reference = {"backbone": _state(backbone), "head": _state(head)}
    moved = max((reference[m][name].double() - starts[0][m][name].double()).abs().max().item()
                for m in MODULES for name in reference[m])
    return Expected(batches, starts, reference, losses, own_losses, moved)


def _modules_from(state: dict) -> tuple[nn.Module, nn.Module]:
    backbone, head = make_backbone(0), make_head(0)
    backbone.load_state_dict(state["backbone"])
    head.load_state_dict(state["head"])
    return backbone, head


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[m][n], want[m][n], rtol=RTOL, atol=ATOL)
               for m in MODULES for n in want[m])


def _identical(a: dict, b: dict) -> bool:
    return all(torch.equal(a[m][n], b[m][n]) for m in MODULES for n in a[m])


def _largest_difference(got: dict, want: dict) -> tuple[float, str]:
    worst, where = -1.0, ""
    for m in MODULES:
        for name in want[m]:
            diff = (got[m][name].double() - want[m][name].double()).abs().max().item()
            if diff > worst:
                worst, where = diff, f"{m}'s {name!r}"
    return worst, where


def judge_training(observations, world_size, situations, checks=ALL_CHECKS):
    reports = every_ranks_calls(observations, len(situations))
    for number, situation in enumerate(situations):
        judge_situation([report[number] for report in reports], world_size,
                        Situation(*situation), checks)


def judge_situation(calls: list, world_size: int, situation: Situation, checks) -> None:
    what = situation.describe(world_size)
    expected = expected_for(world_size, situation)
    states: list[dict] = []

    def judge_rank(rank, call):
        if not isinstance(call, dict):
            raise CheckFailed(f"the rank's report of a call is a {type_name(call)}")
        state = {m: reported_tensors(observed(call, m, dict), expected.reference[m],
                                     f"{what}: after training, the {m}'s") for m in MODULES}
        if "in_place" in checks:
            _judge_in_place(rank, state, expected, situation, what)
        if "rows" in checks:
            _judge_rows(rank, world_size, call, expected, situation, what)
        states.append(state)

    judge_each_rank(calls, judge_rank)
    # Every rank's report is sound from here on; what follows compares ranks, then each rank
    # with one process (replicas that disagree say more than weights that differ).
    agree = all(_identical(s, states[0]) for s in states)
    if "agree" in checks and not agree:
        why = _diagnosis(states, world_size, situation, expected, replicas_agree=False)
        judge_each_rank(states, lambda rank, state: _judge_replicas(states, rank, state, what,
                                                                    why))
    if "weights" in checks and not all(_close(s, expected.reference) for s in states):
        why = _diagnosis(states, world_size, situation, expected, agree)
        judge_each_rank(states, lambda rank, state: _judge_weights(state, expected, what, why))
    if "losses" in checks:  # last: wrong weights make wrong losses, and say more
        judge_each_rank(calls, lambda rank, call: _judge_losses(rank, call, expected, situation,
                                                                what))


def _judge_in_place(rank: int, state: dict, expected: Expected, situation: Situation,
                    what: str) -> None:
    if situation.steps == 0:
        return
    for module in MODULES:
        start = expected.starts[rank][module]
        if all(torch.equal(state[module][name], start[name]) for name in start):
            raise CheckFailed(
                f"{what}: the {module} handed to train still has its initial weights: train "
                "the modules you were given, in place (DDP trains the module it wraps; do not "
                "train a copy)")


def _judge_rows(rank: int, world_size: int, call: dict, expected: Expected,
                situation: Situation, what: str) -> None:
    steps = situation.steps
    backbone_calls = observed(call, "backbone_calls", int)
    head_calls = observed(call, "head_calls", int)
    inputs = observed(call, "inputs", list)
    if backbone_calls != steps:
        raise CheckFailed(
            f"{what}: the backbone's forward ran {backbone_calls} times on this rank; expected "
            f"{steps}, once per step (no extra forward, e.g. to log a loss)")
    if head_calls != steps:
        raise CheckFailed(f"{what}: the head's forward ran {head_calls} times on this rank; "
                          f"expected {steps}, once per step, on the backbone's output")
    if len(inputs) != min(steps, MAX_RECORDED_FORWARDS):
        raise CheckFailed(f"{what}: the rank's report has {len(inputs)} forward inputs, not "
                          f"{min(steps, MAX_RECORDED_FORWARDS)}")
    for step, recorded in enumerate(inputs):
        if not isinstance(recorded, torch.Tensor):
            raise CheckFailed(f"{what}: at step {step} the backbone got {_text(recorded)}, not "
                              "this rank's batch x (pass x as it is)")
        if (recorded.layout != torch.strided or recorded.dtype != torch.float32
                or recorded.dim() != 2):
            raise CheckFailed(f"{what}: at step {step} the backbone got a {recorded.dtype} "
                              f"tensor of shape {tuple(recorded.shape)}, not this rank's x")
        if recorded.shape[0] != situation.rows:
            hint = (" - every rank trained on every rank's rows: each rank must take only its "
                    "own batch (DDP shares what the ranks learn by averaging gradients)"
                    if world_size > 1 and recorded.shape[0] == situation.rows * world_size
                    else "")
            raise CheckFailed(f"{what}: at step {step} the backbone's forward got "
                              f"{recorded.shape[0]} rows; this rank's batch has "
                              f"{situation.rows}{hint}")
        if torch.equal(recorded, expected.batches[rank][step][0]):
            continue
        source = next((f"rank {other}'s batch of step {s}"
                       for other, batches in enumerate(expected.batches)
                       for s, (x, _) in enumerate(batches) if torch.equal(recorded, x)), None)
        if source is None:
            raise CheckFailed(f"{what}: at step {step} the backbone got rows that are not "
                              "this rank's batch of that step (pass each x as it is)")
        hint = (" - each rank trains only on its own batches" if not
                source.startswith(f"rank {rank}'s") else " - at step s, use batches[s]")
        raise CheckFailed(f"{what}: at step {step} the backbone got {source}{hint}")


def _judge_replicas(states, rank, state, what, why) -> None:
    for other, other_state in enumerate(states):
        for module in MODULES:
            for name, tensor in other_state[module].items():
                if not torch.equal(tensor, state[module][name]):
                    diff = (tensor.double() - state[module][name].double()).abs().max().item()
                    raise CheckFailed(
                        f"{what}: after training, the {module}'s {name!r} differs between "
                        f"rank {rank} and rank {other} (max difference {diff:.3g}); DDP "
                        "replicas take identical steps, bit for bit. "
                        + (why or "Are both modules' gradients averaged over the ranks, "
                                  "from rank 0's initial weights?"))


def _judge_weights(state, expected: Expected, what: str, why: str) -> None:
    if _close(state, expected.reference):
        return
    diff, where = _largest_difference(state, expected.reference)
    raise CheckFailed(
        f"{what}: the weights are not what one process gets by training rank 0's initial "
        f"modules on each step's global batch (largest difference {diff:.3g}, in the {where}; "
        f"allowed {ATOL:g} + {RTOL:g} * |w|; training itself moves the weights by up to "
        f"{expected.moved:.3g}). "
        + (why or "Check: a mean (not summed) loss over the rank's batch, gradients averaged "
                  "over the ranks (not summed), plain SGD with this lr, one step per batch"))


def _judge_losses(rank: int, call: dict, expected: Expected, situation: Situation,
                  what: str) -> None:
    world_size = len(expected.batches)
    losses = observed(call, "losses", (list, type(None)))
    returned, text = observed(call, "returned", str), observed(call, "returned_text", str)
    length = observed(call, "returned_length", int)
    want = expected.losses
    if losses is None:
        raise CheckFailed(f"{what}: train must return a list of {len(want)} Python floats (one "
                          f"loss per step, `loss.item()`); it returned {_text(returned)}: "
                          f"{_text(text)}")
    if length != len(want) or len(losses) != min(len(want), MAX_LOSSES):
        raise CheckFailed(f"{what}: train returned {length} losses; expected {len(want)}, one "
                          "per step")
    if not all(isinstance(v, float) and math.isfinite(v) for v in losses):
        raise CheckFailed(f"{what}: the returned losses are not all finite floats: "
                          f"{_text(losses)}")
    got, reference = torch.tensor(losses, dtype=torch.float64), torch.tensor(want[:len(losses)],
                                                                            dtype=torch.float64)
    if torch.allclose(got, reference, rtol=LOSS_RTOL, atol=LOSS_ATOL):
        return
    step = int((got - reference).abs().argmax())
    shown = (f"at step {step} it logged {losses[step]:.6g}, one process's loss on the global "
             f"batch is {want[step]:.6g}")
    own = torch.tensor(expected.own_losses[rank][:len(losses)], dtype=torch.float64)
    for guess, words in (
            (own, "this rank's own loss, on its batch only: each rank's loss is its own (DDP "
                  "averages gradients, never the loss); all-reduce it and divide by the world "
                  "size to log the global batch's mean"),
            (reference * world_size, f"{world_size} times the global mean: all_reduce adds, "
                                     "divide by the world size"),
            (own * situation.rows, "this rank's loss summed over its rows (reduction='sum')"),
            (reference * situation.rows * world_size, "the loss summed over the global batch "
                                                      "(reduction='sum'): log the mean")):
        if torch.allclose(got, guess, rtol=LOSS_RTOL, atol=LOSS_ATOL):
            raise CheckFailed(f"{what}: the logged losses are not the global batch's mean "
                              f"loss ({shown}); they are {words}")
    raise CheckFailed(f"{what}: the logged losses are not the global batch's mean loss before "
                      f"each step ({shown}); log the mean cross-entropy over all ranks' rows, "
                      "the same number on every rank (if the weights are wrong too, fix them "
                      "first: the losses follow the weights)")


# --- the plausible mistakes, replayed: N ranks simulated in one process ---------------------------


@dataclass(frozen=True)
class Sync:
    """How one module is kept in step across the ranks: ``init`` "rank0" (DDP's constructor, or
    a broadcast) or "own"; ``grad`` "mean" (DDP), "sum" or "local"; ``after`` "none" or "rank0"
    (rank 0's weights broadcast after every step)."""

    init: str = "rank0"
    grad: str = "mean"
    after: str = "none"


RIGHT = Sync()
_OUTSIDE, _BYPASSED = Sync("own", "local"), Sync("rank0", "local")


@dataclass(frozen=True)
class Mistake:
    head: Sync = RIGHT
    backbone: Sync = RIGHT
    loss: str = "mean"  # "mean" (right), "sum" (reduction='sum'), "mean/N", "sum/N"
    agrees: bool = True  # the replicas end identical

    def explain(self, world_size: int, situation: Situation) -> str:
        parts = [_SYNC_WORDS[(module, sync)] for module, sync in
                 (("backbone", self.backbone), ("head", self.head)) if sync != RIGHT]
        if self.loss != "mean":
            parts.append(_LOSS_WORDS[self.loss].format(n=world_size, rows=situation.rows))
        return "These are exactly the weights of a loop where " + "; and where ".join(parts) + "."


_SYNC_WORDS = {
    ("head", _OUTSIDE):
        "the head is outside DDP: every rank keeps its own initial head and trains it with its "
        "own gradients only (DDP broadcasts rank 0's weights and averages the gradients of the "
        "module it wraps, and of no other): wrap backbone and head together, e.g. "
        "DDP(nn.Sequential(backbone, head))",
    ("head", _BYPASSED):
        "the head starts from rank 0's weights on every rank (a DDP constructor or a broadcast "
        "ran) but its gradients are never averaged: with a DDP wrapper of its own, the forward "
        "must call the wrapper, not the plain head (the wrapper's forward is what arms its "
        "all-reduce for the next backward)",
    ("head", Sync("own", "mean")):
        "the head's gradients are averaged, but every rank's head starts from its own initial "
        "weights: start from rank 0's (DDP's constructor broadcasts them, unless "
        "init_sync=False)",
    ("head", Sync("rank0", "sum")):
        "the head's gradients are summed over the ranks, not averaged: world size times too "
        "large (all_reduce adds by default; DDP divides by the world size)",
    ("head", Sync("own", "sum")):
        "the head's gradients are summed over the ranks (not averaged) and every rank's head "
        "starts from its own initial weights",
    ("head", Sync("rank0", "local", "rank0")):
        "rank 0's head is broadcast after every step: the replicas agree, but the head learns "
        "from rank 0's batches only, and the other ranks' backbone gradients came through heads "
        "that had moved apart from rank 0's; average the gradients before the step instead",
    ("head", Sync("own", "local", "rank0")):
        "rank 0's head is broadcast after every step (and not before the first): the replicas "
        "agree, but the head learns from rank 0's batches only; average the gradients before "
        "the step instead",
    ("backbone", _OUTSIDE):
        "the backbone is not in DDP either: its gradients are never averaged",
}
_LOSS_WORDS = {
    "sum":
        "the loss is summed over each rank's {rows} rows (reduction='sum'), so every gradient "
        "is {rows} times the mean's: DDP averages the gradients over the ranks, not over the "
        "rows, so the loss still needs its own mean",
    "mean/N":
        "the loss is divided by the world size {n}: DDP already averages over the ranks, so "
        "the gradient is {n} times too small",
    "sum/N":
        "the loss is summed over the rows (reduction='sum') and divided by the world size {n}",
}
MISTAKES = [
    Mistake(loss="sum"),
    Mistake(loss="mean/N"),
    Mistake(loss="sum/N"),
    Mistake(head=Sync("rank0", "sum")),
    Mistake(head=Sync("rank0", "sum"), loss="sum"),
    Mistake(head=Sync("rank0", "local", "rank0")),
    Mistake(head=Sync("rank0", "local", "rank0"), loss="sum"),
    Mistake(head=Sync("own", "local", "rank0")),
    Mistake(head=Sync("own", "local", "rank0"), loss="sum"),
    Mistake(head=_OUTSIDE, agrees=False),
    Mistake(head=_OUTSIDE, loss="sum", agrees=False),
    Mistake(head=_BYPASSED, agrees=False),
    Mistake(head=_BYPASSED, loss="sum", agrees=False),
    Mistake(head=Sync("own", "mean"), agrees=False),
    Mistake(head=Sync("own", "mean"), loss="sum", agrees=False),
    Mistake(head=Sync("own", "sum"), agrees=False),
    Mistake(head=_OUTSIDE, backbone=_OUTSIDE, agrees=False),
    Mistake(head=_OUTSIDE, backbone=_OUTSIDE, loss="sum", agrees=False),
]


def replay(mistake: Mistake, world_size: int, situation: Situation,
           expected: Expected) -> list[dict]:
    """Every rank's modules after ``situation`` when the loop makes ``mistake``: the ranks are
    simulated in this process, their gradients averaged, summed or kept as the mistake says."""
    reduction = "sum" if mistake.loss.startswith("sum") else "mean"
    scale = 1 / world_size if mistake.loss.endswith("/N") else 1.0
    syncs = {"backbone": mistake.backbone, "head": mistake.head}
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), _one_thread():
        ranks = []
        for rank in range(world_size):
            modules = dict(zip(MODULES, _modules_from(expected.starts[rank])))
            for name in MODULES:
                if syncs[name].init == "rank0":
                    modules[name].load_state_dict(expected.starts[0][name])
            ranks.append(modules)
        for step in range(situation.steps):
            for rank, modules in enumerate(ranks):
                for module in modules.values():
                    module.zero_grad()
                x, y = expected.batches[rank][step]
                logits = modules["head"](modules["backbone"](x))
                (F.cross_entropy(logits, y, reduction=reduction) * scale).backward()
            for name in MODULES:
                _combine_and_step(name, syncs[name], ranks, situation.lr)
    return [{name: _state(modules[name]) for name in MODULES} for modules in ranks]


def _combine_and_step(name: str, sync: Sync, ranks: list, lr: float) -> None:
    params = [list(modules[name].parameters()) for modules in ranks]
    with torch.no_grad():
        for i in range(len(params[0])):
            grads = torch.stack([p[i].grad for p in params])
            combined = {"mean": grads.mean(0), "sum": grads.sum(0)}.get(sync.grad)
            for rank, p in enumerate(params):
                p[i].add_(combined if combined is not None else grads[rank], alpha=-lr)
        if sync.after == "rank0":
            for p in params[1:]:
                for mine, rank0s in zip(p, params[0]):
                    mine.copy_(rank0s)


def _diagnosis(states: list[dict], world_size: int, situation: Situation, expected: Expected,
               replicas_agree: bool) -> str:
    """Which plausible mistake reproduces what every rank holds, in words, or ''."""
    for mistake in MISTAKES:
        if mistake.agrees != replicas_agree:
            continue
        if world_size == 1 and (mistake.head != RIGHT or mistake.backbone != RIGHT):
            continue  # one rank: nothing to average, so no mistake of synchronisation shows
        replayed = replay(mistake, world_size, situation, expected)
        if all(_close(r, expected.reference) for r in replayed):
            continue  # the same as the right loop here: it explains nothing
        if all(_close(states[rank], replayed[rank]) for rank in range(world_size)):
            return mistake.explain(world_size, situation)
    return ""


TRAINING = Case(observe_training, judge_training)

# --- the visible checks ---------------------------------------------------------------------------

# Situations travel to the ranks as plain tuples: (rows, steps, lr, seed).
VISIBLE = [(4, 4, 0.5, 0), (6, 3, 0.2, 1)]


def check_train_keeps_replicas_identical(train) -> None:
    """2 ranks: the modules handed in are trained, each backbone forward gets the rank's own
    batch, and both modules end bit-identical on every rank."""
    run_student(TRAINING, 2, train, VISIBLE, ("in_place", "rows", "agree"))


def check_train_matches_one_process(train) -> None:
    """2 ranks: the weights one process gets from each step's global batch."""
    run_student(TRAINING, 2, train, VISIBLE, ("in_place", "weights"))


def check_train_logs_the_global_loss(train) -> None:
    """2 ranks: every rank returns the global batch's mean loss at each step."""
    run_student(TRAINING, 2, train, VISIBLE, ("losses",))
