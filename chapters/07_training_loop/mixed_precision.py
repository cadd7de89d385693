"""Mixed precision under DDP: ``torch.autocast``, a GradScaler for fp16 only, and what it does
(not) do to the all-reduce.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/mixed_precision.py

What the script measures and checks (rank 0 prints it, exits 1 if a claim fails):

* **The spelling.** ``torch.autocast(device_type, dtype=...)`` (also ``torch.amp.autocast``) and
  ``torch.amp.GradScaler(device_type)``. ``torch.cuda.amp.autocast(...)`` and
  ``torch.cuda.amp.GradScaler(...)`` still work but are deprecated: constructing them raises a
  ``FutureWarning`` (torch/cuda/amp/autocast_mode.py and grad_scaler.py, ``@deprecated``);
  :func:`deprecation_warnings` records it.
* **fp16 needs a GradScaler, bf16 does not** (:func:`small_loss_gradients`). fp16 keeps 10
  mantissa bits but its smallest normal number is 6.1e-5: small gradients of activations flush to
  zero. Scaling the loss up before the backward and the gradients down before the step
  (GradScaler) keeps them. bf16 has float32's exponent range, so nothing underflows and scaling
  changes nothing; it has 7 mantissa bits, so its rounding error is larger.
  torch 2.13 runs fp16 autocast and ``GradScaler("cpu")`` on the CPU too, which is how this
  script shows it without a GPU.
* **Gradients stay float32, so the all-reduce does not shrink** (:func:`allreduce_traffic`,
  :func:`real_hook_traffic`). Autocast computes selected ops (matmuls) in the low dtype but the
  parameters stay float32, and so do their ``.grad`` and DDP's gradient buckets. A counting comm
  hook sees the same bytes with or without autocast, and so does the profiler on DDP's own
  all-reduce (no hook). Only a compression hook changes that: ``fp16_compress_hook`` (or
  ``fp16_compress_wrapper(hook)``) of torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py
  casts each bucket to float16, all-reduces it and casts back: half the bytes. With gloo, torch
  2.13 all-reduces float16 and bfloat16 tensors, but ``register_comm_hook`` refuses
  ``bf16_compress_hook`` and ``bf16_compress_wrapper``'s hook by name unless CUDA with NCCL >= 2.10
  (or XPU with XCCL) is there (``DistributedDataParallel._check_comm_hook``, TypeError "BF16 all
  reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and XCCL").
* **GradScaler with DDP keeps the replicas equal** (:func:`scaled_fp16_training`). An overflow on
  one rank reaches every rank through the all-reduce (inf + x = inf), so every rank's scaler skips
  the same step and halves the same scale.

On GPUs (NCCL group, one GPU per rank) the same functions run on the GPU with fp16 autocast; on
CPU the script says that part was skipped and why.
"""

import contextlib
import os
import re
import sys
import warnings

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.profiler import ProfilerActivity, profile

from accumulation import (CommLog, counting_allreduce_hook, gradient_vector, group_device,
                          micro_batches, spread_across_ranks, wrap)
from ddpcourse.dist_env import process_group
from ddpcourse.report import report_checks
from ddpcourse.toys import flat_parameters, make_model, make_regression

MSE = torch.nn.functional.mse_loss
LOW_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
COMPRESSIONS = ("none", "fp16_compress_wrapper")
LOSS_FACTORS = (1.0, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6)
BF16_REFUSED = "BF16 all reduce communication hook required"


def deprecation_warnings() -> dict[str, list[str]]:
    """The FutureWarnings raised by constructing the deprecated ``torch.cuda.amp`` spellings (any
    machine: the class is deprecated, whether or not CUDA is there)."""
    spellings = {"torch.cuda.amp.autocast()": lambda: torch.cuda.amp.autocast(),
                 "torch.cuda.amp.GradScaler()": lambda: torch.cuda.amp.GradScaler()}
    found = {}
    for spelling, construct in spellings.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            construct()
        found[spelling] = [str(w.message) for w in caught if w.category is FutureWarning]
    return found


