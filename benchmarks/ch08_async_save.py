"""How long a checkpoint stalls DDP training: dcp.save against dcp.async_save, timed on 2 ranks, as JSON.

    python benchmarks/ch08_async_save.py                 # about three minutes on 2 cores
    python benchmarks/ch08_async_save.py --attempts 1 --rounds 2 --width 256 --out /tmp/x.json

Chapter 08 (``async_checkpoint``) shows what ``dcp.async_save`` does without a clock: it copies
the state, returns, and writes the copy in a background thread. This measures what that is
worth on the machine it runs on: an MLP of ``--layers`` linear layers of ``--width`` squared
with AdamW (model and optimizer state together: 150 MB with the defaults) trains under DDP on 2
ranks (gloo), and every ``--steps`` steps, one of three variants takes turns:

* ``no checkpoint``: the steps alone (the baseline of the round);
* ``dcp.save``: the loop calls it and waits for it;
* ``dcp.async_save``: the loop calls it (on a gloo group of its own), trains, and waits for its
  future at the end of the segment, as it must before the next save.

Per segment, on rank 0 (every segment starts at a barrier, so the ranks start together):
``call_ms``, how long the save call blocked the loop; ``wait_ms``, how long the loop then waited
for the future at the end (0 for ``dcp.save``); ``segment_ms``, the whole segment; and
``stall_ms``, the segment minus the same round's ``no checkpoint`` segment: what one checkpoint
cost the training loop, including the steps slowed down by a write running beside them (on 2
cores the background thread competes with training for the CPUs). Each save writes a new
directory on the disk under ``--dir`` (``FileSystemWriter``'s default: fsync on every file),
deleted after the round. The whole measurement is repeated ``--attempts`` times with fresh
ranks. The lesson quotes the committed record (benchmarks/results/ch08_async_save.json), never
a live run; the record starts with ``ddpcourse.timing.reference_header`` and says whether its
repeats agreed (``ddpcourse.timing.judge``), and its ``findings`` are sentences computed from its
own numbers (tests/test_chapter_08_dcp.py computes them again).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from ddpcourse.launcher import run_ranks  # noqa: E402
from ddpcourse.timing import (  # noqa: E402
    Timing, close_record, command_line, machine_load, reference_header, write_record)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ch08_async_save.json"
VARIANTS = ("no checkpoint", "dcp.save", "dcp.async_save")
FIGURES = ("call_ms", "wait_ms", "segment_ms", "stall_ms")


def build(width: int, layers: int):
    """The benchmark's model (not wrapped) and the number of bytes of its checkpoint state
    (parameters, AdamW's two moments, and one 4-byte ``step`` per parameter)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    parameters = list(model.parameters())
    state_bytes = sum(3 * p.numel() * p.element_size() + 4 for p in parameters)
    return model, state_bytes


def time_segments(rank: int, world_size: int, config: dict, directory: str) -> dict:
    """Every variant's figures, one sample per round, on rank 0's clock."""
    import shutil
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, state_bytes = build(config["width"], config["layers"])
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    checkpoint_group = dist.new_group(backend="gloo")
    data = torch.randn(config["batch"], config["width"],
                       generator=torch.Generator().manual_seed(rank))
    saves = iter(range(10**6))

    def step():
        ddp(data).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    def state():
        model_state, optim_state = get_state_dict(ddp, optimizer)
        return {"model": model_state, "optim": optim_state}

    def segment(variant: str) -> dict:
        dist.barrier()
        start = time.perf_counter()
        future, target = None, f"{directory}/save_{next(saves)}"
        if variant == "dcp.save":
            dcp.save(state(), checkpoint_id=target, process_group=checkpoint_group)
        elif variant == "dcp.async_save":
            future = dcp.async_save(state(), checkpoint_id=target, process_group=checkpoint_group)
        called = time.perf_counter()
        for _ in range(config["steps"]):
            step()
        trained = time.perf_counter()
        if future is not None:
            future.result()
        end = time.perf_counter()
        return {"call_ms": 1e3 * (called - start), "wait_ms": 1e3 * (end - trained),
                "segment_ms": 1e3 * (end - start)}

    def clean():
        dist.barrier()
        if rank == 0:
            for path in Path(directory).glob("save_*"):
                shutil.rmtree(path)
        dist.barrier()

    for variant in VARIANTS:  # warm-up: first calls, buckets, thread pools, page cache
        segment(variant)
    clean()
    samples = {variant: {figure: [] for figure in FIGURES} for variant in VARIANTS}
    for _ in range(config["rounds"]):
        measured = {variant: segment(variant) for variant in VARIANTS}
        baseline = measured["no checkpoint"]["segment_ms"]
        for variant, figures in measured.items():
            figures["stall_ms"] = figures["segment_ms"] - baseline
            for figure, value in figures.items():
                samples[variant][figure].append(value)
        clean()
    return {"samples": samples, "state_bytes": state_bytes}


# A gap between the two variants' least disturbed segments smaller than this fraction of a
# segment without a checkpoint is not read as a difference (repeats of one variant differ by up
# to 5-20% on this kind of machine).
RESOLVABLE = 0.05


def summarise(samples: list[float]) -> dict:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples),
            "samples": samples}


