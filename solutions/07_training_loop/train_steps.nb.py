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
# # Exercise 07: gradient accumulation with DDP
#
# A batch that does not fit in memory is split into micro-batches whose gradients are added up
# before one optimizer step. Under DDP that has two traps. Every backward outside
# `ddp_model.no_sync()` all-reduces the gradients, so a naive loop pays for the communication k
# times per step; and a loop that syncs, scales or steps on the wrong micro-batch trains a
# different model than the large batch would, with no error anywhere (chapter 07, "Gradient
# accumulation").
#
# You write the training loop. The tests run it in **real process groups** of 1 to 4 ranks (gloo,
# CPU), count the gradient all-reduces it causes, and compare the trained weights with one process
# training on the equivalent large batches.
#
# **How your code runs.** Each test calls your function in every rank (`run_ranks`), with a
# `DistributedDataParallel` model, this rank's micro-batches, an optimizer and a loss function
# that the test built. Use the default process group as usual (`dist.get_world_size()`,
# `dist.all_reduce`); do not call `init_process_group` here.
#
# **Self-check** from the repository root: `pytest exercises/07_training_loop/train_steps.ipynb`.
# Hidden tests (more world sizes, momentum, edge cases) run when the notebook is graded. Keep the
# function name and signature exactly as given, and do not reassign library functions (the tests
# check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import train_steps as checks
from ddpcourse.launcher import run_ranks

setup_notebook("train_steps")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-train-steps", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `train_steps(ddp_model, micro_batches, optimizer, loss_fn, accumulation_steps) -> list[float]` (8 points)
#
# Implement the loop its docstring below describes: what each optimizer step must compute, how
# often the gradients may be all-reduced, what it returns. The lesson (chapter 07, "Gradient
# accumulation") takes one optimizer step from exactly two micro-batches, unrolled, and shows
# what `no_sync()` does and does not keep local. A loop over any list of micro-batches has more to
# decide: for each micro-batch, whether its backward synchronises, how much its loss weighs (the
# last group may be shorter), when the optimizer steps; and which loss to report so that every
# rank reports the same.
#
# **How it is tested.** Each rank builds its model from a different seed (DDP's constructor copies
# rank 0's), its own micro-batches and an SGD optimizer, then calls your function. The test counts
# the bytes all-reduced during the call (when the class is graded, by the grader's relay, which
# your code cannot bypass) and requires one gradient all-reduce per optimizer step. It trains rank
# 0's initial model in one process, one step per group on all ranks' micro-batches of that group
# concatenated, and requires the same losses on every rank, identical replicas and the same
# weights (within 1e-5, since float32 sums in another order differ in the last bits).

# %% nbgrader={"grade": false, "grade_id": "train-steps", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_steps(ddp_model: DDP, micro_batches: list, optimizer: torch.optim.Optimizer,
                loss_fn, accumulation_steps: int) -> list[float]:
    """Train on this rank's micro-batches with gradient accumulation; return each step's loss.

    Called on every rank of the default process group, with the same number of micro-batches on
    every rank, all with the same number of rows.

    * Consecutive micro-batches form groups of `accumulation_steps`; the last group is shorter
      when `len(micro_batches)` is not a multiple of it (7 micro-batches, 3 per group: groups of
      3, 3 and 1). Each group makes exactly ONE `optimizer.step()`, and the gradients it steps
      with are those of the group's micro-batches of all ranks taken as one large batch: the
      mean, over the group's micro-batches and over all ranks, of the gradient of each
      micro-batch's loss (for a short last group, the mean over the micro-batches it has).
    * The gradients are all-reduced exactly once per optimizer step, however many micro-batches
      the step has.
    * Every step starts from zero gradients, not from the previous step's: they are zero or None
      when the function is called, and the gradients of one step must not leak into the next.
    * No micro-batches: no step; return `[]`.

    Args:
        ddp_model: the `DistributedDataParallel` model to train (call it, not `.module`).
        micro_batches: this rank's list of `(inputs, targets)` pairs.
        optimizer: the optimizer over the model's parameters.
        loss_fn: `loss_fn(outputs, targets)` gives a micro-batch's mean loss (a scalar tensor).
        accumulation_steps: micro-batches per optimizer step, an int >= 1.

    Returns:
        One Python float per optimizer step, in order: the global mean loss of that step, the mean
        of `loss_fn` (unscaled) over the step's micro-batches on every rank. The same list on every
        rank: combine the ranks' losses with a collective (a small all-reduce per step is fine).

    Raises:
        ValueError: `accumulation_steps` is less than 1 (raised before any training).
    """
    ### BEGIN SOLUTION
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, not {accumulation_steps}")
    losses = []
    for start in range(0, len(micro_batches), accumulation_steps):
        group = micro_batches[start:start + accumulation_steps]
        step_loss = 0.0
        for position, (inputs, targets) in enumerate(group):
            last = position == len(group) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss = loss_fn(ddp_model(inputs), targets)
                (loss / len(group)).backward()
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = torch.tensor(step_loss / len(group), dtype=torch.float64)
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / dist.get_world_size())
    return losses
    ### END SOLUTION


# %%
# Try it: 2 ranks, 4 micro-batches of 3 rows each, 2 per optimizer step.
def try_it(rank, world_size):
    torch.manual_seed(rank)  # different on each rank: DDP copies rank 0's weights
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(3, 4), torch.randn(3, 1)) for _ in range(4)]
    losses = train_steps(model, data, optimizer, nn.MSELoss(), 2)
    return losses, model.module.weight.detach().flatten().tolist()

for rank, (losses, weight) in enumerate(run_ranks(try_it, 2, timeout=30)):
    print(f"rank {rank}: losses {losses}, weight {weight}")

# %% nbgrader={"grade": true, "grade_id": "test-train-steps-matches-one-process", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, 4 micro-batches by 2 and 6 by 3: the losses and the weights equal one process on the large batches.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import train_steps as checks
integrity.assert_untampered()
checks.check_accumulation_matches_one_process(train_steps)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-steps-one-all-reduce-per-step", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, 6 micro-batches by 3 and 3 by 1: exactly one gradient all-reduce per optimizer step.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import train_steps as checks
integrity.assert_untampered()
checks.check_one_all_reduce_per_optimizer_step(train_steps)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-steps-tail", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 2 ranks, 5 micro-batches by 2 and 7 by 3: the short last group is one more step.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import train_steps as checks
integrity.assert_untampered()
checks.check_the_tail(train_steps)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-steps-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 1, 3 and 4 ranks; accumulation_steps 1 and larger than the number of micro-batches; no micro-batches; momentum; a cross-entropy loss; bad accumulation_steps.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import train_steps as hidden
hidden.check_train_steps(train_steps)
print("passed")
### END HIDDEN TESTS
