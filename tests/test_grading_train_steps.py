"""The checks of exercise train_steps (chapter 07: gradient accumulation with DDP) pass a right
loop, catch each plausible wrong one with a message that names the mistake, count the gradient
all-reduces both in the student's kernel (an audit in the rank sees DDP's reducer) and through the
grader's broker (autograder/relayed.py), and read the ranks' reports as untrusted data.
The exercise: solutions/07_training_loop/train_steps.nb.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from autograder import trusted
from autograder.hidden import train_steps as hidden
from autograder.relayed import RelayedRanks
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import train_steps as checks
from ddpcourse.grading.written_out import digests
from trusted_path import altered, submitted
from written_out_values import assert_digests_close

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


def make(sync="last", scale="group", zero_grad=True, global_loss=True, validate=True,
         as_tensors=False):
    """A train_steps with one rule changed; the defaults give the right one.

    sync: which micro-batch of a group runs outside no_sync ("last", "first", "every": no no_sync,
    "backward": no_sync around the backward only). scale: divide each loss by the group's size
    ("group"), by accumulation_steps ("k"), or not at all ("none")."""
    def train_steps(ddp_model, micro_batches, optimizer, loss_fn, accumulation_steps):
        if validate and accumulation_steps < 1:
            raise ValueError(accumulation_steps)
        losses = []
        for start in range(0, len(micro_batches), max(accumulation_steps, 1)):
            group = micro_batches[start:start + accumulation_steps]
            divisor = {"group": len(group), "k": accumulation_steps, "none": 1}[scale]
            total = 0.0
            for position, (x, y) in enumerate(group):
                synced = {"last": position == len(group) - 1, "first": position == 0,
                          "every": True, "backward": position == len(group) - 1}[sync]
                outer = contextlib.nullcontext() if synced or sync == "backward" else ddp_model.no_sync()
                with outer:
                    loss = loss_fn(ddp_model(x), y)
                    inner = (ddp_model.no_sync() if sync == "backward" and not synced
                             else contextlib.nullcontext())
                    with inner:
                        (loss / divisor).backward()
                total += loss.item()
            optimizer.step()
            if zero_grad:
                optimizer.zero_grad()
            mean = torch.tensor(total / len(group))
            if global_loss:
                dist.all_reduce(mean)
                mean /= dist.get_world_size()
            losses.append(mean if as_tensors else mean.item())
        return losses
    return train_steps


def test_the_reference_solution_passes_every_check():
    right = make()
    checks.check_accumulation_matches_one_process(right)
    checks.check_one_all_reduce_per_optimizer_step(right)
    checks.check_the_tail(right)
    hidden.check_train_steps(right)


@pytest.mark.parametrize("wrong, check, message", [
    (make(sync="backward"), checks.check_one_all_reduce_per_optimizer_step,
     r"expected 2 gradient all-reduce\(s\), one per optimizer step, but the ranks all-reduced "
     r"the gradients 6 time\(s\): a micro-batch whose forward AND backward"),
    (make(sync="every"), checks.check_accumulation_matches_one_process,
     r"expected 2 gradient all-reduce\(s\).*4 time\(s\)"),
    (make(sync="first"), checks.check_accumulation_matches_one_process,
     r"(after training|no longer identical)"),
    (make(scale="none"), checks.check_accumulation_matches_one_process,
     r"parameter '\w+\.\w+' after training, compared with one process"),
    (make(scale="k"), checks.check_the_tail, r"parameter '\w+\.\w+' after training"),
    (make(zero_grad=False), checks.check_accumulation_matches_one_process,
     r"parameter '\w+\.\w+' after training"),
    (make(global_loss=False), checks.check_accumulation_matches_one_process,
     r"the loss of optimizer step 0 should be"),
    (make(as_tensors=True), checks.check_the_tail, r"expected a list of Python floats"),
], ids=["no_sync-around-backward-only", "no-no_sync", "sync-on-the-first", "no-scaling",
        "tail-divided-by-k", "no-zero_grad", "per-rank-losses", "tensors"])
def test_a_wrong_loop_is_caught_with_what_went_wrong(wrong, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


VISIBLE_SITUATIONS = [(2, checks.setting(4, 2)), (2, checks.setting(6, 3, seed=1)),
                      (2, checks.setting(6, 3, seed=2)), (2, checks.setting(3, 1, seed=3)),
                      (2, checks.setting(5, 2, seed=4)), (2, checks.setting(7, 3, seed=5))]


def test_every_written_out_result_is_the_reference_runs():
    """The visible checks hold no one-process run (it yields the answer): each visible
    situation's weights (digests) and losses are written out, held here to the hidden checks'
    reference run; and every situation the visible checks run has them."""
    keys = {checks.situation_key(s, world_size) for world_size, s in VISIBLE_SITUATIONS}
    assert set(checks.VISIBLE_EXPECTED) == keys
    for world_size, s in VISIBLE_SITUATIONS:
        weights, losses, own = checks.written_out(s, world_size)
        ref_weights, ref_losses, ref_own = hidden.reference(s, world_size)
        assert_digests_close(weights, digests(ref_weights))
        assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
        for mine, theirs in zip(own, ref_own, strict=True):
            assert mine == pytest.approx(theirs, rel=1e-6)
    assert not hasattr(checks, "reference_run")


def test_the_visible_judge_refuses_a_situation_without_a_written_out_result():
    with pytest.raises(LookupError, match="grader bug: no written-out result"):
        checks.judge_train_steps([{}, {}], 2, checks.setting(4, 2, seed=99))


def test_the_hidden_checks_catch_a_missing_value_error():
    with pytest.raises(CheckFailed, match=r"accumulation_steps=0.*expected ValueError"):
        hidden.check_train_steps(make(validate=False))


@pytest.fixture(scope="module")
def relayed():
    """Ranks linked only by the grader's broker (unsandboxed here: the tests' functions are
    trusted), as the autograder grades communication-audited cases."""
    with RelayedRanks(lambda rank, relay_dir: trusted.ObservationHost(
            one_rank=True, dynamo=checks.AUDITED_CASES_BUILD_DDP)) as ranks:
        yield ranks


def test_through_the_broker_the_right_loop_passes_and_a_synced_micro_batch_is_counted(host,
                                                                                      relayed):
    checks.check_one_all_reduce_per_optimizer_step(submitted(make(), host, relayed))
    with pytest.raises(CheckFailed, match=r"all-reduced the gradients 6 time\(s\)"):
        checks.check_one_all_reduce_per_optimizer_step(
            submitted(make(sync="backward"), host, relayed))


def gathers_and_reduces_zeros(ddp_model, micro_batches, optimizer, loss_fn, accumulation_steps):
    """Right weights and losses, and one gradient-sized all-reduce per optimizer step, but the
    gradients are averaged through all_gather and the all-reduce carries zeros: what a byte
    count accepts as a synchronisation."""
    if type(accumulation_steps) is not int or accumulation_steps < 1:
        raise ValueError(accumulation_steps)
    params = list(ddp_model.parameters())
    world = dist.get_world_size()
    losses = []
    for start in range(0, len(micro_batches), accumulation_steps):
        group = micro_batches[start:start + accumulation_steps]
        optimizer.zero_grad()
        total = 0.0
        with ddp_model.no_sync():
            for x, y in group:
                loss = loss_fn(ddp_model(x), y) / len(group)
                loss.backward()
                total += loss.item()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        mean, offset = sum(everyone) / world, 0
        for p in params:
            p.grad.copy_(mean[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        dist.all_reduce(torch.zeros(flat.numel()))  # one synchronisation's bytes
        logged = torch.tensor([total])
        dist.all_reduce(logged)
        losses.append(logged.item() / world)
        optimizer.step()
    return losses


def test_through_the_broker_a_dummy_all_reduce_of_zeros_is_no_synchronisation(host, relayed):
    """Issue 27 item 4: counted by its bytes alone (audited in the rank, as in a notebook), the
    loop above passes; the broker sees that its all-reduce carried zeros."""
    checks.check_one_all_reduce_per_optimizer_step(gathers_and_reduces_zeros)
    with pytest.raises(CheckFailed, match=r"all-reduce of optimizer step 0 did not carry this "
                                          r"rank's gradient.*sum of squares of 0"):
        checks.check_one_all_reduce_per_optimizer_step(
            submitted(gathers_and_reduces_zeros, host, relayed))


def test_the_contributions_are_grouped_into_synchronisations():
    """DDP's buckets, one call or several, make a synchronisation; a logged loss between them
    does not; calls that cannot be grouped are judged by their bytes only."""
    calls = [["all_reduce", n] for n in (8, 4, 4, 2, 8)]
    assert checks.gradient_syncs_carried(calls, [2.0, 0.5, 1.0, 0.25, 3.0], 8) == [2.0, 1.5, 3.0]
    assert checks.gradient_syncs_carried(calls, [2.0, 0.5, 1.0, 0.25, 3.0], 16) == [3.5]
    assert checks.gradient_syncs_carried(calls, [2.0, 0.5, 1.0, None, 3.0], 8) is None
    assert checks.gradient_syncs_carried(calls, [2.0] * 5, 4) is None  # a call above a sync


def observations(world_size=2, s=None):
    from ddpcourse.grading.checks import run_observation
    from ddpcourse.launcher import pickle_by_value

    s = s or checks.setting(4, 2)
    return s, run_observation(checks.observe_train_steps, world_size, pickle_by_value(make()),
                              (s,), 60)


def test_the_judge_reads_reports_as_untrusted_data():
    s, reports = observations()
    checks.judge_train_steps(reports, 2, s)  # as reported: right
    forged = [
        (["traffic", "collective_calls"], [["all_reduce", "lots"]], "malformed"),
        (["traffic"], {}, "lacks 'collective_calls'"),
        (["losses"], [1.0, "two"], "list of Python floats"),
        (["weights", "inp.weight"], "a tensor", "as tensors"),
        ([], None, "lacks 'raised'"),
    ]
    for path, value, message in forged:
        with pytest.raises(CheckFailed, match=message):
            checks.judge_train_steps([altered(reports[0], path, value), reports[1]], 2, s)


def test_a_rank_whose_weights_differ_breaks_the_replicas():
    s, reports = observations()
    weights = reports[1]["weights"]
    bumped = {**weights, "out.bias": weights["out.bias"] + 1e-7}
    with pytest.raises(CheckFailed, match="no longer identical"):
        checks.judge_train_steps([reports[0], altered(reports[1], ["weights"], bumped)], 2, s)


def test_the_grader_preloads_dynamo_only_for_exercises_whose_audited_cases_build_ddp():
    from autograder.worker import _audited_cases_build_ddp

    assert _audited_cases_build_ddp(["train_steps"])
    assert _audited_cases_build_ddp(["allreduce_by_hand", "train_steps"])
    assert not _audited_cases_build_ddp(["allreduce_by_hand", "bucketed_ddp"])
