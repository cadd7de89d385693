"""Chapter 01, why DDP: visible checks for ``train_with_ddp``.

The contract is the docstring of ``train_with_ddp`` in
solutions/01_why_ddp/ddp_same_as_one_process.nb.py (students:
exercises/01_why_ddp/ddp_same_as_one_process.ipynb). It runs on every rank of a gloo group, each
rank's ``model`` initialised differently here.

What each rank checks, after every rank's call has returned:

* (d) the returned object is the very ``model`` that was handed in, not a DDP wrapper or a copy;
* (c) the model's forward ran exactly ``steps`` times, each time on ``len(x) / N`` rows of ``x``,
  and at each step the N ranks' rows together are every row of ``x`` exactly once (a forward
  pre-hook records the inputs; the row indices are gathered across the ranks);
* (b) all ranks hold bit-identical parameters and buffers (DDP replicas take identical steps);
* (a) they equal one process training rank 0's initial model on the full batch with the same
  SGD, within ``ATOL + RTOL * |w|``: the all-reduce adds the shards' gradients in another order
  than one process adds the rows', and float32 addition is not associative. Measured for every
  case of these checks: at most 3e-8 (6e-8 after 20 steps); one step fewer already moves some
  weight by 8e-3 or more, a summed instead of averaged loss by 4e-2 or more.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.toys import TinyMLP

ATOL, RTOL = 1e-5, 1e-5


class FrozenShiftNet(nn.Module):
    """A frozen first layer (requires_grad=False) and a buffer: DDP's constructor copies rank 0's
    values of both to every rank, and the frozen layer must stay exactly as rank 0 had it."""

    def __init__(self, in_features: int = 8, hidden: int = 16):
        super().__init__()
        self.embed = nn.Linear(in_features, hidden)
        self.embed.requires_grad_(False)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(hidden, 1))
        self.register_buffer("shift", torch.randn(1))

    def forward(self, x):
        return self.head(self.embed(x)) + self.shift


MODELS = {"tiny": TinyMLP, "frozen_shift": FrozenShiftNet}


def make_batch(rows: int, seed: int, in_features: int = 8):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(rows, 1, generator=generator)
    return x, y


def make_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind]()


def train_single_process(model: nn.Module, x, y, steps: int, lr: float) -> nn.Module:
    """The reference: one process, the full batch, plain SGD on the mean-squared error."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _row_indices(x: torch.Tensor, seen: torch.Tensor) -> list[int]:
    """Index in x of each row of ``seen`` (-1 for a row that is not one of x's)."""
    if seen.dim() != 2 or seen.shape[1] != x.shape[1]:
        return [-1] * (seen.shape[0] if seen.dim() else 1)
    matches = (seen[:, None, :] == x[None, :, :]).all(dim=2)
    return [int(m.nonzero()[0]) if m.any() else -1 for m in matches]


ALL_CHECKS = ("model", "shares", "agree", "weights")


def ddp_case(rank, world_size, train_with_ddp, kind="tiny", rows=8, steps=5, lr=0.1, seed=0,
             checks=ALL_CHECKS):
    x, y = make_batch(rows, seed)
    model = make_model(kind, 1000 * seed + 17 * rank + 1)  # a different start on every rank
    rank0_start = make_model(kind, 1000 * seed + 1)
    inputs: list[torch.Tensor] = []
    hook = model.register_forward_pre_hook(
        lambda module, args: inputs.append(args[0].detach().clone()))
    try:
        result = train_with_ddp(model, x.clone(), y.clone(), steps, lr)
    finally:
        hook.remove()

    # Everything the checks need from the other ranks, in one collective every rank reaches.
    state = _state(model)
    mine = {"calls": [_row_indices(x, seen) for seen in inputs], "state": state}
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)

    what = f"{world_size} ranks, {rows} rows, {steps} steps, lr {lr}, {kind} model"
    if "model" in checks:
        expect_returns_the_model(result, model, what)
    if "shares" in checks:
        expect_shares(everyone, rank, rows, steps, world_size, what)
    if "agree" in checks:
        expect_replicas_agree(everyone, rank, state, what)
    if "weights" in checks:
        expect_single_process_weights(state, rank0_start, x, y, steps, lr, what)
    return [len(call) for call in mine["calls"]]


