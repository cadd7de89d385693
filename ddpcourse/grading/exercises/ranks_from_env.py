"""Chapter 04, process groups: visible checks for ``ranks_from_env``.

The contract is the docstring of ``ranks_from_env`` in
solutions/04_process_groups/ranks_from_env.nb.py (students:
exercises/04_process_groups/ranks_from_env.ipynb). The checks feed it torchrun's and SLURM's
variables, and half-set environments that must raise rather than fall back or default to rank 0
(the source article's "all ranks are rank 0" bug), and run it in real processes that build a
process group from its answer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpcourse.grading.checks import CheckFailed, run_student

TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")


class FrozenEnv(Mapping):
    """A read-only Mapping that is not a dict: ``ranks_from_env`` must accept any Mapping."""

    def __init__(self, values: dict):
        self._values = dict(values)

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)


def expect_ranks(ranks_from_env, env: dict, expected: tuple, what: str) -> None:
    try:
        got = ranks_from_env(env)
    except ValueError as exc:
        raise CheckFailed(f"{what}: expected {expected}, but it raised ValueError: {exc}") from None
    if tuple(got) != expected or not all(type(v) is int for v in got):
        raise CheckFailed(f"{what}: expected {expected} (three ints), got {got!r}")


def expect_value_error(ranks_from_env, env: dict, must_name: tuple, what: str) -> None:
    try:
        got = ranks_from_env(env)
    except ValueError as exc:
        missing = [name for name in must_name if name not in str(exc)]
        if missing:
            raise CheckFailed(f"{what}: the ValueError must name {missing}; it said: {exc}") from None
        return
    except Exception as exc:  # noqa: BLE001 - the wrong exception type is the finding
        raise CheckFailed(f"{what}: expected ValueError, got {type(exc).__name__}: {exc}") from None
    raise CheckFailed(f"{what}: expected ValueError naming {list(must_name)}, got {got!r}")


def cases_case(rank, world_size, ranks_from_env, cases):
    """Run a list of (kind, env, expected_or_names, what) cases inside a clean rank."""
    for kind, env, expected, what in cases:
        if kind == "ranks":
            expect_ranks(ranks_from_env, env, tuple(expected), what)
        else:
            expect_value_error(ranks_from_env, env, tuple(expected), what)


VISIBLE_CASES = [
    ("ranks", {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8), "torchrun env"),
    ("ranks", {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}, (5, 1, 8),
     "SLURM env"),
    ("ranks", {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "SLURM_PROCID": "0",
               "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}, (2, 0, 4),
     "torchrun under srun (torchrun's variables win)"),
]
MISSING_CASES = [
    ("error", {}, TORCHRUN + SLURM, "empty environment"),
    ("error", {"RANK": "1", "WORLD_SIZE": "2"}, ("LOCAL_RANK",),
     "torchrun variables without LOCAL_RANK"),
    ("error", {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, ("SLURM_LOCALID",),
     "SLURM variables without SLURM_LOCALID"),
]


def check_ranks_from_env_reads_torchrun_and_slurm(ranks_from_env) -> None:
    run_student(cases_case, 1, ranks_from_env, VISIBLE_CASES)


def check_ranks_from_env_never_defaults(ranks_from_env) -> None:
    run_student(cases_case, 1, ranks_from_env, MISSING_CASES)


def launched_case(rank, world_size, ranks_from_env, scheduler, store_dir):
    """In a real process: read the identity the launcher gave, then use it to build a process
    group and do the article's sanity check (all_reduce of ones * rank)."""
    env = dict(os.environ)
    if scheduler == "slurm":
        for name in TORCHRUN + ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
            env.pop(name, None)
        env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(world_size))
    expect_ranks(ranks_from_env, env, (rank, rank, world_size),
                 f"{scheduler} environment of process {rank} of {world_size}")
    got_rank, _, got_world = ranks_from_env(env)
    store = dist.FileStore(os.path.join(store_dir, f"store-{scheduler}"), got_world)
    dist.init_process_group("gloo", store=store, rank=got_rank, world_size=got_world,
                            timeout=timedelta(seconds=20))
    try:
        total = torch.ones(1) * got_rank
        dist.all_reduce(total)
    finally:
        dist.destroy_process_group()
    expected = world_size * (world_size - 1) / 2
    if total.item() != expected:
        raise CheckFailed(f"all_reduce of ones * rank gave {total.item()}, expected {expected}")
    return total.item()


def run_launched(ranks_from_env, world_size: int, scheduler: str, **kwargs) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ddpcourse-ranks-from-env-") as store_dir:
        run_student(launched_case, world_size, ranks_from_env, scheduler, store_dir,
                    init_process_group=False, **kwargs)


def check_ranks_from_env_in_real_processes(ranks_from_env) -> None:
    """4 processes under a torchrun-like launcher, then under a SLURM-like one."""
    run_launched(ranks_from_env, 4, "torchrun")
    run_launched(ranks_from_env, 4, "slurm")
