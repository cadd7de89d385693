"""The checks of exercise ranks_from_env (chapter 04: ranks from torchrun's or Slurm's
environment) catch the rank-zero default and the silent fallback between launchers, in the
student's kernel and judged by the trusted grader (autograder/trusted.py, where only the ranks'
observations come back), and read the ranks' reports as untrusted data.
The exercise: solutions/04_process_groups/ranks_from_env.nb.py."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest

from autograder.hidden import ranks_from_env as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import ranks_from_env as checks
from rank_lines import names_ranks_first
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")

def the_solution():
    """``ranks_from_env`` as the source notebook's solution cell defines it. (autograder.sources
    is imported here, not above: the ranks import this module to rebuild its functions, and
    nbformat would cost each of them seconds.)"""
    from autograder.sources import SOLUTIONS, solution_code

    source = SOLUTIONS / "04_process_groups" / "ranks_from_env.ipynb"
    namespace = {"Mapping": Mapping}
    exec(compile(solution_code(source, "ranks-from-env"), "<student notebook>", "exec"),
         namespace)
    return namespace["ranks_from_env"]


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


def returns_strings(env):
    """Reads the right variables but forgets to convert them."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    if not all(n in env for n in names):
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
    return tuple(env[n] for n in names)


def raises_key_error(env):
    """Indexes the environment without checking: a KeyError, not a ValueError, when unset."""
    return int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])


def reads_without_checking(env, missing_named=all, check_range=False):
    """Picks the launcher as the task says; names ``missing_named`` of the missing variables
    (``all``, or only the first: ``any``); checks ``0 <= rank < world_size`` only if asked."""
    torchrun = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    slurm = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
    names = torchrun if any(n in env for n in torchrun) else slurm
    if not any(n in env for n in names):
        raise ValueError(f"none of {torchrun + slurm} is set")
    missing = [n for n in names if n not in env]
    if missing:
        raise ValueError(f"missing {missing if missing_named is all else missing[0]}")
    rank, local_rank, world_size = (int(env[n]) for n in names)
    if check_range and not 0 <= rank < world_size:
        raise ValueError(f"{names[0]} out of range")
    return rank, local_rank, world_size


def names_only_the_first_missing(env):
    return reads_without_checking(env, missing_named=any, check_range=True)


def accepts_rank_equal_to_world_size(env):
    return reads_without_checking(env, missing_named=all, check_range=False)


def defaults_to_zero_and_rebinds_the_checks(env):
    """The rank-zero default, and the check module's comparisons rebound in its process."""
    import ddpcourse.grading.checks as grading
    import ddpcourse.grading.exercises.ranks_from_env as case

    case.expect_ranks = case.expect_value_error = lambda *args, **kwargs: None
    grading.judge_each_rank = case.judge_each_rank = lambda *args, **kwargs: None
    return defaults_to_zero(env)


def test_the_reference_solution_passes_every_check():
    right = the_solution()
    checks.check_ranks_from_env_reads_torchrun_and_slurm(right)
    checks.check_ranks_from_env_never_defaults(right)
    checks.check_ranks_from_env_in_real_processes(right)
    hidden.check_ranks_from_env(right)


def test_ranks_from_env_checks_catch_the_rank_zero_default_and_the_silent_fallback():
    with pytest.raises(CheckFailed, match="empty environment: expected ValueError"):
        checks.check_ranks_from_env_never_defaults(defaults_to_zero)
    checks.check_ranks_from_env_reads_torchrun_and_slurm(falls_back_to_slurm)
    with pytest.raises(CheckFailed, match="half a torchrun environment"):
        hidden.check_ranks_from_env(falls_back_to_slurm)


