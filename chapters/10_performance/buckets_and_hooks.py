"""DDP's buckets and communication hooks, counted: all-reduce calls and bytes per step, per bucket.

    torchrun --standalone --nproc_per_node 2 chapters/10_performance/buckets_and_hooks.py

Launch test: custom (tests/test_chapter_10_buckets_and_hooks.py launches it once and reads its
tables, instead of a second launch by tests/test_chapter_scripts.py).

Every figure printed is a count (calls, bytes, buckets), the same on every machine and run:

1. **Buckets, step by step** (``bucket_cap_mb`` left out, then given): a model of six 256x256
   linear layers (1.58 MB of fp32 gradient) in DDP. Step 0 all-reduces *one* bucket holding every
   gradient: ``DistributedDataParallel._ddp_init_helper`` builds the first buckets with the cap
   ``sys.maxsize`` unless ``find_unused_parameters`` or ``bucket_cap_mb_list`` is given
   (``_BucketCapacityConfig.compute_bucket_size_limits`` in torch/nn/parallel/distributed.py),
   because the registration order of the parameters need not be the order of their gradients.
   Before step 1's forward, ``Reducer._rebuild_buckets`` regroups them in the order step 0's
   gradients became ready, with the caps ``[first, cap]``: left at its default (25 MiB), the
   first bucket's cap is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), so the last layers'
   gradients are sent early; ``bucket_cap_mb`` given explicitly — even 25 — makes the first cap
   the same as the others (``_BucketCapacityConfig.create``). So count from step 1.
2. **A ``bucket_cap_mb`` sweep**: buckets and all-reduce calls per step, from 50 KiB to 25 MiB. A
   bucket never splits a tensor: a cap below one layer's gradient gives one bucket per layer.
3. **Communication hooks** (``torch.distributed.algorithms.ddp_comm_hooks``): bytes the hook hands
   to the backend per step: ``allreduce_hook`` (the default's bytes), ``fp16_compress_hook`` (half),
   a bf16 hook of our own (half: ``DistributedDataParallel._check_comm_hook`` refuses to
   register a hook *named* ``bf16_compress_hook`` unless torch was built with CUDA and NCCL 2.10+,
   so a CPU build refuses it even on gloo), and PowerSGD of rank 1
   (two small all-reduces per bucket for the P and Q factors; the first
   ``start_powerSGD_iter`` steps are plain all-reduces). PowerSGD runs here with one bucket only
   and a process-group timeout of its own: with several buckets on gloo it hung or failed with
   a size mismatch in measured runs (torch 2.13, CPU).

The buckets come from the hook itself (``bucket.index()``, ``bucket.buffer()``,
``bucket.parameters()``); calls and bytes from a wrapper around ``torch.distributed.all_reduce``,
which every hook here calls (``BucketLog.counting``). Rank 0 prints the tables.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.dist_env import process_group
from ddpcourse.report import report_checks

LAYERS, WIDTH, BATCH = 6, 256, 32
SWEEP_CAPS_MB = (0.05, 0.25, 1.0, 4.0, 25.0)


def make_net(seed: int = 0, layers: int = LAYERS, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks[:-1])


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bf16_allreduce_hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket):
    """Compress the bucket to bfloat16, all-reduce the average, decompress into the bucket."""
    buffer = bucket.buffer()
    world = dist.get_world_size(group)
    compressed = buffer.to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


class BucketLog:
    """What a recording hook saw: one entry per bucket per step, and the all-reduces called
    (``calls``, ``sent_bytes``: step -> count) while :meth:`counting` was active."""

    def __init__(self):
        self.step = 0
        self.entries: list[dict] = []
        self.calls: dict[int, int] = {}
        self.sent_bytes: dict[int, int] = {}
        self._lock = threading.Lock()

    def per_step(self, key: str) -> list[list]:
        steps = sorted({e["step"] for e in self.entries})
        return [[e[key] for e in self.entries if e["step"] == s] for s in steps]

    @contextmanager
    def counting(self):
        """Count every ``torch.distributed.all_reduce`` call and its bytes, whichever thread
        makes it: the hooks of ``ddp_comm_hooks`` call it as ``dist.all_reduce``, PowerSGD
        from the callbacks of earlier all-reduces' futures (gloo's threads, which a dispatcher
        mode entered on this thread would not see). The step is the one running: DDP waits for
        every bucket before ``backward`` returns."""
        original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            with self._lock:
                self.calls[self.step] = self.calls.get(self.step, 0) + 1
                self.sent_bytes[self.step] = (self.sent_bytes.get(self.step, 0)
                                              + tensor.numel() * tensor.element_size())
            return original(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        try:
            yield self
        finally:
            dist.all_reduce = original

    def counted(self, key: str) -> list[int]:
        table = getattr(self, key)
        return [table.get(step, 0) for step in range(max(table, default=-1) + 1)]


def recording(inner, log: BucketLog):
    """A comm hook that runs ``inner`` and records, for each bucket: its index, bytes, number of
    parameters, and when it was launched and done (``time.perf_counter``, for a timeline)."""
    def hook(state, bucket):
        entry = {"step": log.step, "index": bucket.index(),
                 "bytes": bucket.buffer().numel() * bucket.buffer().element_size(),
                 "parameters": len(bucket.parameters()), "launched": time.perf_counter()}
        log.entries.append(entry)

        def done(fut):
            entry["done"] = time.perf_counter()
            return fut.value()

        return inner(state, bucket).then(done)

    return hook


def train(model: DDP, log: BucketLog, steps: int, seed: int = 1) -> list[float]:
    """``steps`` SGD steps on a fixed regression batch per rank; the losses."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.sin(x.roll(1, dims=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with log.counting():
        for step in range(steps):
            log.step = step
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def buckets_by_step(rank: int, world_size: int, cap_mb: float | None, steps: int = 3) -> dict:
    """Bytes of each bucket, step by step, with ``bucket_cap_mb`` left out (``None``) or given."""
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    model = DDP(make_net(), **kwargs)
    log = BucketLog()
    model.register_comm_hook(None, recording(default_hooks.allreduce_hook, log))
    train(model, log, steps)
    by_index = [sorted(zip(idx, size)) for idx, size in
                zip(log.per_step("index"), log.per_step("bytes"))]
    logged = model._get_ddp_logging_data()  # private: shown beside the hook's counts only
    return {"bucket_bytes": [[b for _, b in step] for step in by_index],
            "calls": log.counted("calls"), "sent_bytes": log.counted("sent_bytes"),
            "logged_bucket_sizes": logged.get("bucket_sizes"),
            "gradient_bytes": gradient_bytes(model.module)}


