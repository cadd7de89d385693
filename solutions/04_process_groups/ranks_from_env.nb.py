# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise 04: who am I? Ranks from the launcher's environment
#
# Every process of a distributed job must learn three numbers before it can join a process group:
# its global **rank**, its **local rank** (which GPU on its machine), and the **world size**.
# `torchrun` sets `RANK`, `LOCAL_RANK` and `WORLD_SIZE`; a SLURM job step started with `srun` sets
# `SLURM_PROCID`, `SLURM_LOCALID` and `SLURM_NTASKS`.
#
# The source article tells of a job where the script read a variable the launcher did not set and
# every process became rank 0. The cure is a function that **never guesses**.
#
# **Self-check** from the repository root: `pytest exercises/04_process_groups`.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import os
from typing import Mapping

import torch
import torch.distributed as dist

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import ranks_from_env as checks
from ddpcourse.launcher import run_ranks

setup_notebook("ranks_from_env")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-ranks-from-env", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `ranks_from_env(env) -> (rank, local_rank, world_size)` (6 points)
#
# Write the function every script of a distributed job needs first: it reads the launcher's
# variables, whichever launcher started the process, and refuses to guess when they do not add up,
# so that the source article's "every process is rank 0" cannot happen silently.
#
# Implement `ranks_from_env` as its docstring below says: which variables it reads, in what order of
# preference, and when it raises `ValueError` instead.

# %% nbgrader={"grade": false, "grade_id": "ranks-from-env", "locked": false, "schema_version": 3, "solution": true, "task": false}
def ranks_from_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or SLURM's variables; ValueError if unsure.

    1. If any of torchrun's `RANK`, `LOCAL_RANK`, `WORLD_SIZE` is set, use torchrun's: all three
       must be set (under `torchrun` they always are; half of them means something is broken, so do
       not fall back to SLURM).
    2. Otherwise, if any of `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS` is set, use those, and
       all three must be set.
    3. Otherwise, and whenever a required variable is missing, raise `ValueError`.

    Never return a default such as rank 0.

    Values are read as Python's `int()` reads a string: `"3"`, `" 3"`, `"+3"` and `"03"` are 3;
    anything `int()` refuses (`"3.0"`, `"one"`, `""`) is not an integer.

    Args:
        env: any `Mapping[str, str]` (`os.environ`, a dict, ...).

    Returns:
        Three `int`s, `(rank, local_rank, world_size)`, with `0 <= local_rank` and
        `0 <= rank < world_size`.

    Raises:
        ValueError: when a required variable is missing; the message names every missing variable
            (for an environment with neither launcher's variables, all six).
        ValueError: when a value is not an integer, or breaks `0 <= local_rank` or
            `0 <= rank < world_size`; the message names the offending variable.
    """
    ### BEGIN SOLUTION
    torchrun = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    slurm = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
    if any(name in env for name in torchrun):
        names = torchrun
    elif any(name in env for name in slurm):
        names = slurm
    else:
        raise ValueError(f"no launcher variables: none of {', '.join(torchrun + slurm)} is set")
    missing = [name for name in names if name not in env]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (have {[n for n in names if n in env]})")
    values = []
    for name in names:
        try:
            values.append(int(env[name]))
        except ValueError:
            raise ValueError(f"{name}={env[name]!r} is not an integer") from None
    rank, local_rank, world_size = values
    if local_rank < 0:
        raise ValueError(f"{names[1]}={local_rank} is negative")
    if not 0 <= rank < world_size:
        raise ValueError(f"{names[0]}={rank} is not in [0, {names[2]}={world_size})")
    return rank, local_rank, world_size
    ### END SOLUTION


# %%
# Try it: four processes started like torchrun starts them.
def who_am_i(rank, world_size):
    return ranks_from_env(os.environ)

run_ranks(who_am_i, 4, init_process_group=False, timeout=15)

# %% nbgrader={"grade": true, "grade_id": "test-ranks-from-env-torchrun-and-slurm", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): torchrun's variables, SLURM's, and both (torchrun's win).
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ranks_from_env as checks
integrity.assert_untampered()
checks.check_ranks_from_env_reads_torchrun_and_slurm(ranks_from_env)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-ranks-from-env-never-defaults", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): ValueError, never a default of rank 0: missing variables (naming every one),
# RANK == WORLD_SIZE, a value int() cannot read.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ranks_from_env as checks
integrity.assert_untampered()
checks.check_ranks_from_env_never_defaults(ranks_from_env)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-ranks-from-env-real-processes", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 4 real processes read their identity and build a process group with it.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ranks_from_env as checks
integrity.assert_untampered()
checks.check_ranks_from_env_in_real_processes(ranks_from_env)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-ranks-from-env-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) half-set environments, values that are not valid ranks, any Mapping, 1 and 3 processes.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import ranks_from_env as hidden
hidden.check_ranks_from_env(ranks_from_env)
print("passed")
### END HIDDEN TESTS
