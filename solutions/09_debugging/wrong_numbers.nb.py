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
# # Exercise 09: wrong numbers
#
# The worst bugs of a distributed job do not crash it. The three pieces of code below run to the
# end on every rank, raise nothing, and produce numbers that look plausible: an evaluation
# accuracy that is a little off, training that sees its data in the same order every epoch, and
# gradient accumulation that communicates three times more than it should (or, once half fixed,
# lets the replicas drift apart). Each lab shows the symptom in real ranks; you find the cause and
# write the fixed function. Its docstring is the contract.
#
# **How your code runs.** The tests call your function on every rank of a real gloo process group
# (as `run_ranks(fn, world_size)` does): use the default group, never `init_process_group` in
# this notebook. They compare what your ranks did (which samples each forward got, the
# gradients at every `optimizer.step()`, the all-reduces DDP launched, the final weights) with a
# reference the test computes itself in one process.
#
# **Self-check** from the repository root: `pytest exercises/09_debugging/wrong_numbers.ipynb`.
# Hidden tests (3 and 4 ranks, data sets one sample short of and one past a multiple of the
# world size, more epochs, `accumulation_steps` of 1 and of 3 with a shorter last group, SGD with
# momentum) run when the notebook is graded. Keep the names and signatures exactly as given, and
# do not reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import wrong_numbers as checks
from ddpcourse.launcher import run_ranks

setup_notebook("wrong_numbers")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-accuracy", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 7: an evaluation accuracy that is slightly off
#
# `given_accuracy` evaluates a classifier on a data set, each rank on its share, and all-reduces
# the counts. It looks like textbook code. Run it on 2 ranks and 7 samples, and compare with one
# process evaluating all 7.
#
# Where to look: how many samples did the two ranks evaluate together? Read
# `DistributedSampler.__iter__` (torch/utils/data/distributed.py): with `drop_last=False` (the
# default) it *adds extra samples to make the data evenly divisible*, repeating the first ones,
# so that every rank gets `ceil(n / world_size)` samples. `len(sampler)` on one rank, times the
# world size, says how many.

# %% nbgrader={"grade": false, "grade_id": "given-accuracy", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the evaluation as it was handed in. Do not fix it here; write `accuracy` below.
def given_accuracy(model, dataset, batch_size):
    sampler = DistributedSampler(dataset, shuffle=False)  # each rank its own share
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    correct = torch.zeros(())
    total = torch.zeros(())
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(dim=1) == y).sum()
            total += len(y)
    dist.all_reduce(correct)  # the counts of every rank
    dist.all_reduce(total)
    return (correct / total).item()


# %%
# Run it: 2 ranks, 7 samples. Then one process on the same 7 samples.
print("2 ranks return:", run_ranks(checks.watch_accuracy, 2, given_accuracy, timeout=30,
                                   backend="gloo"))
print("one process:   ", checks.one_process_accuracy(7, 0))
share = len(DistributedSampler(range(7), num_replicas=2, rank=0, shuffle=False))
print("samples the 2 ranks evaluate together:", 2 * share, "of 7")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-accuracy", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `accuracy(model, dataset, batch_size) -> float` (2 points)
#
# Count every sample exactly once. Several fixes are right: give each rank the samples
# `range(rank, n, world_size)` (uneven shares are fine here: the evaluation runs no DDP
# collective inside the forward), or keep the sampler and leave out the padded positions
# (position `rank + i * world_size` of the padded list is padding when it is `>= n`), or gather
# every prediction and keep the first `n`. `drop_last=True` is not one: it never evaluates the
# last samples.
#
# **How it is tested.** 2 ranks, 7 and 9 samples. Every rank gets the same model and the whole
# data set; a hook records the rows of every forward of the model. The test then requires that
# no rank evaluated more than `ceil(n / world_size)` samples, that together the ranks evaluated
# every sample, and that every rank returned the exact accuracy (`correct / n`, to 1e-7: a wrong
# count is at least `1 / n` away). When the number is one of the usual miscounts, the message
# says which.

# %% nbgrader={"grade": false, "grade_id": "accuracy", "locked": false, "schema_version": 3, "solution": true, "task": false}
def accuracy(model, dataset, batch_size: int) -> float:
    """The classification accuracy of `model` over ALL of `dataset`, each sample counted once.

    Called on every rank of the default process group (gloo, CPU), with the same arguments on
    every rank: `model` maps a batch of rows to class scores (predicted class: `argmax(dim=1)`),
    `dataset[i]` is `(row, label)`, `batch_size` the largest batch one forward may take.

    * Each rank evaluates only its share: at most `ceil(len(dataset) / world_size)` samples,
      in batches of at most `batch_size`, with `model(x)` (no gradients needed).
    * Together the ranks evaluate every sample.
    * Every rank returns the same Python float: (samples predicted right) / len(dataset),
      where every sample counts exactly once.
    """
    ### BEGIN SOLUTION
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Every world_size-th sample, as DistributedSampler deals them, but without its padding: the
    # shares differ by at most one sample, and each sample is on exactly one rank.
    share = Subset(dataset, range(rank, len(dataset), world_size))
    counts = torch.zeros(2, dtype=torch.int64)  # right, evaluated
    with torch.no_grad():
        for x, y in DataLoader(share, batch_size=batch_size):
            counts[0] += (model(x).argmax(dim=1) == y).sum()
            counts[1] += len(y)
    dist.all_reduce(counts)
    return counts[0].item() / counts[1].item()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-accuracy", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, 7 and 9 samples: each rank its share, every sample evaluated, the exact accuracy on every rank.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import wrong_numbers as checks
