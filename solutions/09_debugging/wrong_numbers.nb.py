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
# accuracy that is a little off, training whose data looks shuffled, and gradient clipping that
# keeps every gradient in bounds. Each lab shows the symptom in real ranks; finding the cause is
# yours (the test's message explains it once your answer is checked), and so is the fixed
# function. Its docstring is the contract.
#
# **How your code runs.** The tests call your function on every rank of a real gloo process group
# (as `run_ranks(fn, world_size)` does): use the default group, never `init_process_group` in
# this notebook. They compare what your ranks did (which samples each forward got, the
# gradients at every `optimizer.step()`, the all-reduces DDP launched, the final weights, what
# your function returned) with what one process computes on the same data.
#
# **Self-check** from the repository root: `pytest exercises/09_debugging/wrong_numbers.ipynb`.
# Hidden tests (3 and 4 ranks, data sets one sample short of and one past a multiple of the
# world size, more epochs, `accumulation_steps` of 1 and of 3 with a shorter last group, a
# `max_norm` no step reaches, SGD with momentum) run when the notebook is graded. Keep the names and signatures exactly as given, and
# do not reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import contextlib

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
# process evaluating all 7: the two numbers differ. Find out why before you write the fix (print
# what each rank evaluated; torch/utils/data/distributed.py is short).

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
print("one process:   ", checks.one_process_accuracy())

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-accuracy", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `accuracy(model, dataset, batch_size) -> float` (2 points)
#
# **How it is tested.** 2 ranks, 7 and 9 samples. Every rank gets the same model and the whole
# data set; a hook records the rows of every forward of the model. The test then requires that
# no rank evaluated more than `ceil(n / world_size)` samples, that together the ranks evaluated
# every sample, and that every rank returned the exact accuracy (`correct / n`, to 1e-7: a wrong
# count is at least `1 / n` away). When the number is one of the usual miscounts, the message
# says which, and where the given code goes wrong.

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
# rank's model saw in each epoch. Then find out why, in torch/utils/data/distributed.py.

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

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-train-clipped", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 9: gradient clipping with gradient accumulation
#
# `given_train_clipped` accumulates gradients over groups of `accumulation_steps` micro-batches
# and takes one optimizer step per group (the last group may be shorter). Its author got the
# communication right: only the group's last micro-batch runs outside `no_sync()`, forward and
# backward, so DDP all-reduces once per step. Training is meant to clip the gradient's total norm
# to `max_norm` (`torch.nn.utils.clip_grad_norm_`), and the loop reports the norm the clip
# measured at every step. Run it: every rank agrees with every other, each step's gradient is
# within `max_norm`, and yet the weights are not those of one process training on the same
# data with the same clipping (whose numbers are printed beside them). Where does the
# difference come from?

# %% nbgrader={"grade": false, "grade_id": "given-train-clipped", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the training loop as it was handed in. Do not fix it here; write `train_clipped` below.
def given_train_clipped(ddp_model, optimizer, micro_batches, accumulation_steps, max_norm):
    norms = []
    count = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        first = i - i % accumulation_steps  # this group's first micro-batch
        group_size = min(accumulation_steps, count - first)
        last = i == first + group_size - 1
        sync = contextlib.nullcontext() if last else ddp_model.no_sync()
        with sync:  # all-reduce only in the backward of the group's last micro-batch
            (F.mse_loss(ddp_model(x), y) / group_size).backward()
            norm = torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)
        if last:
            optimizer.step()
            optimizer.zero_grad()
            norms.append(norm.item())
    return norms


# %%
# Run it: 2 ranks, 6 micro-batches in groups of 3, max_norm=0.3.
reports = run_ranks(checks.watch_clipping, 2, given_train_clipped, timeout=30, backend="gloo")
for rank, report in enumerate(reports):
    print(f"rank {rank}: {report}")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-train-clipped", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `train_clipped(ddp_model, optimizer, micro_batches, accumulation_steps, max_norm) -> list[float]` (3 points)
