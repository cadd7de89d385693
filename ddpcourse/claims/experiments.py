"""Short experiments for the claims of the source article that no chapter asserts yet.

Each function checks the *correct* statement of one row of ``chapters/claims.yaml`` (the row names
it as ``check: NAME``) and returns an :class:`Outcome`: whether the statement held on this machine,
and what was observed. A GPU experiment raises :class:`NeedsHardware` where the machine lacks what
it needs, and the check is then reported as skipped with that reason. Every CPU experiment runs in
well under a second of its own (the DataLoader ones start two worker processes), so
``tests/test_claims.py`` runs them all in the suite, and ``python -m ddpcourse.claims`` on a
student's machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Outcome:
    holds: bool     # the row's correct statement held
    observed: str   # what was seen, in one line


class NeedsHardware(Exception):
    """The experiment needs a GPU (or more of them) that this machine does not have."""


def _torch_file(relative: str) -> Path:
    return Path(torch.__file__).resolve().parent / relative


# --- chapter 03's topic: torchrun -----------------------------------------------------------------


def torchrun_is_torch_distributed_run() -> Outcome:
    """The ``torchrun`` command is the console script of ``torch.distributed.run:main``."""
    from importlib.metadata import distribution

    points = [e for e in distribution("torch").entry_points if e.name == "torchrun"]
    target = points[0].value if points else None
    return Outcome(target == "torch.distributed.run:main", f"torchrun -> {target}")


def c10d_rendezvous_keeps_its_state_in_a_tcp_store() -> Outcome:
    """c10d rendezvous: a TCPStore by default, a FileStore only with ``store_type=file``.

    ``create_backend`` is the function torchrun's ``--rdzv-backend c10d`` calls; with port 0 the
    hosting side binds a free port, so nothing here can collide with another run."""
    from torch.distributed import FileStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    default_params = RendezvousParameters(backend="c10d", endpoint="localhost:0",
                                          run_id="claims", min_nodes=1, max_nodes=1)
    _, default_store = create_backend(default_params)
    with tempfile.TemporaryDirectory() as tmp:
        file_params = RendezvousParameters(backend="c10d", endpoint=str(Path(tmp, "rdzv")),
                                           run_id="claims", min_nodes=1, max_nodes=1,
                                           store_type="file")
        _, file_store = create_backend(file_params)
        file_kind = type(file_store).__name__
        del file_store
    held = isinstance(default_store, TCPStore) and file_kind == FileStore.__name__
    observed = f"default: {type(default_store).__name__}; store_type=file: {file_kind}"
    del default_store
    return Outcome(held, observed)


# --- chapter 06's topic: data loading -------------------------------------------------------------


class _Pids(torch.utils.data.Dataset):
    """Four items, each the pid of the process that loaded it."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return os.getpid()


def dataloader_defaults() -> Outcome:
    """``pin_memory`` and ``persistent_workers`` default to False; ``prefetch_factor`` is None
    without workers and 2 with them (``DataLoader.__init__``)."""
    from torch.utils.data import DataLoader

    plain = DataLoader(_Pids())
    with_workers = DataLoader(_Pids(), num_workers=2)
    seen = {"pin_memory": plain.pin_memory, "persistent_workers": plain.persistent_workers,
            "prefetch_factor (0 workers)": plain.prefetch_factor,
            "prefetch_factor (2 workers)": with_workers.prefetch_factor}
    held = seen == {"pin_memory": False, "persistent_workers": False,
                    "prefetch_factor (0 workers)": None, "prefetch_factor (2 workers)": 2}
    return Outcome(held, ", ".join(f"{k}={v}" for k, v in seen.items()))


def persistent_workers_keep_their_processes() -> Outcome:
    """With ``persistent_workers=True`` the second epoch is loaded by the first epoch's worker
    process; without it, by a new one (workers are started for every epoch)."""
    from torch.utils.data import DataLoader

    def worker_pids(persistent: bool) -> list[set[int]]:
        loader = DataLoader(_Pids(), num_workers=1, persistent_workers=persistent)
        return [{int(pid) for batch in loader for pid in batch} for _epoch in range(2)]

    kept, renewed = worker_pids(True), worker_pids(False)
    held = kept[0] == kept[1] and renewed[0] != renewed[1]
    return Outcome(held, f"persistent: epochs loaded by {kept}; not persistent: by {renewed}")


