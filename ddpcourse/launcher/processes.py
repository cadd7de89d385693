"""Small, OS-level process helpers shared by the rank launcher, the autograder and the tests.

Why they exist: a multi-process test must never leave processes behind. The launcher puts every
rank in its own process group (so one signal reaches the rank *and* whatever it started, such as
DataLoader workers), asks the kernel to kill a child when its parent dies (Linux
``PR_SET_PDEATHSIG``), and the tests count live descendants to prove nothing was orphaned.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Returns False where the platform has no such facility (macOS); callers then rely on their
    other clean-up paths (pipes reaching EOF, explicit kills).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def kill_process_group(pid: int, sig: int = signal.SIGKILL, group_only: bool = False) -> None:
    """Signal the process group led by ``pid`` and ``pid`` itself; a vanished process is fine.

    Use ``group_only=True`` once ``pid`` may have been reaped: the kernel never hands out a pid
    that is still some live group's id, so the group is safe to signal but the bare pid is not.
    """
    for send in (os.killpg,) if group_only else (os.killpg, os.kill):
        try:
            send(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid`` from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    after_name = text[text.rindex(")") + 2 :].split()
    return int(after_name[1]), after_name[0]


def process_table() -> dict[int, tuple[int, str]]:
    """One consistent look at every process: pid -> (parent pid, state). Linux only."""
    table: dict[int, tuple[int, str]] = {}
    if not Path("/proc").is_dir():
        return table
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def live_descendants(root: int | None = None, table: dict | None = None) -> set[int]:
    """Pids of every running (non-zombie) descendant of ``root`` (default: this process).

    Pass one ``process_table()`` to several calls to get answers that agree with each other.
    Linux only (reads /proc); returns an empty set elsewhere.
    """
    root = os.getpid() if root is None else root
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (parent, _state) in table.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {pid for pid in found if table[pid][1] != "Z"}


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    stat = _proc_stat(pid)
    if stat is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not Path("/proc").is_dir()
    return stat[1] != "Z"


# A torchrun job is a tree of processes (the agent, its workers); ``subprocess.run(timeout=...)``
# kills only the top one, so a hung rendezvous would leave workers running. run_bounded gives the
# command a session of its own and, at the deadline, kills every process below it as well: torchrun
# starts each worker in a session of its own (``start_new_session=True`` in
# torch/distributed/elastic/multiprocessing/subprocess_handler), so killing the command's process
# group alone left both workers of a 2-rank job alive.


def kill_tree(pid: int) -> None:
    """Kill ``pid``'s process group and every process below it, whatever group each is in."""
    kill_process_group(pid, signal.SIGSTOP)  # it can start no new child meanwhile
    for child in live_descendants(pid):
        kill_process_group(child, signal.SIGKILL)  # a child, and its group (DataLoader workers)
    kill_process_group(pid, signal.SIGKILL)


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool


def run_bounded(cmd, timeout: float, cwd=None, env=None, shell: bool = False) -> Finished:
    """Run ``cmd``; at ``timeout`` seconds kill its process group and say so (``timed_out``)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(proc.pid)
        out, err = proc.communicate()
    finally:
        kill_process_group(proc.pid, signal.SIGKILL, group_only=True)  # stragglers, if any
    return Finished(proc.returncode, out, err, time.perf_counter() - start, timed_out)
