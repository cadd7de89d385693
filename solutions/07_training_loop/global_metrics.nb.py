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
# # Exercise 07: exact metrics of the whole validation set, on N ranks
#
# A DDP training loop evaluates on a validation set now and then. Each rank should evaluate only
# its own share (N ranks, N times less work each), and yet every rank wants the loss and accuracy
# of the **whole** set: to log them, to keep the best checkpoint, to stop early - and to decide it
# the same way on every rank. Three easy ways to get there give wrong numbers:
#
# * averaging the ranks' own means: with 10 samples on 3 ranks the shares hold 4, 3 and 3 samples,
#   and the mean of three means weighs a sample of a 3-sample share more than one of the 4-sample
#   share. Shares with mean losses 1.0, 2.0 and 2.0 give a true mean of
#   (4·1.0 + 3·2.0 + 3·2.0) / 10 = 1.6, not (1.0 + 2.0 + 2.0) / 3 = 1.67;
# * `DistributedSampler`'s shares: it pads them to equal length by repeating samples (chapter 06:
#   10 samples on 3 ranks become 12, two of them counted twice), or with `drop_last=True` leaves
#   samples out. Fine for training, wrong for an exact metric;
# * letting rank 0 gather the answer (`dist.reduce`): the other ranks are left with a part of it.
#
# Your task: find what each rank must compute over its share so that a collective gives every
# rank the exact numbers of one process evaluating everything, whatever the shares' sizes.
#
# **How your code runs.** The tests call your function on every rank of a real gloo process group
# (like a function given to `run_ranks(fn, world_size)`): use the default group, never
# `init_process_group` in this notebook.
#
# **Self-check** from the repository root: `pytest exercises/07_training_loop/global_metrics.ipynb`.
# Hidden tests (1, 3 and 4 ranks, empty data sets, a DDP model with fewer samples than ranks, a
# model whose modules are not all in one mode) run when the notebook is graded. Keep the name and signature exactly as given.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import global_metrics as checks
from ddpcourse.launcher import run_ranks

setup_notebook("global_metrics")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-evaluate", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `evaluate(model, dataset, batch_size) -> dict` (7 points)
#
# Implement `evaluate` as its docstring below says: what each rank evaluates, what it returns, what
# it must leave as it was, and what happens with empty shares and empty data sets.
#
# **Why `model.module` when you are handed a `DistributedDataParallel` wrapper.** The wrapper's
# forward is not a plain forward: it is a point where the ranks talk. In
# [torch/nn/parallel/distributed.py](https://github.com/pytorch/pytorch/blob/main/torch/nn/parallel/distributed.py)
# (torch 2.13), `DistributedDataParallel.forward` calls `_pre_forward`, which, when
# `_check_sync_bufs_pre_fwd()` says so, calls `_sync_buffers`: it broadcasts rank 0's buffers
# (here BatchNorm's running statistics) to every rank at the first forward after the wrapper was
# built and at the first forward after every forward with gradients on outside `no_sync()`, that
# is after every synchronised training step (with the default `broadcast_buffers=True`, for any model that has buffers).
# That broadcast is a collective: every rank must make it. While evaluating, ranks run different
# numbers of forwards (a share of 4 samples in batches of 4 is one batch, an empty share none), so
# a rank that makes no forward leaves its peers waiting forever in the broadcast. The plain module
# behind the wrapper, `model.module`, computes the same logits and never communicates. The cell
# after the next one shows the broadcast: each rank sets its own BatchNorm statistics after
# wrapping, then makes one forward under `no_grad`.
#
# **How it is tested.** On every rank of groups of 2 and 3 ranks (hidden: 1, 3 and 4), with data
# set sizes that do not divide by the world size, fewer samples than ranks, batches of 1 and larger
# than a share: a forward pre-hook records the rows every forward of the model receives, and the
# test checks that together the ranks evaluated every sample exactly once, no rank more than
# `ceil(n / world_size)`; that the model was in eval mode with gradients off during each forward
# and is afterwards as it was; that every rank returned the same; and that this equals one process
# evaluating the whole data set. `count` and `accuracy` are compared exactly (accuracy to 1e-7, so
# float32 or float64 division of the right counts both pass, and any other count fails: neighbouring
# counts differ by at least 1/17 here). The loss is compared to `1e-6 + 1e-5 * |loss|`: your float32
# losses are added in another order (per batch, per rank, then over the ranks) than the test adds
# them, and float32 addition is not associative. Measured on every test's data, the difference
# stays below 2% of that allowance, while the mean of the ranks' means is off by more than 300
# times it wherever the shares are uneven.

