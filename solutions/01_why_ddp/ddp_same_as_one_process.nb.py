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
# # Exercise 01: DDP on N shards equals one process on the whole batch
#
# Chapter 01's headline claim: with DistributedDataParallel, N ranks that each run forward and
# backward on **their own share** of a global batch end every step with the weights that one
# process gets from the **whole** batch. DDP's constructor copies rank 0's parameters and buffers
# to every rank ([DDP design note](https://docs.pytorch.org/docs/stable/notes/ddp.html)), and
# `backward()` replaces every gradient by its mean over the ranks. With equal shares and a
# mean-reduced loss, the mean of the shards' mean gradients is the full batch's mean gradient, so
# every rank takes the single-process step. Here you write that training loop, and the tests
# compare it with a single-process run.
#
# **How your code runs.** The tests call your function on every rank of a real gloo process group
# (like a function given to `run_ranks(fn, world_size)`): use the default group, never
# `init_process_group` in this notebook.
#
# **Self-check** from the repository root: `pytest exercises/01_why_ddp`. Hidden tests (other world
# sizes and models) run when the notebook is graded. Keep the name and signature exactly as given.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import ddp_same_as_one_process as checks
from ddpcourse.launcher import run_ranks
from ddpcourse.toys import make_model, make_regression

setup_notebook("ddp_same_as_one_process")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-train-with-ddp", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `train_with_ddp(model, x, y, steps, lr) -> model` (6 points)
#
# The training loop of the claim above, on N ranks. Implement `train_with_ddp` as its docstring
# below says: what each rank trains on, with which optimizer and loss, what it returns, and what the
# tests compare it with.
#
# Why the comparison with one process has a tolerance, not exact equality: the all-reduce adds the
# shards' gradients in a different order than one process adds the rows', and float32 addition is
# not associative; measured, the difference stays below 1e-7, while one step too few moves some
# weight by ~1e-2.

# %% nbgrader={"grade": false, "grade_id": "train-with-ddp", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_with_ddp(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
                   lr: float) -> nn.Module:
    """Train `model` with DDP on this rank's equal share of (x, y); return the module.

    Called on every rank. Every rank gets the same global batch `x` (rows are samples) and `y`, and
    its own `model` instance: the tests initialise them differently on every rank, so only rank 0's
    initial weights may count (DDP's constructor takes care of that).

    1. If `len(x)` does not divide by the world size `N`, raise `ValueError` (no equal shares).
    2. Wrap `model` in `DistributedDataParallel` (on CPU without `device_ids`).
    3. Take this rank's share: `len(x) / N` rows of `x` and the matching rows of `y`. Any split into
       equal shares is fine (a contiguous slice per rank is simplest), as long as at every step the
       N shares together are all rows of `x`, each exactly once.
    4. Run `steps` steps of plain `torch.optim.SGD(..., lr=lr)` (no momentum, no weight decay) on
       the mean-squared error with mean reduction (`nn.functional.mse_loss(out, y_share)`):
       `zero_grad`, one forward of the DDP model on the share, `backward`, `step`. Exactly one
       forward per step: no extra passes, e.g. for logging.
    5. Return `model` itself, trained (DDP trains the module it wraps in place).

    Args:
        model: this rank's model, initialised differently on every rank.
        x: the global batch, the same on every rank; rows are samples.
        y: the targets of the rows of `x`, the same on every rank.
        steps: the number of SGD steps.
        lr: SGD's learning rate.

    Returns:
        The `model` that was handed in, trained. Not the DDP wrapper: it is for training only, its
        `state_dict()` keys start with `module.` and do not load into a plain model, so the tests
        reject it. Not a new or copied model either.

    Raises:
        ValueError: if `len(x)` does not divide by the world size.

    What the tests check on every rank, with a forward pre-hook on the `model` they hand in: the
    model's forward ran `steps` times, each on this rank's `len(x) / N` rows (so "every rank
    trains on the whole batch", which gives the right weights at N times the work, fails); the
    ranks' shares at each step are the rows of `x`, each once; all ranks end with bit-identical
    parameters and buffers; and these equal one process training rank 0's initial model on the
    full batch with the same SGD, to `1e-5 + 1e-5 * |w|`.
    """
    ### BEGIN SOLUTION
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if len(x) % world_size:
        raise ValueError(f"{len(x)} rows do not split into {world_size} equal shares")
    share = len(x) // world_size
    x_mine, y_mine = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    ddp_model = DDP(model)  # copies rank 0's parameters and buffers to every rank
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp_model(x_mine), y_mine)
        loss.backward()  # DDP averages the gradients over the ranks here
        optimizer.step()
    return ddp_model.module
    ### END SOLUTION


# %%
# Try it: 2 ranks, different initial models, the same 8 rows; compare the ranks' weights.
def try_training(rank, world_size):
    x, y = make_regression(8, seed=0).tensors
    model = train_with_ddp(make_model(seed=rank), x, y, steps=5, lr=0.1)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])[:4]

run_ranks(try_training, 2, timeout=15, backend="gloo")  # CPU tensors: gloo, also on GPUs

# %% nbgrader={"grade": true, "grade_id": "test-train-with-ddp-matches-one-process", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, TinyMLP, 8 rows, 5 steps: the returned model, equal replicas, and one process's weights.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ddp_same_as_one_process as checks
integrity.assert_untampered()
checks.check_train_with_ddp_matches_one_process(train_with_ddp)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-with-ddp-shares-the-batch", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, 10 rows, 5 steps: each forward sees only this rank's 5 rows, and the shares together are x.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ddp_same_as_one_process as checks
integrity.assert_untampered()
checks.check_train_with_ddp_shares_the_batch(train_with_ddp)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-with-ddp-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) 1, 3 and 4 ranks, other lr and steps, a model with a frozen layer and a buffer, batches that do not split.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import ddp_same_as_one_process as hidden
hidden.check_train_with_ddp(train_with_ddp)
print("passed")
### END HIDDEN TESTS