HOOKS = ("allreduce_hook", "fp16_compress_hook", "own bf16 hook", "PowerSGD rank 1")


def with_hook(rank: int, world_size: int, name: str, steps: int = 4) -> dict:
    """Counted bytes per step and the losses of a run with the hook ``name`` (one bucket: the cap
    is larger than the model, so PowerSGD's bucket is safe on gloo)."""
    group = dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=60))
    model = DDP(make_net(), bucket_cap_mb=25, process_group=group)
    log = BucketLog()
    if name == "allreduce_hook":
        state, inner = group, default_hooks.allreduce_hook
    elif name == "fp16_compress_hook":
        state, inner = group, default_hooks.fp16_compress_hook
    elif name == "own bf16 hook":
        state, inner = group, bf16_allreduce_hook
    else:
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5,
                                       use_error_feedback=True, warm_start=True)
        inner = powersgd.powerSGD_hook
    model.register_comm_hook(state, recording(inner, log))
    losses = train(model, log, steps)
    dist.barrier(group)
    dist.destroy_process_group(group)
    return {"sent_bytes": log.counted("sent_bytes"), "calls": log.counted("calls"),
            "losses": losses,
            "gradient_bytes": gradient_bytes(model.module)}


def bf16_builtin_refusal(rank: int, world_size: int) -> str:
    """What registering ``bf16_compress_hook`` says: ``DistributedDataParallel._check_comm_hook``
    refuses a hook *named* ``bf16_compress_hook`` unless torch was built with CUDA and NCCL 2.10+
    (or XPU and XCCL), whatever the backend: a CPU build refuses it even on gloo, where the same
    code under another name (``bf16_allreduce_hook`` above) runs."""
    model = DDP(make_net(), bucket_cap_mb=25)
    try:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except TypeError as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return "accepted (this torch build has CUDA and NCCL 2.10+)"