def number_formats() -> dict[str, dict[str, float]]:
    """Largest value, smallest normal value and machine epsilon of each floating format."""
    return {name: {"max": torch.finfo(dtype).max, "smallest normal": torch.finfo(dtype).tiny,
                   "eps": torch.finfo(dtype).eps}
            for name, dtype in (("float32", torch.float32), *LOW_DTYPES.items())}


def small_loss_gradients(dtype: str, loss_factor: float, scaled: bool,
                         device_type: str = "cpu") -> dict[str, float]:
    """One backward of ``loss_factor * MSE`` under ``torch.autocast(device_type, dtype)``, with or
    without ``torch.amp.GradScaler`` (unscaled before reading), against the float32 gradients.
    Returns the fraction of gradient entries that are exactly zero and the relative error."""
    device = torch.device(device_type)
    x, y = (t.to(device) for t in make_regression(8, seed=1).tensors)
    reference = make_model(0).to(device)
    (MSE(reference(x), y) * loss_factor).backward()
    model = make_model(0).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device_type, enabled=scaled)
    with torch.autocast(device_type, dtype=LOW_DTYPES[dtype]):
        loss = MSE(model(x).float(), y) * loss_factor
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    got, expected = gradient_vector(model), gradient_vector(reference)
    return {"zero fraction": (got == 0).double().mean().item(),
            "relative error": ((got - expected).norm() / expected.norm()).item()}


def gradient_error_table(device_type: str = "cpu") -> dict[str, list[dict[str, float]]]:
    """:func:`small_loss_gradients` over :data:`LOSS_FACTORS` for fp16, fp16 + GradScaler, bf16
    and bf16 + GradScaler."""
    cases = {"float16": ("float16", False), "float16 + GradScaler": ("float16", True),
             "bfloat16": ("bfloat16", False), "bfloat16 + GradScaler": ("bfloat16", True)}
    return {name: [small_loss_gradients(dtype, factor, scaled, device_type)
                   for factor in LOSS_FACTORS]
            for name, (dtype, scaled) in cases.items()}


def autocast_dtype_here() -> str:
    """The autocast dtype this rank demonstrates: fp16 on a GPU, bf16 on the CPU."""
    return "float16" if group_device().type == "cuda" else "bfloat16"


def allreduce_traffic(rank: int, world_size: int, autocast: str | None,
                      compression: str = "none") -> dict:
    """One DDP forward/backward, under ``torch.autocast`` in ``autocast`` (``None``: float32), with
    a counting comm hook, wrapped by ``fp16_compress_wrapper`` if ``compression`` says so. Returns
    the output, parameter and gradient dtypes and what the hook all-reduced."""
    model = wrap(make_model(0))
    log = CommLog()
    hook = counting_allreduce_hook
    if compression == "fp16_compress_wrapper":
        hook = default_hooks.fp16_compress_wrapper(counting_allreduce_hook)
    elif compression != "none":
        raise ValueError(f"compression must be one of {COMPRESSIONS}, not {compression!r}")
    model.register_comm_hook(log, hook)
    x, y = micro_batches(world_size)[rank]
    device_type = x.device.type
    with torch.autocast(device_type, dtype=LOW_DTYPES.get(autocast), enabled=autocast is not None):
        output = model(x)
    MSE(output.float(), y).backward()
    return {"output dtype": str(output.dtype).removeprefix("torch."),
            "parameter dtypes": sorted({str(p.dtype).removeprefix("torch.")
                                        for p in model.parameters()}),
            "gradient dtypes": sorted({str(p.grad.dtype).removeprefix("torch.")
                                       for p in model.parameters()}),
            "all-reduce calls": log.calls, "all-reduced dtypes": log.dtypes,
            "all-reduced bytes": sum(log.bytes),
            "gradient spread across ranks": spread_across_ranks(gradient_vector(model))}


