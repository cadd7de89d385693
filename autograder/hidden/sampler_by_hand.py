"""Hidden checks for chapter 06: 1 and 4 ranks, datasets smaller than the world (len 2, 1, 0),
other seeds, a large epoch, drop_last with fewer samples than ranks, and more bad arguments.
Every call runs under the hook that forbids DistributedSampler itself. Every check runs the visible
module's observations (the situations are passed as data) and is judged here with
:func:`reference_indices`, torch's own sampler: the grader's reference, kept out of the visible
module (the ranks import it). tests/test_grading_sampler_by_hand.py holds the visible module's
written-out lists (VISIBLE_SHARDS) to it."""

from __future__ import annotations

from torch.utils.data.distributed import DistributedSampler

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.sampler_by_hand import (BAD_ARGUMENTS, judge_shards_with,
                                                         observe_shards)


def reference_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                      drop_last=False) -> list[int]:
    """What torch's own sampler yields: the trusted answer."""
    sampler = DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def judge_with_the_sampler(observations, world_size, cases):
    """The visible judge, with torch's sampler giving every expected list."""
    judge_shards_with(lambda n, replicas, rank, kwargs: reference_indices(n, replicas, rank,
                                                                          **kwargs),
                      observations, world_size, cases)


SHARDS = Case(observe_shards, judge_with_the_sampler)

ONE_RANK = [(7, {}), (7, {"shuffle": False}), (7, {"drop_last": True, "epoch": 3}), (0, {})]
FOUR_RANKS = [
    (10, {}), (10, {"shuffle": False}), (10, {"drop_last": True}), (13, {"seed": 42, "epoch": 5}),
    (2, {}), (2, {"shuffle": False}), (1, {}), (3, {"seed": 7, "epoch": 2}),  # fewer than ranks
    (2, {"drop_last": True}), (3, {"drop_last": True, "shuffle": False}),  # nothing left
    (0, {}), (0, {"drop_last": True}),  # the sampler accepts an empty dataset: [] everywhere
    (9, {"seed": 2**40 + 3, "epoch": 10**6}), (8, {"seed": 1, "epoch": 0, "drop_last": True}),
]
THREE_RANKS = [(2, {"shuffle": False}), (5, {"seed": 123}), (4, {"drop_last": True, "seed": 9})]
ERRORS = [
    ((10, 4, 4), "rank == num_replicas"),
    ((10, 4, 17), "a rank far above num_replicas"),
    ((10, 1, -1), "a negative rank"),
    ((10, 0, 0), "num_replicas 0"),
    ((10, -2, 0), "a negative num_replicas"),
    ((0, 3, 3), "a bad rank on an empty dataset"),
]


def _hidden(case, world_size, fn, *args, **kwargs):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, *args, hide_internals=True, **kwargs)


def check_shard_indices(shard_indices) -> None:
    __tracebackhide__ = True  # noqa: F841
    _hidden(SHARDS, 1, shard_indices, ONE_RANK)
    _hidden(SHARDS, 4, shard_indices, FOUR_RANKS)
    _hidden(SHARDS, 3, shard_indices, THREE_RANKS)
    _hidden(BAD_ARGUMENTS, 1, shard_indices, ERRORS, init_process_group=False)
