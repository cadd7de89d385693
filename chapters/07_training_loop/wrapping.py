"""Wrapping a model in DDP: where it must live first, what the constructor does, ``model.module``.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/wrapping.py

Each claim of the lesson is a function that returns plain data (the lesson calls the same
functions through ``run_ranks``); :func:`problems` lists what contradicts the lesson, and the
script exits non-zero if anything does. What is shown, on 2 ranks with gloo:

* placement: ``device_ids`` on a CPU module is refused (``ValueError``); changing the parameters
  after wrapping (here ``.double()``, on a GPU also ``.to(device)``) raises nothing, but the
  gradients are no longer averaged: the reducer's hooks sit on the old parameters' gradient
  accumulators. With one GPU per rank, :func:`gpu_placement` checks what ``device_ids`` does;
* the constructor compares the ranks' parameters: a different parameter *count* fails on every
  rank, a different *shape* fails only on the rank that differs from rank 0, while rank 0 goes on
  into the broadcast and waits (here on a group with a 2-second timeout, so it ends);
* the constructor broadcasts rank 0's parameters and buffers: ranks seeded differently start
  identical (``init_sync=False`` skips it and they stay different);
* buckets: torch 2.13 reduces the first iteration in *one* bucket (unless
  ``find_unused_parameters=True``), then rebuilds the buckets in the order gradients became ready.
  A recording comm hook reads the public ``GradBucket.index()``/``parameters()``; a model whose
  layers are registered in the reverse of the order it uses them shows why the rebuild matters;
* the first bucket after the rebuild is capped at 1 MiB only when ``bucket_cap_mb`` is left at its
  default; set ``bucket_cap_mb`` and the first bucket is as large as the others;
* ``model.module``: ``state_dict()`` keys carry a ``module.`` prefix through the wrapper; rank 0
  alone can evaluate ``model.module`` but not the wrapper (a collective waits for the others); a
  forward through ``model.module`` during training skips the gradient all-reduce.

The constructor's steps, as the lesson lists them, in torch 2.13's source:

* ``DistributedDataParallel.__init__`` as a whole:
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L816-L1160
* where the parameters are; what ``device_ids`` / ``output_device`` mean:
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L930-L955
* ``_verify_param_shape_across_processes`` (every rank's parameters against rank 0's):
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1062-L1073
* ``_sync_module_states`` (rank 0's parameters and buffers broadcast):
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/utils.py#L289-L315
* ``_ddp_init_helper`` (buckets, the C++ ``Reducer`` and its gradient hooks):
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1374-L1483
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.dist_env import process_group, short_timeout_group
from ddpcourse.report import report_checks

DEMO_TIMEOUT_S = 2.0  # how long a rank waits for a peer that will never come, in the demos
GROUP_TIMEOUT_S = 30.0  # the other demos wait for no one; this only bounds a surprise




def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0]


def grads_equal_across_ranks(model: nn.Module, group=None) -> bool:
    """Whether every rank holds the same gradients (all_gather of one flat vector)."""
    flat = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()
                      if p.grad is not None])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


# --- placement -----------------------------------------------------------------------------

def device_ids_on_cpu(rank: int, world_size: int) -> dict:
    """``DDP(cpu_module, device_ids=[0])``: refused, with DDP's own words."""
    try:
        DDP(nn.Linear(4, 1), device_ids=[0])
    except ValueError as error:
        return {"error": type(error).__name__, "message": first_line(error)}
    return {"error": None, "message": None}


