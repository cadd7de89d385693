"""The checks of exercise ddp_same_as_one_process (chapter 01: train_with_ddp) catch plausible
wrong training loops, pass a right one, and rest on facts about DDP measured here.
The exercise: solutions/01_why_ddp/ddp_same_as_one_process.nb.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autograder.hidden import ddp_same_as_one_process as hidden
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import ddp_same_as_one_process as checks
from ddpcourse.launcher import run_ranks

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


# --- train_with_ddp ---------------------------------------------------------------------------

def _share(x, y, shard=True):
    rank, n = dist.get_rank(), dist.get_world_size()
    if len(x) % n:
        raise ValueError("rows do not split")
    if not shard:
        return x, y
    k = len(x) // n
    return x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]


def _loop(model, x, y, steps, lr, reduction="mean", extra_forward=False):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y, reduction=reduction).backward()
        optimizer.step()
        if extra_forward:
            with torch.no_grad():
                model(x)


def train_right(model, x, y, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    if len(x) % n:
        raise ValueError("rows do not split")
    ddp = DDP(model)
    _loop(ddp, x[rank::n], y[rank::n], steps, lr)  # strided shares are fine too
    return model


def train_every_rank_on_everything(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y, shard=False), steps, lr)
    return model


def train_with_summed_loss(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y), steps, lr, reduction="sum")
    return model


def train_without_ddp(model, x, y, steps, lr):
    _loop(model, *_share(x, y), steps, lr)
    return model


def train_a_new_model(model, x, y, steps, lr):
    fresh = checks.make_model("tiny", 0)
    _loop(DDP(fresh), *_share(x, y), steps, lr)
    return fresh


def train_and_return_the_wrapper(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y), steps, lr)
    return ddp


def train_and_log(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y), steps, lr, extra_forward=True)
    return model


def train_with_uneven_shares(model, x, y, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    _loop(ddp, x.tensor_split(n)[rank], y.tensor_split(n)[rank], steps, lr)
    return model


def test_a_right_training_loop_passes_every_check():
    checks.check_train_with_ddp_matches_one_process(train_right)
    checks.check_train_with_ddp_shares_the_batch(train_right)
    hidden.check_train_with_ddp(train_right)


@pytest.mark.parametrize("wrong, check, message", [
    (train_with_summed_loss, "matches", "not what one process gets"),
    (train_without_ddp, "matches", "differs between rank 0 and rank 1"),
    (train_a_new_model, "matches", "must return the `model` it was given"),
    (train_and_return_the_wrapper, "matches", "returned the DistributedDataParallel wrapper"),
    (train_every_rank_on_everything, "shares", "every rank trained on the whole batch"),
    (train_and_log, "shares", "forward ran 10 times"),
    (train_with_uneven_shares, "not_divisible", "expected ValueError"),
])
def test_the_ddp_checks_catch_wrong_training_loops(wrong, check, message):
    by_name = {"matches": checks.check_train_with_ddp_matches_one_process,
               "shares": checks.check_train_with_ddp_shares_the_batch,
               "not_divisible": lambda fn: run_student(checks.not_divisible_case, 2, fn, 7)}
    assert (2, 7) in hidden.NOT_DIVISIBLE
    if wrong is train_every_rank_on_everything:  # right weights, at N times the work
        checks.check_train_with_ddp_matches_one_process(wrong)
    with pytest.raises(CheckFailed, match=message):
        by_name[check](wrong)


def ddp_facts(rank, world_size):
    model = checks.make_model("frozen_shift", rank)
    ddp = DDP(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, state)
    same = all(torch.equal(everyone[0][k], everyone[r][k]) for r in range(world_size)
               for k in state)
    return ddp.module is model, sorted(ddp.state_dict())[0], same


def test_ddp_wraps_the_module_itself_and_copies_rank_0s_state_frozen_and_buffers_included():
    """Backs the task text: DDP trains the very module it wraps (so returning `model` is right),
    a DDP's state_dict keys carry a 'module.' prefix, and the constructor gives every rank rank
    0's parameters (frozen ones too) and buffers."""
    for is_same_module, first_key, equal_everywhere in run_ranks(ddp_facts, 2):
        assert is_same_module and first_key.startswith("module.") and equal_everywhere
