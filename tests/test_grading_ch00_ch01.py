"""The checks of exercises 00 (bus_bandwidth, all_reduce_self_test) and 01 (train_with_ddp) catch
plausible wrong solutions, pass right ones written several ways, and rest on facts measured here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autograder.hidden import ch00 as hidden00
from autograder.hidden import ch01 as hidden01
from ddpcourse.grading import ch00, ch01, integrity
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.launcher import run_ranks


@pytest.fixture(autouse=True)
def _snapshot():
    integrity.snapshot()


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
    ch00.check_bus_bandwidth_all_reduce(bandwidth)
    ch00.check_bus_bandwidth_other_collectives(bandwidth)
    hidden00.check_bus_bandwidth(bandwidth)
    with pytest.raises(CheckFailed, match="ddpcourse.doctor.algorithm_bandwidth"):
        ch00.check_bus_bandwidth_all_reduce(uses_the_doctor)
    with pytest.raises(CheckFailed, match="that is bytes/s"):
        ch00.check_bus_bandwidth_all_reduce(in_bytes_per_second)
    with pytest.raises(CheckFailed, match="reduce_scatter.*expected busbw"):
        ch00.check_bus_bandwidth_other_collectives(all_reduce_factor_everywhere)
    with pytest.raises(CheckFailed, match="gather.*expected ValueError"):
        ch00.check_bus_bandwidth_other_collectives(no_validation)
    ch00.check_bus_bandwidth_other_collectives(without_all_to_all)
    with pytest.raises(CheckFailed, match="all_to_all"):
        hidden00.check_bus_bandwidth(without_all_to_all)


def test_the_doctor_really_computes_the_all_reduce_figures():
    """What the import ban is about: the course's own doctor gives the right answer."""
    for case in ch00.ALL_REDUCE_CASES:
        assert uses_the_doctor(*case) == pytest.approx(ch00.reference_bandwidth(*case))


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
        ch00.check_self_test_passes_on_a_healthy_group(right(kind))
        ch00.check_self_test_catches_a_broken_all_reduce(right(kind))
        hidden00.check_all_reduce_self_test(right(kind))
    else:  # every corruption reaches this way of calling all_reduce too
        for corruption in [None, *ch00.CORRUPTIONS]:
            run_student(ch00.self_test_case, 2, right(kind), corruption)


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
        ch00.check_self_test_passes_on_a_healthy_group(wrong)
        ch00.check_self_test_catches_a_broken_all_reduce(wrong)

    if visible_catches is True:
        with pytest.raises(CheckFailed, match=message):
            visible()
    else:
        visible()
        assert visible_catches in hidden00.CORRUPTIONS  # the hidden check tries every one
        with pytest.raises(CheckFailed, match=message):
            run_student(ch00.self_test_case, 2, wrong, visible_catches)


def test_a_rank_0_that_contributes_nothing_goes_unnoticed_by_the_articles_check():
    """ones * rank: rank 0 adds zeros, so losing its contribution changes nothing it looks at."""
    run_student(ch00.self_test_case, 4, articles_check, "no-op")  # at 4 ranks the no-op shows
    with pytest.raises(CheckFailed, match="rank 0's contribution is missing"):
        run_student(ch00.self_test_case, 4, articles_check, "rank-0-dropped")


# --- train_with_ddp ---------------------------------------------------------------------------

def _share(x, y, shard=True):
    rank, n = dist.get_rank(), dist.get_world_size()
    if len(x) % n:
        raise ValueError("rows do not split")
    if not shard:
        return x, y
    k = len(x) // n
    return x[rank * k:(rank + 1) * k], y[rank * k:(rank + 1) * k]


def _loop(model, x, y, steps, lr, reduction="mean", extra_forward=False):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y, reduction=reduction).backward()
        optimizer.step()
        if extra_forward:
            with torch.no_grad():
                model(x)


def train_right(model, x, y, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    if len(x) % n:
        raise ValueError("rows do not split")
    ddp = DDP(model)
    _loop(ddp, x[rank::n], y[rank::n], steps, lr)  # strided shares are fine too
    return model


def train_every_rank_on_everything(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y, shard=False), steps, lr)
    return model


def train_with_summed_loss(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y), steps, lr, reduction="sum")
    return model


def train_without_ddp(model, x, y, steps, lr):
    _loop(model, *_share(x, y), steps, lr)
    return model


def train_a_new_model(model, x, y, steps, lr):
    fresh = ch01.make_model("tiny", 0)
    _loop(DDP(fresh), *_share(x, y), steps, lr)
    return fresh


def train_and_return_the_wrapper(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y), steps, lr)
    return ddp


def train_and_log(model, x, y, steps, lr):
    ddp = DDP(model)
    _loop(ddp, *_share(x, y), steps, lr, extra_forward=True)
    return model


def train_with_uneven_shares(model, x, y, steps, lr):
    rank, n = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    _loop(ddp, x.tensor_split(n)[rank], y.tensor_split(n)[rank], steps, lr)
    return model


def test_a_right_training_loop_passes_every_check():
    ch01.check_train_with_ddp_matches_one_process(train_right)
    ch01.check_train_with_ddp_shares_the_batch(train_right)
    hidden01.check_train_with_ddp(train_right)


@pytest.mark.parametrize("wrong, check, message", [
    (train_with_summed_loss, "matches", "not what one process gets"),
    (train_without_ddp, "matches", "differs between rank 0 and rank 1"),
    (train_a_new_model, "matches", "must return the `model` it was given"),
    (train_and_return_the_wrapper, "matches", "returned the DistributedDataParallel wrapper"),
    (train_every_rank_on_everything, "shares", "every rank trained on the whole batch"),
    (train_and_log, "shares", "forward ran 10 times"),
    (train_with_uneven_shares, "not_divisible", "expected ValueError"),
])
def test_the_ddp_checks_catch_wrong_training_loops(wrong, check, message):
    checks = {"matches": ch01.check_train_with_ddp_matches_one_process,
              "shares": ch01.check_train_with_ddp_shares_the_batch,
              "not_divisible": lambda fn: run_student(ch01.not_divisible_case, 2, fn, 7)}
    assert (2, 7) in hidden01.NOT_DIVISIBLE
    if wrong is train_every_rank_on_everything:  # right weights, at N times the work
        ch01.check_train_with_ddp_matches_one_process(wrong)
    with pytest.raises(CheckFailed, match=message):
        checks[check](wrong)


def ddp_facts(rank, world_size):
    model = ch01.make_model("frozen_shift", rank)
    ddp = DDP(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, state)
    same = all(torch.equal(everyone[0][k], everyone[r][k]) for r in range(world_size)
               for k in state)
    return ddp.module is model, sorted(ddp.state_dict())[0], same


def test_ddp_wraps_the_module_itself_and_copies_rank_0s_state_frozen_and_buffers_included():
    """Backs the task text: DDP trains the very module it wraps (so returning `model` is right),
    a DDP's state_dict keys carry a 'module.' prefix, and the constructor gives every rank rank
    0's parameters (frozen ones too) and buffers."""
    for is_same_module, first_key, equal_everywhere in run_ranks(ddp_facts, 2):
        assert is_same_module and first_key.startswith("module.") and equal_everywhere