def changed_after_wrapping(rank: int, world_size: int, when: str) -> dict:
    """Convert the model to float64 ``"before"`` or ``"after"`` wrapping; train two steps on
    different data per rank. Returns whether anything raised and whether the gradients were
    averaged (equal on every rank) after each step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    if when == "before":
        model = model.double()
    group = short_timeout_group(GROUP_TIMEOUT_S, "gloo")
    ddp = DDP(model, process_group=group)
    if when == "after":
        ddp = ddp.double()  # what .to(device) after wrapping does on a GPU, too
    synced, error = [], None
    try:
        for step in range(2):
            ddp.zero_grad()
            x = torch.randn(2, 4, dtype=torch.float64) + rank
            ddp(x).sum().backward()
            synced.append(grads_equal_across_ranks(ddp.module, group))
    except RuntimeError as e:
        error = first_line(e)
    return {"error": error, "grads equal on every rank": synced}


def gpu_placement(rank: int, world_size: int, local_rank: int | None = None) -> dict:
    """With a GPU per rank: ``device_ids=[local_rank]`` moves a CPU input to the GPU; without
    ``device_ids`` the input must already be there; a model moved to the GPU after wrapping gets
    its gradients averaged no more. Returns ``{"skipped": reason}`` without enough GPUs."""
    local_rank = rank if local_rank is None else local_rank
    if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
        return {"skipped": "needs one CUDA GPU per rank"}
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    with_ids = DDP(nn.Linear(4, 1).to(device), device_ids=[local_rank])
    result = {"skipped": None, "output device with device_ids": str(with_ids(torch.randn(2, 4))
                                                                    .device)}
    without_ids = DDP(nn.Linear(4, 1).to(device))
    try:
        without_ids(torch.randn(2, 4))  # a CPU input, a GPU module, nobody moves it
        result["CPU input without device_ids"] = None
    except RuntimeError as error:
        result["CPU input without device_ids"] = first_line(error)
    # wrapped on the CPU (a gloo group), moved afterwards: its gradients, compared on the
    # default group, which holds GPU tensors under NCCL
    late = DDP(nn.Linear(4, 1), process_group=short_timeout_group(GROUP_TIMEOUT_S, "gloo")).to(device)
    late(torch.randn(2, 4, device=device) + rank).sum().backward()
    result["moved after wrapping: grads equal"] = grads_equal_across_ranks(late.module)
    return result


# --- what the constructor checks and broadcasts ----------------------------------------------

def shape_check(rank: int, world_size: int, difference: str,
                timeout_s: float = DEMO_TIMEOUT_S) -> dict:
    """The last rank builds a different model: one more layer (``"count"``) or a wider one
    (``"shape"``). Returns this rank's error, the torch functions it was raised in, and after how
    many seconds (a rank that waits for the others ends at the group's timeout)."""
    differs = rank == world_size - 1
    if difference == "count":
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3 if differs else 2)])
    else:
        model = nn.Linear(8, 5 if differs else 4)
    group = short_timeout_group(timeout_s, "gloo")
    start = time.monotonic()
    try:
        DDP(model, process_group=group)
        return {"error": None, "raised in": None, "seconds": time.monotonic() - start}
    except RuntimeError as error:
        frames = [f.name for f in traceback.extract_tb(error.__traceback__)
                  if "torch" in f.filename]
        return {"error": first_line(error), "raised in": frames,
                "seconds": time.monotonic() - start}