def claims(default: dict, explicit: dict, sweep: dict, hooks: dict) -> list[str]:
    """The statements of the module docstring that these counts contradict (none, as measured
    with torch 2.13): every run of the script checks them."""
    wrong = []
    grad = default["gradient_bytes"]
    if not (default["bucket_bytes"][0] == [grad] and explicit["bucket_bytes"][0] == [grad]):
        wrong.append("step 0 all-reduces one bucket holding every gradient")
    first = default["bucket_bytes"][1][0]
    if not (len(default["bucket_bytes"][1]) > 1 and first >= dist._DEFAULT_FIRST_BUCKET_BYTES
            and first - WIDTH * (WIDTH + 1) * 4 < dist._DEFAULT_FIRST_BUCKET_BYTES):
        wrong.append("from step 1, the default's first bucket closes at 1 MiB")
    if explicit["bucket_bytes"][1] != [grad]:
        wrong.append("an explicit bucket_cap_mb=25 leaves no small first bucket")
    if any(sum(sizes) != grad for sizes in default["bucket_bytes"] + explicit["bucket_bytes"]):
        wrong.append("every step all-reduces each gradient byte once")
    if len(sweep[min(sweep)]["bucket_bytes"][2]) != LAYERS:
        wrong.append("a cap below one layer gives one bucket per layer (never a split tensor)")
    calls = [sweep[cap]["calls"][2] for cap in sorted(sweep)]
    if calls != sorted(calls, reverse=True):
        wrong.append("a larger cap never makes more all-reduce calls")
    sent = {name: found["sent_bytes"][-1] for name, found in hooks.items()}
    if not (sent["fp16_compress_hook"] * 2 == sent["own bf16 hook"] * 2 == grad
            == sent["allreduce_hook"]):
        wrong.append("fp16 and bf16 compression halve the bytes")
    if not sent["PowerSGD rank 1"] < grad / 50:
        wrong.append("PowerSGD of rank 1 sends under 2% of the gradient here")
    return wrong


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        print0 = ctx.print0
        default = buckets_by_step(ctx.rank, ctx.world_size, None)
        explicit = buckets_by_step(ctx.rank, ctx.world_size, 25)
        print0(f"gradient: {default['gradient_bytes']} bytes in {2 * LAYERS} tensors")
        for label, found in (("bucket_cap_mb left out", default), ("bucket_cap_mb=25", explicit)):
            print0(f"{label}: bytes per bucket (by index), step by step")
            for step, sizes in enumerate(found["bucket_bytes"]):
                print0(f"  step {step}: {sizes}  ({found['calls'][step]} all-reduce calls, "
                       f"{found['sent_bytes'][step]} bytes)")
            print0(f"  _get_ddp_logging_data()['bucket_sizes'] (private; the buckets DDP was "
                   f"built with, not the rebuilt ones): {found['logged_bucket_sizes']}")
        print0("bucket_cap_mb sweep (step 2): buckets, all-reduce calls and bytes per step")
        sweep = {cap: buckets_by_step(ctx.rank, ctx.world_size, cap) for cap in SWEEP_CAPS_MB}
        for cap, found in sweep.items():
            print0(f"  {cap:>6} MiB: {len(found['bucket_bytes'][2]):>3} buckets, "
                   f"{found['calls'][2]:>3} calls, {found['sent_bytes'][2]} bytes")
        print0("communication hooks: bytes handed to the backend per step (steps 0-3)")
        hooks = {name: with_hook(ctx.rank, ctx.world_size, name) for name in HOOKS}
        for name, found in hooks.items():
            ratio = found["sent_bytes"][-1] / found["gradient_bytes"]
            print0(f"  {name:<20} {found['sent_bytes']} ({ratio:.4f} of the gradient at step 3,"
                   f" {found['calls'][-1]} calls); final loss {found['losses'][-1]:.5f}")
        print0(f"bf16_compress_hook: {bf16_builtin_refusal(ctx.rank, ctx.world_size)}")
        wrong = claims(default, explicit, sweep, hooks)
        code = report_checks(wrong, echo=print0, label="claims of the docstring")
        dist.barrier()
    return code


if __name__ == "__main__":
    sys.exit(main())
