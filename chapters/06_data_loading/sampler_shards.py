"""What ``DistributedSampler`` hands each rank: shards, padding by repetition, and ``set_epoch``.

    torchrun --standalone --nproc_per_node 2 chapters/06_data_loading/sampler_shards.py

Every rank builds ``DistributedSampler(dataset)`` (it reads rank and world size from the process
group) over a dataset whose length does not divide by the world size, gathers every rank's
indices on rank 0, and rank 0 prints them for ``shuffle=False``, ``shuffle=True`` and
``drop_last=True``, then the first indices of epochs 0-2 with and without ``set_epoch``.

Rank 0 checks what the lesson claims, and exits with code 1 if any check fails:

* every rank gets the same number of indices;
* without ``drop_last`` the extra indices are *repeats* of the first indices of the (shuffled)
  order, never an index outside the dataset (nothing is "padded with zeros");
* with ``drop_last`` the tail is dropped and no index repeats;
* without ``set_epoch`` every epoch yields the same order; with it the order changes, and the
  ranks' shards still form one permutation, i.e. every rank shuffled identically.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddpcourse.dist_env import process_group
from ddpcourse.report import report_checks


class Indices:
    """A dataset of ``n`` samples whose sample ``i`` is just the number ``i``."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def shards(n: int, world_size: int, shuffle: bool = False, drop_last: bool = False,
           seed: int = 0, epoch: int | None = None) -> list[list[int]]:
    """Every rank's indices, from samplers built with explicit ``num_replicas``/``rank``
    (no process group needed)."""
    result = []
    for rank in range(world_size):
        sampler = DistributedSampler(Indices(n), num_replicas=world_size, rank=rank,
                                     shuffle=shuffle, drop_last=drop_last, seed=seed)
        if epoch is not None:
            sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


def whole_dataset_batches(rank: int, world_size: int, n: int = 8, batch_size: int = 4,
                          same_seed: bool = True) -> list[list[int]]:
    """In a rank, *without* a sampler: the batches of ``DataLoader(shuffle=True)`` over the whole
    dataset. The order comes from the rank's global RNG (``RandomSampler.__iter__`` draws its seed
    from it), so it is the same on every rank only when every rank seeded alike."""
    if same_seed:
        torch.manual_seed(0)  # the usual "seed everything" line, run by every rank
    return [batch.tolist() for batch in DataLoader(Indices(n), batch_size=batch_size, shuffle=True)]


def repeated(per_rank: list[list[int]]) -> list[int]:
    """Indices that occur more than once over all ranks."""
    counts = Counter(i for shard in per_rank for i in shard)
    return sorted(i for i, c in counts.items() if c > 1)


def gathered_epochs(n: int, epochs: int, call_set_epoch: bool, shuffle: bool = True,
                    seed: int = 0) -> list[list[list[int]]]:
    """In a process group: ``[epoch][rank] -> indices`` as each rank's own sampler yields them."""
    sampler = DistributedSampler(Indices(n), shuffle=shuffle, seed=seed)
    per_epoch = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(sampler))
        per_epoch.append(gathered)
    return per_epoch


def check(n: int, world_size: int, with_epochs: list, without_epochs: list) -> list[str]:
    """The lesson's claims for ``n`` samples on ``world_size`` ranks; returns what failed."""
    failures = []
    for shuffle in (False, True):
        padded = shards(n, world_size, shuffle=shuffle, epoch=3)
        if len({len(s) for s in padded}) != 1:
            failures.append(f"unequal lengths {[len(s) for s in padded]}")
        flat = [i for s in padded for i in s]
        if set(flat) != set(range(n)):
            failures.append(f"shuffle={shuffle}: indices {sorted(set(flat))} are not 0..{n - 1}")
        order = shards(n, 1, shuffle=shuffle, epoch=3)[0]  # the order before sharding
        extra = len(flat) - n
        if sorted(Counter(flat) - Counter(range(n))) != sorted(order[:extra]):
            failures.append(f"shuffle={shuffle}: repeats are not the first {extra} of {order}")
        dropped = shards(n, world_size, shuffle=shuffle, drop_last=True, epoch=3)
        if repeated(dropped) or sum(map(len, dropped)) != n - n % world_size:
            failures.append(f"drop_last: {dropped}")
    firsts = [epoch[0] for epoch in without_epochs]
    if any(f != firsts[0] for f in firsts):
        failures.append("without set_epoch the order changed")
    if len({tuple(epoch[0]) for epoch in with_epochs}) != len(with_epochs):
        failures.append("with set_epoch two epochs had the same order")
    for epoch in with_epochs:
        if set(i for shard in epoch for i in shard) != set(range(n)):
            failures.append(f"with set_epoch the ranks' shards do not cover 0..{n - 1}: {epoch}")
    return failures


def main() -> int:
    with process_group(timeout_s=30) as ctx:
        n = 2 * ctx.world_size + 1  # never divisible by the world size (for world_size > 1)
        with_epochs = gathered_epochs(n, 3, call_set_epoch=True)
        without_epochs = gathered_epochs(n, 3, call_set_epoch=False)
        if not ctx.is_main:
            return 0
        ws = ctx.world_size
        print(f"{n} samples on {ws} ranks")
        for label, kwargs in (("shuffle=False", {}), ("shuffle=True", {"shuffle": True}),
                              ("shuffle=True, drop_last=True", {"shuffle": True, "drop_last": True})):
            per_rank = shards(n, ws, **kwargs)
            print(f"  {label:<29} {per_rank}  repeated: {repeated(per_rank)}")
        for label, epochs in (("with set_epoch", with_epochs), ("without", without_epochs)):
            print(f"  rank 0, epochs 0-2, {label:<15}", [e[0] for e in epochs])
        failures = check(n, ws, with_epochs, without_epochs)
        return report_checks(failures)


if __name__ == "__main__":
    sys.exit(main())