def initial_sync(rank: int, world_size: int, init_sync: bool = True) -> dict:
    """Each rank seeds its model with its rank and shifts a BatchNorm buffer by its rank.
    Returns checksums of the parameters and of the buffer, before and after wrapping."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with torch.no_grad():
        model[1].running_mean += rank

    def checksums() -> dict:
        return {"parameters": sum(p.sum().item() for p in model.parameters()),
                "running_mean": model[1].running_mean.sum().item()}

    before = checksums()
    DDP(model, init_sync=init_sync, process_group=short_timeout_group(GROUP_TIMEOUT_S, "gloo"))
    return {"before": before, "after": checksums()}


# --- buckets -------------------------------------------------------------------------------

class RegisteredBackwards(nn.Module):
    """``layers`` linear layers used as layer1 -> layer2 -> ... but registered (created in
    ``__init__``) the other way round, as happens when a model's layers are built in an order
    that is not the order its ``forward`` uses them."""

    def __init__(self, width: int = 64, layers: int = 4):
        super().__init__()
        self.layers = layers
        for i in reversed(range(1, layers + 1)):
            setattr(self, f"layer{i}", nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(1, self.layers + 1):
            x = torch.tanh(getattr(self, f"layer{i}")(x))
        return x


def bucket_layouts(rank: int, world_size: int, bucket_cap_mb: float | None = 0.03,
                   find_unused_parameters: bool = False, width: int = 64, layers: int = 4,
                   iterations: int = 2) -> list[dict]:
    """Per iteration: the buckets DDP all-reduced (index, parameter names, bytes, and how many
    gradients were still to be computed when the bucket was handed to the comm hook) and the order
    in which the gradients became ready.

    A comm hook (``register_comm_hook``) receives every bucket as a ``GradBucket``; it records
    ``index()``, ``parameters()`` and ``buffer()`` and then does what DDP does by default
    (``allreduce_hook``). A post-accumulate-grad hook on each parameter records when its gradient
    is ready; both run on the autograd thread, so their order in one list is the real order.
    """
    torch.manual_seed(0)
    model = RegisteredBackwards(width, layers)
    names = {id(p): n for n, p in model.named_parameters()}
    events: list[tuple] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append(("grad", names[id(p)])))
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
              process_group=short_timeout_group(GROUP_TIMEOUT_S, "gloo"))

    def recording_hook(state, bucket):  # no annotations: DDP checks them, and this module's
        # `from __future__ import annotations` would turn them into strings it refuses
        events.append(("bucket", bucket.index(), [names[id(p)] for p in bucket.parameters()],
                       bucket.buffer().numel() * bucket.buffer().element_size()))
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, recording_hook)
    total = sum(1 for _ in model.parameters())
    result = []
    for _ in range(iterations):
        events.clear()
        ddp(torch.randn(8, width)).sum().backward()
        ready, buckets = [], []
        for event in events:
            if event[0] == "grad":
                ready.append(event[1])
            else:
                _, index, params, size = event
                buckets.append({"index": index, "params": params, "bytes": size,
                                "gradients outstanding": total - len(ready)})
        result.append({"buckets": buckets, "ready order": ready})
    return result


def first_bucket_sizes(rank: int, world_size: int, bucket_cap_mb: float | None) -> list[list]:
    """Bytes per bucket in iterations 1 and 2 for six 256x256 layers (about 1.5 MiB)."""
    layouts = bucket_layouts(rank, world_size, bucket_cap_mb, width=256, layers=6)
    return [[b["bytes"] for b in it["buckets"]] for it in layouts]


# --- model.module --------------------------------------------------------------------------

def state_dict_keys(rank: int, world_size: int) -> dict:
    """Keys through the wrapper and through ``model.module``; what loading the wrapper's state
    dict into a plain model says (and what ``strict=False`` leaves unloaded: everything); and
    that stripping the prefix fixes an old checkpoint."""
    ddp = DDP(nn.Linear(2, 1), process_group=short_timeout_group(GROUP_TIMEOUT_S, "gloo"))
    wrapped = ddp.state_dict()
    try:
        nn.Linear(2, 1).load_state_dict(wrapped)
        load_error = None
    except RuntimeError as error:
        load_error = " ".join(str(error).split())
    lenient = nn.Linear(2, 1).load_state_dict(wrapped, strict=False)
    fixed = dict(wrapped)
    consume_prefix_in_state_dict_if_present(fixed, "module.")
    nn.Linear(2, 1).load_state_dict(fixed)  # raises if the fix did not work
    return {"through the wrapper": list(wrapped), "model.module": list(ddp.module.state_dict()),
            "loading the wrapper's keys into a plain model": load_error,
            "strict=False: keys left unloaded": lenient.missing_keys}


def rank0_evaluates(rank: int, world_size: int, through: str,
                    timeout_s: float = DEMO_TIMEOUT_S) -> dict:
    """One training step, then rank 0 alone evaluates ``through`` ``"module"`` or ``"ddp"`` while
    the other ranks wait at a barrier of the patient default group. A model with BatchNorm, whose
    buffers the wrapper broadcasts in the first forward after a training step
    (``forward_sync_buffers``, on by default; ``no_grad`` makes no difference to that one)."""
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)),
              process_group=short_timeout_group(timeout_s, "gloo"))
    ddp(torch.randn(8, 4) + rank).sum().backward()
    result = {"output": None, "error": None, "raised in": None}
    if rank == 0:
        evaluated = ddp.module if through == "module" else ddp
        evaluated.eval()
        try:
            with torch.no_grad():
                result["output"] = evaluated(torch.ones(2, 4)).sum().item()
        except RuntimeError as error:
            result["error"] = first_line(error)
            result["raised in"] = [f.name for f in traceback.extract_tb(error.__traceback__)
                                   if f.filename.endswith("nn/parallel/distributed.py")]
    dist.barrier()
    return result


def training_through_module(rank: int, world_size: int) -> bool:
    """A training step whose forward calls ``model.module``: are the gradients averaged?"""
    torch.manual_seed(0)
    group = short_timeout_group(GROUP_TIMEOUT_S, "gloo")
    ddp = DDP(nn.Linear(4, 1), process_group=group)
    ddp.module(torch.randn(2, 4) + rank).sum().backward()
    return grads_equal_across_ranks(ddp.module, group)


# --- everything, and the check -------------------------------------------------------------

def run_all(rank: int, world_size: int) -> dict:
    """Every demo in this rank, keyed by name (what :func:`problems` reads)."""
    return {
        "device_ids on CPU": device_ids_on_cpu(rank, world_size),
        "float64 before wrapping": changed_after_wrapping(rank, world_size, "before"),
        "float64 after wrapping": changed_after_wrapping(rank, world_size, "after"),
        "gpu placement": gpu_placement(rank, world_size),
        "count differs": shape_check(rank, world_size, "count"),
        "shape differs": shape_check(rank, world_size, "shape"),
        "init_sync=True": initial_sync(rank, world_size, True),
        "init_sync=False": initial_sync(rank, world_size, False),
        "buckets, default": bucket_layouts(rank, world_size, 0.03, False),
        "buckets, find_unused_parameters=True": bucket_layouts(rank, world_size, 0.03, True),
        "first bucket, bucket_cap_mb=None": first_bucket_sizes(rank, world_size, None),
        "first bucket, bucket_cap_mb=2": first_bucket_sizes(rank, world_size, 2),
        "state_dict keys": state_dict_keys(rank, world_size),
        "rank 0 evaluates model.module": rank0_evaluates(rank, world_size, "module"),
        "rank 0 evaluates the wrapper": rank0_evaluates(rank, world_size, "ddp"),
        "training through model.module": training_through_module(rank, world_size),
    }


def problems(results: list[dict]) -> list[str]:
    """What in ``results`` (one :func:`run_all` dict per rank) contradicts the lesson."""
    found = []
    r0, last = results[0], results[-1]

    def expect(condition: bool, claim: str) -> None:
        if not condition:
            found.append(claim)

    gpu = r0["gpu placement"]
    if gpu["skipped"] is None:
        expect(gpu["output device with device_ids"].startswith("cuda")
               and gpu["CPU input without device_ids"] is not None,
               "device_ids should move the input to the GPU, and nothing else should")
        expect(gpu["moved after wrapping: grads equal"] is False,
               "a model moved to the GPU after wrapping should get no gradient averaging")
    expect(r0["device_ids on CPU"]["error"] == "ValueError",
           "device_ids on a CPU module should raise ValueError")
    expect(r0["float64 before wrapping"]["grads equal on every rank"] == [True, True],
           "converting before wrapping should keep the gradients averaged")
    after = r0["float64 after wrapping"]
    expect(after["error"] is None and not any(after["grads equal on every rank"]),
           "converting after wrapping should silently leave the gradients unaveraged")
    for name in ("count differs", "shape differs"):
        expect(last[name]["error"] is not None and
               "_verify_param_shape_across_processes" in last[name]["raised in"],
               f"{name}: the differing rank should fail in the shape verification")
    expect("DDP expects same model across all ranks" in str(r0["count differs"]["error"]),
           "a different parameter count should fail on rank 0 too")
    shape0 = r0["shape differs"]
    expect(shape0["error"] is not None and "_sync_module_states" in shape0["raised in"]
           and shape0["seconds"] >= DEMO_TIMEOUT_S * 0.9,
           "a different shape should leave rank 0 waiting in the broadcast until the timeout")
    synced = [r["init_sync=True"]["after"] for r in results]
    unsynced = [r["init_sync=False"]["after"] for r in results]
    expect(len({r["init_sync=True"]["before"]["parameters"] for r in results}) == len(results),
           "differently seeded ranks should start with different parameters")
    expect(all(s == r0["init_sync=True"]["before"] for s in synced),
           "after wrapping every rank should hold rank 0's parameters and buffers")
    expect(len({u["parameters"] for u in unsynced}) == len(results),
           "init_sync=False should leave the ranks different")
    default = r0["buckets, default"]
    expect(len(default[0]["buckets"]) == 1, "torch 2.13 reduces iteration 1 in one bucket")
    rebuilt = default[1]["buckets"]
    expect(len(rebuilt) > 1 and rebuilt[0]["params"] == default[1]["ready order"]
           [:len(rebuilt[0]["params"])], "the rebuilt bucket 0 should hold the first-ready "
           "gradients")
    expect(rebuilt[0]["gradients outstanding"] > 0, "after the rebuild, bucket 0 should be "
           "all-reduced while gradients are still being computed")
    stuck = r0["buckets, find_unused_parameters=True"]
    expect(len(stuck[0]["buckets"]) > 1 and stuck[0]["buckets"] == stuck[1]["buckets"],
           "with find_unused_parameters=True the buckets should never be rebuilt")
    expect(max((b["gradients outstanding"] for b in stuck[1]["buckets"]), default=9) <= 1,
           "in reverse registration order, every bucket should wait for the end of backward")
    default_sizes = r0["first bucket, bucket_cap_mb=None"]
    set_sizes = r0["first bucket, bucket_cap_mb=2"]
    expect(len(default_sizes[0]) == 1 and len(default_sizes[1]) == 2
           and 2**20 <= default_sizes[1][0] < 2**20 + 2**19,
           "default cap: after the rebuild, the first bucket should hold just over 1 MiB")
    expect(set_sizes[1] == [sum(set_sizes[1])] and len(set_sizes[1]) == 1,
           "bucket_cap_mb=2: the first bucket should not be capped at 1 MiB")
    keys = r0["state_dict keys"]
    expect(keys["through the wrapper"] == ["module.weight", "module.bias"]
           and keys["model.module"] == ["weight", "bias"]
           and "Unexpected key(s)" in str(keys["loading the wrapper's keys into a plain model"]),
           "the wrapper's state_dict keys should carry the module. prefix")
    expect(keys["strict=False: keys left unloaded"] == ["weight", "bias"],
           "strict=False should load nothing from the prefixed keys, silently")
    expect(r0["rank 0 evaluates model.module"]["output"] is not None,
           "rank 0 alone should evaluate model.module")
    through = r0["rank 0 evaluates the wrapper"]
    expect(through["error"] is not None and "_sync_buffers" in (through["raised in"] or []),
           "rank 0 alone through the wrapper should wait in the buffer broadcast")
    expect(not r0["training through model.module"],
           "a forward through model.module should leave the gradients unaveraged")
    return found


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        mine = run_all(ctx.rank, ctx.world_size)
        results: list = [None] * ctx.world_size
        dist.all_gather_object(results, mine)
        if not ctx.is_main:
            return 0
        r0, last = results[0], results[-1]
        print("device_ids on a CPU module:", r0["device_ids on CPU"]["message"])
        for when in ("before", "after"):
            print(f"float64 {when} wrapping: grads equal on every rank per step:",
                  r0[f"float64 {when} wrapping"]["grads equal on every rank"])
        gpu = r0["gpu placement"]
        print("GPU placement:", f"skipped: {gpu['skipped']}" if gpu["skipped"] else gpu)
        for name in ("count differs", "shape differs"):
            for rank, r in enumerate(results):
                print(f"{name}, rank {rank}: {r[name]['error']} "
                      f"(after {r[name]['seconds']:.1f} s)")
        for name in ("init_sync=True", "init_sync=False"):
            print(name, [r[name]["after"] for r in results])
        for name in ("buckets, default", "buckets, find_unused_parameters=True"):
            for i, it in enumerate(r0[name]):
                print(f"{name}, iteration {i + 1}:",
                      [(b["params"], b["gradients outstanding"]) for b in it["buckets"]])
        for name in ("first bucket, bucket_cap_mb=None", "first bucket, bucket_cap_mb=2"):
            print(f"{name}: bytes per bucket, iterations 1 and 2: {r0[name]}")
        print("state_dict keys:", r0["state_dict keys"])
        print("rank 0 evaluates model.module:", r0["rank 0 evaluates model.module"])
        print("rank 0 evaluates the wrapper:", r0["rank 0 evaluates the wrapper"])
        print("training through model.module, grads equal:", r0["training through model.module"])
        found = problems(results)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
