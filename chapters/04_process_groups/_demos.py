"""Rank functions for the chapter 04 notebook and tests, run with ``ddpcourse.launcher.run_ranks``.

Each takes ``(rank, world_size, ...)`` and returns plain values. Those that call
``init_process_group`` themselves are meant for ``run_ranks(..., init_process_group=False)``;
every one of them destroys the group it made before returning.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpcourse.dist_env import free_port  # noqa: F401 - tests and the notebook use _demos.free_port

SHORT = timedelta(seconds=10)


def join_and_sum(rank: int, world_size: int, init_method: str) -> dict:
    """Join with ``init_method`` (env://, tcp://..., file://...), all-reduce the ranks, leave."""
    kwargs = {} if init_method == "env://" else {"rank": rank, "world_size": world_size}
    dist.init_process_group("gloo", init_method=init_method, timeout=SHORT, **kwargs)
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    joined = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": total.item()}
    dist.destroy_process_group()
    return joined


def wait_for_a_missing_peer(rank: int, world_size: int, store_file: str, timeout_s: float):
    """Join a group of ``world_size + 1`` that one process never joins; report what happens.

    ``error``/``after_s``: how ``init_process_group`` ended. If it returned (a backend that
    connects lazily, e.g. gloo with ``TORCH_GLOO_LAZY_INIT=1``), the first all-reduce is tried
    too: ``collective_error``/``collective_s``."""
    start = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                                world_size=world_size + 1, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:  # the point: a timeout turns the missing peer into an error
        return {"error": f"{type(exc).__name__}: {exc}", "after_s": time.perf_counter() - start}
    outcome = {"error": None, "after_s": time.perf_counter() - start}
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        outcome["collective_error"] = None
    except Exception as exc:
        outcome["collective_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    outcome["collective_s"] = time.perf_counter() - start
    dist.destroy_process_group()
    return outcome


def subgroups(rank: int, world_size: int) -> dict:
    """Evens and odds: every rank creates *both* groups (new_group is collective), then reduces
    in its own. Also shows destroying a subgroup, then everything."""
    evens = dist.new_group([r for r in range(world_size) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world_size) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=mine)
    everyone = torch.tensor([float(rank)])
    dist.all_reduce(everyone)
    result = {"group": "evens" if rank % 2 == 0 else "odds",
              "rank_in_group": dist.get_rank(mine), "group_size": dist.get_world_size(mine),
              "group_sum": total.item(), "world_sum": everyone.item(),
              "rank_in_other_group": dist.get_rank(odds if mine is evens else evens)}
    dist.destroy_process_group(evens)
    dist.destroy_process_group(odds)
    dist.destroy_process_group()
    result["initialized_after_destroy"] = dist.is_initialized()
    return result


def ones_times_rank(rank: int, world_size: int) -> float:
    """The article's sanity check: all_reduce(ones * rank), default op SUM."""
    t = torch.ones(1) * rank
    dist.all_reduce(t)
    return t.item()


def everyone_rank0_by_hand(rank: int, world_size: int, port: int, timeout_s: float) -> str:
    """Processes started by hand, all passing rank=0 to tcp://: what each one sees."""
    start = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        first_line = str(exc).strip().splitlines()[0]
        return f"{type(exc).__name__} after {time.perf_counter() - start:.1f} s: {first_line}"
    dist.destroy_process_group()
    return "joined (unexpected)"


def backend_of_environment() -> dict:
    """Which backends this torch build has, and which a device type maps to by default."""
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(), "cuda devices": torch.cuda.device_count(),
            "default for cpu / cuda": (dist.Backend.default_device_backend_map.get("cpu"),
                                       dist.Backend.default_device_backend_map.get("cuda"))}


# --- how DDP averages gradients ---------------------------------------------------------------

class Scale(torch.nn.Module):
    """One weight, ``loss = weight * x``: the gradient of the weight is exactly ``x``."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def ddp_average_in_float16(rank: int, world_size: int, value: float = 40000.0) -> dict:
    """Where DDP divides by N, seen in float16 (largest value 65504): every rank's gradient is
    ``value``. Summing first overflows to inf; dividing first does not. Which one is DDP?"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(Scale(torch.float16))
    model(torch.full((1,), value, dtype=torch.float16)).backward()
    summed = torch.full((1,), value, dtype=torch.float16)
    dist.all_reduce(summed)  # op=SUM
    divided = torch.full((1,), value, dtype=torch.float16) / world_size
    dist.all_reduce(divided)
    return {"DDP": model.module.weight.grad.item(),
            "all_reduce(SUM), then / N": (summed / world_size).item(),
            "/ N, then all_reduce(SUM)": divided.item()}


def what_a_comm_hook_sees(rank: int, world_size: int) -> dict:
    """Register a comm hook that records its bucket, then all-reduces it with SUM and divides
    nothing. Rank r's gradient is r + 1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    seen = []

    def sum_only(state, bucket):
        seen.append(bucket.buffer().tolist())
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    model = DDP(Scale())
    model.register_comm_hook(None, sum_only)
    model(torch.full((1,), float(rank + 1))).backward()
    return {"local gradient": float(rank + 1), "bucket seen by the hook": seen[0],
            "gradient after DDP": model.module.weight.grad.item()}
