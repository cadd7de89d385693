"""Launch a chapter script or benchmark the way its docstring says, with a deadline and no process
left behind (``ddpcourse.launcher.run_bounded`` kills the whole process group at the deadline),
and return what it printed. Shared by the tests that read a script's own output.

:func:`launch_once` runs a command line once per test run, however many tests (in however many
pytest-xdist workers) read its output: the first caller launches it under a file lock and leaves
what it printed in ``build/launches/<run>/``; the others wait for the lock and read it."""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from ddpcourse.launcher import run_bounded
from ddpcourse.launcher.processes import Finished

ROOT = Path(__file__).resolve().parent.parent
LAUNCHES = ROOT / "build" / "launches"


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


def this_run() -> str:
    """What names this test run: pytest-xdist's id, the same in every worker of the run, or this
    process without workers."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"process-{os.getpid()}"


def forget_earlier_runs(older_than_s: float = 2 * 3600) -> None:
    """Remove the launches of earlier runs (the controller calls this as a run starts): the
    folders untouched for ``older_than_s``, so a run going on beside this one keeps its own."""
    if not LAUNCHES.is_dir():
        return
    for folder in LAUNCHES.iterdir():
        try:
            stale = time.time() - folder.stat().st_mtime > older_than_s
        except OSError:
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)


def _key(command: str) -> str:
    """The command line and the content of each file it names, with the private modules
    (``_*.py``) beside them: an edited script is launched afresh."""
    digest = hashlib.sha256(command.encode())
    for word in shlex.split(command):
        path = ROOT / word
        if path.suffix in (".py", ".sh") and path.is_file():
            for part in [path, *sorted(path.parent.glob("_*.py"))]:
                digest.update(part.read_bytes())
    return digest.hexdigest()[:24]


def launch_once(command: str, timeout: float = 420) -> Finished:
    """Run the shell command line ``command`` from the repository root with a deadline, once per
    test run (module docstring), and return what it printed, its exit code and whether it ran
    out of time. The caller asserts on the outcome."""
    folder = LAUNCHES / this_run()
    folder.mkdir(parents=True, exist_ok=True)
    key = _key(command)
    record = folder / f"{key}.json"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker launching it: wait for its record
        if record.exists():
            return Finished(**json.loads(record.read_text()))
        done = run_bounded(command, timeout, cwd=ROOT, env=_environment(), shell=True)
        partial = record.with_suffix(".partial")
        partial.write_text(json.dumps(dataclasses.asdict(done)))
        os.replace(partial, record)
        return done
