"""Chapter 01, why DDP: visible checks for ``train_with_ddp``, and the cases the hidden checks
reuse.

The contract is the docstring of ``train_with_ddp`` in
solutions/01_why_ddp/ddp_same_as_one_process.nb.py (students:
exercises/01_why_ddp/ddp_same_as_one_process.ipynb). It runs on every rank of a gloo group, each
rank's ``model`` initialised differently here.

Each case is a :class:`~ddpcourse.grading.checks.Case`. A rank only records, around the student's
call: what the call returned (in words), the input of every forward of the model it handed in (a
forward pre-hook), and the model's parameters and buffers afterwards. The judge, which never runs
the student's code, rebuilds the batch and rank 0's initial model itself (the inputs) and decides:

* (d) the returned object is the very ``model`` that was handed in, not a DDP wrapper or a copy;
* (c) the model's forward ran exactly ``steps`` times, each time on ``len(x) / N`` rows of ``x``,
  and at each step the N ranks' rows together are every row of ``x`` exactly once (the judge
  finds each reported row in its own ``x``);
* (b) all ranks hold bit-identical parameters and buffers (DDP replicas take identical steps);
* (a) they equal one process training rank 0's initial model on the full batch with the same
  SGD, within ``ATOL + RTOL * |w|``: the all-reduce adds the shards' gradients in another order
  than one process adds the rows', and float32 addition is not associative. Measured for every
  case of these checks: at most 3e-8 (6e-8 after 20 steps); one step fewer already moves some
  weight by 8e-3 or more, a summed instead of averaged loss by 4e-2 or more.

This module holds no one-process training (the ranks import it, and it would be the answer): (a)
compares with the digests of one process's weights written out for the visible case
(:data:`VISIBLE_WEIGHTS`, see :mod:`ddpcourse.grading.written_out`), which
tests/test_grading_ddp_same_as_one_process.py holds to the reference run of the hidden checks
(autograder/hidden/ddp_same_as_one_process.py), where the hidden cases are judged with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcourse.grading.checks import (Case, CheckFailed, judge_each_rank, observed,
                                      reported_tensors, run_student, type_name)
from ddpcourse.grading.written_out import expect_digest
from ddpcourse.toys import TinyMLP

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
ATOL, RTOL = 1e-5, 1e-5
IN_FEATURES = 8
MAX_RECORDED_ROWS = 4096  # of one forward's input; a larger input is reported by its shape only
_MAX_TEXT = 500  # of a text a rank reports, in a message
RETURNED_MODEL, RETURNED_WRAPPER = "the model itself", "the DistributedDataParallel wrapper"


class FrozenShiftNet(nn.Module):
    """A frozen first layer (requires_grad=False) and a buffer: DDP's constructor copies rank 0's
    values of both to every rank, and the frozen layer must stay exactly as rank 0 had it."""

    def __init__(self, in_features: int = IN_FEATURES, hidden: int = 16):
        super().__init__()
        self.embed = nn.Linear(in_features, hidden)
        self.embed.requires_grad_(False)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(hidden, 1))
        self.register_buffer("shift", torch.randn(1))

    def forward(self, x):
        return self.head(self.embed(x)) + self.shift


MODELS = {"tiny": TinyMLP, "frozen_shift": FrozenShiftNet}


def make_batch(rows: int, seed: int, in_features: int = IN_FEATURES):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(rows, 1, generator=generator)
    return x, y


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def rank_model_seed(seed: int, rank: int) -> int:
    """Every rank starts from another model; rank 0's is the one that counts."""
    return 1000 * seed + 17 * rank + 1


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _row_indices(x: torch.Tensor, seen: torch.Tensor) -> list[int]:
    """Index in x of each row of ``seen`` (-1 for a row that is not one of x's)."""
    if seen.dim() != 2 or seen.shape[1] != x.shape[1] or seen.dtype != x.dtype:
        return [-1] * (seen.shape[0] if seen.dim() else 1)
    matches = (seen[:, None, :] == x[None, :, :]).all(dim=2)
    return [int(m.nonzero()[0]) if m.any() else -1 for m in matches]


ALL_CHECKS = ("model", "shares", "agree", "weights")


