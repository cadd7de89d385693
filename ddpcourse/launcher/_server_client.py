"""The parent's side of :mod:`ddpcourse.launcher._rank_server`: start it, send fork requests,
read events.

Two servers are started together the first time ranks are needed: a *fast* one that is ready as
soon as torch is imported (~1 s) and a *warm* one that has also imported ``torch._dynamo`` (which
any process's first optimizer pulls in, ~1.4 s more). Calls use the fast one until the warm one
reports ready, then the fast one is shut down. So the first call is cheap and later calls that
train a model do not pay the dynamo import in every rank.

A process that asks for it at its start, having imported torch and nothing else of note (the
grader's observation hosts, :mod:`ddpcourse.launcher.kernel_with_server`), forks its server instead
of starting a fresh interpreter: it begins with torch imported, and the second of CPU its import
costs is saved (:class:`ForkedServerProcess`). Only then: a server forked later, from whatever
state the process is in by then (``torch.no_grad``, a default dtype, redirected streams), would
pass that state on to every rank, which a fresh server never does.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ddpcourse
from ddpcourse.launcher._interrupts import interrupts_deferred, reached
from ddpcourse.launcher.processes import kill_process_group


def _server_environment() -> dict:
    """The servers' environment: this one, with the package importable (its ranks may start
    Python processes of their own)."""
    env = dict(os.environ)
    package_root = str(Path(ddpcourse.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


# Threads of a process that has only imported torch: its own, and one that torch's import starts
# and leaves waiting (tests/test_launcher.py counts them). A started server forks its ranks in
# just this state.
THREADS_AFTER_IMPORTING_TORCH = 2


def can_fork_a_server() -> bool:
    """Whether this process may fork its rank servers rather than start fresh interpreters:
    torch is imported already (else a fork saves nothing); no thread runs but those of importing
    it (a fork copies only the calling thread, and a lock that another thread held would stay
    locked in the copy: no Python thread, as a Jupyter kernel and pytest-xdist run, and no
    OpenMP pool, which torch's first parallel operation starts); and CUDA is not initialised (a
    forked CUDA context is unusable)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda") or threading.active_count() != 1:
        return False
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:  # no /proc (macOS): native threads cannot be counted, so no fork
        return False
    return threads <= THREADS_AFTER_IMPORTING_TORCH and not torch.cuda.is_initialized()


class ForkedServerProcess:
    """A rank server forked from this process, with what :class:`RankServer` uses of a Popen:
    ``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``kill``.

    The copy leads a session of its own, keeps no descriptor of this process but its two pipes
    (as fds 0 and 1, as a started server has them) and stderr, and runs
    :func:`ddpcourse.launcher._rank_server.serve`, which never returns to this process's code."""

    def __init__(self, warm: bool):
        env = _server_environment()
        parent = os.getpid()
        requests_r, requests_w = os.pipe()
        events_r, events_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
            if stream is not None:
                stream.flush()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                os.setsid()
                os.dup2(requests_r, 0)
                os.dup2(events_w, 1)
                for fd in _open_descriptors():
                    if fd > 2:
                        _close_quietly(fd)
                os.environ.clear()
                os.environ.update(env)
                # the standard streams of a fresh interpreter, whatever this process made of them
                sys.stdin = sys.__stdin__ = open(0, closefd=False)
                sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
                sys.stderr = sys.__stderr__ = open(2, "w", closefd=False,
                                                   errors="backslashreplace")
                from ddpcourse.launcher._rank_server import serve

                serve(parent, warm)
                code = 0
            except BaseException:  # noqa: BLE001 - said on stderr; this copy must never return
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(requests_r)
        os.close(events_w)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = os.fdopen(requests_w, "wb")
        self.stdout = os.fdopen(events_r, "rb", buffering=0)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone all the same
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank server {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not yet reaped: the pid is still this server's
            kill_process_group(self.pid, signal.SIGKILL)


def _open_descriptors() -> list[int]:
    try:
        return sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    except OSError:
        return list(range(3, 1024))


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class RankServer:
    def __init__(self, warm: bool, forked: bool = False):
        self.owner_pid = os.getpid()
        self.ready = False
        self._buffer = b""
        self._backlog: list[dict] = []
        if forked and can_fork_a_server():
            self.process = ForkedServerProcess(warm)
            return
        args = [sys.executable, "-m", "ddpcourse.launcher._rank_server", str(os.getpid())]
        self.process = subprocess.Popen(
            args + (["--warm"] if warm else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_server_environment(),
            close_fds=True,
            # Out of the starting process's process group: a Jupyter kernel signals every child
            # in its group when it shuts down and keeps signalling until none is left, which a
            # child it has not reaped yet never is (jupyter_client then SIGTERMs the kernel after
            # 2.5 s). The server still ends with its parent: stdin's EOF, and on Linux its
            # parent-death signal.
            start_new_session=True,
        )

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, job_dir: str, rank: int) -> None:
        request = json.dumps({"op": "fork", "job": job_dir, "rank": rank}) + "\n"
        self.process.stdin.write(request.encode())
        self.process.stdin.flush()

    def wait_for_events(self, timeout: float) -> None:
        """Return once events can be read without waiting, or after ``timeout`` seconds."""
        if not self._backlog:
            select.select([self.process.stdout.fileno()], [], [], max(0.0, timeout))

    def events(self, timeout: float) -> list[dict]:
        """Events that arrived within ``timeout`` seconds (all that are already there, or wait for
        the first one). Raises ``EOFError`` if the server is gone."""
        if self._backlog:
            events, self._backlog = self._backlog, []
            return events
        fd = self.process.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], max(0.0, timeout))
        if not readable:
            return []
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError("the rank server exited")
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        events = [json.loads(line) for line in lines if line]
        if any(e["ev"] == "ready" for e in events):
            self.ready = True
        return [e for e in events if e["ev"] != "ready"]

    def poll_ready(self) -> bool:
        """Non-blocking: has the server finished preloading? Keeps other events for later."""
        if not self.ready and self.alive:
            try:
                self._backlog.extend(self.events(0.0))
            except EOFError:
                pass
        return self.ready

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()


