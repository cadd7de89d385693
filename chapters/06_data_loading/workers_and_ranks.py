"""DataLoader workers under DDP: shard an IterableDataset by rank and worker; one data seed per rank.

    torchrun --standalone --nproc_per_node 2 chapters/06_data_loading/workers_and_ranks.py

Every rank runs ``num_workers`` DataLoader workers, so ``W x num_workers`` copies of the dataset
produce data at once. Two consequences, each shown and checked here:

* **Iterable datasets** (a stream you cannot index, so no ``DistributedSampler``) must shard
  themselves. :class:`Stream` keeps every ``(W * num_workers)``-th sample, starting at its reader
  number ``rank + W * worker_id`` (``get_worker_info()`` gives the worker's id; the rank is passed
  in), so the workers of rank r together read ``range(r, n, W)``. Sharding by rank alone leaves
  every worker of a rank reading the same samples.
* **Random augmentation.** Each worker seeds ``torch`` and ``random`` with ``base_seed +
  worker_id`` (and ``numpy`` from the same two numbers), where ``base_seed`` is drawn from the
  rank's loader generator (or its global RNG) when the loader's iterator is created, every epoch
  unless ``persistent_workers=True`` (torch/utils/data/dataloader.py,
  ``_BaseDataLoaderIter.__init__``; torch/utils/data/_utils/worker.py, ``_worker_loop``). The same
  seed on every rank therefore gives every rank the same augmentation stream; ``seed + rank``
  gives each rank its own, still reproducible.

Every loader here starts its workers from a fork server, not by forking the rank
(``ddpcourse.dist_env.loader_workers_context``; the lesson's section 6 shows why).

Rank 0 prints what each rank read and drew, and exits with code 1 if a check fails: sharded by
rank and worker, each sample is read exactly once; by rank alone, ``num_workers`` times; with the
same seed the ranks' draws are identical, with ``seed + rank`` they differ and a rerun repeats them.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, get_worker_info

from ddpcourse.dist_env import loader_workers_context, process_group
from ddpcourse.report import report_checks

SPLITS = ("none", "rank", "rank x worker")
# A worker that delivers no batch for this long makes its loader raise (naming the workers),
# instead of leaving the other rank to time out in the next collective without a cause. The
# group's timeout is longer, so the loader's error is the one reported. Both are generous: on a
# loaded 2-core machine one run of this script has taken over 35 s.
LOADER_TIMEOUT_S, GROUP_TIMEOUT_S = 60, 150


class WhoLoads(Dataset):
    """16 samples, each ``[pid, parent pid, intra-op threads, worker id]`` of the process that
    fetched it (the lesson's census of loader processes)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        worker = get_worker_info()
        return torch.tensor([os.getpid(), os.getppid(), torch.get_num_threads(),
                             worker.id if worker else -1])


def rank_threads(rank: int, world_size: int) -> dict:
    """In a process group: how many threads this rank runs, all told (what the kernel lists in
    ``/proc/self/task``; None where there is no /proc) and how many of them Python started."""
    task = Path("/proc/self/task")
    return {"threads": len(list(task.iterdir())) if task.is_dir() else None,
            "started by Python": threading.active_count()}


class Stream(IterableDataset):
    """Samples ``0 .. n-1`` read in order, like lines of a file; ``split`` says how copies divide it.

    ``"none"``: every copy yields everything; ``"rank"``: rank r keeps every W-th sample;
    ``"rank x worker"``: reader ``rank + W * worker_id`` of the ``W x num_workers`` readers keeps
    every ``(W x num_workers)``-th sample from its number on. The rank is a constructor argument
    because the dataset object is copied into the workers, where a ``spawn``/``forkserver`` worker
    has no process group.
    """

    def __init__(self, n: int, rank: int = 0, world_size: int = 1, split: str = "rank x worker"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        self.n, self.rank, self.world_size, self.split = n, rank, world_size, split

    def __iter__(self):
        reader, readers = 0, 1
        if self.split != "none":
            reader, readers = self.rank, self.world_size
        info = get_worker_info()  # None in the rank's own process (num_workers=0)
        if self.split == "rank x worker" and info is not None:
            reader, readers = reader + readers * info.id, readers * info.num_workers
        return itertools.islice(range(self.n), reader, None, readers)


def stream_samples(rank: int, world_size: int, n: int, split: str, num_workers: int = 2,
                   batch_size: int = 2) -> dict:
    """In a process group: the samples this rank's DataLoader yields from :class:`Stream`, and its
    number of batches."""
    loader = DataLoader(Stream(n, rank, world_size, split), batch_size=batch_size,
                        num_workers=num_workers, timeout=LOADER_TIMEOUT_S if num_workers else 0,
                        multiprocessing_context=loader_workers_context(num_workers))
    batches = [batch.tolist() for batch in loader]
    return {"samples": sorted(itertools.chain.from_iterable(batches)), "batches": len(batches)}


def read_counts(per_rank: list[dict]) -> Counter:
    """How many times each sample was read, over all ranks."""
    return Counter(i for result in per_rank for i in result["samples"])


class Augmented(Dataset):
    """Sample ``i`` as ``[i, torch draw, random draw]``: the draws stand for a random crop or flip
    (torchvision's random transforms draw from torch's global RNG, others from ``random``)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), random.random()], dtype=torch.float64)


def seed_worker(worker_id: int) -> None:
    """A ``worker_init_fn`` as in PyTorch's reproducibility notes: seed the other libraries from
    the seed torch gave this worker (``base_seed + worker_id``). It cannot tell ranks apart."""
    worker_seed = torch.initial_seed() % 2**32
    random.seed(worker_seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(worker_seed)


def augmentation_draws(rank: int, world_size: int, seed: int, per_rank: bool,
                       num_workers: int = 2, n: int = 8, epochs: int = 2) -> list[list[list[float]]]:
    """In a process group: ``[epoch][position] -> [sample, torch draw, random draw]`` on this rank.

    The data's randomness is seeded with ``seed`` on every rank, or with ``seed + rank`` when
    ``per_rank``: the global RNG (what the dataset draws from when ``num_workers=0``, and where
    ``base_seed`` comes from without a generator) and the loader's ``generator`` alike.
    """
    data_seed = seed + rank if per_rank else seed
    torch.manual_seed(data_seed)
    random.seed(data_seed)
    dataset = Augmented(n)
    loader = DataLoader(dataset, batch_size=2, num_workers=num_workers,
                        timeout=LOADER_TIMEOUT_S if num_workers else 0,
                        multiprocessing_context=loader_workers_context(num_workers),
                        sampler=DistributedSampler(dataset, shuffle=False),
                        generator=torch.Generator().manual_seed(data_seed),
                        worker_init_fn=seed_worker)
    return [torch.cat(list(loader)).tolist() for _ in range(epochs)]


def same_draws(per_rank: list) -> bool:
    """Whether every rank drew the same random numbers, position by position (samples differ)."""
    def draws(epochs):
        return [row[1:] for epoch in epochs for row in epoch]
    return all(draws(r) == draws(per_rank[0]) for r in per_rank)


def check(n: int, world_size: int, num_workers: int, streams: dict, draws: dict,
          rerun: list) -> list[str]:
    """The module docstring's claims (for ``world_size >= 2``); returns what failed."""
    failures = []
    once = read_counts(streams["rank x worker"])
    if sorted(once.elements()) != list(range(n)):
        failures.append(f"rank x worker: reads {dict(once)}, expected every sample once")
    for split, times in (("rank", num_workers), ("none", num_workers * world_size)):
        counts = read_counts(streams[split])
        if set(counts) != set(range(n)) or set(counts.values()) != {times}:
            failures.append(f"{split}: reads {dict(counts)}, expected each {times} times")
    if not same_draws(draws["same seed"]):
        failures.append("the same seed on every rank gave different draws")
    if same_draws(draws["seed + rank"]):
        failures.append("seed + rank gave every rank the same draws")
    if rerun != draws["seed + rank"]:
        failures.append("seed + rank did not reproduce its draws")
    return failures


def main() -> int:
    with process_group(timeout_s=GROUP_TIMEOUT_S) as ctx:
        n, ws, workers = 10, ctx.world_size, 2
        streams = {}
        for split in SPLITS:
            gathered: list = [None] * ws
            dist.all_gather_object(gathered, stream_samples(ctx.rank, ws, n, split, workers))
            streams[split] = gathered
        draws = {}
        for label, per_rank in (("same seed", False), ("seed + rank", True)):
            gathered = [None] * ws
            dist.all_gather_object(gathered, augmentation_draws(ctx.rank, ws, 0, per_rank, workers))
            draws[label] = gathered
        rerun: list = [None] * ws
        dist.all_gather_object(rerun, augmentation_draws(ctx.rank, ws, 0, True, workers))
        if not ctx.is_main:
            return 0
        print(f"Stream of {n} samples, {ws} ranks x {workers} workers")
        for split in SPLITS:
            counts = read_counts(streams[split])
            print(f"  split by {split:<13} reads per sample {sorted(set(counts.values()))}, "
                  f"batches per rank {[r['batches'] for r in streams[split]]}")
        for label, per_rank in draws.items():
            first = [f"{r[0][0][1]:.4f}" for r in per_rank]
            print(f"  {label:<11}: first torch draw per rank {first}, ranks drew the same: "
                  f"{same_draws(per_rank)}")
        failures = check(n, ws, workers, streams, draws, rerun)
        return report_checks(failures)


if __name__ == "__main__":
    sys.exit(main())
