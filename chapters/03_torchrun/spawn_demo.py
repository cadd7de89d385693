"""torch.multiprocessing.spawn: starting the ranks yourself, and doing torchrun's chores by hand.

    python chapters/03_torchrun/spawn_demo.py --nprocs 2

Launch test: custom (it is not launched by torchrun; tests/test_chapter_03_torchrun.py runs it).

``mp.spawn(fn, nprocs=N)`` starts N fresh interpreters and calls ``fn(i)`` in each. Nothing else:
no RANK or WORLD_SIZE, no rendezvous address, no restarts, no failure report. So the parent picks
a free port (bind port 0, read it, close it) and exports MASTER_ADDR/MASTER_PORT, and each child
sets the variables torchrun would have set before joining with env://. ``fn`` must be importable
by the children (spawn pickles it by name), which is why this is a script and not a notebook
cell: a function defined in a notebook's ``__main__`` cannot be found by a spawned child.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpcourse.dist_env import free_port, process_group


def worker(index: int, nprocs: int) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nprocs),
                      LOCAL_WORLD_SIZE=str(nprocs))
    with process_group(timeout_s=30) as ctx:
        total = torch.tensor([float(ctx.rank)], device=ctx.device)
        dist.all_reduce(total)
        # one write per line: the processes share one pipe
        print(f"spawned process {index} (pid {os.getpid()}): rank {ctx.rank} of "
              f"{ctx.world_size}, sum of ranks {total.item():g}\n", end="", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    opts = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    print(f"parent {os.getpid()}: spawning {opts.nprocs} processes, rendezvous at "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)
    mp.spawn(worker, args=(opts.nprocs,), nprocs=opts.nprocs, join=True)
    print("parent: every process exited cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
