"""Does DDP make training faster? Measure it: time per step, samples/s and communication share.

    torchrun --standalone --nproc_per_node 2 chapters/01_why_ddp/scaling.py
    python chapters/01_why_ddp/scaling.py --world-sizes 1 2 4
    python chapters/01_why_ddp/scaling.py --record benchmarks/results/ch01_scaling.json

The first command measures the world size torchrun gives it; the second measures several world
sizes one after the other, each in fresh ranks started by ``ddpcourse.launcher.run_ranks`` (the
lesson notebook calls :func:`measure_scaling`, which does the same). The third writes the
chapter's recorded reference run: what the lesson plots beside its live run and draws its
conclusions from (strong scaling of both workloads and weak scaling of ``heavy``, 9 rounds each,
with the machine, date, torch version, command and load; run it on a quiet machine).

Two workloads, both trained with DDP, the same loop, the same data pipeline (a DataLoader over a
DistributedSampler):

* ``heavy``: an MLP of 0.39 M parameters (256 -> 512 -> 512 -> 1) on batches of 2048 samples:
  a lot of arithmetic (~6 x parameters x batch FLOPs) for every byte of gradient that must be
  all-reduced;
* ``tiny``: the course's 1.4 k-parameter TinyMLP on batches of 64: almost no arithmetic, so a
  step is mostly fixed costs (Python, the DataLoader, DDP's hooks, the latency of an all-reduce).

Strong scaling by default: the *global* batch stays fixed and is split across the ranks, so N
ranks do the same work per step as one rank, each doing 1/N of it. That is the question a
practitioner asks ("my data set and batch size are given: does an epoch get faster?"), and the
setting in which communication eats the gain soonest: each rank's compute shrinks with N, the
gradient all-reduce does not. ``--mode weak`` keeps the
*per-rank* batch fixed instead (the global batch grows with N).

How the time is split (medians over the measured steps, each step's time taken on the slowest
rank, after warm-up steps that are not counted):

* data: fetching the next batch from the DataLoader;
* compute: a training step inside ``DDP.no_sync()``, where DDP skips the gradient all-reduce;
* comm: a normal step minus a ``no_sync`` step, i.e. the all-reduce time that backward could not
  hide (DDP overlaps it with the rest of backward, so this is the *exposed* part);
* allreduce: one explicit all-reduce of a tensor as large as all the gradients, for reference.

Normal and ``no_sync`` steps alternate, so slow phases of a noisy machine hit both alike. With
``rounds > 1`` each world size is measured that many times; the fastest round is kept, and the
step times of all rounds say how much the runs disagreed (:func:`round_timings`, for
``ddpcourse.timing.judge``). During
the ``no_sync`` steps the replicas' weights drift apart; that does not matter here, because this
script measures time, not training. Each rank runs one thread (``torch.set_num_threads(1)``), so
one rank stands for one device; with more ranks than cores the ranks share cores
("oversubscribed"), which the table flags.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddpcourse import timing
from ddpcourse.launcher import run_ranks, usable_cores, wait_until_warm
from ddpcourse.toys import make_model, make_regression


@dataclass(frozen=True)
class Workload:
    in_features: int
    hidden: int
    global_batch: int  # per-rank batch x world size under strong scaling
    samples: int  # size of the generated data set (the loader cycles through it)
    steps: int  # measured step pairs (one normal + one no_sync each)
    warmup: int  # step pairs run first and not counted


WORKLOADS = {
    "heavy": Workload(in_features=256, hidden=512, global_batch=2048, samples=16_384,
                      steps=6, warmup=2),
    "tiny": Workload(in_features=8, hidden=32, global_batch=64, samples=20_000,
                     steps=60, warmup=10),
}
EPOCH_SAMPLES = 20_000  # the source article's small data set; used to express step time per epoch
COLUMNS = ("world_size", "batch_per_rank", "data_ms", "compute_ms", "comm_ms", "step_ms",
           "allreduce_ms", "samples_per_s", "comm_share", "epoch_s", "speedup", "oversubscribed")
REFERENCE = "ch01_scaling.json"  # under benchmarks/results/: written by --record


def _batches(loader: DataLoader, sampler: DistributedSampler) -> Iterator:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _clock(device: torch.device):
    """A timer that first waits for the GPU's queued work (GPU kernels run asynchronously)."""
    if device.type == "cuda":
        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return now
    return time.perf_counter