def expect_replicas_agree(everyone, rank, state, what):
    for other in range(len(everyone)):
        for name, tensor in everyone[other]["state"].items():
            if not torch.equal(tensor, state[name]):
                raise CheckFailed(
                    f"{what}: after training, {name!r} differs between rank {rank} and rank "
                    f"{other} (max difference {(tensor - state[name]).abs().max().item():.3g}). "
                    "DDP replicas take identical steps: is every rank's model wrapped in "
                    "DistributedDataParallel, and stepped with the gradients DDP averaged?")


def expect_single_process_weights(state, rank0_start, x, y, steps, lr, what):
    reference = _state(train_single_process(copy.deepcopy(rank0_start), x, y, steps, lr))
    start = _state(rank0_start)
    for name, want in reference.items():
        got = state[name]
        if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
            diff = (got - want).abs().max().item()
            moved = (want - start[name]).abs().max().item()
            raise CheckFailed(
                f"{what}: {name!r} is not what one process gets by training rank 0's initial "
                f"model on the whole batch (largest difference {diff:.3g}; allowed "
                f"{ATOL:g} + {RTOL:g} * |w|; training itself moved it by up to {moved:.3g}). "
                "Check: mean (not sum) loss over the rank's share, plain SGD with this lr, "
                "exactly `steps` steps, and DDP wrapped around the model you were given")


def expect_returns_the_model(result, model, what):
    if isinstance(result, DistributedDataParallel):
        raise CheckFailed(
            f"{what}: returned the DistributedDataParallel wrapper; return the plain module "
            "(`ddp.module`, which is the `model` you were given). The wrapper is only for "
            "training: its state_dict keys start with 'module.' and do not load into a plain "
            "model, and its forward takes part in collectives")
    if result is not model:
        raise CheckFailed(
            f"{what}: must return the `model` it was given, trained in place (DDP does not copy "
            f"it); got {type(result).__name__}"
            + (" - a different module object" if isinstance(result, nn.Module) else ""))


def expect_shares(everyone, rank, rows, steps, world_size, what):
    calls = everyone[rank]["calls"]
    share = rows // world_size
    if len(calls) != steps:
        raise CheckFailed(
            f"{what}: the model's forward ran {len(calls)} times on this rank; expected "
            f"{steps}, once per step (no extra passes, e.g. for logging)")
    for step, seen in enumerate(calls):
        if -1 in seen:
            raise CheckFailed(f"{what}: at step {step} the model got an input row that is not a "
                              "row of x (pass the rows of x as they are)")
        if len(seen) != share:
            hint = (" - every rank trained on the whole batch: each must take only its own "
                    "share" if len(seen) == rows and world_size > 1 else "")
            raise CheckFailed(f"{what}: at step {step} this rank's forward saw {len(seen)} rows; "
                              f"its share is len(x) / world_size = {share}{hint}")
    for step in range(steps):
        together = sorted(i for other in everyone for i in other["calls"][step])
        if together != list(range(rows)):
            counts = {i: together.count(i) for i in set(together)}
            twice = sorted(i for i, c in counts.items() if c > 1)
            missing = sorted(set(range(rows)) - set(together))
            raise CheckFailed(
                f"{what}: at step {step} the ranks' shares together are not the rows of x, each "
                f"once: rows {twice} were used by more than one rank and rows {missing} by "
                "none. Give rank r its own slice, e.g. x[r * k:(r + 1) * k] with k = len(x) / N")


def not_divisible_case(rank, world_size, train_with_ddp, rows):
    x, y = make_batch(rows, 3)
    model = make_model("tiny", 5)
    try:
        train_with_ddp(model, x, y, 2, 0.1)
    except ValueError:
        return "ValueError"
    raise CheckFailed(f"{rows} rows over {world_size} ranks do not split into equal shares: "
                      "expected ValueError, but train_with_ddp returned normally")


def check_train_with_ddp_matches_one_process(train_with_ddp) -> None:
    """2 ranks, the TinyMLP, 8 rows, 5 steps: the returned model, replicas that agree, and the
    weights of one process trained on the whole batch."""
    run_student(ddp_case, 2, train_with_ddp, "tiny", 8, 5, 0.1, 0, ("model", "agree", "weights"))


def check_train_with_ddp_shares_the_batch(train_with_ddp) -> None:
    """2 ranks, 10 rows, 5 steps: each rank's forward sees its own 5 rows at every step."""
    run_student(ddp_case, 2, train_with_ddp, "tiny", 10, 5, 0.1, 1, ("shares",))
