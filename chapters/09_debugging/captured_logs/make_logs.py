"""Capture the CPU logs of this folder: run failing_job.py (the exercise's logs) and lesson_job.py
(the lesson's, ``lesson_*.log``) under torchrun once per failure and write everything each run
printed (stdout and stderr, in order) to NAME.log, under a header saying the machine, the date,
the torch version and the exact command.

    python chapters/09_debugging/captured_logs/make_logs.py

``--only NAME ...`` captures some of them; ``--into DIR`` writes there instead of beside this file
(tests/test_grading_read_the_logs.py captures afresh and compares what the exercise asks about
with the committed logs). The captures run side by side, each under a deadline that kills its
whole process tree. The GPU logs (gpu_*.log) come from gpu_duplicate.py and gpu_one_rank.py, run
by hand on a GPU machine: see their docstrings.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
JOB = HERE.relative_to(ROOT) / "failing_job.py"
LESSON_JOB = HERE.relative_to(ROOT) / "lesson_job.py"
DEADLINE_S = 120.0  # a capture needs a few seconds (timeout: 5 more); only a hang reaches this
HEADER_END = "# ---- captured output (stdout and stderr, in order) ----"


@dataclass(frozen=True)
class Capture:
    arguments: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    job: Path = JOB

    def command(self) -> str:
        """The command as typed in a shell at the repository root."""
        prefix = "".join(f"{key}={value} " for key, value in self.env.items())
        return (f"{prefix}torchrun --standalone --nproc-per-node 2 {self.job} "
                + " ".join(self.arguments))


CAPTURES = {
    "raise": Capture(("raise",)),
    "raise_record": Capture(("raise", "--record")),
    "timeout": Capture(("timeout",)),
    "mismatch_detail": Capture(("mismatch",), {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    "sigkill": Capture(("sigkill",)),
    "lesson_raise": Capture(("raise",), job=LESSON_JOB),
    "lesson_raise_record": Capture(("raise", "--record"), job=LESSON_JOB),
    "lesson_abort": Capture(("abort",), job=LESSON_JOB),
}


def torchrun() -> list[str]:
    """torchrun beside this Python, as users type it (else python -m torch.distributed.run)."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without the variables of any rank or launcher it may run in."""
    inherited = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCH_DISTRIBUTED_DEBUG", "OMP_NUM_THREADS")
    env = {key: value for key, value in os.environ.items()
           if key not in inherited and not key.startswith(("TORCHELASTIC_", "PET_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def header(capture: Capture, exit_code: int | None) -> str:
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, no GPU "
               f"used (gloo), Python {platform.python_version()}")
    lines = [f"# machine: {machine}",
             f"# date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
             f"# torch: {importlib.metadata.version('torch')}",
             f"# command (from the repository root): {capture.command()}",
             f"# torchrun's exit code: {exit_code}",
             HEADER_END]
    return "\n".join(lines) + "\n"


def capture_one(name: str, into: Path) -> Path:
    """Run one capture and write ``into/NAME.log``; RuntimeError if it hung past the deadline."""
    from ddpcourse.launcher.processes import run_bounded

    capture = CAPTURES[name]
    command = " ".join([*map(_quote, torchrun()), "--standalone", "--nproc-per-node", "2",
                        str(capture.job), *capture.arguments]) + " 2>&1"
    finished = run_bounded(command, DEADLINE_S, cwd=ROOT, env=clean_env(capture.env), shell=True)
    if finished.timed_out:
        raise RuntimeError(f"{name}: still running after {DEADLINE_S:g} s:\n{finished.stdout}")
    path = into / f"{name}.log"
    path.write_text(header(capture, finished.returncode) + finished.stdout)
    return path


def _quote(word: str) -> str:
    import shlex

    return shlex.quote(word)


def capture(names: list[str], into: Path) -> list[Path]:
    """Every capture of ``names``, side by side; the paths written, in the same order."""
    into.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return list(pool.map(lambda name: capture_one(name, into), names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(CAPTURES), default=list(CAPTURES))
    parser.add_argument("--into", type=Path, default=HERE)
    args = parser.parse_args()
    for path in capture(args.only, args.into):
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # ddpcourse, when run from a checkout without installing it
    main()
