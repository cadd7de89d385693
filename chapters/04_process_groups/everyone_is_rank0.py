"""The article's "all processes are rank 0" bug, reproduced: rank from SLURM under torchrun.

    torchrun --standalone --nproc_per_node 2 chapters/04_process_groups/everyone_is_rank0.py

Launch test: custom (it fails on purpose; tests/test_chapter_04_process_groups.py runs each case).

The script passes ``rank=int(os.environ[--rank-from])`` and ``world_size=int(os.environ[
--world-size-from])`` to ``init_process_group`` instead of letting ``env://`` read RANK, then
all-reduces ``ones * RANK``. Under ``srun --ntasks-per-node=1 torchrun ...`` (chapter 03's batch
file) every worker of a node inherits the *task's* SLURM_PROCID, the node index, so all workers of
node 0 pass rank 0. What torch 2.13 does with that, case by case:

* no SLURM variables at all (plain torchrun): ``KeyError: 'SLURM_PROCID'`` at once;
* ``SLURM_PROCID=0`` (every worker says rank 0 of WORLD_SIZE): ``init_process_group`` waits for
  ranks 1.. that never register and fails after ``--timeout`` seconds with ``DistStoreError: wait
  timeout ... keys: /default_pg/0//cpu//0/1`` (default timeout: 30 min on gloo, 10 on NCCL);
* ``SLURM_PROCID=0 SLURM_NTASKS=1`` with ``--world-size-from SLURM_NTASKS``: no error at all; every
  process is rank 0 of its own world of one, and all-reduce returns each input unchanged;
* ``--rank-from RANK``: correct, one group, the all-reduce sums the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-from", default="SLURM_PROCID")
    parser.add_argument("--world-size-from", default="WORLD_SIZE")
    parser.add_argument("--timeout", type=float, default=5.0, help="process-group timeout (s)")
    opts = parser.parse_args()

    true_rank = int(os.environ["RANK"])
    rank = int(os.environ[opts.rank_from])  # the bug: the launcher's RANK is ignored
    world_size = int(os.environ[opts.world_size_from])
    print(f"RANK={true_rank} (from torchrun) joins as rank {rank} of {world_size} "
          f"(from {opts.rank_from}, {opts.world_size_from})\n", end="", flush=True)
    start = time.perf_counter()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=opts.timeout))
    except Exception:
        print(f"RANK={true_rank}: init_process_group failed after "
              f"{time.perf_counter() - start:.1f} s\n", end="", flush=True)
        raise
    total = torch.ones(1) * true_rank
    dist.all_reduce(total)
    print(f"RANK={true_rank}: in a group of {dist.get_world_size()}, all_reduce(ones * RANK) = "
          f"{total.item():g}\n", end="", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
