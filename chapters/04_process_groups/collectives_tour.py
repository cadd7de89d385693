"""Seven collectives, each run once and checked against the values it must produce on every rank.

    torchrun --standalone --nproc_per_node 2 chapters/04_process_groups/collectives_tour.py

broadcast, reduce, all_reduce, all_gather, reduce_scatter, all_to_all and barrier, on tensors
whose values say where they came from. Scalars: rank r holds ``r + 1``. Vectors (for the
collectives that cut a tensor into one chunk per rank): rank r holds ``10 * j + r`` in chunk j,
so the tens digit names the chunk and the ones digit the rank it started on. The lesson notebook
imports this module, runs :func:`tour` in 4 ranks and draws the before/after of each rank.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from ddpcourse.dist_env import process_group

Values = list[float]


def scalar(rank: int, device="cpu") -> torch.Tensor:
    return torch.tensor([rank + 1.0], device=device)


def chunks(rank: int, world_size: int, device="cpu") -> torch.Tensor:
    return torch.tensor([10.0 * j + rank for j in range(world_size)], device=device)


def broadcast(rank, world_size, device="cpu"):
    t = scalar(rank, device)
    before = t.tolist()
    dist.broadcast(t, src=0)  # rank 0's tensor overwrites everyone's
    return before, t.tolist()


def reduce(rank, world_size, device="cpu"):
    t = scalar(rank, device)
    before = t.tolist()
    dist.reduce(t, dst=0, op=dist.ReduceOp.SUM)  # only rank 0's result is defined
    return before, t.tolist() if rank == 0 else None


def all_reduce(rank, world_size, device="cpu"):
    t = scalar(rank, device)
    before = t.tolist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)  # everyone gets the sum
    return before, t.tolist()


def all_gather(rank, world_size, device="cpu"):
    t = scalar(rank, device)
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t)  # everyone gets everyone's tensor, in rank order
    return t.tolist(), torch.cat(gathered).tolist()


def reduce_scatter(rank, world_size, device="cpu"):
    t = chunks(rank, world_size, device)
    mine = torch.empty(1, device=device)
    dist.reduce_scatter(mine, list(t.split(1)), op=dist.ReduceOp.SUM)  # rank j: sum of chunks j
    return t.tolist(), mine.tolist()


def all_to_all(rank, world_size, device="cpu"):
    t = chunks(rank, world_size, device)
    received = [torch.empty(1, device=device) for _ in range(world_size)]
    dist.all_to_all(received, list(t.split(1)))  # chunk j of rank i lands in slot i of rank j
    return t.tolist(), torch.cat(received).tolist()


def barrier(rank, world_size, device="cpu"):
    """Before/after are times (s): each rank arrives later than the previous, all leave together."""
    start = torch.tensor([time.time()], dtype=torch.float64, device=device)
    dist.broadcast(start, src=0)  # one clock origin for every rank (all on one machine here)
    time.sleep(0.15 * rank)
    arrived = time.time() - start.item()
    dist.barrier()
    return [arrived], [time.time() - start.item()]


COLLECTIVES: dict[str, Callable] = {f.__name__: f for f in (
    broadcast, reduce, all_reduce, all_gather, reduce_scatter, all_to_all, barrier)}


def expected(name: str, rank: int, world_size: int) -> Values | None:
    """What ``name`` must leave on ``rank`` (None: undefined there; barrier is checked apart)."""
    total = world_size * (world_size + 1) / 2  # 1 + 2 + ... + world_size
    return {
        "broadcast": [1.0],
        "reduce": [total] if rank == 0 else None,
        "all_reduce": [total],
        "all_gather": [r + 1.0 for r in range(world_size)],
        "reduce_scatter": [sum(10.0 * rank + r for r in range(world_size))],
        "all_to_all": [10.0 * rank + r for r in range(world_size)],
        "barrier": None,
    }[name]


def tour(rank: int, world_size: int, device="cpu") -> dict[str, tuple[Values, Values | None]]:
    """Run every collective once; return ``{name: (before, after)}`` as plain lists."""
    return {name: fn(rank, world_size, device) for name, fn in COLLECTIVES.items()}


def mismatches(results: list[dict], world_size: int) -> list[str]:
    """Everything in ``results[rank][name]`` that differs from :func:`expected`, in words."""
    problems = []
    for name in COLLECTIVES:
        for rank, result in enumerate(results):
            after = result[name][1]
            want = expected(name, rank, world_size)
            if want is not None and after != want:
                problems.append(f"{name}: rank {rank} got {after}, expected {want}")
    last_arrival = max(r["barrier"][0][0] for r in results)
    for rank, result in enumerate(results):
        if result["barrier"][1][0] < last_arrival:
            problems.append(f"barrier: rank {rank} left at {result['barrier'][1][0]:.3f} s, "
                            f"before the last rank arrived ({last_arrival:.3f} s)")
    return problems


def main() -> int:
    with process_group(timeout_s=30) as ctx:
        mine = tour(ctx.rank, ctx.world_size, ctx.device)
        results: list = [None] * ctx.world_size
        dist.all_gather_object(results, mine)
        problems = mismatches(results, ctx.world_size)
        if ctx.is_main:
            for name in COLLECTIVES:
                befores = [r[name][0] for r in results]
                afters = [r[name][1] for r in results]
                if name == "barrier":
                    befores = [[round(v, 2) for v in b] for b in befores]
                    afters = [[round(v, 2) for v in a] for a in afters]
                print(f"{name:<15} before {befores}\n{'':<15} after  {afters}")
            print("all collectives match the expected values" if not problems
                  else "MISMATCHES:\n" + "\n".join(problems), flush=True)
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
