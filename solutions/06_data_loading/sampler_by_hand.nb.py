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
# # Exercise 06: which samples does my rank see?
#
# Under DDP every rank must train on its own share of the data, and the shares must have the same
# size: a rank with one batch more than its peers waits forever in the extra step's all-reduce.
# `torch.utils.data.distributed.DistributedSampler` does this bookkeeping. It is short, and
# knowing exactly what it does explains the surprises: why an epoch shows a few samples twice, why
# every epoch has the same order unless you call `set_epoch`, and what `drop_last` throws away.
#
# Here you rebuild its index arithmetic as a plain function, and the tests compare your answer with
# the sampler's own, index by index, on every rank of a real process group.
#
# **Self-check** from the repository root: `pytest exercises/06_data_loading`. Hidden tests (edge
# cases) run when the notebook is graded. Keep the function name and signature exactly as given,
# and do not reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import math

import torch
import torch.distributed as dist

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import sampler_by_hand as checks
from ddpcourse.launcher import run_ranks

setup_notebook("sampler_by_hand")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-shard-indices", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `shard_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False) -> list[int]` (6 points)
#
# `DistributedSampler`'s index arithmetic, by hand: implement `shard_indices` as its docstring below
# says. It describes what the sampler does step by step (order, length, share) and what you may not
# call. Read the sampler itself in
# [torch/utils/data/distributed.py](https://github.com/pytorch/pytorch/blob/main/torch/utils/data/distributed.py)
# (torch 2.13) to follow along.
#
# **How it is tested.** In every rank of real process groups of 1 to 4 ranks, each rank calls your
# function with its own rank and `num_replicas` = the world size; the test then builds torch's
# sampler in the same rank and compares. It also checks that all ranks got the same number of
# indices and that together they cover every index (without `drop_last`).

# %% nbgrader={"grade": false, "grade_id": "shard-indices", "locked": false, "schema_version": 3, "solution": true, "task": false}
def shard_indices(dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True,
                  seed: int = 0, epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The indices DistributedSampler gives `rank` of `num_replicas` in epoch `epoch`.

    Return, in order, exactly the indices that
    `DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)` yields after
    `set_epoch(epoch)` for a dataset with `dataset_len` samples. What the sampler does:

    1. Order. With `shuffle`, the order is a random permutation of `0 .. dataset_len-1` drawn by
       `torch.randperm` from a fresh `torch.Generator` seeded with `seed + epoch`. Every rank seeds
       it the same way, so every rank computes the same permutation, and a new epoch gives a new one
       (that is all `set_epoch` does). Without `shuffle`, the order is `0, 1, ..., dataset_len-1`.
    2. Length. Each rank gets `num_samples` indices, the same number on every rank:
       * without `drop_last`: `ceil(dataset_len / num_replicas)`. The list is padded up to
         `num_samples * num_replicas` by appending indices from its start again (the first ones of
         the shuffled order, not index 0 and not the last index), as many passes over the list as
         needed: a dataset smaller than `num_replicas` is repeated several times;
       * with `drop_last`, when `dataset_len` is not a multiple of `num_replicas`:
         `ceil((dataset_len - num_replicas) / num_replicas)`, which is
         `dataset_len // num_replicas` (0 when the dataset is smaller than the world). The tail of
         the ordered list beyond `num_samples * num_replicas` is dropped. (A multiple of
         `num_replicas` loses nothing.)
    3. Share. Rank `r` takes every `num_replicas`-th index of that list starting at position `r`
       (strided, not a contiguous block).

    An empty dataset (`dataset_len = 0`) gives `[]` on every rank.

    Write it yourself: the tests run this function with a profiler hook and fail it if any function
    of `torch/utils/data/distributed.py` runs during the call (so no `DistributedSampler`, however
    it was imported). `torch.Generator` and `torch.randperm` are allowed, and needed.

    Args:
        dataset_len: the number of samples in the dataset (0 is allowed).
        num_replicas: the number of ranks sharing the dataset, the sampler's `num_replicas`.
        rank: the rank whose indices to return, in `[0, num_replicas)`.
        shuffle, seed, drop_last: as the sampler's arguments of the same names.
        epoch: the epoch given to the sampler's `set_epoch`.

    Returns:
        A `list` of Python `int`s (`.tolist()` gives them); the comparison is exact.

    Raises:
        ValueError: when `rank` is not in `[0, num_replicas)`, as the sampler does; since no rank
            can satisfy that when `num_replicas < 1`, that is a `ValueError` too. These are the
            only bad arguments the tests pass (visible: `rank == num_replicas`, a negative rank,
            `num_replicas = 0`); a negative `dataset_len` or a non-integer argument is never
            passed, so what you do with it is up to you.
    """
    ### BEGIN SOLUTION
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be at least 1, not {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)  # the same on every rank, new each epoch
        order = torch.randperm(dataset_len, generator=generator).tolist()
    else:
        order = list(range(dataset_len))
    if drop_last:
        num_samples = dataset_len // num_replicas
    else:
        num_samples = math.ceil(dataset_len / num_replicas)
    total = num_samples * num_replicas
    if total > len(order):  # pad by repeating from the start, as often as needed
        passes = math.ceil(total / len(order))
        order = (order * passes)[:total]
    else:
        order = order[:total]
    return order[rank:total:num_replicas]
    ### END SOLUTION


# %%
# Try it: 10 samples on 3 ranks, shuffled, epoch 1. Every rank gets 4; two samples appear twice.
def my_share(rank, world_size):
    return shard_indices(10, world_size, rank, epoch=1)

shares = run_ranks(my_share, 3, timeout=15)
print(shares, "->", sorted(i for share in shares for i in share))

# %% nbgrader={"grade": true, "grade_id": "test-shard-indices-no-shuffle", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 2 and 3 ranks, 10 and 11 samples, in order: padding and strided shares.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import sampler_by_hand as checks
integrity.assert_untampered()
checks.check_shard_indices_without_shuffle(shard_indices)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-shard-indices-shuffled", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 and 3 ranks, 10 and 11 samples, shuffled in epochs 0 and 1.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import sampler_by_hand as checks
integrity.assert_untampered()
checks.check_shard_indices_shuffled(shard_indices)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-shard-indices-drop-last-and-bad-ranks", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): drop_last on 2 and 3 ranks; ValueError for a rank outside the world and for num_replicas 0.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import sampler_by_hand as checks
integrity.assert_untampered()
checks.check_shard_indices_drop_last_and_bad_ranks(shard_indices)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-shard-indices-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) 1 and 4 ranks, fewer samples than ranks, an empty dataset, other seeds, a large epoch, more bad arguments.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import sampler_by_hand as hidden
hidden.check_shard_indices(shard_indices)
print("passed")
### END HIDDEN TESTS