def traffic_cases(rank: int, world_size: int) -> dict[str, dict]:
    """:func:`allreduce_traffic` without autocast, with autocast, and with autocast plus fp16
    compression (autocast in fp16 on GPUs, bf16 on CPU)."""
    low = autocast_dtype_here()
    return {"float32": allreduce_traffic(rank, world_size, None),
            f"autocast {low}": allreduce_traffic(rank, world_size, low),
            f"autocast {low} + fp16 compression":
                allreduce_traffic(rank, world_size, low, "fp16_compress_wrapper")}


@contextlib.contextmanager
def _profiler_banner_hidden():
    """The profiler (kineto) writes 'profiler_start/stop' lines straight to file descriptor 2;
    hide them for the duration (Python errors still raise, and print once it is restored)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def real_hook_traffic(rank: int, world_size: int, hook_name: str | None) -> dict:
    """Register one of default_hooks' real hooks by name (``None``: DDP's own all-reduce) on a DDP
    model under autocast, and read the all-reduces the backend ran from the profiler
    (``gloo:all_reduce`` / ``nccl:all_reduce`` events, their dtypes and shapes). Returns what
    registering raised (if it did) and each all-reduce's (dtype, elements)."""
    model = wrap(make_model(0))
    if hook_name is not None:
        try:
            model.register_comm_hook(None, getattr(default_hooks, hook_name))
        except TypeError as error:
            return {"registration error": str(error), "all-reduces": []}
    x, y = micro_batches(world_size)[rank]
    MSE(model(x), y).backward()  # the first backward rebuilds the buckets: profile the second
    model.zero_grad()
    with torch.autocast(x.device.type, dtype=LOW_DTYPES[autocast_dtype_here()]):
        output = model(x)
    with _profiler_banner_hidden(), profile(activities=[ProfilerActivity.CPU],
                                            record_shapes=True) as profiled:
        MSE(output.float(), y).backward()
    seen = [(event.input_dtypes[0], event.input_shapes[0][0]) for event in profiled.events()
            if re.fullmatch(r"(gloo|nccl):all_reduce", event.name)]
    return {"registration error": None, "all-reduces": seen}


