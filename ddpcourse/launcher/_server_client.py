"""The parent's side of :mod:`ddpcourse.launcher._rank_server`: start it, send fork requests,
read events.

Two servers are started together the first time ranks are needed: a *fast* one that is ready as
soon as torch is imported (~1 s) and a *warm* one that has also imported ``torch._dynamo`` (which
any process's first optimizer pulls in, ~1.4 s more). Calls use the fast one until the warm one
reports ready, then the fast one is shut down. So the first call is cheap and later calls that
train a model do not pay the dynamo import in every rank.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import ddpcourse
from ddpcourse.launcher._interrupts import interrupts_deferred, reached


class RankServer:
    def __init__(self, warm: bool):
        env = dict(os.environ)
        package_root = str(Path(ddpcourse.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        args = [sys.executable, "-m", "ddpcourse.launcher._rank_server", str(os.getpid())]
        self.process = subprocess.Popen(
            args + (["--warm"] if warm else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
            # Out of the starting process's process group: a Jupyter kernel signals every child
            # in its group when it shuts down and keeps signalling until none is left, which a
            # child it has not reaped yet never is (jupyter_client then SIGTERMs the kernel after
            # 2.5 s). The server still ends with its parent: stdin's EOF, and on Linux its
            # parent-death signal.
            start_new_session=True,
        )
        self.owner_pid = os.getpid()
        self.ready = False
        self._buffer = b""
        self._backlog: list[dict] = []

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
        if "warm" not in self.kinds:
            if self.fast is None or not self.fast.alive:
                self.fast = RankServer(warm=False)
                started = True
        elif self.warm is None or not self.warm.alive:
            self.warm = RankServer(warm=True)
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

    def wait_until_ready(self, timeout: float = 120.0, dynamo: bool = True) -> None:
        if self.fast is None and self.warm is None:
            self.kinds = ("warm",) if dynamo else ("fast",)
        self.start()
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
