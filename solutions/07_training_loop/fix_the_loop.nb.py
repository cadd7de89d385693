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
# # Exercise 07: find the bugs, fix the loop
#
# A colleague fine-tunes a fresh classification head on top of a small backbone with DDP. The
# loop runs on every rank and nothing raises, and yet it is wrong three times over. Each bug is
# one of chapter 07's, and none of them raises an error: a training run can go on for days with
# them. Only measurements show them.
#
# 1. Run `buggy_train` below on two ranks with the `watch` instrument and read what it measures.
# 2. Find the bugs: each shows up in one of `watch`'s numbers.
# 3. Write `train`, the loop `buggy_train` was meant to be. Its docstring is the contract.
#
# **How your code runs.** The tests call your function on every rank of a real gloo process group
# (as `run_ranks(fn, world_size)` does): use the default group, never `init_process_group` in
# this notebook.
#
# **Self-check** from the repository root: `pytest exercises/07_training_loop/fix_the_loop.ipynb`.
# Hidden tests (1, 3 and 4 ranks, other data) run when the notebook is graded. Keep the name and
# signature exactly as given, and do not reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import fix_the_loop as checks
from ddpcourse.launcher import run_ranks

setup_notebook("fix_the_loop")


# %% [markdown] nbgrader={"grade": false, "grade_id": "the-buggy-loop", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## The loop you are handed
#
# `buggy_train` gets this rank's `backbone` and `head` (two `nn.Module`s; the head maps the
# backbone's 16 features to 3 class scores), this rank's `batches` (one `(x, y)` per step) and a
# learning rate. It returns the losses it logged. Its comments say what its author believed.
# The cell is locked: copy it into a cell of your own to experiment.

# %% nbgrader={"grade": false, "grade_id": "buggy-train", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the loop with the bugs. Do not fix it here; write `train` below.
def buggy_train(backbone, head, batches, lr):
    model = DDP(backbone)  # the backbone is the big part: DDP keeps it in sync
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    head_optimizer = torch.optim.SGD(head.parameters(), lr=lr)  # the new head learns too
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        head_optimizer.zero_grad()
        # sum, not mean: DDP already averages over the ranks
        loss = F.cross_entropy(head(model(x)), y, reduction="sum")
        loss.backward()
        optimizer.step()
        head_optimizer.step()
        losses.append(loss.item())  # the training curve
    return losses


# %% nbgrader={"grade": false, "grade_id": "watch", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the instrument. It runs a training function on this rank the way the tests do, then
# measures what DDP must get right.
def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def watch(rank, world_size, train_fn, rows=4, steps=5, lr=0.5, seed=0):
    """Run `train_fn` on this rank's modules and batches (every rank's modules start different,
    as in the tests), then compare the ranks with each other and with ONE process that trains
    rank 0's initial modules on the global batches (every rank's batch of a step, concatenated)
    with the mean loss."""
    backbone_seed, head_seed = checks.module_seeds(seed, rank)
    backbone, head = checks.make_backbone(backbone_seed), checks.make_head(head_seed)
    logged = train_fn(backbone, head, checks.make_batches(seed, rank, steps, rows), lr)

    rank0_backbone_seed, rank0_head_seed = checks.module_seeds(seed, 0)
    one_backbone = checks.make_backbone(rank0_backbone_seed)
    one_head = checks.make_head(rank0_head_seed)
    # One process, one step per global batch, mean cross-entropy, plain SGD on both modules.
    one_optimizer = torch.optim.SGD([*one_backbone.parameters(), *one_head.parameters()], lr=lr)
    one_losses = []
    for x, y in checks.global_batches(world_size, rows, steps, seed):
        one_optimizer.zero_grad()
        one_loss = F.cross_entropy(one_head(one_backbone(x)), y)
        one_loss.backward()
        one_optimizer.step()
        one_losses.append(one_loss.item())
    report = {}
    for name, mine, one in (("backbone", backbone, one_backbone), ("head", head, one_head)):
        everyone = [torch.empty_like(flat(mine)) for _ in range(world_size)]
        dist.all_gather(everyone, flat(mine))
        report[f"{name}, largest difference between ranks"] = max(
            (other - flat(mine)).abs().max().item() for other in everyone)
        report[f"{name}, largest difference from one process"] = (
            (flat(mine) - flat(one)).abs().max().item())
    report["losses logged"] = [round(value, 4) for value in logged] if logged else logged
    report["one process's losses"] = [round(value, 4) for value in one_losses]
    return report


def show(reports):
    for rank, report in enumerate(reports):
        print(f"rank {rank}:")
        for what, value in report.items():
            print(f"    {what}: {value:.3g}" if isinstance(value, float) else
                  f"    {what}: {value}")


# %%
# Watch it: two ranks. Then read the numbers with the questions below.
show(run_ranks(watch, 2, buggy_train, timeout=60, backend="gloo"))