# %% nbgrader={"grade": false, "grade_id": "evaluate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def evaluate(model: nn.Module, dataset, batch_size: int) -> dict:
    """The loss and accuracy of `model` on the WHOLE `dataset`, the same on every rank.

    Called on every rank of the default process group, with the same arguments on every rank.

    Args:
        model: a classifier: `model(x)` maps a batch of rows `x` (shape `(b, features)`) to logits
            of shape `(b, classes)`. It is identical on every rank. It is a plain `nn.Module`, or
            a `DistributedDataParallel` wrapper around one: then evaluate the wrapped module,
            `model.module`, and never call the wrapper itself (its forward is a collective; see
            the task text). The model may contain Dropout and BatchNorm, so its mode matters.
        dataset: a map-style data set: `len(dataset)` samples, `dataset[i]` is `(x_i, y_i)` with
            `x_i` a float32 tensor of shape `(features,)` and `y_i` an integer class label (a
            Python int or a 0-d integer tensor). `DataLoader`'s default batching stacks them
            into the `x` and `y` of a batch.
        batch_size: the most samples one forward may take.

    Requirements:

    * The work is shared: no rank runs the model on more than `ceil(len(dataset) / world_size)`
      samples, and together the ranks run it on every sample exactly once. With fewer samples
      than ranks, some ranks have none, and still take part in every collective their peers call.
    * Every forward takes at most `batch_size` samples, stacked as they are, with the model in
      eval mode and gradients off.
    * The loss of a sample is its cross-entropy (`F.cross_entropy`); a sample is correct when its
      largest logit is its label.

    Returns:
        On every rank the same dict, with exactly these keys:
        `{"loss": float, "accuracy": float, "count": int}`: the mean cross-entropy per sample over
        the whole data set (total loss / count), the fraction of samples classified correctly
        (correct / count), and the number of samples evaluated in total, which is
        `len(dataset)`. Python numbers, not tensors (`.item()` or `.tolist()` gives them). For an
        empty data set: `{"loss": math.nan, "accuracy": math.nan, "count": 0}` (a mean of
        nothing; `F.cross_entropy` of an empty batch says nan too).

    Everything is left as it was handed in: every module of the model in the mode it had (a
    model in training mode may hold a BatchNorm frozen in eval mode), the same parameters and
    buffers bit for bit, no `.grad` on any parameter, `requires_grad` untouched, and gradients
    enabled or disabled afterwards as they were before the call.
    """
    ### BEGIN SOLUTION
    rank, world_size = dist.get_rank(), dist.get_world_size()
    net = model.module if isinstance(model, DDP) else model  # never the wrapper's forward
    modes = [(module, module.training) for module in net.modules()]  # each its own mode
    mine = Subset(dataset, range(rank, len(dataset), world_size))  # each index once, even shares
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    net.eval()
    try:
        with torch.no_grad():
            for x, y in DataLoader(mine, batch_size=batch_size):
                logits = net(x)
                totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
                totals[1] += (logits.argmax(dim=1) == y).sum()
                totals[2] += len(y)
    finally:
        for module, training in modes:
            module.train(training)
    dist.all_reduce(totals)  # every rank, with or without samples: the same totals everywhere
    loss_sum, correct, count = totals.tolist()
    count = int(count)
    if count == 0:
        return {"loss": math.nan, "accuracy": math.nan, "count": 0}
    return {"loss": loss_sum / count, "accuracy": correct / count, "count": count}
    ### END SOLUTION


# %%
# Try it: 10 samples on 3 ranks (shares of 4, 3 and 3), then one process on all 10.
def try_evaluate(rank, world_size):
    model = checks.make_model(seed=0)
    dataset = checks.LabelledRows(10, seed=0)
    return evaluate(model, dataset, batch_size=4)

print("3 ranks:", run_ranks(try_evaluate, 3, timeout=30, backend="gloo"))
print("1 rank: ", run_ranks(try_evaluate, 1, timeout=30, backend="gloo"))


# %%
# Why model.module: after wrapping, each rank sets its own BatchNorm statistics (rank r: r), then
# makes one forward under no_grad. Through the wrapper, every rank ends with rank 0's value (the
# forward broadcast it: a collective); through the module, each keeps its own.
def statistics_after_one_forward(rank, world_size, through_wrapper):
    model = checks.make_model(seed=0)
    wrapper = DDP(model)
    model.body[1].running_mean.fill_(float(rank))
    model.eval()
    with torch.no_grad():
        (wrapper if through_wrapper else model)(torch.randn(2, checks.FEATURES))
    return model.body[1].running_mean[0].item()

print("through the wrapper:", run_ranks(statistics_after_one_forward, 2, True, timeout=60,
                                        backend="gloo"))
print("through .module:    ", run_ranks(statistics_after_one_forward, 2, False, timeout=60,
                                        backend="gloo"))

# %% nbgrader={"grade": true, "grade_id": "test-evaluate-matches-one-process", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 and 3 ranks, uneven shares, models in train and eval mode: one process's loss, accuracy and count on every rank.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import global_metrics as checks
integrity.assert_untampered()
checks.check_evaluate_matches_one_process(evaluate)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-evaluate-counts-each-sample-once", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): batches of 1 and larger than a share, fewer samples than ranks: every sample evaluated exactly once in total.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import global_metrics as checks
integrity.assert_untampered()
checks.check_evaluate_counts_each_sample_once(evaluate)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-evaluate-ddp-model", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 3 ranks, the model wrapped in DistributedDataParallel: its module is evaluated, the wrapper's forward never runs.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import global_metrics as checks
integrity.assert_untampered()
checks.check_evaluate_with_a_ddp_model(evaluate)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-evaluate-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) 1, 3 and 4 ranks, empty data sets, one sample, fewer samples than ranks with a DDP model, tensor labels.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import global_metrics as hidden
hidden.check_evaluate(evaluate)
print("passed")
### END HIDDEN TESTS
