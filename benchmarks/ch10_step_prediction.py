"""The cost model's predicted DDP step time beside the measured one, on 1, 2 and 4 ranks, as JSON.

    python benchmarks/ch10_step_prediction.py                # about two minutes on 2 cores
    python benchmarks/ch10_step_prediction.py --short --out /tmp/x.json

The model (``ddpcourse.cost_model.step_time``) is given what one rank measures without DDP
(forward and backward seconds of the same model and batch, the rest of the step as
"optimizer", one thread per rank as
``run_ranks`` gives on 2 cores), DDP's buckets (``bucket_sizes``, the default caps: 1 MiB first,
25 MiB after) and the α and β fitted to the recorded all-reduce run
(benchmarks/results/ch10_allreduce.json, per world size); it predicts the step time and weak-
scaling efficiency; each world size is then measured (DDP, the default caps, from step 2 on:
DDP rebuilds its buckets after step 0). Every sample is a block of ``--steps`` steps on the
slowest rank; the minimum of ``--rounds`` blocks is compared (the least disturbed run; the
median is recorded too). The record starts with ``ddpcourse.timing.reference_header`` and carries
``ddpcourse.timing.judge``'s verdict.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "chapters" / "10_performance"))

from ddpcourse import cost_model as cm  # noqa: E402
from ddpcourse.launcher import run_ranks  # noqa: E402
from ddpcourse.timing import (  # noqa: E402
    Timing, close_record, command_line, load_reference, machine_load, reference_header, write_record)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ch10_step_prediction.json"
MODEL = {"layers": 8, "width": 512, "batch": 64}


def phases(rank: int, world_size: int, model: dict, rounds: int, steps: int, ddp: bool) -> dict:
    """Seconds per step, one sample per block of ``steps``: forward, backward, optimizer and the
    whole step (each the slowest rank's)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import buckets_and_hooks as bh

    torch.set_num_threads(1)
    net = bh.make_net(layers=model["layers"], width=model["width"])
    tensor_bytes = [p.numel() * p.element_size() for p in net.parameters()]
    net = DDP(net) if ddp else net
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(model["batch"], model["width"])
    samples = {"forward": [], "backward": [], "optimizer": [], "step": []}

    def block():
        spent = dict.fromkeys(samples, 0.0)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = net(x).pow(2).mean()
            t1 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            spent["forward"] += t1 - t0
            spent["backward"] += t2 - t1
            spent["optimizer"] += t3 - t2
        spent["step"] = time.perf_counter() - start
        return {k: v / steps for k, v in spent.items()}

    for _ in range(2):  # DDP's step 0 (one bucket) and its rebuild stay out of the timings
        block()
    for _ in range(rounds):
        for key, value in block().items():
            samples[key].append(value)
    slowest = {}
    for key, values in samples.items():
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[key] = t.tolist()
    return {"samples": slowest, "tensor_bytes": tensor_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="3 rounds of 2 steps, 1 and 2 ranks")
    parser.add_argument("--rounds", type=int, default=None, help="default 9 (3 with --short)")
    parser.add_argument("--steps", type=int, default=None, help="default 5 (2 with --short)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.short else 9)
    steps = args.steps or (2 if args.short else 5)
    world_sizes = args.world_sizes or ([2] if args.short else [2, 4])
    fits = load_reference("ch10_allreduce.json")["fit"]
    load = machine_load(2.0)
    record = reference_header(command_line(), load, args.note)
    record.update(model=MODEL, rounds=rounds, steps_per_block=steps, backend="gloo",
                  allreduce_fit=fits, rows=[])

    alone = run_ranks(phases, 1, MODEL, rounds, steps, False, backend="gloo", timeout=600)[0]
    compute = {k: min(v) for k, v in alone["samples"].items()}
    buckets = cm.bucket_sizes(alone["tensor_bytes"], 25 * cm.MiB, 1 * cm.MiB)
    # the optimizer, zero_grad, the loss and the loop: all of the step that is not forward or
    # backward, so that the model's one-rank step is the measured one
    rest = compute["step"] - compute["forward"] - compute["backward"]
    record.update(one_rank_without_ddp=alone["samples"], buckets=buckets)
    timings = {"1 rank, no DDP": Timing.of(alone["samples"]["step"])}
    for world_size in world_sizes:
        found = run_ranks(phases, world_size, MODEL, rounds, steps, True, backend="gloo",
                          timeout=600)[0]["samples"]
        fit = fits[str(world_size)]
        link = cm.Link(fit["alpha_s"], fit["beta_bytes_per_s"])
        predicted = cm.step_time(forward_s=compute["forward"], backward_s=compute["backward"],
                                 optimizer_s=rest, buckets=buckets,
                                 world_size=world_size, link=link)
        measured = min(found["step"])
        record["rows"].append({
            "world_size": world_size, "predicted_step_s": predicted.step_s,
            "predicted_exposed_communication_s": predicted.exposed_communication_s,
            "predicted_communication_s": predicted.communication_s,
            "predicted_efficiency": cm.scaling_efficiency(compute["step"], predicted.step_s),
            "measured_step_s": measured, "measured_median_step_s": sorted(found["step"])[
                len(found["step"]) // 2],
            "measured_efficiency": cm.scaling_efficiency(compute["step"], measured),
            "measured_backward_s": min(found["backward"]),
            "error": predicted.step_s / measured - 1, "samples": found})
        timings[f"{world_size} ranks, DDP"] = Timing.of(found["step"])
    print(f"one rank, no DDP (min of {rounds}): " + ", ".join(
        f"{k} {1e3 * v:.2f} ms" for k, v in compute.items()))
    print(f"buckets (bytes, launch order): {buckets}")
    print(f"{'ranks':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>7} "
          f"{'pred. eff.':>10} {'meas. eff.':>10}")
    for r in record["rows"]:
        print(f"{r['world_size']:>5} {1e3 * r['predicted_step_s']:>13.2f} "
              f"{1e3 * r['measured_step_s']:>12.2f} {100 * r['error']:>+6.0f}% "
              f"{r['predicted_efficiency']:>10.2f} {r['measured_efficiency']:>10.2f}")
    close_record(record, timings, load)
    write_record(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