integrity.assert_untampered()
checks.check_accuracy(accuracy)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-train-epochs", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 8: every epoch in the same order
#
# `given_train_epochs` trains a DDP model for a few epochs on a shuffled, sharded data set. The
# loss goes down; nothing looks wrong. Run it on 2 ranks for 3 epochs and read which samples each
# rank's model saw in each epoch.
#
# Where to look: `DistributedSampler.__iter__` seeds its shuffle with `seed + self.epoch`, and
# `self.epoch` changes only when you call `set_epoch` (its docstring: "calling the set_epoch
# method at the beginning of each epoch before creating the DataLoader iterator is necessary to
# make shuffling work properly across multiple epochs. Otherwise, the same ordering will be
# always used").

# %% nbgrader={"grade": false, "grade_id": "given-train-epochs", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the training loop as it was handed in. Do not fix it here; write `train_epochs` below.
def given_train_epochs(ddp_model, optimizer, dataset, epochs, batch_size, seed):
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)  # shuffled, sharded
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(ddp_model(x), y).backward()
            optimizer.step()


# %%
# Run it: 2 ranks, 7 samples, batches of 2, 3 epochs. Which samples did each rank's model see?
seen = run_ranks(checks.watch_epochs, 2, given_train_epochs, timeout=30, backend="gloo")
for rank, epochs in enumerate(seen):
    for epoch, samples in enumerate(epochs):
        print(f"rank {rank}, epoch {epoch}: samples {samples}")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-train-epochs", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `train_epochs(ddp_model, optimizer, dataset, epochs, batch_size, seed) -> None` (3 points)
#
# **How it is tested.** 2 ranks, 7 samples for 3 epochs and 9 samples for 2. Every rank builds
# its model from a seed of its own (DDP's constructor gives every rank rank 0's weights), and a
# hook records the rows of every forward. The test builds torch's own `DistributedSampler` for
# every rank and epoch, calls `set_epoch(epoch)`, and requires each batch to hold exactly those
# samples, in that order (the test's orders differ from epoch to epoch). Then it requires
# bit-identical weights on every rank, equal to one process that trains rank 0's initial model on
# each step's global batch (every rank's batch of that step), to `1e-5 + 1e-5 * |w|`.

# %% nbgrader={"grade": false, "grade_id": "train-epochs", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_epochs(ddp_model, optimizer, dataset, epochs: int, batch_size: int, seed: int) -> None:
    """Train `ddp_model` for `epochs` epochs on this rank's share of `dataset`, reshuffled
    every epoch.

    Called on every rank of the default process group (gloo, CPU), with the same `dataset`,
    `epochs`, `batch_size` and `seed` on every rank; `ddp_model` is a DistributedDataParallel
    model and `optimizer` its optimizer.

    * The data: `DistributedSampler(dataset, shuffle=True, seed=seed)` (drop_last=False),
      loaded by `DataLoader(dataset, batch_size=batch_size, sampler=sampler)`; epoch `e` must
      see the sampler's order of epoch `e` (a different shuffle every epoch, the same on every
      rank).
    * Each batch `(x, y)`: `optimizer.zero_grad()`, the loss `F.mse_loss(ddp_model(x), y)`,
      `backward()`, `optimizer.step()`. No other forward.
    """
    ### BEGIN SOLUTION
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        # The shuffle is seeded with seed + epoch: without this, every epoch repeats epoch 0.
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(ddp_model(x), y).backward()
            optimizer.step()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-train-epochs", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, 2-3 epochs: each epoch in DistributedSampler's order for that epoch, equal replicas, one process's weights.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import wrong_numbers as checks
