"""Hand-written ring and halving-doubling all-reduce against ``dist.all_reduce``, size by size.

    torchrun --standalone --nproc_per_node 2 chapters/05_allreduce/ring_vs_gloo.py

The full sweep of the lesson (4 KiB to 64 MiB, 2 and 4 ranks, under a minute each on 2 cores),
recorded as the chapter's reference runs (run them on a quiet machine; ``--note`` says how quiet):

    torchrun --standalone --nproc_per_node 2 chapters/05_allreduce/ring_vs_gloo.py --full --out benchmarks/results/ch05_ring_vs_gloo_ws2.json
    torchrun --standalone --nproc_per_node 4 chapters/05_allreduce/ring_vs_gloo.py --full --out benchmarks/results/ch05_ring_vs_gloo_ws4.json

For every message size, each algorithm (``ring`` and ``halving_doubling`` from
hand_collectives.py, ``gloo``: ``dist.all_reduce``; NCCL when each rank has a GPU) is first
checked against ``dist.all_reduce`` on random data, then timed on a zero buffer: two warm-up
calls, then ``--repeats`` timings, each of ``k`` back-to-back calls after a barrier, on the slowest
rank (a collective is done when its last rank is). The algorithms take turns inside every repeat
(in a rotating order), so a burst of load on a shared machine hits all of them alike. Every
timing is kept; the best (least disturbed) one and the median are reported. On a 2-core VM the
median of small messages sits far above a best time that every quiet moment reproduces, so the
bandwidths and the ring/gloo ratio are computed from the best time.
Rank 0 prints both times, ``algbw = bytes / time`` and ``busbw = algbw * 2(N-1)/N`` (the
definitions of NVIDIA's nccl-tests, doc/PERFORMANCE.md) and the ring/gloo bus-bandwidth ratio,
and writes
everything to ``--out`` as JSON (the lesson notebook plots that file): the rows, and the fields of
a reference record (``ddpcourse.timing.reference_header``: machine, date, torch version, this
command, how busy the machine was before the timings) with the verdict of
``ddpcourse.timing.judge`` on the repeats' spread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hand_collectives, next to this file

import hand_collectives  # noqa: E402
from ddpcourse import timing  # noqa: E402
from ddpcourse.dist_env import process_group  # noqa: E402

ALGORITHMS = {
    "ring": hand_collectives.ring_allreduce,
    "halving_doubling": hand_collectives.halving_doubling_allreduce,
    "gloo": dist.all_reduce,  # the backend's own all-reduce (named after the CPU backend)
}
QUICK_SIZES = ["4K", "256K", "16M"]
FULL_SIZES = ["4K", "16K", "64K", "256K", "1M", "4M", "16M", "64M"]


def parse_size(text: str) -> int:
    """'4K' -> 4096, '16M' -> 16 MiB, '100' -> 100 bytes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(nbytes: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}iB"
    return f"{nbytes} B"