def scaled_fp16_training(rank: int, world_size: int, steps: int = 3) -> list[dict]:
    """fp16 autocast + ``torch.amp.GradScaler`` under DDP on this rank's device. At step 0 rank 0
    alone multiplies its loss by 1e6, which overflows fp16 in its backward. Returns, per step, the
    scale after ``update()``, whether the step changed the parameters, and the replicas' spread."""
    model = wrap(make_model(0))
    device_type = group_device().type
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device_type, init_scale=2.0 ** 16)
    x, y = micro_batches(world_size, size=8)[rank]
    history = []
    for step in range(steps):
        before = flat_parameters(model.module)
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=torch.float16):
            output = model(x)
        loss = MSE(output.float(), y) * (1e6 if step == 0 and rank == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped when the unscaled gradients hold an inf or a NaN
        scaler.update()  # halves the scale after a skipped step
        after = flat_parameters(model.module)
        history.append({"scale": scaler.get_scale(), "stepped": not torch.equal(before, after),
                        "parameter spread across ranks": spread_across_ranks(after)})
    return history


def problems(warned: dict, errors: dict, traffic: dict, hooks: dict, history: list,
             on_gpu: bool) -> list[str]:
    """What contradicts the module docstring, given the measurements (rank 0's view)."""
    found = []
    for spelling, messages in warned.items():
        if not messages:
            found.append(f"{spelling}: no FutureWarning")
    fp16, scaled_fp16 = errors["float16"][-1], errors["float16 + GradScaler"][-1]
    bf16, scaled_bf16 = errors["bfloat16"][-1], errors["bfloat16 + GradScaler"][-1]
    if not (fp16["zero fraction"] > 0 and scaled_fp16["zero fraction"] == 0
            and bf16["zero fraction"] == 0
            and scaled_fp16["relative error"] < fp16["relative error"]):
        found.append(f"smallest loss: fp16 {fp16}, fp16 + scaler {scaled_fp16}, bf16 {bf16}")
    if abs(scaled_bf16["relative error"] - bf16["relative error"]) > 0.1 * bf16["relative error"]:
        found.append(f"GradScaler changed bf16's error: {bf16} vs {scaled_bf16}")
    full, autocast, compressed = traffic.values()
    for name, result in traffic.items():
        if result["gradient dtypes"] != ["float32"] or result["gradient spread across ranks"]:
            found.append(f"{name}: gradients {result['gradient dtypes']}, spread "
                         f"{result['gradient spread across ranks']}")
    if autocast["output dtype"] == "float32" or autocast["all-reduced bytes"] != \
            full["all-reduced bytes"] or set(autocast["all-reduced dtypes"]) != {"float32"}:
        found.append(f"autocast changed the all-reduce: {full} vs {autocast}")
    if 2 * compressed["all-reduced bytes"] != full["all-reduced bytes"] \
            or set(compressed["all-reduced dtypes"]) != {"float16"}:
        found.append(f"fp16 compression did not halve the bytes: {compressed}")
    expected_dtypes = {None: {"float"}, "fp16_compress_hook": {"c10::Half"}}
    if on_gpu:
        expected_dtypes["bf16_compress_hook"] = {"c10::BFloat16"}
    for name, dtypes in expected_dtypes.items():
        seen = {dtype for dtype, _ in hooks[name]["all-reduces"]}
        if seen != dtypes:
            found.append(f"profiler, hook {name}: all-reduced {seen}, expected {dtypes}")
    bf16_error = hooks["bf16_compress_hook"]["registration error"] or ""
    if on_gpu == (BF16_REFUSED in bf16_error):
        found.append(f"bf16_compress_hook registration: {bf16_error or 'accepted'}")
    first, *rest = history
    if first["stepped"] or first["scale"] != 2.0 ** 15 or not all(h["stepped"] for h in rest) \
            or any(h["parameter spread across ranks"] for h in history):
        found.append(f"GradScaler under DDP: {history}")
    return found


def main() -> int:
    with process_group(timeout_s=60) as ctx:
        on_gpu = ctx.device.type == "cuda"
        warned = deprecation_warnings()
        errors = gradient_error_table(ctx.device.type)
        traffic = traffic_cases(ctx.rank, ctx.world_size)
        hooks = {name: real_hook_traffic(ctx.rank, ctx.world_size, name)
                 for name in (None, "fp16_compress_hook", "bf16_compress_hook")}
        history = scaled_fp16_training(ctx.rank, ctx.world_size)
        for spelling, messages in warned.items():
            ctx.print0(f"{spelling}: FutureWarning {messages}")
        ctx.print0(f"gradient relative error, loss x {LOSS_FACTORS}:")
        for name, rows in errors.items():
            ctx.print0(f"  {name:<22} " + " ".join(f"{r['relative error']:9.2e}" for r in rows)
                       + f"   zero entries at the smallest: {rows[-1]['zero fraction']:.1%}")
        for name, result in traffic.items():
            ctx.print0(f"  {name:<36}: output {result['output dtype']}, gradients "
                       f"{result['gradient dtypes']}, all-reduced {result['all-reduced bytes']} "
                       f"bytes as {result['all-reduced dtypes']}")
        for name, result in hooks.items():
            ctx.print0(f"  profiler, hook {name}: {result}")
        ctx.print0(f"  fp16 + GradScaler under DDP on {ctx.device.type}: {history}")
        if not on_gpu:
            ctx.print0("  skipped: fp16 autocast + GradScaler on CUDA with NCCL needs one CUDA GPU "
                       f"per rank; this machine has {torch.cuda.device_count()} "
                       "(the same functions ran on the CPU with gloo)")
        if not ctx.is_main:
            return 0
        found = problems(warned, errors, traffic, hooks, history, on_gpu)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
