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
  1-2 s of starting Python and importing torch (see ``benchmarks/launcher_overhead.py``).
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
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from ddpcourse import _pickling
from ddpcourse._job import JobCall, JobFiles, JobSpec
from ddpcourse._output import RankOutput
from ddpcourse._server_client import RankServer, pool
from ddpcourse.processes import kill_process_group
from ddpcourse.rank_errors import RankError, RankFailure, RankTimeoutError, describe_exit

__all__ = ["run_ranks", "prestart", "resolve_backend", "RankError", "RankTimeoutError"]

DEFAULT_TIMEOUT_S = 60.0
STACK_DUMP_GRACE_S = 0.5
REAP_GRACE_S = 5.0
_call_lock = threading.Lock()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` means NCCL with one GPU per rank when there are enough GPUs, else gloo on CPU.

    Checking the GPU count does not initialise CUDA in this process.
    """
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


def wait_until_warm(timeout: float = 120.0) -> None:
    """Block until the warm rank server (``torch._dynamo`` preloaded) serves the calls."""
    with _call_lock:
        pool.wait_until_warm(timeout)


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
            call = _Call(server, files, spec, relay_output, max_output_bytes)
            return call.run()
        finally:
            shutil.rmtree(job_dir, ignore_errors=True)


class _Call:
    """One ``run_ranks`` call: fork the ranks, watch them, report, clean up."""

    def __init__(self, server: RankServer, files: JobFiles, spec: JobSpec, relay: bool,
                 max_output_bytes: int):
        self.server = server
        self.files = files
        self.spec = spec
        self.pids: dict[int, int] = {}  # rank -> pid
        self.exitcodes: dict[int, int] = {}  # rank -> exit code
        self.outputs = [
            RankOutput(files.output(r), r, max_output_bytes, relay) for r in range(spec.world_size)
        ]

    def run(self) -> list[Any]:
        world_size = self.spec.world_size
        deadline = time.monotonic() + self.spec.timeout_s
        try:
            for rank in range(world_size):
                self.server.fork(self.files.dir, rank)
            while True:
                self._collect_events(min(0.05, max(0.0, deadline - time.monotonic())))
                for out in self.outputs:
                    out.pump()
                failed = [r for r, code in self.exitcodes.items() if not self._returned(r, code)]
                if failed:
                    raise self._failure_error()
                if len(self.exitcodes) == world_size:
                    return [self._load_result(r) for r in range(world_size)]
                if time.monotonic() >= deadline:
                    raise self._timeout_error()
        finally:
            self._stop_all()
            for out in self.outputs:
                out.pump(final=True)

    def _collect_events(self, timeout: float) -> None:
        try:
            events = self.server.events(timeout)
        except EOFError:
            raise RankError(
                [RankFailure(r, "stopped") for r in range(self.spec.world_size)],
                self.spec.world_size,
                self.spec.backend,
                intro="the rank server died unexpectedly",
            ) from None
        rank_of = {pid: rank for rank, pid in self.pids.items()}
        for event in events:
            if event["ev"] == "forked" and event["job"] == self.files.dir:
                self.pids[event["rank"]] = event["pid"]
                rank_of[event["pid"]] = event["rank"]
            elif event["ev"] == "exit" and event["pid"] in rank_of:
                self.exitcodes[rank_of[event["pid"]]] = event["code"]

    def _returned(self, rank: int, exitcode: int) -> bool:
        return exitcode == 0 and os.path.exists(self.files.result(rank))

    def _load_result(self, rank: int) -> Any:
        with open(self.files.result(rank), "rb") as f:
            return pickle.load(f)

    def _read_error(self, rank: int) -> dict | None:
        try:
            with open(self.files.error(rank), "rb") as f:
                return pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    def _describe(self, rank: int, kind_if_running: str) -> RankFailure:
        report = self._read_error(rank)
        tail = self.outputs[rank].tail()
        if report is not None:
            return RankFailure(
                rank,
                "raised",
                exitcode=self.exitcodes.get(rank),
                exc_type=report["exc_type"],
                message=(report["message"] if report["stage"] == "running the function"
                         else f"{report['message']} (while {report['stage']})"),
                traceback=report["traceback"],
                output_tail=tail,
                exception_bytes=report["exception"],
            )
        if rank in self.exitcodes:
            stack = self._read_stacks(rank) if self.exitcodes[rank] < 0 else ""
            return RankFailure(rank, "exited", exitcode=self.exitcodes[rank], stack=stack,
                               output_tail=tail, message=describe_exit(self.exitcodes[rank]))
        return RankFailure(rank, kind_if_running, output_tail=tail)

    def _failure_error(self) -> RankError:
        # The rank whose error came first is listed first: it is usually the cause, and the
        # others failed because it left (e.g. "Connection closed by peer").
        failed = [r for r, code in self.exitcodes.items() if not self._returned(r, code)]
        failures = [self._describe(r, "stopped") for r in failed]
        order = {r: (self._read_error(r) or {}).get("time", float("inf")) for r in failed}
        failures.sort(key=lambda f: (order[f.rank], f.rank))
        stopped = [
            RankFailure(r, "stopped")
            for r in range(self.spec.world_size)
            if r not in self.exitcodes
        ]
        return RankError(failures + stopped, self.spec.world_size, self.spec.backend)

    def _timeout_error(self) -> RankTimeoutError:
        unfinished = [r for r in range(self.spec.world_size) if r not in self.exitcodes]
        stuck = [r for r in unfinished if not os.path.exists(self.files.result(r))]
        for rank in stuck:
            if rank in self.pids:
                try:
                    os.kill(self.pids[rank], signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        self._wait_for_stacks(stuck)
        failures = [
            RankFailure(rank, "timeout", output_tail=self.outputs[rank].tail(),
                        stack=self._read_stacks(rank) or "(no stack: the rank had not started)")
            for rank in stuck
        ]
        finished = [r for r in range(self.spec.world_size) if r not in stuck]
        intro = (
            f"rank(s) {stuck} did not finish within {self.spec.timeout_s:g} s"
            + (f"; rank(s) {finished} returned" if finished else "")
            + ". Typical causes: a deadlock (mismatched collectives, a recv with no send), an"
            " endless loop, a long sleep"
        )
        return RankTimeoutError(failures, self.spec.world_size, self.spec.backend, intro=intro)

    def _wait_for_stacks(self, ranks: list[int]) -> None:
        give_up = time.monotonic() + STACK_DUMP_GRACE_S
        while time.monotonic() < give_up:
            if all(os.path.getsize(self.files.stacks(r)) > 0 for r in ranks
                   if os.path.exists(self.files.stacks(r))):
                time.sleep(0.02)  # let the dump of the last threads land
                return
            time.sleep(0.01)

    def _read_stacks(self, rank: int) -> str:
        try:
            with open(self.files.stacks(rank)) as f:
                text = f.read()
        except OSError:
            return ""
        return _strip_launcher_frames(text)

    def _stop_all(self) -> None:
        """Kill every rank that has not exited, then wait (bounded) until the server has reaped
        them, so the caller never returns with live ranks."""
        for rank, pid in self.pids.items():
            if rank not in self.exitcodes:
                kill_process_group(pid, signal.SIGKILL)
        give_up = time.monotonic() + REAP_GRACE_S
        while len(self.exitcodes) < len(self.pids) and time.monotonic() < give_up:
            try:
                self._collect_events(0.05)
            except RankError:
                break
        # A rank's children (DataLoader workers, subprocesses) share its process group.
        for pid in self.pids.values():
            kill_process_group(pid, signal.SIGKILL, group_only=True)


_LAUNCHER_FILES = ("ddpcourse/_rank_server.py", "ddpcourse/_rank_child.py", "<frozen runpy>")


def _strip_launcher_frames(stacks: str) -> str:
    """faulthandler prints the innermost frame first; drop the launcher's own outer frames."""
    kept = []
    for line in stacks.splitlines():
        if any(part in line for part in _LAUNCHER_FILES):
            continue
        kept.append(line)
    return "\n".join(kept)
