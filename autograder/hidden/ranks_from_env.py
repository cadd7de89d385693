"""Hidden checks for chapter 04: half-set environments, bad values, any Mapping, 1-3 processes.
Every check runs the visible module's Cases (the environments are passed as data; "frozen" asks
the rank for a read-only Mapping), so it runs only in the trusted grader."""

from __future__ import annotations

from ddpcourse.grading.exercises.ranks_from_env import (ENVIRONMENTS, SLURM, TORCHRUN,
                                                        run_launched)
from ddpcourse.grading.checks import run_student

CASES = [
    ("ranks", {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, (0, 0, 1), "a single process"),
    ("ranks", {"RANK": "12", "LOCAL_RANK": "4", "WORLD_SIZE": "16", "SLURM_PROCID": "3"},
     (12, 4, 16), "torchrun's variables with a stray SLURM_PROCID"),
    ("ranks", {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "3"}, (2, 0, 3),
     "a read-only Mapping", "frozen"),
    ("error", {"RANK": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2"},
     ("LOCAL_RANK", "WORLD_SIZE"), "half a torchrun environment (no silent fall-back to SLURM)"),
    ("error", {"LOCAL_RANK": "0"}, ("RANK", "WORLD_SIZE"), "only LOCAL_RANK"),
    ("error", {"SLURM_LOCALID": "0"}, ("SLURM_PROCID", "SLURM_NTASKS"), "only SLURM_LOCALID"),
    ("error", {"RANK": "one", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, ("RANK",),
     "a RANK that is not a number"),
    ("error", {"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, ("RANK",),
     "RANK not below WORLD_SIZE"),
    ("error", {"SLURM_PROCID": "0", "SLURM_LOCALID": "-1", "SLURM_NTASKS": "2"},
     ("SLURM_LOCALID",), "a negative SLURM_LOCALID"),
    ("error", {"PATH": "/usr/bin"}, TORCHRUN + SLURM, "an unrelated environment"),
]


def check_ranks_from_env(ranks_from_env) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(ENVIRONMENTS, 1, ranks_from_env, CASES, hide_internals=True)
    for world_size in (1, 3):
        for scheduler in ("torchrun", "slurm"):
            run_launched(ranks_from_env, world_size, scheduler, hide_internals=True)
