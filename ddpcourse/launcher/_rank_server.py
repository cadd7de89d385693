"""The rank server: a process with torch already imported that forks rank processes on request.

Started by :mod:`ddpcourse.launcher._server_client` as
``python -m ddpcourse.launcher._rank_server PARENT_PID [--warm]``. Importing torch costs 1-2 s per
process; forking a process that has already imported it costs milliseconds. That is the whole
reason this process exists. It is single-threaded, never touches CUDA, and talks to its parent over
two pipes in JSON lines:

* stdin  (parent -> server): ``{"op": "fork", "job": DIR, "rank": R}``
* stdout (server -> parent): ``{"ev": "ready"}``, ``{"ev": "forked", "job": DIR, "rank": R,
  "pid": PID}``, ``{"ev": "exit", "pid": PID, "code": CODE}``

With ``--warm`` it also imports ``torch._dynamo`` before it is ready (the first optimizer use in
any process imports it, ~1.4 s), so ranks that build optimizers start at full speed.

Clean-up guarantees: every rank leads its own process group; when the parent closes the pipe or
dies (``PR_SET_PDEATHSIG`` delivers SIGTERM), the server kills every live rank's group and exits.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys

from ddpcourse.launcher.processes import kill_process_group, set_parent_death_signal

_live_ranks: set[int] = set()


def _preload(warm: bool) -> None:
    import cloudpickle  # noqa: F401  (the ranks unpickle their job with it)
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    import torch.utils.data  # noqa: F401

    import ddpcourse.launcher._rank_child  # noqa: F401

    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    if warm:
        import torch._dynamo  # noqa: F401
        import torch.nn.parallel  # noqa: F401

        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    gc.collect()
    gc.freeze()  # keep the preloaded objects out of the children's copy-on-write path


def _send(event: dict) -> None:
    os.write(1, (json.dumps(event) + "\n").encode())


def _kill_all_and_exit(*_unused) -> None:
    for pid in list(_live_ranks):
        kill_process_group(pid, signal.SIGKILL)
    os._exit(0)


def _fork_rank(job_dir: str, rank: int, wakeup_fds: tuple[int, int]) -> None:
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.setpgid(0, 0)
            signal.set_wakeup_fd(-1)
            for fd in wakeup_fds:
                os.close(fd)
            for sig in (signal.SIGCHLD, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            from ddpcourse.launcher._rank_child import run_rank

            code = run_rank(job_dir, rank)
        finally:
            os._exit(code)
    try:
        os.setpgid(pid, pid)  # also done by the child: whichever runs first wins the race
    except OSError:
        pass
    _live_ranks.add(pid)
    _send({"ev": "forked", "job": job_dir, "rank": rank, "pid": pid})


def _reap() -> None:
    while _live_ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _live_ranks.discard(pid)
        _send({"ev": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(parent_pid: int, warm: bool) -> None:
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:
        return
    signal.signal(signal.SIGTERM, _kill_all_and_exit)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle
    _preload(warm)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    _send({"ev": "ready"})

    pending = b""
    while True:
        try:
            readable, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            _reap()
        if 0 in readable:
            chunk = os.read(0, 65536)
            if not chunk:
                _kill_all_and_exit()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                if request["op"] == "fork":
                    _fork_rank(request["job"], int(request["rank"]), (wake_r, wake_w))
        _reap()


if __name__ == "__main__":
    serve(int(sys.argv[1]), warm="--warm" in sys.argv[2:])
