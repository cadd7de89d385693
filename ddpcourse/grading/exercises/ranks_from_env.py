"""Chapter 04, process groups: visible checks for ``ranks_from_env``.

The contract is the docstring of ``ranks_from_env`` in
solutions/04_process_groups/ranks_from_env.nb.py (students:
exercises/04_process_groups/ranks_from_env.ipynb). The checks feed it torchrun's and SLURM's
variables, and half-set environments that must raise rather than fall back or default to rank 0
(the source article's "all ranks are rank 0" bug), and run it in real processes that build a
process group from its answer.

Each check is a :class:`~ddpcourse.grading.checks.Case`. The rank calls the student's function and
reports, as plain data, what came back (the ints, or a text of what else it was) or the
exception's type and message; in the real processes also what the all-reduce of the group built
from the answer gave. The judge compares with the expected answers, which the check itself holds
(the rank's identity is the launcher's, known to the judge; the tables below are the grader's).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpcourse.grading.checks import (Case, CheckFailed, cut_text, judge_each_rank, observed,
                                      reported_calls, run_student, safe_text)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
MAX_TEXT = 2000  # characters of a message or a repr a rank reports (a message names variables)
GROUP_TIMEOUT_S = 5.0  # a rank whose peer answered wrong stops waiting for it after this


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


def _cut(text, limit: int = MAX_TEXT) -> str:
    return cut_text(text, limit)


def _safe_text(make) -> str:
    return safe_text(make, MAX_TEXT)


# --- in the rank: what the call gave, as data --------------------------------------------------


def _described(exc: BaseException) -> dict:
    return {"raised": type(exc).__name__, "message": _safe_text(lambda: exc),
            "value_error": isinstance(exc, ValueError)}


def _answer(got) -> list[int] | None:
    """The returned values when they are a few Python ints (any iterable of them), else None."""
    try:
        values = tuple(got)
    except Exception:  # noqa: BLE001 - not iterable: not an answer
        return None
    if len(values) <= 8 and all(type(v) is int for v in values):
        return list(values)
    return None


def observe_call(ranks_from_env, env: Mapping, must_raise: bool) -> dict:
    """One call. A ValueError is reported; so is any other exception when a ValueError is
    expected (its type is the finding). Otherwise another exception ends the rank, and the
    student reads it with its traceback, as in any of their own runs."""
    try:
        got = ranks_from_env(env)
    except ValueError as exc:
        return {"answer": None, "repr": "", "raised": _described(exc)}
    except Exception as exc:  # noqa: BLE001 - see the docstring
        if not must_raise:
            raise
        return {"answer": None, "repr": "", "raised": _described(exc)}
    return {"answer": _answer(got), "repr": _safe_text(lambda: repr(got)), "raised": None}


def observe_environments(rank, world_size, ranks_from_env, cases):
    """Every case ``(kind, env, expected_or_names, what[, "frozen"])`` in a clean process; the
    environment is given as a fresh dict, or as a read-only :class:`FrozenEnv` when marked so."""
    calls = []
    for kind, env, _, _, *mapping in cases:
        given = FrozenEnv(env) if mapping == ["frozen"] else dict(env)
        calls.append(observe_call(ranks_from_env, given, kind == "error"))
    return {"calls": calls}


def observe_launched(rank, world_size, ranks_from_env, scheduler, token):
    """In a real process: read the identity the launcher gave, then use it to build a process
    group and do the article's sanity check (all_reduce of ones * rank). ``token`` names the
    store file the processes share (in each one's temporary folder: the same for all of them,
    in the sandbox too). What the group gave is reported by the rank, where the student's code
    ran: a determined student could forge it; the judge checks every rank's answer itself, and a
    forged sum could only pass a submission whose answers were right."""
    env = dict(os.environ)
    if scheduler == "slurm":
        for name in TORCHRUN + ("LOCAL_WORLD_SIZE", "GROUP_RANK"):
            env.pop(name, None)
        env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(world_size))
    call = observe_call(ranks_from_env, env, False)
    # The group is built from the answer only when it is this process's identity: with a wrong
    # one it could not form (the judge says why from the answers); the peers then time out.
    if call["answer"] != [rank, rank, world_size]:
        return {**call, "group": None}
    got_rank, _, got_world = call["answer"]
    path = os.path.join(tempfile.gettempdir(), f"ddpcourse-ranks-from-env-{token}-{scheduler}")
    try:
        store = dist.FileStore(path, got_world)
        dist.init_process_group("gloo", store=store, rank=got_rank, world_size=got_world,
                                timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        try:
            total = torch.ones(1) * got_rank
            dist.all_reduce(total)
        finally:
            dist.destroy_process_group()
        del store  # the last process to let go of the store removes its file
        group = {"total": float(total.item())}
    except Exception as exc:  # noqa: BLE001 - reported, the judge decides
        group = {"error": _safe_text(lambda: f"{type(exc).__name__}: {exc}")}
        try:
            os.remove(path)
        except OSError:
            pass
    return {**call, "group": group}


# --- in the judge ------------------------------------------------------------------------------


def _reported_exception(call) -> dict | None:
    raised = observed(call, "raised", (dict, type(None)))
    if raised is None:
        return None
    return {"type": _cut(observed(raised, "raised", str), 200),
            "message": _cut(observed(raised, "message", str)),
            "value_error": observed(raised, "value_error", bool)}


def _reported_answer(call) -> tuple | None:
    answer = observed(call, "answer", (list, type(None)))
    if answer is not None and not (len(answer) <= 8 and all(type(v) is int for v in answer)):
        raise CheckFailed("the rank's report has an 'answer' that is not a few ints")
    return None if answer is None else tuple(answer)


def expect_ranks(call, expected: tuple, what: str) -> None:
    raised = _reported_exception(call)
    if raised is not None:  # only a ValueError is reported here (another one ends the rank)
        raise CheckFailed(f"{what}: expected {expected}, but it raised {raised['type']}: "
                          f"{raised['message']}")
    if _reported_answer(call) != tuple(expected):
        raise CheckFailed(f"{what}: expected {tuple(expected)} (three ints), got "
                          f"{_cut(observed(call, 'repr', str))}")


def expect_value_error(call, must_name: tuple, what: str) -> None:
    raised = _reported_exception(call)
    if raised is None:
        raise CheckFailed(f"{what}: expected ValueError naming {list(must_name)}, got "
                          f"{_cut(observed(call, 'repr', str))}")
    if not raised["value_error"]:
        raise CheckFailed(f"{what}: expected ValueError, got {raised['type']}: "
                          f"{raised['message']}")
    missing = [name for name in must_name if name not in raised["message"]]
    if missing:
        raise CheckFailed(f"{what}: the ValueError must name {missing}; it said: "
                          f"{raised['message']}")


def judge_environments(observations, world_size, cases):
    def judge_rank(rank, observation):
        calls = reported_calls(observation, len(cases))
        for call, (kind, _, expected, what, *_) in zip(calls, cases):
            if kind == "ranks":
                expect_ranks(call, tuple(expected), what)
            else:
                expect_value_error(call, tuple(expected), what)

    judge_each_rank(observations, judge_rank)


def judge_launched(observations, world_size, scheduler, token):
    # First every process's identity; only when all are right, what their group did.
    judge_each_rank(observations, lambda rank, call: expect_ranks(
        call, (rank, rank, world_size),
        f"{scheduler} environment of process {rank} of {world_size}"))
    expected = world_size * (world_size - 1) / 2

    def judge_group(rank, call):
        group = observed(call, "group", dict)
        if "error" in group:
            raise CheckFailed(f"a process group built from its answer failed: "
                              f"{_cut(observed(group, 'error', str))}")
        total = observed(group, "total", float)
        if total != expected:
            raise CheckFailed(f"all_reduce of ones * rank gave {total}, expected {expected}")

    judge_each_rank(observations, judge_group)


ENVIRONMENTS = Case(observe_environments, judge_environments)
LAUNCHED = Case(observe_launched, judge_launched)

VISIBLE_CASES = [
    ("ranks", {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8), "torchrun env"),
    ("ranks", {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}, (5, 1, 8),
     "SLURM env"),
    ("ranks", {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "SLURM_PROCID": "0",
               "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}, (2, 0, 4),
     "torchrun under srun (torchrun's variables win)"),
]
# Every requirement of the task's "Raises" has a visible case (the hidden ones vary them).
MISSING_CASES = [
    ("error", {}, TORCHRUN + SLURM, "empty environment"),
    ("error", {"RANK": "1", "WORLD_SIZE": "2"}, ("LOCAL_RANK",),
     "torchrun variables without LOCAL_RANK"),
    ("error", {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, ("SLURM_LOCALID",),
     "SLURM variables without SLURM_LOCALID"),
    ("error", {"RANK": "1"}, ("LOCAL_RANK", "WORLD_SIZE"),
     "only RANK (the message names every missing variable)"),
    ("error", {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}, ("RANK",),
     "RANK equal to WORLD_SIZE"),
    ("error", {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2.0"},
     ("SLURM_NTASKS",), "a SLURM_NTASKS that int() does not read"),
]


def check_ranks_from_env_reads_torchrun_and_slurm(ranks_from_env) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(ENVIRONMENTS, 1, ranks_from_env, VISIBLE_CASES)


def check_ranks_from_env_never_defaults(ranks_from_env) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(ENVIRONMENTS, 1, ranks_from_env, MISSING_CASES)


def run_launched(ranks_from_env, world_size: int, scheduler: str, **kwargs) -> None:
    """``world_size`` processes under a torchrun-like (or SLURM-like) launcher; a fresh token
    names the store file their group shares."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(LAUNCHED, world_size, ranks_from_env, scheduler, secrets.token_hex(8),
                init_process_group=False, **kwargs)


def check_ranks_from_env_in_real_processes(ranks_from_env) -> None:
    """4 processes under a torchrun-like launcher, then under a SLURM-like one."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_launched(ranks_from_env, 4, "torchrun")
    run_launched(ranks_from_env, 4, "slurm")
