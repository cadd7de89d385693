"""The on-disk layout of one :func:`ddpcourse.launcher.run_ranks` call, shared by parent and ranks.

Each call gets a private temporary directory. Files, not pipes, carry results and reports: a rank
that returns a large value or prints 100 MB can never block on a full pipe, and the parent can read
whatever a killed rank left behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

# Set in each rank to the call's scratch folder (JobFiles.scratch; see launcher.call_scratch_dir).
SCRATCH_VARIABLE = "DDPCOURSE_CALL_SCRATCH"


@dataclass
class JobSpec:
    """How to run the ranks: plain data, loadable before the caller's ``sys.path`` is in place."""

    world_size: int
    backend: str
    timeout_s: float
    seed: int | None
    threads_per_rank: int
    init_process_group: bool
    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    sources: dict  # in-memory linecache entries (notebook cells) for readable tracebacks


@dataclass
class JobCall:
    """What to run, pickled by value (cloudpickle); loaded once the caller's context is adopted."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict


class JobFiles:
    """Paths inside one call's directory."""

    def __init__(self, job_dir: str):
        self.dir = job_dir

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    @property
    def spec(self) -> str:
        return self._path("job.pkl")

    @property
    def call(self) -> str:
        return self._path("call.pkl")

    @property
    def store(self) -> str:
        return self._path("filestore")

    def result(self, rank: int) -> str:
        return self._path(f"result-{rank}.pkl")

    def error(self, rank: int) -> str:
        return self._path(f"error-{rank}.pkl")

    def output(self, rank: int) -> str:
        return self._path(f"output-{rank}.log")

    def stacks(self, rank: int) -> str:
        return self._path(f"stacks-{rank}.txt")

    @property
    def scratch(self) -> str:
        """A folder every rank of the call may write in; it goes with the call's files."""
        return self._path("scratch")