@pytest.mark.parametrize("wrong, check, message", [
    (returns_strings, checks.check_ranks_from_env_reads_torchrun_and_slurm,
     r"^rank 0: torchrun env: expected \(3, 1, 8\) \(three ints\), got \('3', '1', '8'\)$"),
    (raises_key_error, checks.check_ranks_from_env_never_defaults,
     r"empty environment: expected ValueError, got KeyError: 'RANK'"),
    (raises_key_error, checks.check_ranks_from_env_in_real_processes,
     r"your code raised KeyError"),
    (defaults_to_zero, checks.check_ranks_from_env_in_real_processes,
     r"slurm environment of process 1 of 4: expected \(1, 1, 4\) \(three ints\), got "
     r"\(0, 0, 1\)"),
    # what the task's "Raises" asks, each with a visible case (not only a hidden one)
    (names_only_the_first_missing, checks.check_ranks_from_env_never_defaults,
     r"only RANK \(the message names every missing variable\): the ValueError must name "
     r"\['WORLD_SIZE'\]"),
    (accepts_rank_equal_to_world_size, checks.check_ranks_from_env_never_defaults,
     r"RANK equal to WORLD_SIZE: expected ValueError naming \['RANK'\], got \(2, 0, 2\)"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_visible_checks_catch(wrong, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("wrong, check, message", [
    (defaults_to_zero_and_rebinds_the_checks, checks.check_ranks_from_env_never_defaults,
     "empty environment: expected ValueError"),
    (defaults_to_zero, checks.check_ranks_from_env_in_real_processes,
     r"rank 1: slurm environment of process 1 of 4: expected \(1, 1, 4\)"),
    (raises_key_error, checks.check_ranks_from_env_reads_torchrun_and_slurm,
     r"rank 0: your code raised KeyError: 'RANK'"),
    (falls_back_to_slurm, hidden.check_ranks_from_env, "half a torchrun environment"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(wrong, host))
    assert names_ranks_first(str(failed.value))  # each failed rank is named


# --- the judges read the ranks' reports as untrusted data ----------------------------------

CASES = checks.VISIBLE_CASES + checks.MISSING_CASES


def honest_reports():
    report = checks.observe_environments(0, 1, the_solution(), CASES)
    return [report, copy.deepcopy(report)]


def honest_launched_reports(world_size=3):
    total = float(world_size * (world_size - 1) // 2)
    return [{"answer": [rank, rank, world_size], "repr": repr((rank, rank, world_size)),
             "raised": None, "group": {"total": total}} for rank in range(world_size)]


DAMAGE = [
    ((), None), ((), [1, 2]), (("calls",), "all"), (("calls",), []), (("calls", 0), None),
    (("calls", 0, "answer"), "3, 1, 8"), (("calls", 0, "answer"), [3.0, 1.0, 8.0]),
    (("calls", 0, "answer"), [True, 1, 8]), (("calls", 0, "answer"), list(range(10**6))),
    (("calls", 0, "answer"), None), (("calls", 0), {"answer": None, "repr": None, "raised": None}),
    (("calls", 0, "raised"), "ValueError"), (("calls", 0, "raised"), {"raised": "ValueError"}),
    (("calls", 3, "raised"), None), (("calls", 3, "raised", "value_error"), "yes"),
    (("calls", 3, "raised", "message"), "x" * 1_000_000),
    (("calls", 3, "raised", "raised"), ["ValueError"]),
]
LAUNCHED_DAMAGE = [
    ((), None), ((), {}), (("answer",), [0, 0, 3]), (("answer",), "1"), (("raised",), 7),
    (("group",), None), (("group",), {}), (("group",), {"total": "3.0"}),
    (("group",), {"total": 4.0}), (("group",), {"total": float("nan")}),
    (("group",), {"error": None}), (("group",), {"error": "e" * 1_000_000}),
]


def test_honest_reports_pass_the_judges():
    checks.judge_environments(honest_reports(), 2, CASES)
    checks.judge_launched(honest_launched_reports(), 3, "slurm", "token")


@pytest.mark.parametrize("case, path, value",
                         [("environments", *damage) for damage in DAMAGE]
                         + [("launched", *damage) for damage in LAUNCHED_DAMAGE],
                         ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(case, path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    if case == "environments":
        reports = honest_reports()
        reports[1] = altered(reports[1], path, value)
        judge = lambda: checks.judge_environments(reports, 2, CASES)  # noqa: E731
    else:
        reports = honest_launched_reports()
        reports[1] = altered(reports[1], path, value)
        judge = lambda: checks.judge_launched(reports, 3, "torchrun", "token")  # noqa: E731
    with pytest.raises(CheckFailed) as failed:
        judge()
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