# --- in the ranks: record only ------------------------------------------------------------------


def _recorded_input(args: tuple) -> torch.Tensor | str:
    """What one forward got, as data: the input tensor's copy, or words for anything else."""
    first = args[0] if args else None
    if (isinstance(first, torch.Tensor) and first.layout == torch.strided and first.dim() >= 1
            and first.shape[0] <= MAX_RECORDED_ROWS and first.numel() <= 64 * MAX_RECORDED_ROWS):
        return first.detach().to("cpu").clone()
    if isinstance(first, torch.Tensor):
        return f"a tensor of shape {tuple(first.shape)}"
    return type_name(first)


def observe_ddp(rank, world_size, train_with_ddp, kind="tiny", rows=8, steps=5, lr=0.1, seed=0,
                checks=ALL_CHECKS):
    """What the call returned (in words), every forward's input, the state afterwards."""
    x, y = make_batch(rows, seed)
    model = make_model(kind, rank_model_seed(seed, rank))
    inputs: list[torch.Tensor | str] = []
    calls = [0]

    def record(module, args):
        calls[0] += 1
        if len(inputs) <= steps:  # one more than right is enough to say what went wrong
            inputs.append(_recorded_input(args))

    hook = model.register_forward_pre_hook(record)
    try:
        result = train_with_ddp(model, x.clone(), y.clone(), steps, lr)
    finally:
        hook.remove()
    if result is model:
        returned = RETURNED_MODEL
    elif isinstance(result, DistributedDataParallel):
        returned = RETURNED_WRAPPER
    else:
        returned = type_name(result)
    return {"returned": returned, "returned_module": isinstance(result, nn.Module),
            "forward_calls": calls[0], "inputs": inputs, "state": _state(model)}