def calls_per_timing(nbytes: int) -> int:
    """A few back-to-back calls for small messages, so that one timing is not one wake-up."""
    return max(1, min(10, 2**18 // max(nbytes, 1)))


def bus_factor(world_size: int, in_network: bool = False) -> float:
    """busbw / algbw for all-reduce, as nccl-tests computes it (doc/PERFORMANCE.md, and
    ``AllReduceGetBw`` in src/all_reduce.cu): ``2(N-1)/N``, the least traffic per rank of any
    algorithm made of point-to-point sends and receives; ``(N-1)/(N+1)`` for in-network
    reduction (the switch adds: NVLink SHARP, which nccl-tests assumes when NCCL_ALGO is NVLS or
    NVLSTree)."""
    if in_network:
        return (world_size - 1) / (world_size + 1)
    return 2 * (world_size - 1) / world_size


def same_algorithm_gap(rows: list[dict]) -> dict[int, float]:
    """{bytes: best time(ring) / best time(halving_doubling)}: measured on 2 ranks, where both
    algorithms send the very same two messages, it is 1 up to the noise of the machine."""
    by = {(r["bytes"], r["algorithm"]): r["best_s"] for r in rows}
    return {nbytes: by[(nbytes, "ring")] / by[(nbytes, "halving_doubling")]
            for (nbytes, name) in by if name == "ring" and (nbytes, "halving_doubling") in by}


def worst_gap(rows: list[dict]) -> tuple[int, float]:
    """The (bytes, ring / halving_doubling time) of :func:`same_algorithm_gap` furthest from 1
    (a ratio of 2 and one of 0.5 are as far)."""
    return max(same_algorithm_gap(rows).items(), key=lambda item: abs(math.log(item[1])))


def measure(rank: int, world_size: int, sizes: list[int], repeats: int = 5,
            algorithms: list[str] | None = None) -> list[dict]:
    """One row per (size, algorithm): median and best seconds per call, bandwidths (from the
    best), correctness, and every timing (each on the slowest rank)."""
    names = algorithms or list(ALGORITHMS)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        torch.manual_seed(1000 + rank)
        data = torch.randn(numel, device=device)
        expected = data.clone()
        dist.all_reduce(expected)
        correct = {}
        for name in names:
            result = data.clone()
            ALGORITHMS[name](result)
            correct[name] = bool(torch.allclose(result, expected, rtol=1e-5, atol=1e-5))
        buffer = torch.zeros(numel, device=device)  # sums of zeros never overflow
        k = calls_per_timing(nbytes)
        for name in names:
            for _ in range(2):
                ALGORITHMS[name](buffer)
        timings = {name: [] for name in names}
        for repeat in range(repeats):
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # rotate
                dist.barrier()
                sync()
                start = time.perf_counter()
                for _ in range(k):
                    ALGORITHMS[name](buffer)
                sync()
                timings[name].append((time.perf_counter() - start) / k)
        for name in names:
            slowest = torch.tensor(timings[name], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            ok = torch.tensor([1.0 if correct[name] else 0.0], device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            seconds = statistics.median(slowest.tolist())
            best = min(slowest.tolist())
            algbw = nbytes / best
            rows.append({"bytes": nbytes, "algorithm": name, "time_s": seconds, "best_s": best,
                         "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * bus_factor(world_size) / 1e9,
                         "calls_per_timing": k, "timings_s": slowest.tolist(),
                         "correct": ok.item() == 1.0})
    return rows


def busbw_ratios(rows: list[dict], numerator: str = "ring", denominator: str = "gloo") -> dict:
    """{bytes: busbw(numerator) / busbw(denominator)} for every size both were measured at."""
    by = {(r["bytes"], r["algorithm"]): r["busbw_GBps"] for r in rows}
    return {nbytes: by[(nbytes, numerator)] / by[(nbytes, denominator)]
            for (nbytes, name) in by if name == numerator and (nbytes, denominator) in by}


def row_timings(rows: list[dict]) -> dict[str, timing.Timing]:
    """Each (algorithm, size)'s repeats, named for :func:`ddpcourse.timing.judge`."""
    return {f"{r['algorithm']} {human(r['bytes'])}": timing.Timing.of(r["timings_s"])
            for r in rows}


def launch_command(world_size: int, argv: list[str]) -> str:
    """The torchrun command line that reproduces this run, from the repository root."""
    script = Path(__file__).resolve()
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join(["torchrun", "--standalone", "--nproc_per_node", str(world_size), str(script),
                       *argv])


def format_table(rows: list[dict], world_size: int) -> str:
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    head = f"{'size':>9} " + " ".join(
        f"{name + ' best us':>24} {'median':>9} {'busbw':>6}" for name in names)
    lines = [head + (f" {'ring/gloo':>9}" if {"ring", "gloo"} <= set(names) else "")]
    lines.append("-" * len(lines[0]))
    ratios = busbw_ratios(rows) if {"ring", "gloo"} <= set(names) else {}
    for nbytes in dict.fromkeys(r["bytes"] for r in rows):
        line = f"{human(nbytes):>9} "
        for name in names:
            r = next(r for r in rows if r["bytes"] == nbytes and r["algorithm"] == name)
            flag = "" if r["correct"] else "!"
            line += (f"{r['best_s'] * 1e6:>23.1f}{flag or ' '} {r['time_s'] * 1e6:>9.1f}"
                     f" {r['busbw_GBps']:>6.3f} ")
        if nbytes in ratios:
            line += f"{ratios[nbytes]:>9.2f}"
        lines.append(line.rstrip())
    lines.append(f"(times in µs per call, best and median of the repeats; busbw in GB/s = 1e9 "
                 f"bytes/s, from the best time: bytes / time * 2(N-1)/N = * "
                 f"{bus_factor(world_size):.2f}; '!' marks a wrong sum)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=None,
                        help=f"message sizes, e.g. 4K 1M 16M (default {' '.join(QUICK_SIZES)})")
    parser.add_argument("--full", action="store_true",
                        help=f"the lesson's sweep: {' '.join(FULL_SIZES)}, 20 repeats")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timings per point (default 5; 20 with --full)")
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--note", default="", help="how loaded the machine was (for the record)")
    opts = parser.parse_args()
    sizes = [parse_size(s) for s in (opts.sizes or (FULL_SIZES if opts.full else QUICK_SIZES))]
    repeats = opts.repeats or (20 if opts.full else 5)

    with process_group(timeout_s=120) as ctx:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
        # How busy the machine is with other work, sampled by rank 0 while the other ranks wait
        # in a barrier (after start-up, which keeps every core busy importing torch).
        dist.barrier()
        load = timing.machine_load(interval=1.0) if ctx.rank == 0 else None
        dist.barrier()
        rows = measure(ctx.rank, ctx.world_size, sizes, repeats, opts.algorithms)
        verdict = timing.judge(row_timings(rows), load) if ctx.rank == 0 else None
        ctx.print0(f"all-reduce on {ctx.world_size} ranks, backend {ctx.backend}, "
                   f"best and median of {repeats} timings; before the timings: {load}")
        ctx.print0(format_table(rows, ctx.world_size))
        ctx.print0(verdict)
        if ctx.rank == 0 and opts.out:
            command = launch_command(ctx.world_size, sys.argv[1:])
            report = {
                **timing.reference_header(command, load, opts.note),
                "world_size": ctx.world_size, "backend": ctx.backend, "repeats": repeats,
                "verdict": str(verdict), "conclusive": verdict.conclusive, "rows": rows,
                "ring_over_gloo_busbw": {str(k): v for k, v in busbw_ratios(rows).items()},
            }
            opts.out.write_text(json.dumps(report, indent=1) + "\n")
            ctx.print0(f"wrote {opts.out}")
        return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
