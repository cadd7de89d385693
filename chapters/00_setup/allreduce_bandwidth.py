"""All-reduce bandwidth against message size, reported the way NVIDIA's nccl-tests report it.

    torchrun --standalone --nproc_per_node 2 chapters/00_setup/allreduce_bandwidth.py

Every rank all-reduces messages from 4 KiB to 16 MiB (gloo on CPU; NCCL when each rank has a GPU
of its own), checks each sum, and rank 0 prints one row per size: the time of one all-reduce
(median of 5 timings, each on the slowest rank), the algorithm bandwidth ``algbw = bytes / time``
and the bus bandwidth ``busbw = algbw * 2(n-1)/n``, the figure to compare with the speed of the
link between the ranks (formulas: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
Small messages measure latency (the time hardly depends on the size), large ones bandwidth.
GB/s here means 10^9 bytes per second, as in nccl-tests.
"""

from __future__ import annotations

import argparse
import sys

from ddpcourse.dist_env import process_group
from ddpcourse.doctor import algorithm_bandwidth, all_reduce_bus_bandwidth, allreduce_probe

DEFAULT_SIZES = [4 * 2**10 * 4**k for k in range(7)]  # 4 KiB, 16 KiB, ..., 16 MiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=DEFAULT_SIZES,
                        help="message sizes in bytes (multiples of 4: float32 elements)")
    opts = parser.parse_args()

    with process_group(timeout_s=60) as ctx:
        rows = allreduce_probe(ctx.rank, ctx.world_size, opts.sizes)
        ctx.print0(f"all_reduce on {ctx.world_size} ranks, backend {ctx.backend}")
        ctx.print0(f"{'bytes':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} "
                   f"{'correct':>8}")
        for nbytes, seconds, correct in rows:
            algbw = algorithm_bandwidth(nbytes, seconds) / 1e9
            busbw = all_reduce_bus_bandwidth(nbytes, seconds, ctx.world_size) / 1e9
            ctx.print0(f"{nbytes:>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} {busbw:>11.3f} "
                       f"{str(correct):>8}")
        return 0 if all(correct for _, _, correct in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