integrity.assert_untampered()
checks.check_train_epochs(train_epochs)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-train-accumulated", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 9: gradient accumulation that syncs too often, or at the wrong time
#
# `given_train_accumulated` accumulates gradients over groups of `accumulation_steps`
# micro-batches and takes one optimizer step per group (the last group may be shorter). Its
# author meant to all-reduce once per group and to skip DDP's all-reduce for the other
# micro-batches with `no_sync()`. Run it and count: the instrument counts the gradient
# all-reduces DDP launched (ddpcourse.grading.comm_audit sees DDP's reducer too) and compares the
# weights across ranks and with one process.
#
# Two bugs hide here, and the first hides the second:
#
# * Read `DistributedDataParallel.no_sync` and `_post_forward` (torch/nn/parallel/distributed.py):
#   `no_sync()` only sets `require_backward_grad_sync = False`, and it is the *forward* that reads
#   it (`prepare_for_backward`). The docstring warns: "The forward pass should be included inside
#   the context manager, or else gradients will still be synchronized."
# * Once the forward moves inside `no_sync()` too, the all-reduce happens where the code says it
#   should: on the micro-batch with `i % accumulation_steps == 0`. Is that the right one? The
#   gradients DDP averages are those accumulated *so far*; whatever is added after stays local.
#   (Try it in a copy: the count drops to 2, and the replicas drift apart.)

# %% nbgrader={"grade": false, "grade_id": "given-train-accumulated", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the accumulation loop as it was handed in. Do not fix it here; write
# `train_accumulated` below.
def given_train_accumulated(ddp_model, optimizer, micro_batches, accumulation_steps):
    count = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        first = i - i % accumulation_steps  # this group's first micro-batch
        group_size = min(accumulation_steps, count - first)
        loss = F.mse_loss(ddp_model(x), y) / group_size
        if i % accumulation_steps == 0:  # once per group: let DDP all-reduce
            loss.backward()
        else:  # the others: accumulate locally, no communication
            with ddp_model.no_sync():
                loss.backward()
        if i == first + group_size - 1:  # the group's last micro-batch: step
            optimizer.step()
            optimizer.zero_grad()


# %%
# Run it: 2 ranks, 6 micro-batches in groups of 3.
reports = run_ranks(checks.watch_accumulation, 2, given_train_accumulated, timeout=30,
                    backend="gloo")
for rank, report in enumerate(reports):
    print(f"rank {rank}: {report}")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-train-accumulated", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `train_accumulated(ddp_model, optimizer, micro_batches, accumulation_steps) -> None` (3 points)
#
# **How it is tested.** 2 ranks: 6 micro-batches in groups of 3, and 5 in groups of 2 (a last
# group of 1). Each rank's model starts from a seed of its own; the test counts the gradient
# all-reduces (the all-reduced bytes, in units of one full gradient: the count a grader's broker
# sees, which your code cannot bypass), records the gradients at every `optimizer.step()` and the
# weights at the end. It requires one optimizer step per group, exactly as many gradient
# all-reduces, gradients at every step bit-identical on all ranks (a step whose gradients still
# differ had no all-reduce after its group's last backward), and gradients and final weights
# equal to one process taking the same steps on every rank's micro-batches of each group, to
# `1e-5 + 1e-5 * |w|`.

# %% nbgrader={"grade": false, "grade_id": "train-accumulated", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_accumulated(ddp_model, optimizer, micro_batches: list, accumulation_steps: int) -> None:
    """Gradient accumulation with DDP: one optimizer step and ONE gradient all-reduce per group
    of `accumulation_steps` micro-batches.

    Called on every rank of the default process group (gloo, CPU); `ddp_model` is a
    DistributedDataParallel model, `optimizer` its optimizer, `micro_batches` this rank's
    `(x, y)` pairs (the same count and sizes on every rank), `accumulation_steps >= 1`.

    * The micro-batches form groups of `accumulation_steps`, in order; the last group holds
      what is left (it may be shorter).
    * Each micro-batch: the loss `F.mse_loss(ddp_model(x), y)` divided by the size of its group,
      then `backward()`; after the group's last one, `optimizer.step()`, then
      `optimizer.zero_grad()`.
    * Exactly one gradient all-reduce per group, after the group's last backward: every other
      micro-batch runs its forward AND its backward inside `ddp_model.no_sync()`.
    """
    ### BEGIN SOLUTION
    count = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        first = i - i % accumulation_steps
        group_size = min(accumulation_steps, count - first)
        if i == first + group_size - 1:
            # The group's last micro-batch: forward and backward outside no_sync, so DDP
            # all-reduces the gradients accumulated over the whole group, then step.
            (F.mse_loss(ddp_model(x), y) / group_size).backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            # The forward too: DDP decides in the forward whether the backward all-reduces.
            with ddp_model.no_sync():
                (F.mse_loss(ddp_model(x), y) / group_size).backward()
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-train-accumulated", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, groups of 3 and of 2 with a shorter last group: one gradient all-reduce per optimizer step, equal gradients at every step, one process's weights.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import wrong_numbers as checks
integrity.assert_untampered()
checks.check_train_accumulated(train_accumulated)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-wrong-numbers-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 3 and 4 ranks; data sets one sample short of and one past a multiple of the world size; more epochs; accumulation_steps 1 and 3 with a shorter last group; momentum.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import wrong_numbers as hidden
hidden.check_all(accuracy, train_epochs, train_accumulated)
print("passed")
### END HIDDEN TESTS
