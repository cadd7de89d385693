"""All-reduce bandwidth against message size, the way NVIDIA's nccl-tests reports it.

    torchrun --standalone --nproc_per_node 2 chapters/10_performance/allreduce_bandwidth.py

The default is the short mode (three sizes, a few seconds). The lesson's sweep, 1 KiB to
256 MiB, is ``--full``; ``benchmarks/ch10_allreduce.py`` runs it on 2 and 4 ranks and records it
(with the fitted α and β of ``ddpcourse.cost_model``) in benchmarks/results/ch10_allreduce.json.

For every size: one all-reduce of random data checked against the sum computed locally from
every rank's seed (a wrong sum fails the run); then two warm-up calls; then ``--repeats`` timings,
each of ``k`` back-to-back calls (``k`` > 1 for small messages, so that one timing is not one
wake-up) after a barrier, on the slowest rank (a collective is done when its last rank is). Rank
0 prints a table and, with ``--json``, one JSON object per line (machine-readable, one per size).
As in nccl-tests (doc/PERFORMANCE.md): ``algbw = bytes / time`` and
``busbw = algbw · 2(N−1)/N`` — the bandwidth each rank's link must carry in a ring, which is
comparable across rank counts and with the link's own rate. Bandwidths come from the best
timing (the least disturbed; on a shared machine the median of small messages is far above a
best time that every quiet moment reproduces); both are printed.

Backend: gloo on CPU; NCCL when each rank has its own GPU (``ddpcourse.dist_env``), with the
buffers on the GPU and ``torch.cuda.synchronize`` around each timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from ddpcourse.cost_model import bus_factor
from ddpcourse.dist_env import process_group
from ddpcourse.doctor import slowest_rank_timings

QUICK_SIZES = ["1K", "64K", "4M"]
FULL_SIZES = ["1K", "4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M", "256M"]


def parse_size(text: str) -> int:
    """'4K' -> 4096, '16M' -> 16 MiB, '100' -> 100 bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}iB"
    return f"{nbytes} B"


def calls_per_timing(nbytes: int) -> int:
    return max(1, min(20, 2**18 // max(nbytes, 1)))


def measure(rank: int, world_size: int, sizes: list[int], repeats: int = 5) -> list[dict]:
    """One row per size: every timing (seconds per call, slowest rank), best, median, algbw and
    busbw (GB/s, 1e9 bytes/s, from the best), and whether the sum was right on every rank."""
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    rows = []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        data = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(device)
        expected = sum(torch.randn(numel, generator=torch.Generator().manual_seed(r))
                       for r in range(world_size))
        dist.all_reduce(data)
        ok = torch.tensor([float(torch.allclose(data.cpu(), expected, rtol=1e-4, atol=1e-4))],
                          device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        del data, expected
        buffer = torch.zeros(numel, device=device)  # sums of zeros never overflow
        k = calls_per_timing(nbytes)
        slowest = slowest_rank_timings(buffer, k, repeats, sync)  # the doctor's timing, as in ch00
        best = min(slowest)
        algbw = 4 * numel / best
        rows.append({"bytes": 4 * numel, "world_size": world_size, "backend": dist.get_backend(),
                     "best_s": best, "median_s": statistics.median(slowest),
                     "algbw_GBps": algbw / 1e9,
                     "busbw_GBps": algbw * bus_factor(world_size) / 1e9,
                     "calls_per_timing": k, "timings_s": slowest, "correct": ok.item() == 1.0})
        del buffer
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'size':>9} {'best us':>11} {'median us':>11} {'algbw GB/s':>11} "
             f"{'busbw GB/s':>11}  sum"]
    for r in rows:
        lines.append(f"{human(r['bytes']):>9} {r['best_s'] * 1e6:>11.1f} "
                     f"{r['median_s'] * 1e6:>11.1f} {r['algbw_GBps']:>11.3f} "
                     f"{r['busbw_GBps']:>11.3f}  {'ok' if r['correct'] else 'WRONG'}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", help=f"e.g. 4K 1M (default {' '.join(QUICK_SIZES)})")
    parser.add_argument("--full", action="store_true", help=f"sizes {' '.join(FULL_SIZES)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="also print one JSON row per size")
    opts = parser.parse_args()
    sizes = [parse_size(s) for s in (opts.sizes or (FULL_SIZES if opts.full else QUICK_SIZES))]
    with process_group(timeout_s=300) as ctx:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
        rows = measure(ctx.rank, ctx.world_size, sizes, opts.repeats)
        ctx.print0(f"all-reduce, {ctx.world_size} ranks, backend {ctx.backend}, "
                   f"best and median of {opts.repeats} timings")
        ctx.print0(format_table(rows))
        if opts.json:
            for r in rows:
                ctx.print0("JSON " + json.dumps(r))
        dist.barrier()
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