def _slowest_rank_median(values: list[float]) -> float:
    """Per step, the slowest rank's time (a synchronous step ends when its last rank does);
    then the median over steps, which shrugs off the odd step a noisy machine stretches."""
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _device() -> torch.device:
    """The rank's GPU under NCCL (torchrun via process_group(), or run_ranks), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def measure_rank(rank: int, world_size: int, workload: str, mode: str = "strong",
                 steps: int | None = None, warmup: int | None = None, threads: int = 1) -> dict:
    """Time ``workload``'s DDP training steps in the current process group (every rank calls
    this); returns the same row of measurements on every rank."""
    spec = WORKLOADS[workload]
    steps = spec.steps if steps is None else steps
    warmup = spec.warmup if warmup is None else warmup
    torch.set_num_threads(threads)
    if mode == "strong":
        if spec.global_batch % world_size:
            raise ValueError(f"global batch {spec.global_batch} does not split over {world_size}")
        per_rank = spec.global_batch // world_size
    elif mode == "weak":
        per_rank = spec.global_batch
    else:
        raise ValueError(f"mode must be 'strong' or 'weak', not {mode!r}")

    data = make_regression(spec.samples, in_features=spec.in_features, seed=0)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=per_rank, sampler=sampler, drop_last=True)
    device = _device()
    clock = _clock(device)
    model = make_model(0, in_features=spec.in_features, hidden=spec.hidden).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    batches = _batches(loader, sampler)

    def step(x, y) -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    data_s, sync_s, nosync_s = [], [], []
    for i in range(warmup + steps):
        order = (True, False) if i % 2 == 0 else (False, True)
        for synced in order:
            start = clock()
            x, y = (t.to(device) for t in next(batches))
            fetched = clock()
            if synced:
                step(x, y)
            else:
                with model.no_sync():  # forward and backward inside: no all-reduce at all
                    step(x, y)
            done = clock()
            if i >= warmup:
                (sync_s if synced else nosync_s).append(done - fetched)
                data_s.append(fetched - start)

    grads = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)
    allreduce_s = []
    for i in range(warmup + steps):
        dist.barrier()
        start = clock()
        dist.all_reduce(grads)
        if i >= warmup:
            allreduce_s.append(clock() - start)

    data = _slowest_rank_median(data_s)
    synced = _slowest_rank_median(sync_s)
    compute = _slowest_rank_median(nosync_s)
    step_time = data + synced
    global_batch = per_rank * world_size
    return {
        "workload": workload,
        "mode": mode,
        "world_size": world_size,
        "batch_per_rank": per_rank,
        "data_ms": data * 1e3,
        "compute_ms": compute * 1e3,
        "comm_ms": max(0.0, synced - compute) * 1e3,
        "step_ms": step_time * 1e3,
        "allreduce_ms": _slowest_rank_median(allreduce_s) * 1e3,
        "gradient_bytes": grads.numel() * grads.element_size(),
        "samples_per_s": global_batch / step_time,
        "comm_share": max(0.0, synced - compute) / step_time,
        "epoch_s": math.ceil(EPOCH_SAMPLES / global_batch) * step_time,
        "oversubscribed": world_size * threads > usable_cores(),
    }


def work_per_step(workload: str, world_size: int, mode: str = "strong") -> dict:
    """What one step asks of each rank, counted, not timed: the same on every machine.

    Parameters and gradient bytes come from the model itself. FLOPs use the usual estimate for a
    dense network, 6 x parameters x samples (forward 2, backward 4: a multiply and an add per
    weight and sample). A ring all-reduce makes each rank send 2(N-1)/N of the gradient bytes
    (chapter 05 counts it), the least any point-to-point algorithm can.
    """
    spec = WORKLOADS[workload]
    params = sum(p.numel() for p in
                 make_model(0, in_features=spec.in_features, hidden=spec.hidden).parameters())
    per_rank = spec.global_batch // world_size if mode == "strong" else spec.global_batch
    gradient_bytes = 4 * params  # float32
    sent = gradient_bytes * 2 * (world_size - 1) / world_size
    flops = 6 * params * per_rank
    return {"workload": workload, "mode": mode, "world_size": world_size, "params": params,
            "batch_per_rank": per_rank, "gradient_bytes": gradient_bytes,
            "flops_per_rank": flops, "bytes_sent_per_rank": sent,
            "flops_per_byte_sent": flops / sent if sent else math.inf}


COMPUTE_SPLIT_MAX = 0.65  # heavy compute on 2 ranks / on 1 rank: above this, a core was busy


def compute_split(rows: Sequence[dict]) -> float:
    """Compute time per step on 2 ranks over 1 rank: under strong scaling 0.5 is a perfect split
    of the work over two free cores, under weak scaling (each rank does one rank's work) 1.0."""
    by = {row["world_size"]: row["compute_ms"] for row in rows}
    return by[2] / by[1]


def cores_were_free(rows: Sequence[dict]) -> bool:
    """Whether 2 ranks computed as fast as two free cores allow, within the margin of
    :data:`COMPUTE_SPLIT_MAX` (0.65 = 0.5 x 1.3 under strong scaling, 1.3 under weak): if not,
    another program used a core during the run, whatever the load figure said before it."""
    ideal = 0.5 if rows[0]["mode"] == "strong" else 1.0
    return compute_split(rows) <= COMPUTE_SPLIT_MAX * ideal / 0.5


def add_speedups(rows: list[dict]) -> list[dict]:
    """Speed-up of each row against the first (one rank): ratio of samples per second."""
    base = rows[0]["samples_per_s"]
    return [{**row, "speedup": row["samples_per_s"] / base} for row in rows]


def measure_scaling(workload: str, world_sizes: Sequence[int] = (1, 2, 4), mode: str = "strong",
                    steps: int | None = None, warmup: int | None = None, threads: int = 1,
                    rounds: int = 1, timeout: float = 120.0) -> list[dict]:
    """One row per world size, each measured in fresh ranks (``run_ranks``) with ``threads``
    threads per rank; speed-ups are against the first world size given.

    With ``rounds > 1`` every world size is measured that many times, the rounds interleaved
    (1, 2, 4, 1, 2, 4, ...), and the fastest run of each is kept: on a machine shared with other
    programs the least disturbed run is the best estimate of what the ranks themselves cost.
    Every row also carries ``step_ms_rounds``, the step time of each round.
    """
    wait_until_warm()  # the launcher warms a rank server in the background: not during a timing
    runs: dict[int, list[dict]] = {world_size: [] for world_size in world_sizes}
    for _ in range(rounds):
        for world_size in world_sizes:
            runs[world_size].append(
                run_ranks(measure_rank, world_size, workload, mode, steps, warmup, threads,
                          timeout=timeout, relay_output=False)[0])
    rows = []
    for world_size in world_sizes:
        best = min(runs[world_size], key=lambda row: row["step_ms"])  # = most samples/s
        rows.append({**best, "step_ms_rounds": [row["step_ms"] for row in runs[world_size]]})
    return add_speedups(rows)


def round_timings(rows: Sequence[dict]) -> dict[str, timing.Timing]:
    """Each row's step times over its rounds, named for :func:`ddpcourse.timing.judge`."""
    return {f"{r['workload']} {r['mode']}, {r['world_size']} ranks": timing.Timing.of(
        r["step_ms_rounds"]) for r in rows}


def record_reference(path: Path, world_sizes: Sequence[int] = (1, 2, 4), rounds: int = 9,
                     note: str = "") -> dict:
    """Measure what the lesson plots and write it, with everything that makes it reproducible,
    to ``path`` (a JSON record for :func:`ddpcourse.timing.load_reference`)."""
    before = timing.machine_load(interval=2.0)
    strong = {name: measure_scaling(name, world_sizes, "strong", rounds=rounds)
              for name in WORKLOADS}
    weak = {"heavy": measure_scaling("heavy", world_sizes, "weak", rounds=rounds)}
    after = timing.machine_load(interval=2.0)
    rows = [row for runs in (strong, weak) for rows in runs.values() for row in rows]
    verdict = timing.judge(round_timings(rows), timing.Load(max(before.busy, after.busy),
                                                             before.cores, before.source))
    record = timing.reference_header(timing.command_line(), before, note)
    record["load"]["busy_cores_after"] = round(after.busy, 3)
    record.update({"rounds": rounds, "world_sizes": list(world_sizes),
                   "verdict": str(verdict), "conclusive": verdict.conclusive,
                   "strong": strong, "weak": weak})
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def format_table(rows: Sequence[dict]) -> str:
    """The measurements as a fixed-width table, one line per world size."""
    head = (f"{'ranks':>5} {'batch/rank':>10} {'data ms':>8} {'compute ms':>10} {'comm ms':>8} "
            f"{'step ms':>8} {'allreduce ms':>12} {'samples/s':>10} {'comm %':>6} "
            f"{'epoch s':>8} {'speed-up':>8}")
    lines = [f"{rows[0]['workload']} model, {rows[0]['mode']} scaling "
             f"({rows[0]['gradient_bytes'] / 2**20:.2f} MiB of gradients per step)", head]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        lines.append(
            f"{r['world_size']:>5} {r['batch_per_rank']:>10} {r['data_ms']:>8.2f} "
            f"{r['compute_ms']:>10.2f} {r['comm_ms']:>8.2f} {r['step_ms']:>8.2f} "
            f"{r['allreduce_ms']:>12.2f} {r['samples_per_s']:>10.0f} "
            f"{100 * r['comm_share']:>5.0f}% "
            f"{r['epoch_s']:>8.2f} {speedup:>8}"
            + ("  (oversubscribed: more ranks than cores)" if r["oversubscribed"] else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--mode", choices=("strong", "weak"), default="strong")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4],
                        help="only without torchrun: the world sizes to measure one by one")
    parser.add_argument("--rounds", type=int, default=None,
                        help="only without torchrun: measure each world size this many times and "
                             "keep the fastest run (default 1; 9 with --record)")
    parser.add_argument("--record", type=Path, default=None,
                        help="only without torchrun: write the lesson's reference run here")
    parser.add_argument("--note", default="", help="with --record: how loaded the machine was")
    opts = parser.parse_args()

    if "RANK" not in os.environ and opts.record:
        record = record_reference(opts.record, opts.world_sizes, opts.rounds or 9, opts.note)
        for mode in ("strong", "weak"):
            for rows in record[mode].values():
                print(format_table(rows), "\n")
        print(record["verdict"], f"\nwrote {opts.record}", flush=True)
        return 0
    if "RANK" not in os.environ:
        for workload in opts.workloads:
            rows = measure_scaling(workload, opts.world_sizes, opts.mode, rounds=opts.rounds or 1)
            print(format_table(rows), "\n", flush=True)
        return 0

    from ddpcourse.dist_env import process_group

    with process_group(timeout_s=60) as ctx:
        ctx.print0(f"{ctx.world_size} ranks, backend {ctx.backend}; one row per workload "
                   "(for a speed-up, compare with `--nproc_per_node 1`, or run the sweep "
                   "command in this docstring)")
        for workload in opts.workloads:
            row = measure_rank(ctx.rank, ctx.world_size, workload, opts.mode)
            ctx.print0(format_table([row]), "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
