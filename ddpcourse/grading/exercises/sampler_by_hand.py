"""Chapter 06, data loading: visible checks for ``shard_indices``.

The contract is the docstring of ``shard_indices`` in
solutions/06_data_loading/sampler_by_hand.nb.py (students:
exercises/06_data_loading/sampler_by_hand.ipynb). Written by hand: the call runs under a profile
hook (:mod:`ddpcourse.grading.forbidden`) watching ``torch/utils/data/distributed.py``, so no
function of that file may run during it.

Each case runs in every rank of a real group with that rank's own rank; the reference is the
sampler itself, built in the same rank right after the student's call (outside the hook).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from ddpcourse.grading.checks import CheckFailed, agree, agree_on, run_student
from ddpcourse.grading.forbidden import call_watching

# The file the hook watches: exactly what the profiler reports as a frame's co_filename.
SAMPLER_FILE = DistributedSampler.__init__.__code__.co_filename


def reference_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                      drop_last=False) -> list[int]:
    """What torch's own sampler yields: the trusted answer."""
    sampler = DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def _shown(args: tuple, kwargs: dict, rank_text: str | None = None) -> str:
    parts = [repr(a) for a in args] + ([rank_text] if rank_text else [])
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"shard_indices({', '.join(parts)})"


def own_code_call(shard_indices, args: tuple, kwargs: dict):
    """Call the student's function, watching the sampler's file; return (result, exception).
    Calling DistributedSampler (any of its code) fails the check."""
    watched = call_watching(shard_indices, args, kwargs, SAMPLER_FILE)
    if watched.forbidden_calls:
        raise CheckFailed(
            f"{_shown(args, kwargs)} ran code of torch/utils/data/distributed.py "
            f"({watched.forbidden_calls}): DistributedSampler is what you are to rebuild, so it "
            "must not run during the call. torch.Generator and torch.randperm are allowed")
    if watched.hook_removed:
        raise CheckFailed(f"{_shown(args, kwargs)} changed the profiler hook (sys.setprofile) "
                          "that watches for DistributedSampler: leave it alone")
    return watched.result, watched.exception


def _is_index_list(value) -> bool:
    return type(value) is list and all(type(v) is int for v in value)


def _first_difference(got: list, expected: list) -> str:
    for position, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            return f"first difference at position {position}: expected {e}, got {g}"
    return (f"the first {min(len(got), len(expected))} agree, then the lengths differ: expected "
            f"{len(expected)} indices, got {len(got)}")


def _preview(values: list, n: int = 14) -> str:
    return "[" + ", ".join(map(str, values[:n])) + (", ...]" if len(values) > n else "]")


def _judge_rank(rank, got, raised, expected, what) -> None:
    if raised is not None:
        raise CheckFailed(f"{what}: expected {_preview(expected)}, but it raised "
                          f"{type(raised).__name__}: {raised}")
    if not _is_index_list(got):
        kind = type(got).__name__
        raise CheckFailed(f"{what}: expected a list of Python ints (torch's .tolist() gives "
                          f"them), got {kind}: {str(got)[:120]}")
    if got != expected:
        raise CheckFailed(f"{what}: expected {_preview(expected)}, got {_preview(got)}; "
                          f"{_first_difference(got, expected)}")


def _judge_shards(rank, everyone, dataset_len, num_replicas, drop_last, what) -> None:
    """On rank 0 only (the others would say the same): equal lengths, and the union."""
    if rank != 0 or any(shard is None for shard in everyone):
        return
    lengths = [len(shard) for shard in everyone]
    if len(set(lengths)) > 1:
        raise CheckFailed(f"{what} on every rank: the ranks got different numbers of indices "
                          f"{lengths}; every rank must get the same number (else the ranks run "
                          "different numbers of steps and the extra one waits forever in DDP's "
                          "all-reduce)")
    covered = set().union(*everyone) if everyone else set()
    if not drop_last and covered != set(range(dataset_len)):
        missing = sorted(set(range(dataset_len)) - covered)
        extra = sorted(covered - set(range(dataset_len)))
        raise CheckFailed(f"{what} on every rank: together the ranks must cover every index of "
                          f"range({dataset_len}); missing {missing[:10]}, outside it "
                          f"{extra[:10]}")


def shard_case(rank, world_size, shard_indices, cases):
    """Every case ``(dataset_len, kwargs)`` on this rank with ``num_replicas = world_size``."""
    for dataset_len, kwargs in cases:
        args = (dataset_len, world_size, rank)
        shortcut = None
        try:
            got, raised = own_code_call(shard_indices, args, kwargs)
        except CheckFailed as found:  # maybe on some ranks only: end the case on every rank
            got, raised, shortcut = None, None, str(found)
        agree(shortcut)
        expected = reference_indices(*args, **kwargs)
        # First what the ranks hold together (it says which rule is broken), then each rank's
        # list index by index.
        everyone = [None] * world_size
        dist.all_gather_object(everyone, got if _is_index_list(got) else None)
        agree_on(_judge_shards, rank, everyone, dataset_len, world_size,
                 kwargs.get("drop_last", False), _shown(args[:2], kwargs, "rank"))
        agree_on(_judge_rank, rank, got, raised, expected, _shown(args, kwargs))
    return len(cases)


def errors_case(rank, world_size, shard_indices, errors):
    """Each ``(args, what)`` must raise ValueError, as the sampler does (checked here too)."""
    for args, what in errors:
        try:
            reference_indices(*args)
        except ValueError:
            pass
        else:  # the sampler changed: the exercise text is wrong, not the student
            raise RuntimeError(f"DistributedSampler accepted {args}")
        got, raised = own_code_call(shard_indices, args, {})
        if raised is None:
            raise CheckFailed(f"{_shown(args, {})} ({what}): expected ValueError, as "
                              f"DistributedSampler raises, got {got!r}")
        if not isinstance(raised, ValueError):
            raise CheckFailed(f"{_shown(args, {})} ({what}): expected ValueError, got "
                              f"{type(raised).__name__}: {raised}")
    return len(errors)


NO_SHUFFLE = [(10, {"shuffle": False}), (11, {"shuffle": False})]
SHUFFLED = [(10, {}), (11, {}), (10, {"epoch": 1}), (11, {"epoch": 1}),
            (11, {"seed": 1, "epoch": 1})]
DROP_LAST = [(11, {"drop_last": True}), (11, {"shuffle": False, "drop_last": True}),
             (10, {"epoch": 1, "drop_last": True})]
BAD_RANKS = [((10, 2, 2), "rank == num_replicas"), ((10, 3, -1), "a negative rank")]


def check_shard_indices_without_shuffle(shard_indices) -> None:
    for world_size in (2, 3):
        run_student(shard_case, world_size, shard_indices, NO_SHUFFLE)


def check_shard_indices_shuffled(shard_indices) -> None:
    for world_size in (2, 3):
        run_student(shard_case, world_size, shard_indices, SHUFFLED)


def check_shard_indices_drop_last_and_bad_ranks(shard_indices) -> None:
    for world_size in (2, 3):
        run_student(shard_case, world_size, shard_indices, DROP_LAST)
    run_student(errors_case, 1, shard_indices, BAD_RANKS, init_process_group=False)
