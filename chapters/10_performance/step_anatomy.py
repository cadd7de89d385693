"""Anatomy of a DDP step: forward, backward, waiting on communication, optimizer — and a trace.

    torchrun --standalone --nproc_per_node 2 chapters/10_performance/step_anatomy.py

Launch test: custom (tests/test_chapter_10_step_anatomy.py launches it once and reads its
output, instead of a second launch by tests/test_chapter_scripts.py).

A model of six 256x256 linear layers (``buckets_and_hooks.make_net``) in DDP with
``bucket_cap_mb=0.25``: one bucket per layer (a bucket never splits a tensor), so six all-reduces
per step that backward can overlap. Each step is cut by timers (``time.perf_counter``) and by the
comm hook's own timestamps (``buckets_and_hooks.recording``: when each bucket was launched and
when its all-reduce was done):

* **forward**: the model's call and the loss;
* **backward, computing**: from ``backward()``'s start to the launch of the last bucket (the
  reducer launches a bucket as soon as all its gradients are ready, in bucket-index order,
  ``Reducer::mark_bucket_ready`` in torch/csrc/distributed/c10d/reducer.cpp);
* **waiting on communication**: from the last launch to ``backward()``'s return
  (``Reducer::finalize_backward`` waits for every bucket's future before backward returns);
* **optimizer**: ``opt.step()``.

*Hidden* communication is the part of the buckets' all-reduce time (the union of their
[launched, done] intervals) that lies before the last launch, i.e. while backward still computed.
How much hides is a timing: the script reports it with min/median over steps 2.. (step 0 has one
bucket for every gradient, buckets are rebuilt before step 1) and the machine's load, and draws
no conclusion from it when the machine is loaded or the repeats disagree.

What it checks (counts and orderings, the same on every machine; exit 1 if one is contradicted):
from step 1, six buckets per step on every rank, launched in index order; every bucket launched
after ``backward()`` started and done before it returned; the Chrome trace (rank 0, two steps
under ``torch.profiler``) names a backend all-reduce and stays under 5 MB. Open the trace in
https://ui.perfetto.dev (its path is printed): the all-reduces run on the backend's own thread
beside autograd's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
import buckets_and_hooks as bh  # noqa: E402

from ddpcourse.dist_env import process_group  # noqa: E402
from ddpcourse.report import report_checks  # noqa: E402
from ddpcourse.timing import Timing, judge, machine_load  # noqa: E402

CAP_MB = 0.25  # below one layer's 263 KB: one bucket per layer
TRACE_LIMIT_BYTES = 5_000_000


def union_length(intervals: list[tuple[float, float]], lo: float = float("-inf"),
                 hi: float = float("inf")) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a:
            continue
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def phases(step: dict, buckets: list[dict]) -> dict:
    """Seconds of forward, backward computing, waiting, optimizer, and the hidden communication
    of one step, from its timers and its buckets' timestamps."""
    last_launch = max(b["launched"] for b in buckets)
    comm = [(b["launched"], b["done"]) for b in buckets]
    total_comm = union_length(comm)
    hidden = union_length(comm, step["backward"], last_launch)
    return {"forward": step["backward"] - step["forward"],
            "backward": last_launch - step["backward"],
            "waiting": step["backward_done"] - last_launch,
            "optimizer": step["optimizer_done"] - step["optimizer"],
            "communication": total_comm,
            "hidden_fraction": hidden / total_comm if total_comm > 0 else 0.0}


