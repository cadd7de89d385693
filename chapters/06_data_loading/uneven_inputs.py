"""Ranks with different numbers of batches: DDP training stops at a collective; two fixes.

    torchrun --standalone --nproc_per_node 2 chapters/06_data_loading/uneven_inputs.py --fix join

Launch test: custom (``--fix none`` is expected to fail; tests/test_chapter_06_data_loading.py
launches all three):

    torchrun --standalone --nproc_per_node 2 chapters/06_data_loading/uneven_inputs.py --fix none
    torchrun --standalone --nproc_per_node 2 chapters/06_data_loading/uneven_inputs.py --fix sampler

Nine samples, batches of two, DDP on a tiny model. ``--fix none`` shards the data by hand with
``indices[rank::world_size]``: rank 0 gets 5 samples (3 batches), rank 1 gets 4 (2 batches). Rank 1
leaves the loop and waits in the ``dist.barrier()`` that usually precedes saving a checkpoint,
while rank 0 waits in its third backward for rank 1's gradients. DDP and that barrier use a
process group with a 3-second timeout (``--timeout-s``, a demo value; the default is minutes),
which turns the wait into an error and a non-zero exit. That group is created after a barrier
(``ddpcourse.dist_env.short_timeout_group``), so its clock starts when every rank is ready;
joining, start-up and the final summary run on the default group with a generous timeout, so that
a loaded machine, where one rank starts seconds after the other, cannot trip the short one by
accident.

``--fix sampler`` uses ``DistributedSampler``, whose shards have equal lengths (it repeats samples).
``--fix join`` keeps the uneven shards and wraps the loop in ``Join([model])``
(``torch.distributed.algorithms.join``): a rank that runs out of batches shadows the others'
all-reduces with zeros until every rank is done. Both exit 0; rank 0 prints each rank's batch count.
"""

from __future__ import annotations

import argparse
import contextlib
import linecache
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddpcourse.dist_env import process_group, short_timeout_group
from ddpcourse.toys import make_model, make_regression

FIXES = ("none", "sampler", "join")


def train(rank: int, world_size: int, fix: str, n: int = 9, batch_size: int = 2,
          group: dist.ProcessGroup | None = None) -> int:
    """Train one epoch with DDP on ``group`` (default: the world); return this rank's batch count."""
    data = make_regression(n, seed=0)
    if fix == "sampler":
        loader = DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data))
    else:
        loader = DataLoader(Subset(data, list(range(n))[rank::world_size]), batch_size=batch_size)
    model = DDP(make_model(0), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = 0
    with Join([model]) if fix == "join" else contextlib.nullcontext():
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            batches += 1
    dist.barrier(group=group)  # e.g. before rank 0 saves a checkpoint
    return batches


def where_it_stops(rank: int, world_size: int, timeout_s: float = 3.0) -> dict:
    """``train(..., "none")`` on a group with a ``timeout_s`` clock started after a barrier.

    Returns where this rank's wait ended in an error: the line of :func:`train` that raised, how
    many batches it had finished, and the error's first line (``None`` values if nothing raised).
    """
    group = short_timeout_group(timeout_s)
    try:
        return {"batches done": train(rank, world_size, "none", group=group), "line": None,
                "code": None, "error": None}
    except RuntimeError as error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code is not train.__code__:
            tb = tb.tb_next
        frame = tb.tb_frame
        return {"batches done": frame.f_locals["batches"], "line": tb.tb_lineno,
                "code": linecache.getline(__file__, tb.tb_lineno).strip(),
                "error": str(error).splitlines()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", choices=FIXES, default="join")
    parser.add_argument("--timeout-s", type=float, default=3.0,
                        help="timeout of the group DDP trains on (default: %(default)s)")
    args = parser.parse_args()
    with process_group(timeout_s=120) as ctx:
        training_group = short_timeout_group(args.timeout_s)
        batches = torch.tensor([train(ctx.rank, ctx.world_size, args.fix, group=training_group)])
        gathered = [torch.zeros_like(batches) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, batches)
        ctx.print0(f"--fix {args.fix}: batches per rank {[int(b) for b in gathered]}, finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
