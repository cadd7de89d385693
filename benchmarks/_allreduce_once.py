"""The unit of work every launcher is timed on: join a gloo group, one all_reduce, leave.

    torchrun --standalone --nproc_per_node 2 benchmarks/_allreduce_once.py
"""

import os

import torch
import torch.distributed as dist


def allreduce_once(rank: int, world_size: int) -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def spawned(rank: int, world_size: int, store_path: str) -> None:
    """Entry point for ``torch.multiprocessing.spawn``, which does not create the group itself."""
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    allreduce_once(rank, world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    assert allreduce_once(int(os.environ["RANK"]), dist.get_world_size()) == dist.get_world_size()
    dist.destroy_process_group()
