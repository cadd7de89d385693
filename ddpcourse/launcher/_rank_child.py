"""What runs inside one rank process (forked by :mod:`ddpcourse.launcher._rank_server`).

In order: become safe to kill (own process group, die with the server), send all output to the
rank's log file, arm faulthandler so the parent can ask for a Python stack at any moment (SIGUSR1)
and a crash leaves one behind, take the parent's environment, seed the RNGs, join the process group
through a FileStore in the call's private directory (no ports), run the function, and write the
result or the failure to a file.
"""

from __future__ import annotations

import faulthandler
import io
import linecache
import os
import pickle
import random
import signal
import sys
import time
import traceback
from datetime import timedelta

import cloudpickle
import torch
import torch.distributed as dist

from ddpcourse.launcher._job import SCRATCH_VARIABLE, JobCall, JobFiles, JobSpec
from ddpcourse.launcher.processes import set_parent_death_signal

_EXIT_FAILED = 1
_stack_file: io.TextIOWrapper | None = None  # kept open for faulthandler's whole life


def _isolate_and_redirect(files: JobFiles, rank: int) -> None:
    global _stack_file
    set_parent_death_signal(signal.SIGKILL)
    out_fd = os.open(files.output(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.close(null_fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    _stack_file = open(files.stacks(rank), "w")
    faulthandler.enable(_stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, _stack_file, all_threads=True)


def _adopt_parent_context(spec: JobSpec, rank: int) -> None:
    """Make the rank see what a freshly spawned process of the parent would see, plus torchrun's
    variables, so code written for ``torchrun`` runs unchanged."""
    os.environ.clear()
    os.environ.update(spec.environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        OMP_NUM_THREADS=str(spec.threads_per_rank),
    )
    dist.set_debug_level_from_env()
    try:
        os.chdir(spec.cwd)
    except OSError:
        pass
    sys.path[:] = spec.sys_path
    linecache.cache.update(spec.sources)
    torch.set_num_threads(spec.threads_per_rank)


def _seed(spec: JobSpec, rank: int) -> None:
    seed = spec.seed + rank if spec.seed is not None else int.from_bytes(os.urandom(8), "little")
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def _init_process_group(spec: JobSpec, files: JobFiles, rank: int) -> dist.Store:
    store = dist.FileStore(files.store, spec.world_size)
    if spec.init_process_group:
        device_id = None
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s + 10),
            device_id=device_id,
        )
    return store


def to_cpu(value):
    """Return ``value`` with every tensor (also inside lists, tuples, dicts) detached on the CPU,
    so the parent never initialises CUDA to read a result."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, torch.nn.Module):
        return value.cpu()
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def _write_atomically(path: str, payload: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)


def _user_frames(exc: BaseException, stage: str):
    """The traceback without this module's own frame, when the error came from ``fn``."""
    tb = exc.__traceback__
    if stage == "running the function" and tb is not None and tb.tb_next is not None:
        return tb.tb_next
    return tb


def _report_failure(files: JobFiles, rank: int, exc: BaseException, stage: str) -> None:
    try:
        exception_bytes = cloudpickle.dumps(exc)
        pickle.loads(exception_bytes)
    except Exception:
        exception_bytes = None
    report = {
        "stage": stage,
        "exc_type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, _user_frames(exc, stage))),
        "exception": exception_bytes,
        "time": time.time(),
    }
    _write_atomically(files.error(rank), pickle.dumps(report))


def _wait_for_all_ranks(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Leave only when every rank has finished ``fn``: a rank that tears its process group down
    early would make a slower peer's last collective fail with 'connection closed'."""
    store.set(f"ddpcourse/finished/{rank}", "1")
    store.wait([f"ddpcourse/finished/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))


def run_rank(job_dir: str, rank: int) -> int:
    files = JobFiles(job_dir)
    _isolate_and_redirect(files, rank)
    stage = "loading the job"
    try:
        with open(files.spec, "rb") as f:
            spec: JobSpec = pickle.load(f)
        _adopt_parent_context(spec, rank)
        os.makedirs(files.scratch, exist_ok=True)
        os.environ[SCRATCH_VARIABLE] = files.scratch
        with open(files.call, "rb") as f:
            call: JobCall = pickle.load(f)
        _seed(spec, rank)
        stage = "joining the process group"
        store = _init_process_group(spec, files, rank)
        stage = "running the function"
        result = call.fn(rank, spec.world_size, *call.args, **call.kwargs)
        stage = "sending the return value back"
        _write_atomically(files.result(rank), cloudpickle.dumps(to_cpu(result)))
        stage = "waiting for the other ranks to finish"
        _wait_for_all_ranks(store, rank, spec.world_size, spec.timeout_s)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures of a rank too
        _report_failure(files, rank, exc, stage)
        return _EXIT_FAILED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0