def distributed_sampler_knows_no_topology() -> Outcome:
    """``DistributedSampler`` takes no device or link argument: rank r reads indices r, r+W, ...
    of one permutation shared by all ranks; which GPU is linked to which cannot change that."""
    import inspect

    from torch.utils.data import DistributedSampler

    params = list(inspect.signature(DistributedSampler.__init__).parameters)[1:]
    world, n, seed = 4, 10, 3
    shards = [list(DistributedSampler(range(n), num_replicas=world, rank=r, seed=seed))
              for r in range(world)]
    # one permutation drawn from seed + epoch (epoch 0), padded from its start to a multiple of W
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    order += order[: -n % world]
    strided = all(shards[r] == order[r::world] for r in range(world))
    held = params == ["dataset", "num_replicas", "rank", "shuffle", "seed", "drop_last"] and strided
    return Outcome(held, f"arguments {params}; rank r gets order[r::{world}]: {strided}")


# --- variables and processes around the ranks -----------------------------------------------------


def nccl_blocking_wait_was_renamed() -> Outcome:
    """torch reads ``TORCH_NCCL_BLOCKING_WAIT``; ``NCCL_BLOCKING_WAIT`` is only its deprecated
    alias, declared next to it in ``ProcessGroupNCCL.hpp`` (installed with every build)."""
    header = _torch_file("include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
    text = header.read_text()
    pair = re.search(r"TORCH_NCCL_BLOCKING_WAIT\s*=\s*\{\s*\"TORCH_NCCL_BLOCKING_WAIT\",\s*"
                     r"\"NCCL_BLOCKING_WAIT\"\s*\}", text)
    return Outcome(pair is not None,
                   f"{header.name}: " + (re.sub(r"\s+", " ", pair.group(0)) if pair
                                         else "no TORCH_NCCL_BLOCKING_WAIT declaration"))


def taskset_binds_every_rank_to_the_same_cores() -> Outcome:
    """A CPU affinity set on a launcher (what ``taskset -c 0-7 torchrun ...`` does) is inherited by
    every process it starts: all ranks share those cores; none is bound to its own NUMA node."""
    if not hasattr(os, "sched_setaffinity"):
        raise NeedsHardware("needs Linux (os.sched_setaffinity)")
    one_core = {min(os.sched_getaffinity(0))}
    # a launcher bound to one core starts two "ranks" the way torchrun starts workers (Popen)
    launcher = ("import os, subprocess, sys\n"
                "ranks = [subprocess.run([sys.executable, '-c', "
                "'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, "
                "text=True).stdout.strip() for _ in range(2)]\n"
                "print(ranks)\n")
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                          timeout=60, preexec_fn=lambda: os.sched_setaffinity(0, one_core))
    seen = done.stdout.strip()
    held = done.returncode == 0 and seen == str([str(sorted(one_core))] * 2)
    return Outcome(held, f"launcher bound to {sorted(one_core)}; its two children: {seen}")


# --- GPU only -------------------------------------------------------------------------------------


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        raise NeedsHardware("needs a GPU (torch.cuda.is_available() is False)")


def bundled_nccl_is_newer_than_2_10() -> Outcome:
    """The article's check, ``torch.cuda.nccl.version()``, on a CUDA build: a tuple, >= 2.10."""
    _need_cuda()
    version = torch.cuda.nccl.version()
    return Outcome(tuple(version) >= (2, 10), f"torch.cuda.nccl.version() = {version}")


def empty_cache_returns_cached_blocks_and_peak_stats_reset() -> Outcome:
    """``empty_cache`` hands the allocator's *unused* cached blocks back to the driver (reserved
    memory drops, allocated memory does not); ``reset_peak_memory_stats`` only resets the peak
    that ``max_memory_allocated`` reports, it measures nothing by itself."""
    _need_cuda()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    keep = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del big
    reserved_before, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    peak_before = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    reserved_after = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    peak_after = torch.cuda.max_memory_allocated()
    held = (reserved_after <= reserved_before - 256 * 2**20
            and torch.cuda.memory_allocated() == allocated
            and peak_before >= allocated + 256 * 2**20 and peak_after == allocated)
    del keep
    mib = 2**20
    return Outcome(held, f"reserved {reserved_before // mib} -> {reserved_after // mib} MiB after "
                         f"empty_cache, allocated {allocated // mib} MiB unchanged; peak "
                         f"{peak_before // mib} -> {peak_after // mib} MiB after reset")


CHECKS = {f.__name__: f for f in [
    torchrun_is_torch_distributed_run,
    c10d_rendezvous_keeps_its_state_in_a_tcp_store,
    dataloader_defaults,
    persistent_workers_keep_their_processes,
    distributed_sampler_knows_no_topology,
    nccl_blocking_wait_was_renamed,
    taskset_binds_every_rank_to_the_same_cores,
    bundled_nccl_is_newer_than_2_10,
    empty_cache_returns_cached_blocks_and_peak_stats_reset,
]}
