"""Process-group set-up for scripts launched by ``torchrun``: the same script on a laptop and a lab.

    from ddpcourse.dist_env import process_group

    with process_group() as ctx:        # reads RANK, LOCAL_RANK, WORLD_SIZE set by torchrun
        model = Model().to(ctx.device)  # cuda:LOCAL_RANK with NCCL, else cpu with gloo
        ctx.print0("only rank 0 prints this")

The backend is NCCL when every local rank can have a GPU of its own, else gloo on the CPU. The
process group is always destroyed on the way out, also when the body raises.

Leaving the block must free the group for real, and three things see to it (found the hard way,
torch 2.13, gloo). A group that outlives the interpreter aborts the process at exit ("terminate
called without an active exception", exit -6) now and then: one of its worker threads may still be
dropping a finished collective whose tensors Python created, which needs the GIL, and a thread
that asks for the GIL while the interpreter shuts down is ended by ``pthread_exit``, which C++
turns into ``std::terminate`` (the stack is in tests/test_dist_env.py; pytorch/pytorch#190489).

* Some torch modules write ``group=group.WORLD`` as a default argument, which Python evaluates once,
  at import. Imported while a group exists, they hold that group until the process ends, and
  ``destroy_process_group`` cannot free it. ``DistributedDataParallel(...)`` imports two of them
  (through ``torch._dynamo``). So before destroying the group, ``process_group`` sets those
  defaults back to ``None``, which they would be had the modules been imported before the group
  (``MODULES_THAT_BIND_THE_GROUP_AT_IMPORT``; a test scans torch for new ones). Importing them
  first instead would cost every script about 0.8 s.
* A DDP model is kept alive by reference cycles, and with it its group, until the garbage
  collector runs: collecting before the group is destroyed frees what the block left behind,
  and collecting at exit frees models that outlive the block while the interpreter is whole.
* ``cpu_group``'s gloo twin is forgotten when the default group is destroyed.
* DTensor (FSDP2's ``fully_shard`` shards parameters as DTensors) caches what it computed for a
  device mesh, and each cached entry holds the mesh, whose ``_pg_registry`` holds the group: the
  C++ fast path's sharding-propagation cache (``torch._C._clear_DTensor_sharding_propagator_cache``;
  held C++-side, so no Python referrer shows it), the Python one, the redistribution planners
  (``_redistribute._planner_cache``: keyed by a weak reference to the mesh, but each planner holds
  the mesh itself) and the mesh topology (``MeshTopoInfo.build_from_mesh``). Left alone they keep
  gloo's three threads running after the group is destroyed (tests/test_dist_env.py shows it), so
  ``process_group`` empties them first (``_forget_dtensor_caches``).
"""

from __future__ import annotations

import atexit
import gc
import inspect
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