def anatomy(rank: int, world_size: int, steps: int = 8, trace_path: str | None = None) -> dict:
    """Run ``steps`` DDP steps with timers and the recording hook; on rank 0, two more steps
    under ``torch.profiler`` exported to ``trace_path``. Plain data: per step its timers, its
    buckets (index, bytes, launched, done) and its phases."""
    model = DDP(bh.make_net(), bucket_cap_mb=CAP_MB)
    log = bh.BucketLog()
    model.register_comm_hook(None, bh.recording(default_hooks.allreduce_hook, log))
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(bh.BATCH, bh.WIDTH, generator=g)
    y = torch.sin(x.roll(1, dims=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def one_step(step: int) -> dict:
        log.step = step
        t = {"forward": time.perf_counter()}
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        t["backward"] = time.perf_counter()
        loss.backward()
        t["backward_done"] = time.perf_counter()
        t["optimizer"] = time.perf_counter()
        opt.step()
        t["optimizer_done"] = time.perf_counter()
        return t

    dist.barrier()
    timers = [one_step(step) for step in range(steps)]
    out = []
    for step, t in enumerate(timers):
        buckets = [{k: e[k] for k in ("index", "bytes", "launched", "done")}
                   for e in log.entries if e["step"] == step]
        out.append({"timers": t, "buckets": buckets, "phases": phases(t, buckets)})
    trace = None
    if trace_path is not None:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(steps, steps + 2):
                one_step(step)
        if rank == 0:
            prof.export_chrome_trace(trace_path)
            text = Path(trace_path).read_text()
            trace = {"path": trace_path, "bytes": len(text.encode()),
                     "all_reduce_events": sum(1 for e in json.loads(text)["traceEvents"]
                                              if "all_reduce" in str(e.get("name", "")))}
    dist.barrier()
    return {"rank": rank, "steps": out, "trace": trace,
            "gradient_bytes": bh.gradient_bytes(model.module)}


def claims(ranks: list[dict]) -> list[str]:
    """The docstring's statements that these counts and orderings contradict (none with torch
    2.13): counted from step 1."""
    wrong = []
    for found in ranks:
        later = found["steps"][1:]
        if any([b["index"] for b in s["buckets"]] != list(range(bh.LAYERS)) for s in later):
            wrong.append(f"rank {found['rank']}: six buckets per step, launched in index order")
        if any(not (s["timers"]["backward"] <= b["launched"] <= b["done"]
                    <= s["timers"]["backward_done"]) for s in later for b in s["buckets"]):
            wrong.append(f"rank {found['rank']}: every bucket launched after backward started "
                         f"and done before it returned")
    trace = ranks[0]["trace"]
    if trace is not None and not (trace["all_reduce_events"] > 0
                                  and trace["bytes"] < TRACE_LIMIT_BYTES):
        wrong.append("the trace names a backend all-reduce and stays under 5 MB")
    return wrong


def summary(ranks: list[dict], load=None) -> tuple[dict, object]:
    """min/median of each phase (ms) and of the hidden fraction over steps 2.. of every rank,
    and the verdict on whether the timings may be read (``ddpcourse.timing.judge``)."""
    measured = [s["phases"] for r in ranks for s in r["steps"][2:]]
    table = {k: Timing.of(max(p[k], 1e-9) for p in measured)
             for k in ("forward", "backward", "waiting", "optimizer", "communication")}
    hidden = Timing.of(max(p["hidden_fraction"], 1e-9) for p in measured)
    verdict = judge(table, load if load is not None else machine_load(0.5), statistic="median")
    return {"table": table, "hidden": hidden}, verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trace", default=None,
                        help="Chrome trace path (default: a new temporary directory)")
    args = parser.parse_args(argv)
    with process_group(timeout_s=120) as ctx:
        trace = args.trace
        if trace is None:
            trace = os.path.join(tempfile.mkdtemp(prefix="ddp_step_"), "step_trace.json")
        found = anatomy(ctx.rank, ctx.world_size, args.steps, trace)
        ranks = [None] * ctx.world_size
        dist.all_gather_object(ranks, found)
        wrong = claims(ranks)
        if ctx.rank == 0:
            stats, verdict = summary(ranks)
            print(f"{found['gradient_bytes']} bytes of gradient, bucket_cap_mb={CAP_MB}: "
                  f"buckets per step {[len(s['buckets']) for s in found['steps']]}")
            print("phase (ms, steps 2.. of every rank): min / median")
            for name, t in stats["table"].items():
                print(f"  {name:<14} {1e3 * t.min:8.2f} / {1e3 * t.median:8.2f}")
            h = stats["hidden"]
            print(f"communication hidden behind backward: min {100 * h.min:.0f}% / "
                  f"median {100 * h.median:.0f}% of the all-reduce time")
            print(f"timings: {verdict}")
            for r in ranks:
                s = r["steps"][-1]
                t0 = s["timers"]["forward"]
                line = ", ".join(f"#{b['index']} {1e3 * (b['launched'] - t0):.1f}-"
                                 f"{1e3 * (b['done'] - t0):.1f}" for b in s["buckets"])
                print(f"rank {r['rank']} last step, buckets launched-done (ms after forward "
                      f"began; backward {1e3 * (s['timers']['backward'] - t0):.1f}-"
                      f"{1e3 * (s['timers']['backward_done'] - t0):.1f}): {line}")
            tr = ranks[0]["trace"]
            print(f"Chrome trace ({tr['bytes']} bytes, {tr['all_reduce_events']} all-reduce "
                  f"events): {tr['path']}  (open it in https://ui.perfetto.dev)")
            report_checks(wrong, label="claims of the docstring")
        dist.barrier()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
