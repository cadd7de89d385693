"""Run a function in N ranks of a real ``torch.distributed`` process group: ``run_ranks``.

This is the launcher behind every exercise test, the autograder and the notebooks' live demos::

    from ddpcourse.launcher import run_ranks

    def total(rank, world_size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t

    run_ranks(total, 2)   # -> [tensor([3.]), tensor([3.])]

What it guarantees, and how:

* ``fn`` may be defined in a notebook cell and use helpers, classes and globals from other cells:
  it travels by value (cloudpickle), where plain pickling would fail on ``__main__``.
* Ranks are forked from a rank server that has torch imported, so a call costs ~0.1 s, not the
  1-2 s of starting Python and importing torch (see ``benchmarks/launcher_overhead.py``). A
  process that calls ``fork_server_now()`` first thing, with torch imported, has its server
  forked from itself rather than started (no second import of torch: the grader's hosts and the
  course's headless kernels, :mod:`ddpcourse.launcher.kernel_with_server`).
* Rendezvous goes through a ``FileStore`` in a private temporary directory: no ports, so any number
  of tests or graders can run at once.
* A hard deadline: ranks still running at ``timeout`` seconds have their Python stacks dumped
  (faulthandler) and are killed; the error names them and shows where they were stuck.
* A rank that raises, exits or crashes stops the others at once; the error names the rank, the
  exit code or signal, and carries its full traceback.
* Nothing is left behind: each rank leads its own process group, which is killed as a whole
  (DataLoader workers and subprocesses included); ranks and servers die with their parent.
* Each rank looks like a fresh process of the caller: the caller's current environment variables,
  working directory and ``sys.path``, torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...),
  its own RNG seed, ``torch.set_num_threads(cores // world_size)``, and it may start DataLoader
  workers. Tensors come back detached on the CPU.
* ``call_scratch_dir()``, inside a rank: a folder of the call, shared by its ranks, for files
  needed only during the call; it goes with the call's other files when the call ends.

Also public: :mod:`ddpcourse.launcher.errors` (the errors above, written for a student) and
:mod:`ddpcourse.launcher.processes` (process-group, parent-death and orphan-counting helpers, and
``run_bounded``: run a command with a deadline, leaving no process behind). The underscore
modules are the launcher's own parts: ``_call`` (one call: fork, watch, report, clean up),
``_server_client`` (start the rank servers, talk to them), ``_rank_server`` (forks ranks),
``_rank_child`` (runs inside a rank), ``_job`` (the files of one call), ``_output`` (relays what
ranks print), ``_pickling`` (sends ``fn`` by value, keeping tracebacks readable) and
``_interrupts`` (a Ctrl-C at any moment of a call raises ``KeyboardInterrupt`` and leaves no rank
behind; ``set_phase_hook`` lets tests interrupt a call at each of its named ``PHASES``).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable

from ddpcourse.launcher import _pickling
from ddpcourse.launcher._call import Call
from ddpcourse.launcher._interrupts import PHASES, interrupts_deferred, reached, set_phase_hook
from ddpcourse.launcher._job import SCRATCH_VARIABLE, JobCall, JobFiles, JobSpec
from ddpcourse.launcher._server_client import pool
from ddpcourse.launcher.errors import RankError, RankFailure, RankTimeoutError
from ddpcourse.launcher.processes import run_bounded

__all__ = [
    "run_ranks", "prestart", "resolve_backend", "RankError", "RankFailure", "RankTimeoutError",
    "run_bounded", "fork_server_now", "wait_until_warm", "wait_until_ready", "rank_server_pids", "usable_cores", "pickle_by_value",
    "PHASES", "set_phase_hook", "call_scratch_dir",
]

DEFAULT_TIMEOUT_S = 60.0
_call_lock = threading.Lock()


def call_scratch_dir() -> str:
    """Where a rank of :func:`run_ranks` keeps files that are needed only during the call (a
    checkpoint that a check writes and reads back): a folder of the call, shared by its ranks and
    removed with the call's other files when it ends. Outside a rank: the system's temporary
    folder."""
    return os.environ.get(SCRATCH_VARIABLE) or tempfile.gettempdir()


def pickle_by_value(obj) -> bytes:
    """Pickle ``obj`` the way ``run_ranks`` sends ``fn``: functions of ``__main__`` (a notebook
    cell) by value, with their real file names kept. Lets a caller find out before a launch that
    a function cannot travel to the ranks (it holds a lock, an open file, a socket...)."""
    return _pickling.dumps(obj)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` means NCCL with one GPU per rank when there are enough GPUs, else gloo on CPU.

    Checking the GPU count does not initialise CUDA in this process.
    """
    with interrupts_deferred():  # a Ctrl-C inside torch's first import would be lost
        import torch
        import torch.distributed as dist

    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if backend == "auto":
        return "nccl" if enough_gpus and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not (enough_gpus and dist.is_nccl_available()):
        raise RuntimeError(
            f"backend='nccl' needs NCCL and one GPU per rank: world_size={world_size}, "
            f"GPUs visible={torch.cuda.device_count() if torch.cuda.is_available() else 0}"
        )
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    return backend


