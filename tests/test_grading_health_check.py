"""The checks of exercise health_check (chapter 00: bus_bandwidth, all_reduce_self_test) catch
plausible wrong solutions, pass right ones written several ways, and rest on facts measured here;
in the student's kernel and judged by the trusted grader (autograder/trusted.py), where only the
ranks' observations come back. The exercise: solutions/00_setup/health_check.nb.py."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from autograder.hidden import health_check as hidden
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import health_check as checks
from rank_lines import names_ranks_first, ranks_named
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
# This module's functions travel to the ranks by value, as a notebook's do: a rank never imports
# this module (and, through it, the grader's heavy imports).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- bus_bandwidth ----------------------------------------------------------------------------

FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
           "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
           "reduce": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n}


def bandwidth(collective, nbytes, seconds, world_size, factors=FACTORS, scale=1e9):
    if collective not in factors or world_size < 1 or seconds <= 0 or nbytes < 0:
        raise ValueError(collective)
    algbw = nbytes / seconds / scale
    return algbw, algbw * factors[collective](world_size)


def uses_the_doctor(collective, nbytes, seconds, world_size):
    from ddpcourse import doctor

    return (doctor.algorithm_bandwidth(nbytes, seconds) / 1e9,
            doctor.all_reduce_bus_bandwidth(nbytes, seconds, world_size) / 1e9)


def in_bytes_per_second(collective, nbytes, seconds, world_size):
    return bandwidth(collective, nbytes, seconds, world_size, scale=1)


def all_reduce_factor_everywhere(collective, nbytes, seconds, world_size):
    return bandwidth(collective, nbytes, seconds, world_size,
                     factors={name: FACTORS["all_reduce"] for name in FACTORS})


def no_validation(collective, nbytes, seconds, world_size):
    algbw = nbytes / max(seconds, 1e-12) / 1e9
    return algbw, algbw * FACTORS.get(collective, lambda n: 1.0)(max(world_size, 1))


def without_all_to_all(collective, nbytes, seconds, world_size):
    factors = {name: f for name, f in FACTORS.items() if name != "all_to_all"}
    return bandwidth(collective, nbytes, seconds, world_size, factors=factors)


def test_bus_bandwidth_checks_pass_the_definitions_and_catch_wrong_ones():
    checks.check_bus_bandwidth_all_reduce(bandwidth)
    checks.check_bus_bandwidth_other_collectives(bandwidth)
    hidden.check_bus_bandwidth(bandwidth)
    with pytest.raises(CheckFailed, match="ddpcourse.doctor.algorithm_bandwidth"):
        checks.check_bus_bandwidth_all_reduce(uses_the_doctor)
    with pytest.raises(CheckFailed, match="that is bytes/s"):
        checks.check_bus_bandwidth_all_reduce(in_bytes_per_second)
    with pytest.raises(CheckFailed, match="reduce_scatter.*expected busbw"):
        checks.check_bus_bandwidth_other_collectives(all_reduce_factor_everywhere)
    with pytest.raises(CheckFailed, match="gather.*expected ValueError"):
        checks.check_bus_bandwidth_other_collectives(no_validation)
    checks.check_bus_bandwidth_other_collectives(without_all_to_all)
    with pytest.raises(CheckFailed, match="all_to_all"):
        hidden.check_bus_bandwidth(without_all_to_all)


def test_the_doctor_really_computes_the_all_reduce_figures():
    """What the import ban is about: the course's own doctor gives the right answer."""
    for case in checks.ALL_REDUCE_CASES:
        assert uses_the_doctor(*case) == pytest.approx(checks.reference_bandwidth(*case))


# --- all_reduce_self_test ---------------------------------------------------------------------

def _pattern(rank):
    return (rank + 1) * torch.arange(1, 9, dtype=torch.float64)


def _expected():
    n = dist.get_world_size()
    return n * (n + 1) // 2 * torch.arange(1, 9, dtype=torch.float64)


def right(all_reduce_kind):
    """A right self-test, with the all-reduce called in one of several ways."""
    def test():
        if dist.get_world_size() < 2:
            raise ValueError("one rank")
        t = _pattern(dist.get_rank())
        if all_reduce_kind == "functional":
            import torch.distributed._functional_collectives as functional

            t = functional.all_reduce(t, "sum", dist.group.WORLD)
        elif all_reduce_kind == "imported":
            from torch.distributed import all_reduce

            all_reduce(t)
        elif all_reduce_kind == "async":
            dist.all_reduce(t, async_op=True).wait()
        else:
            dist.all_reduce(t)
        return torch.equal(t, _expected())
    return test


def always_true():
    if dist.get_world_size() < 2:
        raise ValueError("one rank")
    dist.all_reduce(_pattern(dist.get_rank()))
    return True


def functional_always_true():
    import torch.distributed._functional_collectives as functional

    if dist.get_world_size() < 2:
        raise ValueError("one rank")
    functional.all_reduce(_pattern(dist.get_rank()), "sum", dist.group.WORLD).wait()
    return True


