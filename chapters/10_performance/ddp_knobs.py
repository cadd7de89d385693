"""Three DDP knobs, counted: ``gradient_as_bucket_view``, ``no_sync`` and ``static_graph``.

    torchrun --standalone --nproc_per_node 2 chapters/10_performance/ddp_knobs.py

Launch test: custom (tests/test_chapter_10_ddp_knobs.py launches it once and reads its output,
instead of a second launch by tests/test_chapter_scripts.py).

Every figure is a count (bytes, calls), the same on every machine:

1. **``gradient_as_bucket_view``**: the reducer keeps one flat buffer per bucket for the
   all-reduce (``Reducer::initialize_buckets``). By default each ``.grad`` is a tensor of its
   own, copied into the bucket before the all-reduce and back after it: the gradient is held
   twice. With ``gradient_as_bucket_view=True`` every ``.grad`` *is* a view into its bucket's
   buffer (same storage), so it is held once. Measured after ``backward()``: the bytes of the
   buckets' buffers (their ``data_ptr`` and size, from the comm hook's ``bucket.buffer()``) and
   the bytes of the ``.grad`` tensors whose memory lies outside every bucket.
2. **``no_sync``** under gradient accumulation of ``ACCUMULATE`` micro-batches: all-reduce calls
   and bytes per optimizer step, counted by the comm hook, with and without ``no_sync()`` around
   every micro-batch but the last: ``ACCUMULATE`` times the buckets without, once with.
3. **``static_graph=True``**: the same buckets, calls and bytes per step as the default (it
   sends nothing less); what it saves is host work — with ``find_unused_parameters=True`` the
   reducer searches the autograd graph for unused parameters every step, with ``static_graph``
   it learns them once in the first iteration — and it makes a graph that reuses parameters
   (reentrant checkpointing) legal. The script counts that the calls and bytes are the same
   from step 1, and that ``find_unused_parameters=True`` on a model that uses every
   parameter sends the same bytes (its buckets, hence its calls, may differ: printed).

Exit 1 if a count contradicts a statement above.
"""

from __future__ import annotations

import sys
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

CAP_MB = 0.5  # two layers per bucket: three buckets
ACCUMULATE = 4