def observe_not_divisible(rank, world_size, train_with_ddp, rows):
    """What the call did with a batch that does not split: returned, or raised what."""
    x, y = make_batch(rows, 3)
    model = make_model("tiny", 5)
    try:
        train_with_ddp(model, x, y, 2, 0.1)
    except Exception as exc:  # noqa: BLE001 - described as data, judged outside the ranks
        return {"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                "message": str(exc)[:_MAX_TEXT]}
    return {"raised": None, "value_error": False, "message": ""}


# --- in the judge: the reference, recomputed here -------------------------------------------------


def _text(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "..."


def rank0_start(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """Rank 0's initial state (the one that counts), without moving the caller's random state
    (in a notebook the judge runs in the student's kernel)."""
    with torch.random.fork_rng(devices=[]):
        return _state(make_model(kind, rank_model_seed(seed, 0)))


# One process's weights after training rank 0's initial model on the whole batch, for the visible
# case that judges them: each tensor's digest (ddpcourse.grading.written_out), keyed by
# (kind, rows, steps, lr, seed). Held to the hidden checks' reference run by
# tests/test_grading_ddp_same_as_one_process.py.
VISIBLE_WEIGHTS: dict[tuple, dict[str, tuple[float, ...]]] = {
    ('tiny', 8, 5, 0.1, 0): {
        'net.0.weight': (2.90506846574, 0.797101820586, 3.55639115139, -2.25452246959),
        'net.0.bias': (1.03580040671, 0.987776592374, -0.543523199856, 0.195240542293),
        'net.2.weight': (-0.269796459914, 2.44567576373, 2.9479643108, 1.00522343258),
        'net.2.bias': (-0.541000054684, 0.639351834077, 0.225455993321, -0.222182192374),
        'net.4.weight': (0.498480809154, -0.217748561176, 0.445907850983, -1.01822451199),
        'net.4.bias': (0.127084881067, 0.127084881067, -0.127084881067, -0.127084881067),
    },
}

# ``expected(kind, rows, steps, lr, seed)``: one process's final state, as tensors (the hidden
# checks' reference run) or digests (the visible cases').
Expected = Callable[[str, int, int, float, int], dict[str, Any]]


def written_out_weights(kind: str, rows: int, steps: int, lr: float, seed: int) -> dict:
    """The visible case's expected weights, from :data:`VISIBLE_WEIGHTS`."""
    key = (kind, rows, steps, lr, seed)
    if key not in VISIBLE_WEIGHTS:
        raise LookupError(f"grader bug: no written-out weights for {key}: add them to "
                          "VISIBLE_WEIGHTS, or judge the case with the hidden checks")
    return VISIBLE_WEIGHTS[key]


def judge_ddp(observations, world_size, kind="tiny", rows=8, steps=5, lr=0.1, seed=0,
              checks=ALL_CHECKS):
    """The visible cases' judge: their expected weights are written out."""
    judge_ddp_with(written_out_weights, observations, world_size, kind, rows, steps, lr, seed,
                   checks)


def judge_ddp_with(expected: Expected, observations, world_size, kind="tiny", rows=8, steps=5,
                   lr=0.1, seed=0, checks=ALL_CHECKS):
    """Every rank's record, with one process's final state from ``expected`` (asked only when
    the weights are judged)."""
    what = f"{world_size} ranks, {rows} rows, {steps} steps, lr {lr}, {kind} model"
    x, _ = make_batch(rows, seed)
    start = rank0_start(kind, seed)
    share = rows // world_size

    def rows_seen(observation) -> list[list[int]]:
        calls = observed(observation, "forward_calls", int)
        inputs = observed(observation, "inputs", list)
        if calls != steps:
            raise CheckFailed(
                f"{what}: the model's forward ran {calls} times on this rank; expected "
                f"{steps}, once per step (no extra passes, e.g. for logging)")
        if len(inputs) != steps:
            raise CheckFailed(f"{what}: the rank's report has {len(inputs)} forward inputs, not "
                              f"{steps}")
        seen = []
        for step, recorded in enumerate(inputs):
            if (not isinstance(recorded, torch.Tensor) or recorded.layout != torch.strided
                    or recorded.dim() == 0 or recorded.shape[0] > MAX_RECORDED_ROWS):
                got = (_text(recorded) if not isinstance(recorded, torch.Tensor)
                       else f"a tensor of shape {tuple(recorded.shape)}")
                raise CheckFailed(f"{what}: at step {step} the model got {got}, not rows of x "
                                  "(pass the rows of x as they are)")
            indices = _row_indices(x, recorded)
            if -1 in indices:
                raise CheckFailed(f"{what}: at step {step} the model got an input row that is "
                                  "not a row of x (pass the rows of x as they are)")
            if len(indices) != share:
                hint = (" - every rank trained on the whole batch: each must take only its own "
                        "share" if len(indices) == rows and world_size > 1 else "")
                raise CheckFailed(f"{what}: at step {step} this rank's forward saw "
                                  f"{len(indices)} rows; its share is len(x) / world_size = "
                                  f"{share}{hint}")
            seen.append(indices)
        return seen

    def judge_rank(rank, observation):
        if "model" in checks:
            expect_returns_the_model(observed(observation, "returned", str),
                                     observed(observation, "returned_module", bool), what)
        if "shares" in checks:
            rows_seen(observation)
        reported_tensors(observed(observation, "state", dict), start,
                         f"{what}: after training, the model's")

    judge_each_rank(observations, judge_rank)
    # Every rank's report is sound from here on; what follows compares ranks, then each rank
    # with one process (replicas that disagree say more than weights that differ).
    if "shares" in checks:
        expect_shares_cover_the_batch([rows_seen(o) for o in observations], rows, steps, what)
    states = [observation["state"] for observation in observations]
    if "agree" in checks:
        judge_each_rank(states, lambda rank, state: expect_replicas_agree(states, rank, state,
                                                                          what))
    if "weights" in checks:
        reference = expected(kind, rows, steps, lr, seed)
        judge_each_rank(states, lambda rank, state: expect_single_process_weights(
            state, start, reference, what))


DDP_TRAINING = Case(observe_ddp, judge_ddp)


def expect_replicas_agree(states, rank, state, what):
    for other, other_state in enumerate(states):
        for name, tensor in other_state.items():
            if not torch.equal(tensor, state[name]):
                diff = (tensor.double() - state[name].double()).abs().max().item()
                raise CheckFailed(
                    f"{what}: after training, {name!r} differs between rank {rank} and rank "
                    f"{other} (max difference {diff:.3g}). "
                    "DDP replicas take identical steps: is every rank's model wrapped in "
                    "DistributedDataParallel, and stepped with the gradients DDP averaged?")


WEIGHTS_HINT = (". Check: mean (not sum) loss over the rank's share, plain SGD with this lr, "
                "exactly `steps` steps, and DDP wrapped around the model you were given")


def expect_single_process_weights(state, start, reference, what):
    """``reference``: one process's final state, each tensor itself or its written-out digest."""
    for name, want in reference.items():
        got = state[name]
        if not isinstance(want, torch.Tensor):
            expect_digest(got, want, f"{what}: {name!r} is not what one process gets by "
                          "training rank 0's initial model on the whole batch", RTOL, ATOL,
                          WEIGHTS_HINT)
        elif not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            diff = (got.double() - want.double()).abs().max().item()
            moved = (want.double() - start[name].double()).abs().max().item()
            raise CheckFailed(
                f"{what}: {name!r} is not what one process gets by training rank 0's initial "
                f"model on the whole batch (largest difference {diff:.3g}; allowed "
                f"{ATOL:g} + {RTOL:g} * |w|; training itself moved it by up to {moved:.3g}). "
                "Check: mean (not sum) loss over the rank's share, plain SGD with this lr, "
                "exactly `steps` steps, and DDP wrapped around the model you were given")


def expect_returns_the_model(returned: str, returned_module: bool, what: str):
    if returned == RETURNED_WRAPPER:
        raise CheckFailed(
            f"{what}: returned the DistributedDataParallel wrapper; return the plain module "
            "(`ddp.module`, which is the `model` you were given). The wrapper is only for "
            "training: its state_dict keys start with 'module.' and do not load into a plain "
            "model, and its forward takes part in collectives")
    if returned != RETURNED_MODEL:
        raise CheckFailed(
            f"{what}: must return the `model` it was given, trained in place (DDP does not copy "
            f"it); got {_text(returned)}"
            + (" - a different module object" if returned_module else ""))


def expect_shares_cover_the_batch(seen_by_rank, rows, steps, what):
    for step in range(steps):
        together = sorted(i for seen in seen_by_rank for i in seen[step])
        if together != list(range(rows)):
            counts = {i: together.count(i) for i in set(together)}
            twice = sorted(i for i, c in counts.items() if c > 1)
            missing = sorted(set(range(rows)) - set(together))
            raise CheckFailed(
                f"{what}: at step {step} the ranks' shares together are not the rows of x, each "
                f"once: rows {twice} were used by more than one rank and rows {missing} by "
                "none. Give rank r its own slice, e.g. x[r * k:(r + 1) * k] with k = len(x) / N")


def judge_not_divisible(observations, world_size, rows):
    what = f"{rows} rows over {world_size} ranks do not split into equal shares"

    def judge_rank(rank, observation):
        raised = observed(observation, "raised", (str, type(None)))
        message = observed(observation, "message", str)
        if raised is None:
            raise CheckFailed(f"{what}: expected ValueError, but train_with_ddp returned "
                              "normally")
        if observed(observation, "value_error", bool) is not True:
            raise CheckFailed(f"{what}: expected ValueError, but train_with_ddp raised "
                              f"{_text(raised)}: {_text(message)}")

    judge_each_rank(observations, judge_rank)


UNEVEN_BATCH = Case(observe_not_divisible, judge_not_divisible)


def check_train_with_ddp_matches_one_process(train_with_ddp) -> None:
    """2 ranks, the TinyMLP, 8 rows, 5 steps: the returned model, replicas that agree, and the
    weights of one process trained on the whole batch."""
    run_student(DDP_TRAINING, 2, train_with_ddp, "tiny", 8, 5, 0.1, 0,
                ("model", "agree", "weights"))


def check_train_with_ddp_shares_the_batch(train_with_ddp) -> None:
    """2 ranks, 10 rows, 5 steps: each rank's forward sees its own 5 rows at every step."""
    run_student(DDP_TRAINING, 2, train_with_ddp, "tiny", 10, 5, 0.1, 1, ("shares",))
