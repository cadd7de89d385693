"""The checks of exercise health_check (chapter 00: bus_bandwidth, all_reduce_self_test) catch
plausible wrong solutions, pass right ones written several ways, and rest on facts measured here.
The exercise: solutions/00_setup/health_check.nb.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autograder.hidden import health_check as hidden
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import health_check as checks

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


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
            run_student(checks.self_test_case, 2, right(kind), corruption)


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
            run_student(checks.self_test_case, 2, wrong, visible_catches)


def test_a_rank_0_that_contributes_nothing_goes_unnoticed_by_the_articles_check():
    """ones * rank: rank 0 adds zeros, so losing its contribution changes nothing it looks at."""
    run_student(checks.self_test_case, 4, articles_check, "no-op")  # at 4 ranks the no-op shows
    with pytest.raises(CheckFailed, match="rank 0's contribution is missing"):
        run_student(checks.self_test_case, 4, articles_check, "rank-0-dropped")