def batch(rank: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(bh.BATCH, bh.WIDTH, generator=g)
    return x, torch.sin(x.roll(1, dims=1))


def gradient_memory(rank: int, world_size: int, as_view: bool) -> dict:
    """Bytes of gradient storage after one backward (step 1, buckets rebuilt): the buckets'
    buffers, and the ``.grad`` bytes outside them."""
    model = DDP(bh.make_net(), bucket_cap_mb=CAP_MB, gradient_as_bucket_view=as_view)
    buffers: dict[int, int] = {}

    def hook(state, bucket):
        buf = bucket.buffer()
        buffers[buf.data_ptr()] = buf.numel() * buf.element_size()
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    x, y = batch(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):  # step 0 has one bucket; count after the rebuild
        buffers.clear()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        opt.step()
    inside = [any(start <= g.data_ptr() < start + size for start, size in buffers.items())
              for g in grads]
    return {"bucket_bytes": sum(buffers.values()),
            "grad_bytes": sum(g.numel() * g.element_size() for g in grads),
            "grad_bytes_outside_buckets": sum(g.numel() * g.element_size()
                                              for g, ok in zip(grads, inside) if not ok),
            "grads_in_buckets": sum(inside), "parameters": len(grads)}


def per_optimizer_step(rank: int, world_size: int, use_no_sync: bool = False,
                       static_graph: bool = False, find_unused: bool = False,
                       optimizer_steps: int = 3) -> dict:
    """All-reduce calls and bytes per optimizer step (each of ``ACCUMULATE`` micro-batches),
    counted by the comm hook (``BucketLog``), and the final weights' checksum."""
    model = DDP(bh.make_net(), bucket_cap_mb=CAP_MB, static_graph=static_graph,
                find_unused_parameters=find_unused)
    log = bh.BucketLog()
    model.register_comm_hook(None, bh.recording(default_hooks.allreduce_hook, log))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with log.counting():
        for step in range(optimizer_steps):
            log.step = step
            opt.zero_grad(set_to_none=True)
            for micro in range(ACCUMULATE):
                x, y = batch(rank, seed=100 * step + micro)
                last = micro == ACCUMULATE - 1
                ctx = model.no_sync() if use_no_sync and not last else _nothing()
                with ctx:
                    (nn.functional.mse_loss(model(x), y) / ACCUMULATE).backward()
            opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"calls": log.counted("calls"), "sent_bytes": log.counted("sent_bytes"),
            "weights": weights.tolist()[:8], "weight_sum": float(weights.double().sum())}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def claims(memory: dict, accumulation: dict, grad_bytes: int) -> list[str]:
    """The docstring's statements these counts contradict (none with torch 2.13)."""
    wrong = []
    default, view = memory[False], memory[True]
    if not (default["bucket_bytes"] == view["bucket_bytes"] == grad_bytes
            and default["grad_bytes_outside_buckets"] == grad_bytes
            and view["grad_bytes_outside_buckets"] == 0
            and view["grads_in_buckets"] == view["parameters"]):
        wrong.append("gradient_as_bucket_view=True holds the gradient once (every .grad a view "
                     "into its bucket), the default twice")
    plain, nosync = accumulation["without no_sync"], accumulation["with no_sync"]
    buckets = plain["calls"][-1] // ACCUMULATE
    if not (buckets >= 2 and plain["calls"][-1] == ACCUMULATE * nosync["calls"][-1]
            and plain["sent_bytes"][-1] == ACCUMULATE * grad_bytes
            and nosync["sent_bytes"][-1] == grad_bytes):
        wrong.append("no_sync: one all-reduce of the gradient per optimizer step instead of "
                     f"{ACCUMULATE}")
    if abs(plain["weight_sum"] - nosync["weight_sum"]) > 1e-3 * max(1.0, abs(plain["weight_sum"])):
        wrong.append("no_sync leaves the update unchanged (up to rounding)")
    static = accumulation["static_graph"]
    if not (static["calls"][1:] == plain["calls"][1:]
            and static["sent_bytes"][1:] == plain["sent_bytes"][1:]):
        wrong.append("static_graph sends the same calls and bytes per step")
    if accumulation["find_unused_parameters"]["sent_bytes"] != plain["sent_bytes"]:
        wrong.append("find_unused_parameters (all parameters used) sends the same bytes per step")
    return wrong


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        memory = {v: gradient_memory(ctx.rank, ctx.world_size, v) for v in (False, True)}
        accumulation = {
            "without no_sync": per_optimizer_step(ctx.rank, ctx.world_size),
            "with no_sync": per_optimizer_step(ctx.rank, ctx.world_size, use_no_sync=True),
            "static_graph": per_optimizer_step(ctx.rank, ctx.world_size, static_graph=True),
            "find_unused_parameters": per_optimizer_step(ctx.rank, ctx.world_size,
                                                         find_unused=True),
        }
        grad = bh.gradient_bytes(bh.make_net())
        wrong = claims(memory, accumulation, grad)
        p = ctx.print0
        p(f"gradient: {grad} bytes; bucket_cap_mb={CAP_MB}")
        for as_view, m in memory.items():
            p(f"gradient_as_bucket_view={as_view}: buckets {m['bucket_bytes']} bytes + .grad "
              f"outside them {m['grad_bytes_outside_buckets']} bytes = "
              f"{m['bucket_bytes'] + m['grad_bytes_outside_buckets']} bytes of gradient "
              f"storage ({m['grads_in_buckets']}/{m['parameters']} .grad are bucket views)")
        saved = memory[False]["grad_bytes_outside_buckets"] - memory[True][
            "grad_bytes_outside_buckets"]
        p(f"saved by gradient_as_bucket_view: {saved} bytes (one copy of the gradient)")
        p(f"per optimizer step, {ACCUMULATE} micro-batches: all-reduce calls / bytes (steps 0..)")
        for name, found in accumulation.items():
            p(f"  {name:<24} calls {found['calls']}, bytes {found['sent_bytes']}")
        p(f"final weight sum: without no_sync {accumulation['without no_sync']['weight_sum']:.6f}, "
          f"with no_sync {accumulation['with no_sync']['weight_sum']:.6f}")
        code = report_checks(wrong, echo=p, label="claims of the docstring")
        dist.barrier()
    return code


if __name__ == "__main__":
    sys.exit(main())
