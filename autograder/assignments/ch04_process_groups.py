"""Assignment 04_process_groups: know who you are, from torchrun or SLURM, or fail loudly."""

from autograder.authoring import hidden_test, markdown, scratch, setup, solution, visible_test

ASSIGNMENT = "04_process_groups"
NOTEBOOK = "ranks_from_env"

SETUP = """
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import os
from typing import Mapping

import torch
import torch.distributed as dist

from ddpcourse.grading import ch04, integrity, setup_notebook
from ddpcourse.launcher import run_ranks

setup_notebook(grader_modules=["autograder.hidden.ch04"])
"""

INTRO = """
# Exercise 04: who am I? Ranks from the launcher's environment

Every process of a distributed job must learn three numbers before it can join a process group:
its global **rank**, its **local rank** (which GPU on its machine), and the **world size**.
`torchrun` sets `RANK`, `LOCAL_RANK` and `WORLD_SIZE`; a SLURM job step started with `srun` sets
`SLURM_PROCID`, `SLURM_LOCALID` and `SLURM_NTASKS`.

The source article tells of a job where the script read a variable the launcher did not set and
every process became rank 0. The cure is a function that **never guesses**.

**Self-check** from the repository root: `pytest exercises/04_process_groups`.
"""

TASK = """
## `ranks_from_env(env) -> (rank, local_rank, world_size)` (6 points)

`env` is any `Mapping[str, str]` (`os.environ`, a dict, ...). Return three `int`s:

1. If **any** of torchrun's `RANK`, `LOCAL_RANK`, `WORLD_SIZE` is set, use torchrun's: all three
   must be set (under `torchrun` they always are; half of them means something is broken, so do not
   fall back to SLURM).
2. Otherwise, if any of `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS` is set, use those, and all
   three must be set.
3. Otherwise, and whenever a required variable is missing, raise `ValueError` whose message
   **names every missing variable** (for an environment with neither, all six).

Values must be integers with `0 <= local_rank`, `0 <= rank < world_size`; anything else is a
`ValueError` that names the offending variable. Never return a default such as rank 0.
"""

SOLUTION = '''
def ranks_from_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or SLURM's variables; ValueError if unsure."""
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
'''

TRY = """
# Try it: four processes started like torchrun starts them.
def who_am_i(rank, world_size):
    return ranks_from_env(os.environ)

run_ranks(who_am_i, 4, init_process_group=False, timeout=15)
"""


def cells():
    return [
        markdown("intro", INTRO),
        setup("setup", SETUP),
        markdown("task-ranks-from-env", TASK),
        solution("ranks-from-env", SOLUTION),
        scratch(TRY),
        visible_test("test-ranks-from-env-torchrun-and-slurm", 2,
                     "torchrun's variables, SLURM's, and both (torchrun's win).", "ch04",
                     "check_ranks_from_env_reads_torchrun_and_slurm(ranks_from_env)"),
        visible_test("test-ranks-from-env-never-defaults", 1,
                     "missing variables raise ValueError naming them - never a default of "
                     "rank 0.", "ch04", "check_ranks_from_env_never_defaults(ranks_from_env)"),
        visible_test("test-ranks-from-env-real-processes", 1,
                     "4 real processes read their identity and build a process group with it.",
                     "ch04", "check_ranks_from_env_in_real_processes(ranks_from_env)"),
        hidden_test("test-ranks-from-env-hidden", 2,
                    "half-set environments, values that are not valid ranks, any Mapping, 1 and "
                    "3 processes.", "ch04", "check_ranks_from_env(ranks_from_env)"),
    ]