# Modules whose functions take ``group=<group.WORLD at import time>`` as a default argument.
MODULES_THAT_BIND_THE_GROUP_AT_IMPORT = (
    "torch.distributed.nn.functional",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "torch.distributed.optim.zero_redundancy_optimizer",
)


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def print0(self, *args, **kwargs) -> None:
        """print() on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reports free now (bind port 0, read it, close it).
    Another process may take it before it is used; for demos and tests, never a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_backend(local_world_size: int) -> str:
    """NCCL if NCCL is built in and there is one GPU per local rank, else gloo."""
    if (
        dist.is_nccl_available()
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= local_world_size
    ):
        return "nccl"
    return "gloo"


def _require_torchrun_environment() -> None:
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: launch this script with torchrun, e.g. "
            "`torchrun --standalone --nproc_per_node 2 SCRIPT.py` (running it with plain "
            "`python` gives no ranks to talk to)."
        )


@contextmanager
def process_group(timeout_s: float = 120.0, backend: str = "auto",
                  restart_safe: bool = False) -> Iterator[DistContext]:
    """Join the process group torchrun prepared; leave it when the block ends.

    ``restart_safe=True`` is for scripts that torchrun may restart (``--max_restarts``). torchrun
    (torch 2.13, ``--standalone`` or c10d) hands every attempt the same TCP store, which still
    holds the previous attempt's keys (its ranks' network addresses), so a fresh rank can read a
    dead peer's address and fail in gloo's connect ("Gloo connectFullMesh failed"). Joining under
    a key prefix private to the attempt (``restart_N/``, N = TORCHELASTIC_RESTART_COUNT) avoids
    it; chapters/03_torchrun/restart_demo.py shows the race and the counts are recorded in
    benchmarks/results/ch03_restart_races.json. On several nodes, where each agent counts its own
    restarts, launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` instead (a new store per
    attempt; this function then joins with plain env://).
    """
    _require_torchrun_environment()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if backend == "auto":
        backend = pick_backend(local_world_size)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    atexit.register(gc.collect)  # see the module docstring
    timeout = timedelta(seconds=timeout_s)
    joining = {}  # plain env:// unless this attempt needs a store namespace of its own
    if restart_safe and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        joining = dict(store=dist.PrefixStore(f"restart_{attempt}", agent_store),
                       rank=rank, world_size=world_size)
    dist.init_process_group(
        backend,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
        **joining,
    )
    try:
        yield DistContext(rank, local_rank, world_size, backend, device)
    finally:
        gc.collect()  # free the body's DDP models while their group still lives (docstring)
        _cpu_groups.clear()
        _forget_in_default_arguments(dist.group.WORLD)
        _forget_dtensor_caches()
        dist.destroy_process_group()


def _forget_in_default_arguments(group: dist.ProcessGroup) -> None:
    """Every default argument of ``MODULES_THAT_BIND_THE_GROUP_AT_IMPORT``'s functions and methods
    that holds ``group`` becomes ``None`` (which those functions read as the default group), so
    that destroying ``group`` frees it (module docstring)."""
    for name in MODULES_THAT_BIND_THE_GROUP_AT_IMPORT:
        module = sys.modules.get(name)
        if module is None:  # not imported: nothing holds the group
            continue
        functions = [f for f in vars(module).values() if inspect.isfunction(f)]
        for cls in (c for c in vars(module).values() if inspect.isclass(c)):
            functions += [f for f in vars(cls).values() if inspect.isfunction(f)]
        for function in functions:
            if function.__defaults__:
                function.__defaults__ = tuple(None if value is group else value
                                              for value in function.__defaults__)
            if function.__kwdefaults__:
                function.__kwdefaults__ = {key: None if value is group else value
                                           for key, value in function.__kwdefaults__.items()}


def _forget_dtensor_caches() -> None:
    """Empty DTensor's caches of results computed for a device mesh (each holds the mesh, and
    the mesh its process groups; module docstring). Nothing to do where DTensor was never
    imported. Each cache is looked up by name, so a torch without it is passed over; the test of
    the threads left after an FSDP2 step fails if a new cache keeps the group."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cache_clear = getattr(getattr(propagator, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None:
        for name in ("clear_redistribute_planner_cache", "_gen_transform_infos.cache_clear"):
            target = redistribute
            for part in name.split("."):
                target = getattr(target, part, None)
            if target is not None:
                target()
    collective_utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    topology = getattr(collective_utils, "MeshTopoInfo", None)
    if topology is not None and hasattr(topology.build_from_mesh, "cache_clear"):
        topology.build_from_mesh.cache_clear()


def group_device() -> torch.device:
    """This rank's device in the default group: its GPU (``LOCAL_RANK``) under NCCL, else the
    CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return torch.device("cpu")


_cpu_groups: dict = {}  # the default group -> its gloo twin


def cpu_group() -> dist.ProcessGroup | None:
    """All ranks: the group of a demo whose tensors live on the CPU: the default group (None)
    under gloo; under NCCL, a gloo group over the same ranks, made at the first call (by every
    rank) and reused while the default group lives."""
    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    if world not in _cpu_groups:
        _cpu_groups.clear()
        _cpu_groups[world] = dist.new_group(backend="gloo")
    return _cpu_groups[world]


def short_timeout_group(timeout_s: float, backend: str | None = None) -> dist.ProcessGroup:
    """All ranks: a new group over the world whose collectives time out after ``timeout_s``, with
    a clock that starts only once every rank is ready. ``backend``: the default group's unless
    given (``"gloo"`` for CPU demos on a machine whose default group is NCCL).

    Demos of a hang turn a wait that never ends into an error after a few seconds. Start-up is
    slow and uneven on a loaded machine: creating processes, importing torch, and the first
    ``DistributedDataParallel(...)`` or optimizer, which imports ``torch._dynamo`` (seconds; see
    ``DistributedDataParallel.__init__`` in torch/nn/parallel/distributed.py, which reads
    ``torch._dynamo.utils.get_optimize_ddp_mode()``). A short timeout that counted that time would
    fire on start-up skew instead of on the bug being shown. So this pays those costs first, waits
    for every rank at a barrier of the patient default group, and only then creates the
    short-timeout group (and meets once more, so no rank uses it before all have it).
    """
    import torch._dynamo  # noqa: F401  (what DDP's constructor would import inside the short clock)

    dist.barrier()  # default group, patient timeout: absorbs start-up skew
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    dist.barrier()  # every rank has the group before any rank uses it
    return group


def loader_workers_context(num_workers: int):
    """``DataLoader(multiprocessing_context=...)`` for a loader in a rank: workers started by a
    fork server rather than forked from the rank (``None`` without workers; the DataLoader refuses
    a context then).

    By the time a rank's loader starts its workers, the rank runs other threads (gloo's, from
    ``init_process_group`` on), and ``fork`` copies only the calling thread: a lock that another
    thread holds at that instant stays locked in the worker forever (Python's documentation of
    ``os.fork``; CPython issue gh-112275; chapter 06, section 6, and
    benchmarks/fork_with_native_threads.py). The fork server is a fresh, single-threaded
    process, so its forks are safe. It imports torch once when it starts; without that preload
    each worker would import torch itself. The dataset, ``collate_fn`` and ``worker_init_fn``
    are pickled to the workers, so they must be importable by name.
    """
    if not num_workers:
        return None
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    return context
