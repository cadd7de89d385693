"""Measurements behind chapter 02 (DataParallel vs DDP vs FSDP), shared by its notebook,
its scripts and its tests.

Four groups of functions:

* DataParallel's per-iteration mechanism, done by hand on the CPU (``dp_step_emulated``,
  ``dp_mechanism_cost``): with no GPU ``nn.DataParallel`` just calls the module, so we do
  explicitly what it does on GPUs every iteration - scatter, replicate, apply, gather, and the
  backward that sums every replica's gradient onto device 0 - count what each phase copies
  and time it (fastest and median of several repeats; ``live_timings`` hands them to
  ``ddpcourse.timing.judge``, which says when the machine was too loaded to read the times).
* What the collectives of each scheme put on the wire per step, computed (``link_bytes_per_step``).
* DDP's mechanism and cost, as rank functions for ``run_ranks`` or torchrun
  (``ddp_costs``, ``ddp_broadcast_at_construction``, ``ddp_buffer_sync``, ``ddp_bucket_sizes``,
  ``ddp_event_log``).
* What each rank holds in memory under DDP and FSDP2 ``fully_shard`` after one Adam step,
  counted tensor by tensor (``ddp_memory``, ``fsdp_memory``, ``memory_per_rank``).

``gpu_dataparallel_report`` runs the real ``nn.DataParallel`` when there are >= 2 GPUs.
Line numbers in ``SOURCE`` are those of PyTorch v2.13.0, the version this chapter was checked
against (tests/test_chapter_02_dp_ddp_fsdp.py re-reads the cited lines).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse import timing
from ddpcourse.memory_calculator import tensor_bytes

TORCH_TAG = "v2.13.0"
_GITHUB = f"https://github.com/pytorch/pytorch/blob/{TORCH_TAG}/"

# (path in the pytorch repository, first line, last line) of the code each lesson step cites.
SOURCE = {
    "dp_init_no_device": ("torch/nn/parallel/data_parallel.py", 145, 149),
    "dp_forward": ("torch/nn/parallel/data_parallel.py", 172, 197),
    "dp_forward_no_device": ("torch/nn/parallel/data_parallel.py", 174, 175),
    "scatter_function": ("torch/nn/parallel/_functions.py", 126, 155),
    "ddp_faster_than_dp": ("torch/nn/parallel/distributed.py", 483, 485),
    "replicate": ("torch/nn/parallel/replicate.py", 118, 162),
    "broadcast_backward": ("torch/nn/parallel/_functions.py", 10, 79),
    "parallel_apply_threads": ("torch/nn/parallel/parallel_apply.py", 123, 136),
    "scatter": ("torch/nn/parallel/scatter_gather.py", 49, 57),
    "gather": ("torch/nn/parallel/scatter_gather.py", 110, 130),
    "ddp_bucket_default": ("torch/nn/parallel/distributed.py", 31, 33),
    "ddp_first_iteration_one_bucket": ("torch/nn/parallel/distributed.py", 150, 154),
    "ddp_broadcast_at_init": ("torch/nn/parallel/distributed.py", 1062, 1073),
    "sync_module_states": ("torch/distributed/utils.py", 289, 328),
    "ddp_reducer": ("torch/nn/parallel/distributed.py", 1437, 1449),
    "ddp_gradient_as_bucket_view": ("torch/nn/parallel/distributed.py", 731, 735),
    "fsdp_all_gather": ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 111, 124),
    "fsdp_reduce_scatter": ("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 175, 190),
    # DataParallel's copies: replicate broadcasts the parameters with the autograd function
    # Broadcast, whose forward is comm.broadcast_coalesced and whose backward is one
    # ReduceAddCoalesced over all parameters, i.e. comm.reduce_add -> NCCL reduce on CUDA.
    "dp_replicate_every_forward": ("torch/nn/parallel/data_parallel.py", 195, 197),
    "replicate_broadcast_params": ("torch/nn/parallel/replicate.py", 136, 136),
    "replicate_broadcast_apply": ("torch/nn/parallel/replicate.py", 107, 108),
    "broadcast_forward_coalesced": ("torch/nn/parallel/_functions.py", 24, 24),
    "broadcast_backward_reduce": ("torch/nn/parallel/_functions.py", 38, 44),
    "comm_broadcast_coalesced": ("torch/nn/parallel/comm.py", 50, 67),
    "comm_reduce_add_nccl": ("torch/nn/parallel/comm.py", 109, 111),
    # DDP's buffers: broadcast from rank 0 at the start of a forward whose previous forward ran
    # with gradients enabled outside no_sync (require_forward_param_sync), by default.
    "ddp_forward_sync_buffers_default": ("torch/nn/parallel/distributed.py", 982, 990),
    "ddp_pre_forward_sync_buffers": ("torch/nn/parallel/distributed.py", 1781, 1782),
    "ddp_forward_param_sync_flag": ("torch/nn/parallel/distributed.py", 1828, 1841),
    "ddp_will_sync_module_buffers": ("torch/nn/parallel/distributed.py", 2382, 2387),
    "ddp_sync_buffers_from_rank_0": ("torch/nn/parallel/distributed.py", 2405, 2425),
    # DDP's small first bucket: only when bucket_cap_mb is left at its default.
    "ddp_first_bucket_only_default": ("torch/nn/parallel/distributed.py", 106, 110),
    "ddp_reducer_first_bucket_cap": ("torch/nn/parallel/distributed.py", 1452, 1454),
}


def source_link(name: str) -> str:
    """GitHub link, with line range, to the PyTorch code that ``SOURCE[name]`` names."""
    path, first, last = SOURCE[name]
    return f"{_GITHUB}{path}#L{first}-L{last}"


# ----------------------------------------------------------------------------------- models


def make_mlp(width: int, depth: int = 4, out_features: int | None = None, seed: int = 0
             ) -> nn.Sequential:
    """``depth`` Linear(width, width) layers with tanh, then an optional Linear(width, out)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    if out_features is not None:
        layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)




