"""The checks of exercise ranks_from_env (chapter 04: ranks from torchrun's or Slurm's
environment) catch the rank-zero default and the silent fallback between launchers.
The exercise: solutions/04_process_groups/ranks_from_env.nb.py."""

from __future__ import annotations

import pytest

from autograder.hidden import ranks_from_env as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import ranks_from_env as checks

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


def defaults_to_zero(env):
    """The article's bug, as a function: a missing variable silently becomes rank 0."""
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def falls_back_to_slurm(env):
    """Right for complete environments, but mixes launchers when torchrun's are half set."""
    for names in (("RANK", "LOCAL_RANK", "WORLD_SIZE"),
                  ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")):
        if all(n in env for n in names):
            return tuple(int(env[n]) for n in names)
    raise ValueError("missing RANK LOCAL_RANK WORLD_SIZE SLURM_PROCID SLURM_LOCALID SLURM_NTASKS")


def test_ranks_from_env_checks_catch_the_rank_zero_default_and_the_silent_fallback():
    with pytest.raises(CheckFailed, match="empty environment: expected ValueError"):
        checks.check_ranks_from_env_never_defaults(defaults_to_zero)
    checks.check_ranks_from_env_reads_torchrun_and_slurm(falls_back_to_slurm)
    with pytest.raises(CheckFailed, match="half a torchrun environment"):
        hidden.check_ranks_from_env(falls_back_to_slurm)
