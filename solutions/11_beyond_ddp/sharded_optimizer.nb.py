# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise 11: a sharded optimizer (ZeRO-1) of your own
#
# Under DDP every rank holds the whole optimizer state (Adam: two values per parameter) and runs
# the same update. ZeRO-1 splits the update instead: each rank keeps the state of a **share** of
# the parameters' elements, updates only that share, and the ranks then exchange the updated
# shares so that every replica ends with the same full weights. Chapter 11 shows
# `ZeroRedundancyOptimizer`, which shares out **whole parameter tensors** and ends uneven when one
# tensor is large; yours shares out elements.
#
# **How your code runs.** Each test builds the same model in every rank of a real process group
# (`run_ranks`), wraps its parameters in your `ShardedOptimizer`, trains a few steps on the same
# batch in every rank (the gradients DDP would have averaged), and compares the weights with the
# unsharded optimizer's in one process; it then counts the bytes your object holds. Do **not**
# call `init_process_group` in this notebook.
#
# **Self-check** from the repository root: `pytest exercises/11_beyond_ddp/sharded_optimizer.ipynb`
# runs this notebook and reports each visible test. Hidden tests (edge cases) run when the
# notebook is graded.
#
# **Rules.** Keep the class name and signatures exactly as given (they are the grading contract).
# Do not reassign library functions: the tests check for it and fail.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import sharded_optimizer as checks
from ddpcourse.launcher import run_ranks

setup_notebook("sharded_optimizer")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-sharded-optimizer", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `ShardedOptimizer(params, optimizer_cls, **kwargs)` (10 points)
#
# Implement it as its docstring says. Hint: concatenate the parameters' elements into one flat
# vector (`torch.cat([p.reshape(-1) for p in params])`); rank `r` owns one contiguous piece of it.
# A flat tensor of your piece, with its own `.grad`, is what your inner optimizer updates;
# `dist.all_gather` of equal-sized pieces brings every rank's update back.

# %% nbgrader={"grade": false, "grade_id": "sharded-optimizer", "locked": false, "schema_version": 3, "solution": true, "task": false}
class ShardedOptimizer:
    """ZeRO-1: an element-wise optimizer whose state is split over the ranks of the default group.

    Built in every rank with the same parameters (the model's replica of each rank: same shapes,
    one dtype, CPU) as `ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)`; the
    keyword arguments go to `optimizer_cls`, which is element-wise (`Adam`, `AdamW`, `SGD` with
    or without momentum).

    Concatenate the parameters' elements, in order, into one flat vector of `n` elements and cut
    it into N contiguous pieces of `ceil(n / N)` elements (the last ones shorter, or empty); rank
    `r` owns piece `r`. `self.optimizer` is an `optimizer_cls(..., **kwargs)` over tensors that
    hold only this rank's piece, so that its state covers only that piece.

    `step()` is called after `backward()`. It updates this rank's piece with `self.optimizer`
    from the matching elements of the gradients, and uses no other element of them: as under
    ZeRO, where each rank's gradients are averaged only over its own piece, the elements outside
    a rank's piece may differ from rank to rank. It then brings every rank's updated piece into
    every rank's parameters, in place (same tensors: the model holds them).

    Requirements the tests check:

    * after any number of steps, every rank's parameters equal those of `optimizer_cls` over
      all the parameters in one process, to float64 rounding, also when each rank's gradients
      differ from the others' outside its own piece (so the pieces must be exactly the ones
      above: pieces cut another way, floor-sized or round-robin, use elements outside them);
    * `self.optimizer.state` of each rank holds at most about 1/N of the unsharded optimizer's
      state bytes (10 % and 64 bytes of slack), also when one parameter is much larger than the
      others (sharing out whole parameters fails that);
    * between steps nothing keeps a tensor beyond this rank's share (its piece, the piece's
      gradient and `self.optimizer`'s state): neither the object nor anything else in the
      rank's process (a module global, a class attribute, a closure). Allocate the buffers of
      the exchange inside `step()`. References to the model's own parameters are not copies
      and do not count: keeping `self.params = list(params)` is fine, and so are their `.grad`s;
    * 1 to 4 ranks, and element counts that do not divide by N.

    Args:
        params: the parameters to optimize (an iterable of tensors, like any optimizer's).
        optimizer_cls: the optimizer class to shard, e.g. `torch.optim.Adam`.
        **kwargs: its arguments, e.g. `lr=1e-3`.
    """

    def __init__(self, params, optimizer_cls, **kwargs):
        ### BEGIN SOLUTION
        self.params = list(params)
        world_size, rank = dist.get_world_size(), dist.get_rank()
        total = sum(p.numel() for p in self.params)
        self.piece = -(-total // world_size)  # ceil(n / N)
        start = min(rank * self.piece, total)
        self.mine = slice(start, min(start + self.piece, total))
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            self.shard = flat[self.mine].clone().requires_grad_(True)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        ### END SOLUTION

    def step(self) -> None:
        ### BEGIN SOLUTION
        world_size = dist.get_world_size()
        with torch.no_grad():
            grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                               for p in self.params])
            self.shard.grad = grads[self.mine].clone()
            self.optimizer.step()
            self.shard.grad = None
            gathered = torch.zeros(self.piece * world_size, dtype=self.shard.dtype)
            pieces = list(gathered.split(self.piece))
            mine = torch.zeros(self.piece, dtype=self.shard.dtype)
            mine[:self.shard.numel()] = self.shard
            dist.all_gather(pieces, mine)
            gathered = torch.cat(pieces)
            offset = 0
            for p in self.params:
                p.copy_(gathered[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        ### END SOLUTION


# %%
# Try it: 2 ranks, Adam; compare with the unsharded Adam and look at each rank's state.
def try_sharded(rank, world_size):
    torch.manual_seed(0)
    model, plain_model = nn.Linear(6, 4), nn.Linear(6, 4)
    plain_model.load_state_dict(model.state_dict())
    sharded = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    for m, opt in ((model, sharded), (plain_model, plain)):
        m(x).pow(2).mean().backward()
        opt.step()
    state = sum(t.numel() for s in sharded.optimizer.state.values() for t in s.values())
    return {"weights equal": torch.allclose(model.weight, plain_model.weight),
            "state elements here": state}

run_ranks(try_sharded, 2, timeout=30, backend="gloo")

# %% nbgrader={"grade": true, "grade_id": "test-same-weights", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
# Test (4 points): 2 ranks, Adam, 3 steps: the weights equal the unsharded Adam's.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import sharded_optimizer as checks
integrity.assert_untampered()
checks.check_same_weights_as_unsharded(ShardedOptimizer)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-state-sharded", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 4 ranks, Adam, one large weight: each rank's state about 1/4 of the whole.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import sharded_optimizer as checks
integrity.assert_untampered()
checks.check_state_is_sharded(ShardedOptimizer)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-sharded-optimizer-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 1, 3 and 4 ranks; SGD with momentum, AdamW; more steps; counts that do not divide;
# gradients that differ between ranks outside each rank's piece.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import sharded_optimizer as hidden
hidden.check_sharded_optimizer(ShardedOptimizer)
print("passed")
### END HIDDEN TESTS