def param_bytes(module: nn.Module) -> int:
    return tensor_bytes(module.parameters())


def _samples(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _row_label(row: dict) -> str:
    label = f"{row['param_bytes'] / 1e6:.2f} MB"
    return label + (f", batch {row['batch']}" if "batch" in row else "")


def live_timings(rows: list[dict], series, prefix: str = "",
                 floor_s: float = 1e-3) -> dict[str, timing.Timing]:
    """Each timed ``series`` of each row (its repeats, ``row["samples"][name]``) as a
    ``ddpcourse.timing.Timing``, named for ``timing.judge``'s reasons. Series whose fastest run
    is under ``floor_s`` are left out: at tens of microseconds the timer and the scheduler's
    jitter alone move the median, whatever else the machine does."""
    return {f"{prefix}{name} ({_row_label(row)})": timing.Timing.of(row["samples"][name])
            for row in rows for name in series if min(row["samples"][name]) >= floor_s}


# ------------------------------------------------------- DataParallel, done by hand on CPU


def replicate_on_cpu(network: nn.Module, copies: int) -> list[nn.Module]:
    """What ``torch.nn.parallel.replicate`` builds, with CPU tensors: ``copies`` module trees
    whose parameters are differentiable copies of ``network``'s.

    As in replicate.py: one shell per module (``_replicate_for_data_parallel``), children wired
    to the shells, each parameter set as a non-leaf copy, so backward adds every replica's
    gradient into the original parameter (what DP's ``Broadcast.backward`` does onto device 0).
    """
    modules = list(network.modules())
    index = {m: i for i, m in enumerate(modules)}
    replicas = []
    for _ in range(copies):
        shells = [m._replicate_for_data_parallel() for m in modules]
        for module, shell in zip(modules, shells):
            for key, child in module._modules.items():
                shell._modules[key] = None if child is None else shells[index[child]]
            for key, param in module._parameters.items():
                if param is not None:
                    setattr(shell, key, param.clone())
            for key, buf in module._buffers.items():
                if buf is not None:
                    shell._buffers[key] = buf.clone()
        replicas.append(shells[0])
    return replicas


def dp_step_emulated(module: nn.Module, x: torch.Tensor, y: torch.Tensor, n_devices: int = 2,
                     timings: dict | None = None) -> torch.Tensor:
    """One DataParallel training iteration on the CPU, phase by phase, as DP does it on GPUs.

    1. scatter: split the batch; device 0 keeps its chunk, every other device gets a copy.
    2. replicate: build a replica for devices 1..n-1 (``replicate_on_cpu``); device 0 runs the
       module itself (DP's replica on device 0 shares storage with the module).
    3. parallel_apply: run each replica on its chunk, one new Python thread per replica.
    4. gather: concatenate the outputs on device 0, where the loss is computed.
    5. backward: gradients flow back through gather and every replica into the module's
       ``.grad`` - the only gradients that persist, and only on device 0.

    Returns the loss; adds each phase's seconds to ``timings`` if given.
    """
    clock = [time.perf_counter()]

    def lap(name):
        now = time.perf_counter()
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + now - clock[0]
        clock[0] = now

    chunks = list(x.chunk(n_devices))
    chunks = [chunks[0]] + [c.clone() for c in chunks[1:]]
    lap("scatter_s")

    replicas = [module] + replicate_on_cpu(module, len(chunks) - 1)
    lap("replicate_s")

    outputs: list[torch.Tensor | None] = [None] * len(chunks)

    def work(i):
        outputs[i] = replicas[i](chunks[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(chunks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lap("apply_s")

    out = torch.cat(outputs)
    lap("gather_s")

    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    lap("backward_s")
    return loss.detach()


def dp_emulation_gradient_error(width: int = 32, depth: int = 2, n_devices: int = 2,
                                batch: int = 16, seed: int = 0) -> float:
    """Max |grad| difference between the by-hand DP step and one process on the full batch.

    ~1e-8 (float32 rounding) shows the emulation computes what DataParallel computes.
    """
    torch.manual_seed(seed + 1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    single, replicated = make_mlp(width, depth, seed=seed), make_mlp(width, depth, seed=seed)
    nn.functional.mse_loss(single(x), y).backward()
    dp_step_emulated(replicated, x, y, n_devices)
    return max((a.grad - b.grad).abs().max().item()
               for a, b in zip(single.parameters(), replicated.parameters()))


def dp_mechanism_cost(width: int, depth: int = 4, n_devices: int = 2, batch: int = 32,
                      repeats: int = 7, seed: int = 0) -> dict:
    """What one DP iteration copies (counted) and how long each phase takes (timed), for an MLP.

    Counted, the same on every machine: the parameter bytes copied into the replicas of
    devices 1..n-1 (``replica_bytes``), the module shells built for them
    (``modules_replicated``), and the input and output bytes that scatter and gather move
    between device 0 and the others (``scatter_bytes``, ``gather_bytes``).
    Timed: each phase's fastest (``<phase>_s``) and median (``<phase>_median_s``) over
    ``repeats`` iterations, and the same for the whole iteration (``step_s``,
    ``step_median_s``); every repeat in ``samples[<phase>]``.
    """
    model = make_mlp(width, depth, seed=seed)
    torch.manual_seed(seed + 1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    phases = ["scatter_s", "replicate_s", "apply_s", "gather_s", "backward_s"]
    samples: dict[str, list[float]] = {p: [] for p in phases + ["step_s"]}
    # One core per emulated device: with several intra-op threads per replica thread, the
    # replicas' OpenMP threads oversubscribe the cores and the timings turn to noise.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dp_step_emulated(model, x, y, n_devices)  # warm-up
        for _ in range(repeats):
            timings: dict[str, float] = {}
            model.zero_grad(set_to_none=True)
            dp_step_emulated(model, x, y, n_devices, timings)
            for p in phases:
                samples[p].append(timings[p])
            samples["step_s"].append(sum(timings[p] for p in phases))
    finally:
        torch.set_num_threads(threads)
    nbytes = param_bytes(model)
    chunks = x.chunk(n_devices)
    others = sum(c.numel() * c.element_size() for c in chunks[1:])
    result = {"width": width, "depth": depth, "n_devices": n_devices, "batch": batch,
              "param_bytes": nbytes, "params": sum(p.numel() for p in model.parameters()),
              "modules": len(list(model.modules())),
              "replica_bytes": (n_devices - 1) * nbytes,
              "modules_replicated": (n_devices - 1) * len(list(model.modules())),
              # the MLP's output has the input's shape: gather brings back what scatter sent
              "scatter_bytes": others, "gather_bytes": others}
    for key, values in samples.items():
        result[key] = min(values)
        result[key[:-len("_s")] + "_median_s"] = statistics.median(values)
    result["samples"] = {key[:-len("_s")]: values for key, values in samples.items()}
    return result


def link_bytes_per_step(n_devices: int, param_bytes: int) -> dict[str, float]:
    """Bus bytes per training step for ``param_bytes`` of parameters: for each collective,
    its size times nccl-tests' bus-bandwidth factor, so that its time on the wire is about
    bus bytes / link bandwidth; summed over the step. The same count for every scheme.

    * ``dp_nccl``: DataParallel on a CUDA build. Replicate's ``Broadcast`` goes through
      ``comm.broadcast_coalesced`` -> NCCL broadcast, its backward ``ReduceAddCoalesced``
      through ``comm.reduce_add`` -> NCCL reduce; nccl-tests' factor is 1 for both: P + P.
    * ``dp_copies``: the fallback without NCCL: device 0 copies P to each of the n-1 others,
      and receives n-1 gradient copies: 2 (n-1) P through device 0's link.
    * ``ddp``: DDP's ring all-reduce of the gradients, factor 2 (n-1)/n.

    DP's input scatter and output gather, and the buffers either scheme broadcasts, come on
    top; they do not depend on the parameter count.
    """
    n, p = n_devices, param_bytes
    return {"dp_nccl": 2.0 * p, "dp_copies": 2.0 * (n - 1) * p, "ddp": 2.0 * (n - 1) / n * p}


def dp_device_bytes(width: int, depth: int = 4, n_devices: int = 2, batch: int = 32,
                    optimizer_states: int = 2) -> list[dict]:
    """Bytes each device holds under DataParallel, from the byte counts of the by-hand step.

    Persistent: the module's parameters, gradients and optimizer state live on device 0 only
    (the replicas are rebuilt every iteration). Per iteration: every device holds one replica
    and its chunk's activations; device 0 also holds the gathered outputs of the whole batch.
    This is an accounting of where tensors live, not an allocator reading: the GPU cell of the
    notebook measures the real thing with ``torch.cuda.max_memory_allocated``.
    """
    model = make_mlp(width, depth)
    p = param_bytes(model)
    out_bytes = batch * width * 4
    rows = []
    for d in range(n_devices):
        rows.append({
            "device": d,
            "params": p,  # device 0: the module itself; others: this iteration's replica
            "grads": p if d == 0 else 0,
            "optimizer_state": optimizer_states * p if d == 0 else 0,
            "gathered_outputs": out_bytes if d == 0 else 0,
        })
    return rows


# ----------------------------------------------------------------- DDP (rank functions)


def from_every_rank(value) -> list:
    """Every rank's ``value``, indexed by rank, on every rank (``all_gather_object``)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _ddp(module, **kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(module, **kwargs)


def ddp_broadcast_at_construction(rank: int, world_size: int) -> dict:
    """Each rank builds its model with a different seed; DDP's constructor makes them equal."""
    model = make_mlp(16, 2, seed=100 + rank)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).sum().item()
    _ddp(model)
    after = torch.cat([p.detach().flatten() for p in model.parameters()]).sum().item()
    return {"rank": rank, "checksum_before": before, "checksum_after": after}


def _buffer_sync_kwargs(sync: bool) -> dict:
    """DDP's switch for broadcasting buffers in forward: ``forward_sync_buffers`` since torch
    2.13 (default None, meaning True), ``broadcast_buffers`` (default True) before it."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    name = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
            else "broadcast_buffers")
    return {name: sync}


def ddp_buffer_sync(rank: int, world_size: int, forward_sync_buffers: bool | None = None,
                    steps: int = 2) -> dict:
    """BatchNorm's running mean on each rank, around DDP's buffer broadcast.

    Every rank trains the same Linear + BatchNorm1d on its own data (mean 3 x rank), ``steps``
    SGD steps. Recorded per step: ``inside`` - the running mean as BatchNorm sees it when the
    forward reaches it, i.e. after whatever DDP did at the start of the forward; ``after`` -
    the running mean after the step (BatchNorm updated it from this rank's batch).
    ``forward_sync_buffers=None`` leaves DDP's default.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    bn = model[1]
    inside: list[list[float]] = []
    bn.register_forward_pre_hook(lambda module, args: inside.append(module.running_mean.tolist()))
    kwargs = {} if forward_sync_buffers is None else _buffer_sync_kwargs(forward_sync_buffers)
    ddp = _ddp(model, **kwargs)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    after: list[list[float]] = []
    for _ in range(steps):
        x = torch.randn(16, 4) + 3.0 * rank
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()
        after.append(bn.running_mean.tolist())
    params = torch.cat([q.detach().flatten() for q in model.parameters()])
    return {"rank": rank, "inside": inside, "after": after, "params": params.tolist(),
            "forward_sync_buffers": getattr(ddp, "forward_sync_buffers", None)}


def ddp_buffer_sync_both(rank: int, world_size: int, steps: int = 2) -> dict:
    """``ddp_buffer_sync`` with DDP's default, then with the forward broadcast turned off."""
    return {"default": ddp_buffer_sync(rank, world_size, None, steps),
            "off": ddp_buffer_sync(rank, world_size, False, steps)}


def _recording_allreduce_hook(state: list, bucket):
    """A DDP comm hook that records each bucket's buffer, then all-reduces it (averaging)."""
    buf = bucket.buffer()
    state.append({"index": bucket.index(), "bytes": buf.numel() * buf.element_size(),
                  "storage": buf.untyped_storage().data_ptr(), "t": time.perf_counter()})
    fut = dist.all_reduce(buf, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def ddp_bucket_sizes(rank: int, world_size: int, bucket_cap_mb: float | None = None,
                     width: int = 512, depth: int = 12, iterations: int = 3) -> list[list[int]]:
    """Bytes of every bucket DDP all-reduces, per iteration, read from the buckets themselves."""
    model = make_mlp(width, depth, seed=rank)
    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = _ddp(model, **kwargs)
    seen: list[dict] = []
    ddp.register_comm_hook(seen, _recording_allreduce_hook)
    sizes = []
    for _ in range(iterations):
        seen.clear()
        ddp(torch.randn(4, width)).sum().backward()
        sizes.append([b["bytes"] for b in seen])
    return sizes


def ddp_bucket_sizes_by_cap(rank: int, world_size: int, caps, width: int = 512,
                            depth: int = 12, iterations: int = 3) -> dict:
    """``ddp_bucket_sizes`` for each ``bucket_cap_mb`` in ``caps`` (None: left at its default)."""
    return {cap: ddp_bucket_sizes(rank, world_size, cap, width, depth, iterations) for cap in caps}


def ddp_event_log(rank: int, world_size: int, bucket_cap_mb: float = 1.0, width: int = 512,
                  depth: int = 8) -> list[tuple[float, str]]:
    """When each layer's gradient is ready and when each bucket's all-reduce is launched,
    during the second backward (after DDP rebuilt its buckets in backward order)."""
    model = make_mlp(width, depth, seed=rank)
    ddp = _ddp(model, bucket_cap_mb=bucket_cap_mb)
    buckets: list[dict] = []
    ddp.register_comm_hook(buckets, _recording_allreduce_hook)
    grads: list[tuple[float, str]] = []
    linears = [m for m in model if isinstance(m, nn.Linear)]
    for i, layer in enumerate(linears):
        layer.weight.register_post_accumulate_grad_hook(
            lambda p, i=i: grads.append((time.perf_counter(), f"grad ready: layer {i} weight")))
    x = torch.randn(64, width)
    ddp(x).sum().backward()  # iteration 1: one bucket; DDP records the order grads arrive
    buckets.clear()
    grads.clear()
    start = time.perf_counter()
    ddp(x).sum().backward()
    end = time.perf_counter()
    events = grads + [(b["t"], f"all-reduce launched: bucket {b['index']} "
                               f"({b['bytes'] / 2**20:.2f} MiB)") for b in buckets]
    events.append((end, "backward() returned"))
    return [(round((t - start) * 1e3, 2), what) for t, what in sorted(events)]


def ddp_costs(rank: int, world_size: int, widths, depth: int = 4, batch: int = 16,
              repeats: int = 3, device: str = "cpu") -> list[dict]:
    """Per model width: DDP construction time (once per run) and per-step exposed gradient
    all-reduce time (forward+backward with sync minus the same under ``no_sync``), each as
    fastest (``*_s``) and median (``*_median_s``) of ``repeats``, every repeat in
    ``samples``."""
    _ddp(make_mlp(8, 1).to(device))  # the first DDP in a process pays one-off set-up costs
    rows = []
    for width in widths:
        model = make_mlp(width, depth, seed=rank).to(device)

        def construct():
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            built = _ddp(model)
            _sync(device)
            return built, time.perf_counter() - start

        construct_times = [construct()[1] for _ in range(repeats)]
        ddp, _ = construct()
        x = torch.randn(batch, width, device=device)
        y = torch.randn(batch, width, device=device)

        def step(sync: bool):
            with nullcontext() if sync else ddp.no_sync():
                nn.functional.mse_loss(ddp(x), y).backward()

        step(True)
        step(True)  # the second iteration runs with the rebuilt buckets

        with_sync, without_sync = [], []
        for _ in range(repeats):  # interleaved, so a noisy moment hits both kinds of step
            for sync, times in ((True, with_sync), (False, without_sync)):
                dist.barrier()
                start = time.perf_counter()
                step(sync)
                _sync(device)
                times.append(time.perf_counter() - start)
        median = statistics.median
        rows.append({"width": width, "param_bytes": param_bytes(model),
                     "construct_s": min(construct_times),
                     "construct_median_s": median(construct_times),
                     "step_sync_s": min(with_sync), "step_sync_median_s": median(with_sync),
                     "step_nosync_s": min(without_sync),
                     "step_nosync_median_s": median(without_sync),
                     "allreduce_s": max(min(with_sync) - min(without_sync), 0.0),
                     "allreduce_median_s": max(median(with_sync) - median(without_sync), 0.0),
                     "samples": {"construct": construct_times, "step_sync": with_sync,
                                 "step_nosync": without_sync}})
        del ddp
    return rows


# ------------------------------------------------------------- memory held by each rank


def _adam_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(bytes of exp_avg + exp_avg_sq, bytes of the per-parameter ``step`` counters)."""
    moments = steps = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            n = tensor_bytes([value])
            if key == "step":
                steps += n
            else:
                moments += n
    return moments, steps


def _memory_model(width: int, depth: int, out_features: int) -> nn.Sequential:
    return make_mlp(width, depth, out_features=out_features, seed=0)


def ddp_memory(rank: int, world_size: int, width: int = 256, depth: int = 8,
               out_features: int = 5, gradient_as_bucket_view: bool = False,
               device: str = "cpu") -> dict:
    """Bytes this rank holds under DDP after one Adam step, counted tensor by tensor."""
    model = _memory_model(width, depth, out_features).to(device)
    ddp = _ddp(model, gradient_as_bucket_view=gradient_as_bucket_view)
    buckets: list[dict] = []
    ddp.register_comm_hook(buckets, _recording_allreduce_hook)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    x = torch.randn(8, width, device=device)
    nn.functional.mse_loss(ddp(x), torch.zeros(8, out_features, device=device)).backward()
    optimizer.step()
    moments, steps = _adam_state_bytes(optimizer)
    grad_storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    bucket_storages = {b["storage"] for b in buckets}
    separate = not (grad_storages & bucket_storages)
    bucket_bytes = sum(b["bytes"] for b in buckets)
    return {
        "rank": rank, "scheme": "DDP", "full_param_bytes": param_bytes(model),
        "params": param_bytes(model),
        "grads": tensor_bytes(p.grad for p in model.parameters()),
        "optim_moments": moments, "optim_steps": steps,
        "buckets": bucket_bytes if separate else 0,
        "bucket_buffer_bytes": bucket_bytes, "grads_are_bucket_views": not separate,
        "allreduce_bytes": bucket_bytes,
    }


def fsdp_memory(rank: int, world_size: int, width: int = 256, depth: int = 8,
                out_features: int = 5, device: str = "cpu") -> dict:
    """Bytes this rank holds under FSDP2 ``fully_shard`` after one Adam step (local shards),
    plus what was all-gathered and reduce-scattered during that step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    model = _memory_model(width, depth, out_features).to(device)
    full_param_bytes = param_bytes(model)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    padded_bound = sum(
        -(-p.shape[0] // world_size) * (p.numel() // p.shape[0]) * p.element_size()
        for p in model.parameters())
    inside_forward: list[dict] = []

    def record_unsharded(module, args):
        # registered after fully_shard's own pre-forward hook, so it runs after the all-gather
        w = module.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        inside_forward.append({"type": type(w).__name__, "shape": tuple(w.shape),
                               "local_shape": tuple(local.shape)})

    for layer in linears:
        fully_shard(layer, mesh=mesh)
        layer.register_forward_pre_hook(record_unsharded)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # The collectives FSDP2 calls (torch 2.13: *_single; older: *_into_tensor / *_tensor),
    # wrapped to record their buffer sizes.
    names = {"all_gather": "all_gather_single" if hasattr(dist, "all_gather_single")
             else "all_gather_into_tensor",
             "reduce_scatter": "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single")
             else "reduce_scatter_tensor"}
    traffic: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}
    originals = {kind: getattr(dist, name) for kind, name in names.items()}

    def counting(kind):
        # Both take (output, input, ...), by position or keyword. The unsharded buffer is the
        # all-gather's output and the reduce-scatter's input.
        position, keys = ((0, ("output_tensor", "output")) if kind == "all_gather"
                          else (1, ("input_tensor", "input")))

        def call(*args, **kwargs):
            full = next((kwargs[k] for k in keys if k in kwargs), None)
            full = args[position] if full is None else full
            traffic[kind].append(full.numel() * full.element_size())
            return originals[kind](*args, **kwargs)
        return call

    for kind, name in names.items():
        setattr(dist, name, counting(kind))
    try:
        x = torch.randn(8, width, device=device)
        nn.functional.mse_loss(model(x), torch.zeros(8, out_features, device=device)).backward()
    finally:
        for kind, name in names.items():
            setattr(dist, name, originals[kind])
    optimizer.step()
    moments, steps = _adam_state_bytes(optimizer)
    params = list(model.parameters())
    return {
        "rank": rank, "scheme": "FSDP2", "full_param_bytes": full_param_bytes,
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optim_moments": moments, "optim_steps": steps, "buckets": 0,
        "padded_shard_bound": padded_bound,
        "params_are_dtensors": all(isinstance(p, DTensor) for p in params),
        "placements": sorted({str(p.placements) for p in params}),
        "shards": {name: (tuple(p.shape), tuple(p.to_local().shape))
                   for name, p in model.named_parameters()},
        "inside_forward": inside_forward,
        "all_gather_bytes": sum(traffic["all_gather"]),
        "all_gather_calls": len(traffic["all_gather"]),
        "reduce_scatter_bytes": sum(traffic["reduce_scatter"]),
        "reduce_scatter_calls": len(traffic["reduce_scatter"]),
    }


def memory_per_rank(rank: int, world_size: int, width: int = 256, depth: int = 8,
                    out_features: int = 5, device: str = "cpu") -> dict:
    """This rank's DDP and FSDP2 byte counts for the same model (same process group)."""
    return {"ddp": ddp_memory(rank, world_size, width, depth, out_features, device=device),
            "fsdp": fsdp_memory(rank, world_size, width, depth, out_features, device=device)}


MEMORY_COLUMNS = ["params", "grads", "optim_moments", "optim_steps", "buckets"]


def memory_rows(results: list[dict]) -> list[dict]:
    """Flatten ``memory_per_rank`` results (one per rank) into table rows with a total."""
    rows = []
    for scheme in ("ddp", "fsdp"):
        for per_rank in results:
            row = dict(per_rank[scheme])
            row["total"] = sum(row[c] for c in MEMORY_COLUMNS)
            rows.append(row)
    return rows


def format_memory_table(results: list[dict]) -> str:
    """The per-rank memory table, one line per (scheme, rank), in bytes."""
    header = (f"{'scheme':<7}{'rank':>5}{'params':>12}{'grads':>12}{'Adam m+v':>12}"
              f"{'Adam step':>11}{'DDP buckets':>13}{'total':>12}")
    lines = [header, "-" * len(header)]
    for row in memory_rows(results):
        lines.append(f"{row['scheme']:<7}{row['rank']:>5}{row['params']:>12,}"
                     f"{row['grads']:>12,}{row['optim_moments']:>12,}{row['optim_steps']:>11,}"
                     f"{row['buckets']:>13,}{row['total']:>12,}")
    return "\n".join(lines)


def check_memory_relations(results: list[dict]) -> list[tuple[str, bool]]:
    """The exact relations the measured table must satisfy, as (statement, holds) pairs."""
    full = results[0]["ddp"]["full_param_bytes"]
    world = len(results)
    checks = []
    for r in results:
        d, f = r["ddp"], r["fsdp"]
        checks += [
            (f"rank {d['rank']} DDP params == full model ({full:,} B)", d["params"] == full),
            (f"rank {d['rank']} DDP grads == full model", d["grads"] == full),
            (f"rank {d['rank']} DDP Adam m+v == 2 x full model", d["optim_moments"] == 2 * full),
            (f"rank {d['rank']} DDP buckets == full model (separate storage)",
             d["buckets"] == full),
            (f"rank {f['rank']} FSDP params <= padded shard bound "
             f"({f['padded_shard_bound']:,} B)", f["params"] <= f["padded_shard_bound"]),
            (f"rank {f['rank']} FSDP grads == its param shard", f["grads"] == f["params"]),
            (f"rank {f['rank']} FSDP Adam m+v == 2 x its param shard",
             f["optim_moments"] == 2 * f["params"]),
        ]
    shards = sum(r["fsdp"]["params"] for r in results)
    checks.append((f"FSDP shards over {world} ranks add up to the full model", shards == full))
    return checks


# -------------------------------------------------------------- real DataParallel on GPUs


def gpu_dataparallel_report(widths=(1024, 2048, 4096), depth: int = 4, batch: int = 512,
                            repeats: int = 5) -> tuple[list[dict] | None, str]:
    """Real ``nn.DataParallel`` on every visible GPU: per-iteration replicate and gather time
    (fastest ``*_s`` and median ``*_median_s`` of ``repeats``), and each GPU's peak allocated
    memory over an Adam training step.

    Returns ``(None, reason)`` when there are fewer than two GPUs.
    """
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return None, (f"skipped: the real DataParallel measurement needs >= 2 CUDA GPUs, "
                      f"this machine has {n}")
    devices = list(range(n))

    def sync():
        for d in devices:
            torch.cuda.synchronize(d)

    def timed(fn) -> list[float]:
        def run():
            sync()
            fn()
            sync()
        return _samples(run, repeats)

    rows = []
    for width in widths:
        model = make_mlp(width, depth).cuda(0)
        dp = nn.DataParallel(model, device_ids=devices)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(batch, width, device="cuda:0")
        y = torch.randn(batch, width, device="cuda:0")

        def train_step():
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(dp(x), y).backward()
            optimizer.step()

        train_step()  # warm-up; creates Adam's state on device 0
        sync()
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
        step = timed(train_step)
        peaks = [torch.cuda.max_memory_allocated(d) for d in devices]

        scattered, kwargs = dp.scatter((x,), {}, devices)
        replicate = timed(lambda: dp.replicate(model, devices))
        with torch.no_grad():
            outputs = dp.parallel_apply(dp.replicate(model, devices), scattered, kwargs)
        gather = timed(lambda: dp.gather(outputs, 0))
        row = {"width": width, "param_bytes": param_bytes(model), "gpus": n, "peak_bytes": peaks}
        row["samples"] = {"step": step, "replicate": replicate, "gather": gather}
        for name, values in row["samples"].items():
            row[f"{name}_s"], row[f"{name}_median_s"] = min(values), statistics.median(values)
        rows.append(row)
        del dp, model, optimizer, outputs, scattered
        torch.cuda.empty_cache()
    return rows, f"measured on {n} GPUs ({torch.cuda.get_device_name(0)})"