#
# Part of the answer is the diagnosis: the list your function returns holds, for every optimizer
# step, the norm that step's gradient had before it was clipped. The given loop returns a number
# there too; it is not that one.
#
# **How it is tested.** 2 ranks: 6 micro-batches in groups of 3 with `max_norm=0.3`, and 5 in
# groups of 2 (a last group of 1) with `max_norm=0.25`. Each rank's model starts from a seed of
# its own; the test counts the gradient all-reduces (the all-reduced bytes, in units of one full
# gradient: the count a grader's broker sees, which your code cannot bypass), records the
# gradients at every `optimizer.step()` and the weights at the end. It requires one optimizer step
# per group, exactly as many gradient all-reduces, gradients at every step bit-identical on all
# ranks and of norm at most `max_norm`, the norms you return alike on every rank and equal (to
# `1e-5 + 1e-5 * |norm|`) to those of one process taking the same steps on every rank's
# micro-batches of each group, then that process's clipped gradients and final weights, to
# `1e-5 + 1e-5 * |w|` (written out for these two cases as each tensor's sum and norm).

# %% nbgrader={"grade": false, "grade_id": "train-clipped", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_clipped(ddp_model, optimizer, micro_batches: list, accumulation_steps: int,
                  max_norm: float) -> list:
    """Gradient accumulation with DDP and gradient clipping: one optimizer step and ONE gradient
    all-reduce per group of `accumulation_steps` micro-batches, each step's gradient clipped.

    Called on every rank of the default process group (gloo, CPU); `ddp_model` is a
    DistributedDataParallel model, `optimizer` its optimizer, `micro_batches` this rank's
    `(x, y)` pairs (the same count and sizes on every rank), `accumulation_steps >= 1`,
    `max_norm > 0`.

    * The micro-batches form groups of `accumulation_steps`, in order; the last group holds
      what is left (it may be shorter).
    * Each micro-batch: the loss `F.mse_loss(ddp_model(x), y)` divided by the size of its group,
      then `backward()`. Exactly one gradient all-reduce per group: every micro-batch but the
      group's last runs its forward AND its backward inside `ddp_model.no_sync()`.
    * Once per group, before `optimizer.step()` (then `optimizer.zero_grad()`): the gradient the
      step applies is clipped to total 2-norm `max_norm` with
      `torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm)`. The step must equal
      one process's step on the group's micro-batches of every rank, clipped the same way.
    * Returns a list with one Python float per optimizer step, the same on every rank: the
      total norm of the gradient that step applies, before clipping.
    """
    ### BEGIN SOLUTION
    norms = []
    count = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        first = i - i % accumulation_steps
        group_size = min(accumulation_steps, count - first)
        if i < first + group_size - 1:
            # Local accumulation: inside no_sync() each rank's .grad is its own partial sum,
            # so nothing here may look at the gradient's norm.
            with ddp_model.no_sync():
                (F.mse_loss(ddp_model(x), y) / group_size).backward()
            continue
        # The group's last micro-batch: DDP all-reduces the accumulated gradients in this
        # backward, so afterwards every rank holds the group's averaged gradient. Clip that.
        (F.mse_loss(ddp_model(x), y) / group_size).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-train-clipped", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, groups of 3 and of 2 with a shorter last group: one gradient all-reduce per step, the averaged gradient's norm, one process's clipped steps.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import wrong_numbers as checks
integrity.assert_untampered()
checks.check_train_clipped(train_clipped)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-wrong-numbers-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 3 and 4 ranks; data sets one sample short of and one past a multiple of the world size; more epochs; accumulation_steps 1 and 3 with a shorter last group; a max_norm no step reaches; momentum.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import wrong_numbers as hidden
hidden.check_all(accuracy, train_epochs, train_clipped)
print("passed")
### END HIDDEN TESTS
