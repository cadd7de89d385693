"""Launch a chapter script or benchmark the way its docstring says, with a deadline and no process
left behind (``ddpcourse.launcher.run_bounded`` kills the whole process group at the deadline),
and return what it printed. Shared by the tests that read a script's own output."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ddpcourse.launcher import run_bounded

ROOT = Path(__file__).resolve().parent.parent


def _environment() -> dict:
    """This interpreter's bin folder first, so ``torchrun`` is the one beside the torch we test."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def launch(args: list[str], timeout: float = 420, torchrun_ranks: int | None = None):
    """Run ``args`` from the repository root (under ``torchrun --standalone --nproc_per_node N``
    when ``torchrun_ranks`` is given); fail with its output unless it exits 0 in time."""
    cmd = [str(a) for a in args]
    if torchrun_ranks is not None:
        cmd = ["torchrun", "--standalone", "--nproc_per_node", str(torchrun_ranks), *cmd]
    else:
        cmd = [sys.executable, *cmd]
    done = run_bounded(cmd, timeout, cwd=ROOT, env=_environment())
    assert not done.timed_out, f"{' '.join(cmd)} did not finish within {timeout} s:\n{done.stdout}"
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done
