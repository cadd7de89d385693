"""Three ways to average gradients, after the PyTorch DDP paper, on the same model and data.

    torchrun --standalone --nproc_per_node 2 chapters/05_allreduce/three_ddp_designs.py

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020
(https://arxiv.org/abs/2006.15704), walk from the simplest correct design to DDP:

1. ``naive``: after ``backward()``, one blocking all-reduce per parameter (``average_gradients``;
   this is also the answer to exercise 05's first task).
2. ``hooks``: one *asynchronous* all-reduce per parameter, launched from a
   ``Tensor.register_post_accumulate_grad_hook`` the moment that parameter's gradient is final,
   so communication can overlap the rest of the backward pass; wait for all before the step.
3. ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` with a small ``bucket_cap_mb``:
   gradients are packed into buckets and each bucket is all-reduced (asynchronously) once full.
   A comm hook wraps DDP's all-reduce to count the buckets.

Every design trains a copy of the same MLP with SGD on the same global batches (each rank gets
its 1/N slice), and counts its all-reduce calls per step. ``compute_only`` (no communication at
all, so the replicas drift apart) is timed as the floor. Rank 0 prints the median step time
(slowest rank) and the calls per step, and checks that the three designs end with the same
weights on every rank. Exit code 1 if they do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.dist_env import process_group
from ddpcourse.toys import flat_parameters, make_regression

DESIGNS = ("compute_only", "naive", "hooks", "ddp")


def make_mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def average_gradients(model: nn.Module, calls: list) -> None:
    """Design 1: replace every .grad by its mean over ranks, one blocking all-reduce each."""
    world_size = dist.get_world_size()
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            calls.append(parameter.numel())
            parameter.grad /= world_size


class HookAllReduce:
    """Design 2: an async all-reduce per parameter, launched from its post-accumulate hook."""

    def __init__(self, model: nn.Module, calls: list):
        self.model, self.calls, self.pending = model, calls, []
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._launch)

    def _launch(self, parameter: torch.Tensor) -> None:
        # .grad is final for this backward: nothing in autograd writes it again
        self.pending.append(dist.all_reduce(parameter.grad, async_op=True))
        self.calls.append(parameter.numel())

    def finish(self) -> None:
        """Wait for every launched all-reduce, then turn the sums into means."""
        for work in self.pending:
            work.wait()
        self.pending.clear()
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                parameter.grad /= dist.get_world_size()


def _counting_allreduce_hook(calls: list, bucket):
    """A DDP comm hook: count the bucket, all-reduce its flat buffer, divide by the world size."""
    buffer = bucket.buffer()
    calls.append(buffer.numel())
    future = dist.all_reduce(buffer, async_op=True).get_future()
    return future.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def train(rank: int, world_size: int, design: str, steps: int = 8, width: int = 256,
          depth: int = 6, batch: int = 128, bucket_cap_mb: float = 0.3, lr: float = 0.05) -> dict:
    """Train one design; per step: time (this rank) and the sizes of its all-reduce calls."""
    model = make_mlp(width, depth, seed=0)  # the same initial weights on every rank
    data = make_regression(steps * batch * world_size, in_features=width, seed=1)
    calls: list[int] = []
    hooks = HookAllReduce(model, calls) if design == "hooks" else None
    trained: nn.Module = model
    if design == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        trained = DDP(model, bucket_cap_mb=bucket_cap_mb)
        trained.register_comm_hook(calls, _counting_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    times, calls_per_step, sizes_per_step = [], [], []
    for step in range(steps):
        start_row = (step * world_size + rank) * batch  # this rank's slice of global batch `step`
        x = data.tensors[0][start_row:start_row + batch]
        y = data.tensors[1][start_row:start_row + batch]
        calls.clear()
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(trained(x), y)
        loss.backward()
        if design == "naive":
            average_gradients(model, calls)
        elif hooks is not None:
            hooks.finish()
        optimizer.step()
        times.append(time.perf_counter() - start)
        calls_per_step.append(len(calls))
        sizes_per_step.append(list(calls))
    return {"design": design, "step_times_s": times, "calls_per_step": calls_per_step,
            "elements_per_call": sizes_per_step,
            "params_with_grad": sum(p.grad is not None for p in model.parameters()),
            "weights": flat_parameters(model)}


def run_designs(rank: int, world_size: int, **options) -> dict:
    """Every design in turn in this process group; times are the slowest rank's per step."""
    results = {}
    for design in DESIGNS:
        r = train(rank, world_size, design, **options)
        slowest = torch.tensor(r["step_times_s"], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        r["step_times_s"] = slowest.tolist()
        r["median_step_s"] = statistics.median(slowest.tolist()[1:] or slowest.tolist())
        # the largest difference between this rank's weights and rank 0's
        reference = r["weights"].clone()
        dist.broadcast(reference, src=0)
        spread = torch.tensor([(r["weights"] - reference).abs().max().item()])
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        r["max_diff_across_ranks"] = spread.item()
        results[design] = r
    for r in results.values():
        r["max_diff_vs_naive"] = (r["weights"] - results["naive"]["weights"]).abs().max().item()
    return results


def same_weights(results: dict, tolerance: float = 1e-6) -> bool:
    """The three real designs agree with each other and across ranks."""
    return all(results[d]["max_diff_vs_naive"] <= tolerance
               and results[d]["max_diff_across_ranks"] <= tolerance
               for d in ("naive", "hooks", "ddp"))


def format_report(results: dict, world_size: int) -> str:
    lines = [f"{'design':<13}{'step ms':>9}{'all-reduces/step':>18}{'max |w - w_naive|':>19}"
             f"{'max |w_r - w_0|':>17}"]
    for design, r in results.items():
        counts = sorted(set(r["calls_per_step"]))
        count_text = "/".join(map(str, counts)) if len(counts) > 1 else str(counts[0])
        lines.append(f"{design:<13}{r['median_step_s'] * 1e3:>9.2f}{count_text:>18}"
                     f"{r['max_diff_vs_naive']:>19.2e}{r['max_diff_across_ranks']:>17.2e}")
    naive = results["naive"]
    lines.append(f"{world_size} ranks; parameters with a gradient: {naive['params_with_grad']}; "
                 f"DDP buckets per step: {results['ddp']['calls_per_step']}")
    lines.append("compute_only: no communication (replicas drift apart): the floor, not a design")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    opts = parser.parse_args()
    with process_group(timeout_s=60) as ctx:
        results = run_designs(ctx.rank, ctx.world_size, steps=opts.steps, width=opts.width,
                              depth=opts.depth, batch=opts.batch,
                              bucket_cap_mb=opts.bucket_cap_mb)
        ok = same_weights(results)
        ctx.print0(format_report(results, ctx.world_size))
        ctx.print0(f"RESULT: naive, hooks and DDP end with the same weights: {ok}")
        if ctx.rank == 0 and opts.out:
            summary = {d: {k: v for k, v in r.items() if k != "weights"}
                       for d, r in results.items()}
            opts.out.write_text(json.dumps({"world_size": ctx.world_size, "options": vars(opts)
                                            | {"out": str(opts.out)}, "results": summary,
                                            "same_weights": ok}, indent=1))
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