def findings(record: dict) -> list[str]:
    """The record's conclusions, computed from its numbers over all attempts' rounds: minima
    (the least disturbed segment of each variant) and medians."""
    def values(variant, figure):
        return [v for attempt in record["attempts"] for v in attempt[variant][figure]["samples"]]

    def least(variant):
        return min(values(variant, "segment_ms"))

    def median(variant, figure):
        return statistics.median(values(variant, figure))

    base = least("no checkpoint")
    sync_extra, async_extra = least("dcp.save") - base, least("dcp.async_save") - base
    steps = record["steps_per_segment"]
    lines = [
        f"checkpoint state: {record['state_bytes'] / 1e6:.0f} MB per rank (model and AdamW "
        f"state), one checkpoint per {steps} training steps",
        f"least disturbed segment of {steps} steps: no checkpoint {base:.0f} ms, with dcp.save "
        f"{base + sync_extra:.0f} ms (+{sync_extra:.0f} ms), with dcp.async_save "
        f"{base + async_extra:.0f} ms ({async_extra:+.0f} ms)",
        f"median stall per checkpoint (segment minus the same round's segment without one): "
        f"dcp.save {median('dcp.save', 'stall_ms'):.0f} ms, dcp.async_save "
        f"{median('dcp.async_save', 'stall_ms'):.0f} ms",
        f"median time blocked in the call: dcp.save {median('dcp.save', 'call_ms'):.0f} ms, "
        f"dcp.async_save {median('dcp.async_save', 'call_ms'):.0f} ms (the staging copy)",
        f"median wait for async_save's future after {steps} steps: "
        f"{median('dcp.async_save', 'wait_ms'):.0f} ms",
    ]
    if not record["conclusive"]:
        lines.append("no comparison is drawn: the verdict says this run is not conclusive "
                     "(rerun on a quiet machine)")
    elif abs(async_extra - sync_extra) < RESOLVABLE * base:
        lines.append(f"so, in the least disturbed segments, the two cost the training loop the "
                     f"same within what this run resolves ({async_extra:+.0f} vs "
                     f"{sync_extra:+.0f} ms per checkpoint, a gap under {RESOLVABLE:.0%} of a "
                     f"segment): async_save blocks the loop for less time, but the writing it "
                     f"moves to its thread still slows the training steps here")
    else:
        lines.append(f"so, in the least disturbed segments, dcp.async_save cost the training "
                     f"loop {'less' if async_extra < sync_extra else 'more'} than dcp.save "
                     f"({async_extra:+.0f} vs {sync_extra:+.0f} ms per checkpoint)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attempts", type=int, default=2,
                        help="independent runs (fresh ranks each time)")
    parser.add_argument("--rounds", type=int, default=9, help="samples per variant per attempt")
    parser.add_argument("--steps", type=int, default=4, help="training steps per segment")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the checkpoints are written (a folder on the disk)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--note", default="", help="what the reader should know about the run")
    args = parser.parse_args()
    config = {"width": args.width, "layers": args.layers, "batch": args.batch,
              "steps": args.steps, "rounds": args.rounds}
    load = machine_load(2.0)
    record = reference_header(command_line(), load, args.note)
    record.update(world_size=2, backend="gloo", optimizer="AdamW", width=args.width,
                  layers=args.layers, batch=args.batch, steps_per_segment=args.steps,
                  rounds=args.rounds, writer="FileSystemWriter (defaults: fsync each file)",
                  attempts=[])
    timings = {}
    for attempt in range(args.attempts):
        with tempfile.TemporaryDirectory(prefix="ch08_async_save_", dir=args.dir) as directory:
            measured = run_ranks(time_segments, 2, config, directory, backend="gloo",
                                 timeout=900)[0]
        record["state_bytes"] = measured["state_bytes"]
        per_variant = {variant: {figure: summarise(values) for figure, values in figures.items()}
                       for variant, figures in measured["samples"].items()}
        record["attempts"].append(per_variant)
        for variant in VARIANTS:
            timings[f"{variant}, segment, attempt {attempt}"] = Timing.of(
                measured["samples"][variant]["segment_ms"])
        print(f"attempt {attempt}:")
        for variant, figures in per_variant.items():
            print(f"  {variant:<15}" + "  ".join(
                f"{figure} {f['min']:.0f}/{f['median']:.0f}/{f['max']:.0f}"
                for figure, f in figures.items()) + "  (min/median/max)")
    close_record(record, timings, load)  # conclusions from minima
    record["findings"] = findings(record)
    print(*record["findings"], sep="\n")
    write_record(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
