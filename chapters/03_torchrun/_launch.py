"""Run a command with a deadline and leave nothing behind: used by chapters 03-04 and their tests.

A torchrun job is a tree of processes (torchrun's agent, its workers). ``subprocess.run(...,
timeout=...)`` kills only the top one, so a hung rendezvous would leave workers running. Here the
command gets a session of its own, and at the deadline its whole process group is killed.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass

from ddpcourse.processes import kill_process_group


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
        kill_process_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    finally:
        kill_process_group(proc.pid, signal.SIGKILL, group_only=True)  # stragglers, if any
    return Finished(proc.returncode, out, err, time.perf_counter() - start, timed_out)