def prestart() -> None:
    """Start the rank servers now (in the background) so the first ``run_ranks`` is fast.

    Notebooks and test suites call this early; ``run_ranks`` starts them itself when needed.
    """
    with _call_lock:
        pool.start()


def fork_server_now(dynamo: bool = True) -> None:
    """Fork this process's rank server now, if none was started: the warm one, or with
    ``dynamo=False`` the fast one, for good. Call it first thing in a single-threaded process that
    has imported torch: the server then starts with torch imported rather than importing it
    again (a second of CPU). Where a fork is not safe (other threads, CUDA initialised) it
    starts one as :func:`prestart` does."""
    with _call_lock:
        pool.start_only(dynamo, fork=True)


def wait_until_warm(timeout: float = 120.0) -> None:
    """Block until the warm rank server (``torch._dynamo`` preloaded) serves the calls."""
    wait_until_ready(timeout)


def wait_until_ready(timeout: float = 120.0, dynamo: bool = True) -> None:
    """Block until the rank server the calls will use is ready. Called before any other use of
    the launcher, it starts only that server: the warm one, or with ``dynamo=False`` the fast
    one, for good (ranks that build no optimizer, DDP or dispatch mode never need dynamo;
    those that do import it themselves, in every rank)."""
    with _call_lock:
        pool.wait_until_ready(timeout, dynamo)


def rank_server_pids() -> set[int]:
    """Pids of the long-lived rank servers (so orphan checks can tell them from leftovers)."""
    return pool.server_pids()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT_S,
    seed: int | None = None,
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
    relay_output: bool = True,
    max_output_bytes: int = 1_000_000,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes; return every
    rank's return value, indexed by rank.

    Args:
        backend: ``"auto"`` (NCCL if each rank can have its own GPU, else gloo), ``"gloo"`` or
            ``"nccl"``.
        timeout: seconds until ranks that have not finished are killed and
            :class:`RankTimeoutError` is raised (the process group's own timeout is set longer,
            so the launcher, which can show every rank's stack, always speaks first).
        seed: ``None`` gives every rank its own fresh random seed; an int seeds rank ``r`` with
            ``seed + r`` (``random``, ``numpy`` and ``torch``). Seed inside ``fn`` for equal
            streams on every rank.
        env: extra environment variables for the ranks (on top of the caller's ``os.environ``).
        init_process_group: set False to get processes with torchrun's variables but no process
            group (for code that calls ``init_process_group`` itself via ``file://`` or a store).
        relay_output: copy what each rank prints to ``sys.stdout``, prefixed ``[rank R]``.
        max_output_bytes: relay at most this much of each rank's output.

    Raises:
        RankError: a rank raised, exited or crashed; ``.failures`` has one entry per rank that
            did not return, with its traceback and exit code.
        RankTimeoutError: ranks were still running at the deadline; their stacks are included.
        TypeError: ``fn`` or its arguments could not be pickled (nothing was started).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    reached("call started")
    backend = resolve_backend(backend, world_size)
    spec = JobSpec(
        world_size=world_size,
        backend=backend,
        timeout_s=float(timeout),
        seed=seed,
        threads_per_rank=max(1, usable_cores() // world_size),
        init_process_group=init_process_group,
        environ={**os.environ, **(env or {})},
        cwd=os.getcwd(),
        sys_path=list(sys.path),
        sources=_pickling.in_memory_sources(),
    )
    try:
        payload = _pickling.dumps(JobCall(fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_ranks could not send {getattr(fn, '__name__', fn)!r} and its arguments to the "
            f"ranks: {type(exc).__name__}: {exc}. Everything fn uses from outside (globals, "
            "closures, arguments) must be picklable; create locks, files and sockets inside fn."
        ) from exc

    with _call_lock:
        server = pool.get()
        job_dir = tempfile.mkdtemp(prefix="ddpcourse-ranks-")
        try:
            files = JobFiles(job_dir)
            with open(files.spec, "wb") as f:
                pickle.dump(spec, f)
            with open(files.call, "wb") as f:
                f.write(payload)
            call = Call(server, files, spec, relay_output, max_output_bytes)
            return call.run()
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)