class ServerPool:
    """Hands out the best rank server available right now (see the module docstring).

    A process whose first word is :meth:`wait_until_ready` gets only the server it waits for:
    the warm one, or with ``dynamo=False`` the fast one for good (each server imports torch:
    seconds of CPU)."""

    def __init__(self):
        self.fast: RankServer | None = None
        self.warm: RankServer | None = None
        self.kinds = ("fast", "warm")
        self._fork_next = False

    def start(self) -> None:
        """Start the servers that are missing. A Ctrl-C meanwhile waits until each server
        started is recorded here (milliseconds), so none is left running untracked."""
        with interrupts_deferred():
            started = self._start_missing()
        if started:
            reached("rank servers starting")

    def _start_missing(self) -> bool:
        if any(s is not None and s.owner_pid != os.getpid() for s in (self.fast, self.warm)):
            # We are a forked copy of the process that started them: they are not ours to use.
            self.fast = self.warm = None
        started = False
        forked, self._fork_next = self._fork_next, False  # a restart never forks
        if "warm" not in self.kinds:
            if self.fast is None or not self.fast.alive:
                self.fast = RankServer(warm=False, forked=forked)
                started = True
        elif self.warm is None or not self.warm.alive:
            self.warm = RankServer(warm=True, forked=forked)
            started = True
            if "fast" in self.kinds and (self.fast is None or not self.fast.alive):
                self.fast = RankServer(warm=False)
        return started

    def get(self) -> RankServer:
        self.start()
        if "warm" not in self.kinds:
            return self.fast
        if self.fast is not None and (self.warm.poll_ready() or not self.fast.alive):
            self.fast.close()
            self.fast = None
        return self.fast or self.warm

    def start_only(self, dynamo: bool = True, fork: bool = False) -> None:
        """Start the one server this process will use (the warm one, or the fast one), if no
        server was started yet, without waiting for it. ``fork``: fork it from this process
        when :func:`can_fork_a_server` (call it so only where this process's state is a fresh
        one's: at its start, torch imported)."""
        if self.fast is None and self.warm is None:
            self.kinds = ("warm",) if dynamo else ("fast",)
            self._fork_next = fork
        self.start()

    def wait_until_ready(self, timeout: float = 120.0, dynamo: bool = True) -> None:
        self.start_only(dynamo)
        server = self.warm if "warm" in self.kinds else self.fast
        deadline = time.monotonic() + timeout
        while not server.poll_ready():
            if time.monotonic() > deadline or not server.alive:
                raise RuntimeError("the rank server did not become ready")
            time.sleep(0.02)
        self.get()

    def server_pids(self) -> set[int]:
        return {s.process.pid for s in (self.fast, self.warm) if s is not None and s.alive}

    def close(self) -> None:
        for server in (self.fast, self.warm):
            if server is not None and server.owner_pid == os.getpid():
                server.close()
        self.fast = self.warm = None


pool = ServerPool()
atexit.register(pool.close)