# %% [markdown] nbgrader={"grade": false, "grade_id": "what-to-look-for", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## What the numbers should be
#
# * **Between ranks: exactly 0**, for both modules. DDP replicas take identical steps, bit for
#   bit: every rank starts from rank 0's weights and applies the same averaged gradient. Which
#   module is not 0? What does DDP keep in sync, and what does it not touch? (Chapter 07, "Seeds
#   and replicas".)
# * **From one process: about 1e-7**, not more. The ranks add the same numbers in another order
#   than one process does, and float32 addition is not associative; a wrong loop is off by 1e-2 or
#   more. Once the replicas agree, is the step the right size? What does DDP average, and over
#   what? (Chapter 07, "The loss under DDP".)
# * **Losses logged: the one process's losses, on every rank.** What does each rank's `loss` hold?
#
# Fix one bug at a time in a copy of the loop and watch each number fall into place.

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-train", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `train(backbone, head, batches, lr) -> list[float]` (8 points)
#
# The loop `buggy_train` was meant to be: implement `train` as its docstring below says.
#
# **How it is tested.** Every rank builds its backbone and head from a seed of its own and its
# own batches, puts a forward hook on the backbone and the head you are given, and calls your
# function. The test then builds everything again where none of your code runs, trains rank 0's
# initial modules in one process on the global batches, and compares: the forwards (one per step,
# on this rank's own batch), the ranks' parameters (bit-identical), the weights (those of one
# process, within `1e-5 + 1e-5 * |w|`: measured, a right loop is at most 6e-8 away and the closest
# wrong one 2.7e-2) and the losses you return. When something is off, the message names the
# mistake that reproduces your weights exactly, when it is one of those the test knows.

# %% nbgrader={"grade": false, "grade_id": "train", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train(backbone: nn.Module, head: nn.Module, batches: list, lr: float) -> list[float]:
    """Train `head(backbone(x))` with DDP on this rank's batches; return the logged losses.

    Called on every rank of the default process group (gloo, CPU). Every rank gets:

    * its own `backbone` and `head` (`nn.Module`s, the head applied to the backbone's output),
      initialised differently on every rank: only rank 0's initial weights may count;
    * its own data: `batches[s] = (x, y)` is this rank's batch of step s (`x` float rows, `y`
      class indices); every rank has the same number of steps and of rows per batch;
    * the learning rate `lr`.

    At each step s, on this rank: ONE forward of `head(backbone(x))` on `batches[s]` (no other
    forward, not even to log a loss), the cross-entropy loss, backward, and one step of plain
    `torch.optim.SGD(..., lr=lr)` (no momentum, no weight decay) on both modules.

    What must hold afterwards, on every rank:

    1. `backbone` and `head`, the very objects handed in, are trained in place (wrap them,
       do not copy them);
    2. every rank holds bit-identical backbone and head parameters;
    3. these are the weights that ONE process gets by training rank 0's initial backbone and
       head with the same SGD, where step s uses the global batch (every rank's `batches[s]`,
       concatenated) and the mean cross-entropy over all of its rows (to 1e-5 + 1e-5 * |w|);
    4. the returned list holds, for each step, that one process's loss of step s (the global
       batch's mean loss, before the update), as a Python float, the same on every rank (to
       1e-5 + 1e-5 * |loss|).

    Args:
        backbone: this rank's backbone.
        head: this rank's head, applied to the backbone's output.
        batches: this rank's `(x, y)` of every step, in order.
        lr: SGD's learning rate.

    Returns:
        One float per step, in order: the loss one process computes on that step's global batch.
    """
    ### BEGIN SOLUTION
    # One wrapper around both modules: DDP's constructor gives every rank rank 0's weights of
    # both, and every backward averages the gradients of both (the head outside drifted apart).
    model = DDP(nn.Sequential(backbone, head))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        # The mean over this rank's rows: DDP's average over the ranks of equal batches then
        # gives the global batch's mean (a summed loss makes every gradient `rows` times larger).
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        # Each rank's loss is its own (DDP averages gradients, never the loss): average it.
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        losses.append(logged.item() / dist.get_world_size())
    return losses
    ### END SOLUTION


# %%
# Try it: the same instrument on your loop.
show(run_ranks(watch, 2, train, timeout=60, backend="gloo"))

# %% nbgrader={"grade": true, "grade_id": "test-train-replicas", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks: modules trained in place, one forward per step on the rank's own batch, equal replicas.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import fix_the_loop as checks
integrity.assert_untampered()
checks.check_train_keeps_replicas_identical(train)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-one-process", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks: the weights of one process trained on each step's global batch.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import fix_the_loop as checks
integrity.assert_untampered()
checks.check_train_matches_one_process(train)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-losses", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 2 ranks: every rank returns the global batch's mean loss of each step.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import fix_the_loop as checks
integrity.assert_untampered()
checks.check_train_logs_the_global_loss(train)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-train-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 1, 3 and 4 ranks, other batch sizes, step counts, learning rates and seeds: every check at once.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import fix_the_loop as hidden
hidden.check_train(train)
print("passed")
### END HIDDEN TESTS
