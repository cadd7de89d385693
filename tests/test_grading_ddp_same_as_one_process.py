"""The checks of exercise ddp_same_as_one_process (chapter 01: train_with_ddp) catch plausible
wrong training loops, pass a right one, and rest on facts about DDP measured here; in the
student's kernel and judged by the trusted grader (autograder/trusted.py), where only the ranks'
observations come back. The exercise: solutions/01_why_ddp/ddp_same_as_one_process.nb.py."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autograder.hidden import ddp_same_as_one_process as hidden
from ddpcourse.grading.written_out import digests
from written_out_values import assert_digests_close
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import ddp_same_as_one_process as checks
from ddpcourse.launcher import run_ranks
from rank_lines import names_ranks_first, ranks_named
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
# This module's functions travel to the ranks by value, as a notebook's do: a rank never imports
# this module (and, through it, the grader's heavy imports).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
    fresh = checks.make_model("tiny", 0)
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
    checks.check_train_with_ddp_matches_one_process(train_right)
    checks.check_train_with_ddp_shares_the_batch(train_right)
    hidden.check_train_with_ddp(train_right)


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
    by_name = {"matches": checks.check_train_with_ddp_matches_one_process,
               "shares": checks.check_train_with_ddp_shares_the_batch,
               "not_divisible": lambda fn: run_student(checks.UNEVEN_BATCH, 2, fn, 7)}
    assert (2, 7) in hidden.NOT_DIVISIBLE
    if wrong is train_every_rank_on_everything:  # right weights, at N times the work
        checks.check_train_with_ddp_matches_one_process(wrong)
    with pytest.raises(CheckFailed, match=message):
        by_name[check](wrong)


def ddp_facts(rank, world_size):
    model = checks.make_model("frozen_shift", rank)
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


def train_with_summed_loss_and_rebound_checks(model, x, y, steps, lr):
    """Attack: the summed loss, and the comparisons rebound inside the rank (where the old checks
    judged): the judge runs elsewhere, so nothing changes."""
    import ddpcourse.grading.checks as grading
    import ddpcourse.grading.exercises.ddp_same_as_one_process as case
    grading.CheckFailed = case.CheckFailed = type("Silenced", (Exception,), {})
    torch.allclose = lambda *args, **kwargs: True
    torch.equal = lambda *args, **kwargs: True
    return train_with_summed_loss(model, x, y, steps, lr)


def test_what_the_class_changes_inside_the_ranks_cannot_change_the_verdict():
    with pytest.raises(CheckFailed, match="not what one process gets") as failed:
        checks.check_train_with_ddp_matches_one_process(train_with_summed_loss_and_rebound_checks)
    assert {0, 1} <= set(ranks_named(str(failed.value)))


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("wrong, check, message", [
    (train_with_summed_loss_and_rebound_checks, checks.check_train_with_ddp_matches_one_process,
     "not what one process gets"),
    (train_without_ddp, checks.check_train_with_ddp_matches_one_process,
     "differs between rank 0 and rank 1"),
    (train_and_return_the_wrapper, checks.check_train_with_ddp_matches_one_process,
     "returned the DistributedDataParallel wrapper"),
    (train_every_rank_on_everything, checks.check_train_with_ddp_shares_the_batch,
     "every rank trained on the whole batch"),
    (train_with_uneven_shares, hidden.check_train_with_ddp, "expected ValueError"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(wrong, host))
    assert names_ranks_first(str(failed.value))  # each failed rank is named


# --- the judges read the ranks' reports as untrusted data ----------------------------------


def honest_report(world_size, rank, rows=8, steps=5, lr=0.1, seed=0):
    x, _ = checks.make_batch(rows, seed)
    reference = hidden.reference_run("tiny", rows, steps, lr, seed)
    k = rows // world_size
    return {"returned": checks.RETURNED_MODEL, "returned_module": True, "forward_calls": steps,
            "inputs": [x[rank * k:(rank + 1) * k].clone() for _ in range(steps)],
            "state": {name: t.clone() for name, t in reference.items()}}


TRAINING_DAMAGE = [
    ((), None), ((), {}), ((), [1, 2]), (("returned",), 3), (("returned",), "Module"),
    (("returned",), "x" * 1_000_000), (("returned_module",), "yes"),
    (("forward_calls",), "5"), (("forward_calls",), 6), (("inputs",), "x"), (("inputs",), []),
    (("inputs", 0), "a string"), (("inputs", 0), torch.zeros(4, 3)),
    (("inputs", 0), torch.zeros(())),
    (("inputs", 0), torch.zeros(100_000, 8)), (("inputs", 0), torch.zeros(4, 8).to_sparse()),
    (("inputs", 0), torch.zeros(4, 8, dtype=torch.complex64)), (("state",), []),
    (("state",), {"x" * 100_000: 1}), (("state", "net.0.weight"), "nan"),
    (("state", "net.0.weight"), torch.zeros(3, dtype=torch.int64)),
    (("state", "net.0.bias"), None),
]
UNEVEN_DAMAGE = [((), None), ((), {}), (("raised",), 3), (("raised",), None),
                 (("value_error",), "yes"), (("value_error",), False),
                 (("message",), None)]


def test_every_written_out_weight_is_the_reference_runs():
    """The visible checks hold no one-process training (it yields the answer): the visible case's
    weights are written out as digests, held here to the hidden checks' reference run."""
    assert checks.VISIBLE_WEIGHTS
    for (kind, rows, steps, lr, seed), written in checks.VISIBLE_WEIGHTS.items():
        assert_digests_close(written, digests(hidden.reference_run(kind, rows, steps, lr, seed)))
    for name in ("reference_run", "train_single_process"):
        assert not hasattr(checks, name)


def test_the_visible_judge_refuses_a_case_without_written_out_weights():
    reports = [honest_report(2, rank, steps=4) for rank in range(2)]
    with pytest.raises(LookupError, match="grader bug: no written-out weights"):
        checks.judge_ddp(reports, 2, "tiny", 8, 4)


def test_the_written_out_digest_catches_one_step_fewer():
    reports = [honest_report(2, rank) for rank in range(2)]
    fewer = hidden.reference_run("tiny", 8, 4, 0.1, 0)
    for report in reports:
        report["state"] = {name: t.clone() for name, t in fewer.items()}
    with pytest.raises(CheckFailed, match="is not what one process gets.*its sum is"):
        checks.judge_ddp(reports, 2)


def test_honest_reports_pass_the_judges():
    checks.judge_ddp([honest_report(2, rank) for rank in range(2)], 2)
    ok = {"raised": "ValueError", "value_error": True, "message": "no split"}
    checks.judge_not_divisible([ok, ok], 2, 7)


@pytest.mark.parametrize("case, path, value",
                         [("training", *damage) for damage in TRAINING_DAMAGE]
                         + [("uneven", *damage) for damage in UNEVEN_DAMAGE],
                         ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(case, path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    if case == "training":
        reports = [honest_report(2, rank) for rank in range(2)]
        judge, args = checks.judge_ddp, ()
    else:
        ok = {"raised": "ValueError", "value_error": True, "message": "no split"}
        reports, judge, args = [ok, ok], checks.judge_not_divisible, (7,)
    reports[1] = altered(reports[1], path, value)
    with pytest.raises(CheckFailed) as failed:
        judge(reports, 2, *args)
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