def articles_check():
    """§5.3 of the source article: ones * rank, summed, compared with 0 + 1 + ... + (n-1)."""
    n = dist.get_world_size()
    if n < 2:
        raise ValueError("one rank")
    t = torch.ones(1) * dist.get_rank()
    dist.all_reduce(t)
    return t.item() == n * (n - 1) / 2


def first_element_only():
    if dist.get_world_size() < 2:
        raise ValueError("one rank")
    t = _pattern(dist.get_rank())
    dist.all_reduce(t)
    return bool(t[0] == _expected()[0])


def sum_only():
    if dist.get_world_size() < 2:
        raise ValueError("one rank")
    t = _pattern(dist.get_rank())
    dist.all_reduce(t)
    return bool(t.sum() == _expected().sum())


def asks_everyone():
    """Agrees with the other ranks: then one broken rank makes every rank say False."""
    if dist.get_world_size() < 2:
        raise ValueError("one rank")
    t = _pattern(dist.get_rank())
    dist.all_reduce(t)
    ok = torch.tensor([float(torch.equal(t, _expected()))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item() == 1.0)


def returns_a_tensor():
    if dist.get_world_size() < 2:
        raise ValueError("one rank")
    t = _pattern(dist.get_rank())
    dist.all_reduce(t)
    return (t == _expected()).all()


def no_value_error_on_one_rank():
    t = _pattern(dist.get_rank())
    dist.all_reduce(t)
    return torch.equal(t, _expected())


def chatty():
    for i in range(5):
        print("element", i, "checked")
    return right("dist")()


def tears_down_the_group():
    ok = right("dist")()
    dist.destroy_process_group()
    return ok


@pytest.mark.parametrize("kind", ["dist", "imported", "async", "functional"])
def test_a_right_self_test_passes_however_it_calls_all_reduce(kind):
    if kind == "dist":
        checks.check_self_test_passes_on_a_healthy_group(right(kind))
        checks.check_self_test_catches_a_broken_all_reduce(right(kind))
        hidden.check_all_reduce_self_test(right(kind))
    else:  # every corruption reaches this way of calling all_reduce too
        for corruption in [None, *checks.CORRUPTIONS]:
            run_student(checks.SELF_TEST, 2, right(kind), corruption)


@pytest.mark.parametrize("wrong, visible_catches, message", [
    (always_true, True, "WRONG, but your function returned True"),
    (functional_always_true, True, "WRONG, but your function returned True"),
    (first_element_only, True, "wrong in one element on the last rank only"),
    (asks_everyone, True, "was right .only another rank's was damaged"),
    (returns_a_tensor, True, "must return a Python bool"),
    (no_value_error_on_one_rank, True, "must raise ValueError"),
    (chatty, True, "printed 5 lines"),
    (tears_down_the_group, True, "the process group is unusable"),
    (articles_check, "no-op", "does nothing .every rank keeps its own values.: this rank's all-"),
    (sum_only, "shifted", "one position off"),
])
def test_the_self_test_checks_catch_checks_that_cannot_fail(wrong, visible_catches, message):
    """``visible_catches``: True, or the hidden corruption (tried on 2 ranks) that catches it."""
    def visible():
        checks.check_self_test_passes_on_a_healthy_group(wrong)
        checks.check_self_test_catches_a_broken_all_reduce(wrong)

    if visible_catches is True:
        with pytest.raises(CheckFailed, match=message):
            visible()
    else:
        visible()
        assert visible_catches in hidden.CORRUPTIONS  # the hidden check tries every one
        with pytest.raises(CheckFailed, match=message):
            run_student(checks.SELF_TEST, 2, wrong, visible_catches)


def test_a_rank_0_that_contributes_nothing_goes_unnoticed_by_the_articles_check():
    """ones * rank: rank 0 adds zeros, so losing its contribution changes nothing it looks at."""
    run_student(checks.SELF_TEST, 4, articles_check, "no-op")  # at 4 ranks the no-op shows
    with pytest.raises(CheckFailed, match="rank 0's contribution is missing"):
        run_student(checks.SELF_TEST, 4, articles_check, "rank-0-dropped")


def rebinds_the_checks_and_always_true():
    """Attack: a self-test that cannot fail, and the comparisons rebound inside the rank (where
    the old checks judged): the judge runs elsewhere, so nothing changes."""
    import ddpcourse.grading.exercises.health_check as case

    case.CheckFailed = type("Silenced", (Exception,), {})
    case.corruption_affects = lambda *args: False
    return always_true()


def test_what_the_class_changes_inside_the_ranks_cannot_change_the_verdict():
    with pytest.raises(CheckFailed, match="WRONG, but your function returned True") as failed:
        checks.check_self_test_catches_a_broken_all_reduce(rebinds_the_checks_and_always_true)
    assert {0, 2} <= set(ranks_named(str(failed.value)))


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("wrong, check, message", [
    (uses_the_doctor, checks.check_bus_bandwidth_all_reduce,
     "ddpcourse.doctor.algorithm_bandwidth"),
    (in_bytes_per_second, checks.check_bus_bandwidth_all_reduce, "that is bytes/s"),
    (without_all_to_all, hidden.check_bus_bandwidth, "all_to_all"),
    (rebinds_the_checks_and_always_true, checks.check_self_test_catches_a_broken_all_reduce,
     "WRONG, but your function returned True"),
    (no_value_error_on_one_rank, checks.check_self_test_passes_on_a_healthy_group,
     "must raise ValueError"),
    (tears_down_the_group, checks.check_self_test_passes_on_a_healthy_group,
     "the process group is unusable"),
    (sum_only, hidden.check_all_reduce_self_test, "one position off"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(wrong, host))
    assert names_ranks_first(str(failed.value))  # each failed rank is named


# --- the judges read the ranks' reports as untrusted data ----------------------------------


def honest_call(args):
    algbw, busbw = checks.reference_bandwidth(*args)
    return {"forbidden_calls": [], "hook_removed": False, "raised": None, "value_error": False,
            "message": "", "type": "tuple", "repr": repr((algbw, busbw)),
            "values": [algbw, busbw]}


def honest_bandwidth_report():
    return {"cases": [honest_call(args) for args in checks.OTHER_CASES],
            "errors": [{"forbidden_calls": [], "hook_removed": False, "raised": "ValueError",
                        "value_error": True, "message": "no", "type": "None", "repr": "",
                        "values": None} for _ in checks.ERROR_CASES]}


def honest_self_test_report(world_size, rank, corruption):
    return {"result": not checks.corruption_affects(corruption, rank, world_size),
            "type": "bool", "repr": "True", "lines": 0, "first_lines": [], "all_reduces": 1,
            "group_after": (world_size * torch.arange(4, dtype=torch.float64)
                            + world_size * (world_size - 1) / 2)}


BANDWIDTH_DAMAGE = [
    ((), None), ((), {}), (("cases",), "x"), (("cases",), []), (("errors",), None),
    (("cases", 0), None), (("cases", 0, "forbidden_calls"), "doctor"),
    (("cases", 0, "forbidden_calls"), ["x" * 1_000_000]), (("cases", 0, "hook_removed"), "no"),
    (("cases", 0, "hook_removed"), True), (("cases", 0, "raised"), 7),
    (("cases", 0, "raised"), "x" * 1_000_000), (("cases", 0, "values"), "1, 2"),
    (("cases", 0, "values"), [1.0]), (("cases", 0, "values"), [True, 1.0]),
    (("cases", 0, "values"), [torch.tensor(1.0), 2.0]), (("cases", 0, "values"), [1.0, 2.0]),
    (("cases", 0, "values", 0), float("nan")), (("errors", 0, "raised"), None),
    (("errors", 0, "value_error"), "yes"), (("errors", 0, "message"), None),
]
SELF_TEST_DAMAGE = [
    ((), None), ((), {}), (("lines",), "0"), (("lines",), 4), (("first_lines",), None),
    (("all_reduces",), 0), (("all_reduces",), None), (("result",), "True"), (("result",), False),
    (("result",), None), (("type",), 1), (("group_after",), None),
    (("group_after",), "x" * 1_000_000), (("group_after",), torch.ones(2)),
    (("group_after",), torch.zeros(4, dtype=torch.int64)),
    (("group_after",), torch.zeros(4).to_sparse()),
]


def test_honest_reports_pass_the_judges():
    checks.judge_bandwidth([honest_bandwidth_report()] * 2, 2, checks.OTHER_CASES,
                           checks.ERROR_CASES)
    checks.judge_self_test([honest_self_test_report(3, r, "one-rank") for r in range(3)], 3,
                           "one-rank")
    single = {"raised": "ValueError", "value_error": True, "repr": ""}
    checks.judge_single_rank([single, single], 2)


@pytest.mark.parametrize("case, path, value",
                         [("bandwidth", *damage) for damage in BANDWIDTH_DAMAGE]
                         + [("self_test", *damage) for damage in SELF_TEST_DAMAGE]
                         + [("single", (), None), ("single", ("raised",), 3),
                            ("single", ("value_error",), False), ("single", ("repr",), None)],
                         ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(case, path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    if case == "bandwidth":
        reports = [honest_bandwidth_report(), honest_bandwidth_report()]
        judge, args = checks.judge_bandwidth, (checks.OTHER_CASES, checks.ERROR_CASES)
    elif case == "self_test":
        reports = [honest_self_test_report(2, r, None) for r in range(2)]
        judge, args = checks.judge_self_test, (None,)
    else:
        single = {"raised": "ValueError", "value_error": True, "repr": ""}
        reports, judge, args = [single, dict(single)], checks.judge_single_rank, ()
    reports[1] = altered(reports[1], path, value)
    with pytest.raises(CheckFailed) as failed:
        judge(reports, 2, *args)
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
