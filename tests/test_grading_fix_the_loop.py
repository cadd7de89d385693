"""The checks of exercise fix_the_loop (chapter 07: train) pass right loops, catch the notebook's
buggy_train and the plausible wrong fixes each with its own message, and judge the same way in
the student's kernel and in the trusted grader (autograder/trusted.py), where only the ranks'
observations come back. The exercise: solutions/07_training_loop/fix_the_loop.nb.py."""

from __future__ import annotations

import copy
import functools
import re
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from autograder.hidden import fix_the_loop as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import fix_the_loop as checks
from rank_lines import names_ranks_first, ranks_named
from trusted_path import altered, submitted
from written_out_values import assert_digests_close

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
# This module's functions travel to the ranks by value, as a notebook's do: a rank never imports
# this module (and, through it, the grader's heavy imports).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOURCE = SOLUTIONS / "07_training_loop" / "fix_the_loop.ipynb"


def from_the_notebook(cell_id: str, name: str):
    """A function as the source notebook's cell ``cell_id`` defines it."""
    namespace = {"torch": torch, "dist": dist, "nn": nn, "F": F, "DDP": DDP}
    exec(compile(solution_code(SOURCE, cell_id), "<student notebook>", "exec"), namespace)
    return namespace[name]


# --- loops, right and wrong ----------------------------------------------------------------------


def _global_mean(loss):
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return logged.item() / dist.get_world_size()


def _loop(forward, params, batches, lr, reduction="mean", scale=1.0, after_backward=None,
          after_step=None, log=_global_mean):
    optimizer = torch.optim.SGD(params, lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(forward(x), y, reduction=reduction) * scale
        loss.backward()
        if after_backward:
            after_backward()
        optimizer.step()
        if after_step:
            after_step()
        losses.append(log(loss))
    return losses


def _broadcast(module):
    for p in module.parameters():
        dist.broadcast(p.data, 0)


def _all_reduce_grads(module, average=True):
    def reduce():
        for p in module.parameters():
            dist.all_reduce(p.grad)
            if average:
                p.grad /= dist.get_world_size()
    return reduce


def two_ddps(backbone, head, batches, lr):
    model = nn.Sequential(DDP(backbone), DDP(head))
    return _loop(model, model.parameters(), batches, lr)


def head_averaged_by_hand(backbone, head, batches, lr):
    backbone_ddp = DDP(backbone)
    _broadcast(head)
    model = nn.Sequential(backbone_ddp, head)
    return _loop(model, model.parameters(), batches, lr, after_backward=_all_reduce_grads(head))


def only_the_head_fixed(backbone, head, batches, lr):
    model = DDP(nn.Sequential(backbone, head))
    return _loop(model, model.parameters(), batches, lr, reduction="sum")


def only_the_loss_fixed(backbone, head, batches, lr):
    model = nn.Sequential(DDP(backbone), head)
    return _loop(model, model.parameters(), batches, lr)


def second_ddp_bypassed(backbone, head, batches, lr):
    """The head gets a DDP of its own and its optimizer, but the forward calls the plain head."""
    backbone_ddp, head_ddp = DDP(backbone), DDP(head)
    return _loop(lambda x: head(backbone_ddp(x)),
                 [*backbone_ddp.parameters(), *head_ddp.parameters()], batches, lr)


def second_ddp_without_init_sync(backbone, head, batches, lr):
    model = nn.Sequential(DDP(backbone), DDP(head, init_sync=False))
    return _loop(model, model.parameters(), batches, lr)


def head_gradients_summed(backbone, head, batches, lr):
    backbone_ddp = DDP(backbone)
    _broadcast(head)
    model = nn.Sequential(backbone_ddp, head)
    return _loop(model, model.parameters(), batches, lr,
                 after_backward=_all_reduce_grads(head, average=False))


def head_broadcast_after_each_step(backbone, head, batches, lr):
    backbone_ddp = DDP(backbone)
    _broadcast(head)
    model = nn.Sequential(backbone_ddp, head)
    return _loop(model, model.parameters(), batches, lr, after_step=lambda: _broadcast(head))


def loss_divided_by_the_world_size(backbone, head, batches, lr):
    model = DDP(nn.Sequential(backbone, head))
    n = dist.get_world_size()
    return _loop(model, model.parameters(), batches, lr, scale=1 / n,
                 log=lambda loss: _global_mean(loss) * n)


def logs_its_own_loss(backbone, head, batches, lr):
    model = DDP(nn.Sequential(backbone, head))
    return _loop(model, model.parameters(), batches, lr, log=lambda loss: loss.item())


def logs_the_sum_over_ranks(backbone, head, batches, lr):
    def log(loss):
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        return logged.item()

    model = DDP(nn.Sequential(backbone, head))
    return _loop(model, model.parameters(), batches, lr, log=log)


def logs_tensors(backbone, head, batches, lr):
    model = DDP(nn.Sequential(backbone, head))
    return _loop(model, model.parameters(), batches, lr, log=lambda loss: loss.detach())


def trains_on_every_ranks_rows(backbone, head, batches, lr):
    model = DDP(nn.Sequential(backbone, head))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, batches)
    merged = [(torch.cat([b[s][0] for b in everyone]), torch.cat([b[s][1] for b in everyone]))
              for s in range(len(batches))]
    return _loop(model, model.parameters(), merged, lr, log=lambda loss: loss.item())


def trains_a_copy(backbone, head, batches, lr):
    model = DDP(nn.Sequential(copy.deepcopy(backbone), copy.deepcopy(head)))
    return _loop(model, model.parameters(), batches, lr)


def logs_with_an_extra_forward(backbone, head, batches, lr):
    model = DDP(nn.Sequential(backbone, head))

    def log(loss):
        with torch.no_grad():
            return F.cross_entropy(model(batches[0][0]), batches[0][1]).item()

    return _loop(model, model.parameters(), batches, lr, log=log)


REPLICAS = checks.check_train_keeps_replicas_identical
ONE_PROCESS = checks.check_train_matches_one_process
LOSSES = checks.check_train_logs_the_global_loss
HEAD_OUTSIDE = "the head is outside DDP"
SUMMED_LOSS = r"summed over each rank's 4 rows \(reduction='sum'\)"


def test_other_right_loops_pass_every_check():
    """Two DDPs, and a head averaged by hand, give what one process gives, as the notebook's
    solution (one DDP around both modules) does (it passes below, through the trusted grader)."""
    for train in (two_ddps, head_averaged_by_hand):
        run_student(checks.TRAINING, 2, train, checks.VISIBLE, checks.ALL_CHECKS)
    hidden.check_train(two_ddps)


def test_the_notebooks_buggy_train_fails_every_visible_check_naming_its_bugs():
    buggy_train = from_the_notebook("buggy-train", "buggy_train")
    for check, messages in ((REPLICAS, (HEAD_OUTSIDE, SUMMED_LOSS, "rank 0 and rank 1")),
                            (ONE_PROCESS, (HEAD_OUTSIDE, SUMMED_LOSS)),
                            (LOSSES, ("not the global batch's mean loss",))):
        with pytest.raises(CheckFailed) as failed:
            check(buggy_train)
        for message in messages:
            assert any(re.search(message, line)
                       for line in str(failed.value).splitlines()), (message, str(failed.value))


@pytest.mark.parametrize("wrong, check, message", [
    (only_the_head_fixed, ONE_PROCESS, "These are exactly the weights of a loop where the loss "
                                       "is summed over each rank's 4 rows"),
    (only_the_loss_fixed, REPLICAS, f"{HEAD_OUTSIDE}: every rank keeps its own initial head"),
    (second_ddp_bypassed, REPLICAS, "the forward must call the wrapper, not the plain head"),
    (second_ddp_without_init_sync, REPLICAS, "starts from its own initial weights"),
    (head_gradients_summed, ONE_PROCESS, "the head's gradients are summed over the ranks, not "
                                         "averaged"),
    (head_broadcast_after_each_step, ONE_PROCESS, "rank 0's head is broadcast after every step"),
    (loss_divided_by_the_world_size, ONE_PROCESS, "the loss is divided by the world size 2"),
    (logs_its_own_loss, LOSSES, "they are this rank's own loss, on its batch only"),
    (logs_the_sum_over_ranks, LOSSES, "they are 2 times the global mean"),
    (logs_tensors, LOSSES, "must return a list of 4 Python floats"),
    (trains_on_every_ranks_rows, REPLICAS, "every rank trained on every rank's rows"),
    (trains_a_copy, REPLICAS, "the backbone handed to train still has its initial weights"),
    (logs_with_an_extra_forward, REPLICAS, "the backbone's forward ran 8 times"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_checks_catch_wrong_fixes_each_with_its_own_message(wrong, check, message):
    with pytest.raises(CheckFailed) as failed:
        check(wrong)
    text = str(failed.value)
    assert message in text, text
    assert ranks_named(text)[:2] == [0, 1]  # each failed rank is named


def test_replicas_that_agree_can_still_be_wrong():
    """A head broadcast from rank 0 after each step, or gradients summed: the replicas are
    bit-identical, so only the comparison with one process catches them."""
    for wrong in (head_broadcast_after_each_step, head_gradients_summed, only_the_head_fixed):
        REPLICAS(wrong)


def test_the_hidden_checks_catch_what_only_more_ranks_show():
    """On one rank a rank's own loss is the global one and summing over one rank is averaging:
    the hidden checks' 3 and 4 ranks catch both."""
    assert 1 in hidden.SITUATIONS and {3, 4} <= set(hidden.SITUATIONS)
    with pytest.raises(CheckFailed, match="this rank's own loss") as failed:
        hidden.check_train(logs_its_own_loss)
    assert "3 ranks" in str(failed.value)
    with pytest.raises(CheckFailed, match="summed over the ranks, not averaged"):
        hidden.check_train(head_gradients_summed)


def test_the_replay_of_the_right_loop_is_one_process():
    """The judge's simulated ranks agree with its one-process reference when nothing is wrong, and
    the mistakes it names are different from it: replaying is a fair witness."""
    for world_size, situation in ((2, checks.VISIBLE[0]), (4, hidden.SITUATIONS[4][0])):
        situation = checks.Situation(*situation)
        expected = hidden.expected_for(world_size, situation)
        right = hidden.replay(checks.Mistake(), world_size, situation, expected)
        assert all(checks._close(rank, expected.reference) for rank in right)
        for mistake in checks.MISTAKES:
            replayed = hidden.replay(mistake, world_size, situation, expected)
            assert not checks._close(replayed[0], expected.reference), mistake


def train_with_summed_loss_and_rebound_checks(backbone, head, batches, lr):
    """Attack: a summed loss, and the comparisons rebound inside the rank: the judge runs
    elsewhere, so nothing changes."""
    import ddpcourse.grading.checks as grading
    grading.CheckFailed = checks.CheckFailed = type("Silenced", (Exception,), {})
    torch.allclose = lambda *args, **kwargs: True
    torch.equal = lambda *args, **kwargs: True
    return only_the_head_fixed(backbone, head, batches, lr)


def test_what_the_class_changes_inside_the_ranks_cannot_change_the_verdict():
    with pytest.raises(CheckFailed, match="summed over each rank's 4 rows"):
        ONE_PROCESS(train_with_summed_loss_and_rebound_checks)


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("wrong, check, message", [
    (from_the_notebook("buggy-train", "buggy_train"), REPLICAS, HEAD_OUTSIDE),
    (only_the_head_fixed, ONE_PROCESS, "summed over each rank's 4 rows"),
    (logs_its_own_loss, LOSSES, "this rank's own loss"),
    (head_gradients_summed, hidden.check_train, "summed over the ranks, not averaged"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(wrong, host))
    assert names_ranks_first(str(failed.value))  # each failed rank is named


# --- the judge reads the ranks' reports as untrusted data ----------------------------------


SITUATION = (4, 3, 0.5, 0)


@functools.lru_cache(maxsize=None)
def _expected(world_size):
    return hidden.expected_for(world_size, checks.Situation(*SITUATION))


def honest_report(world_size, rank):
    expected = _expected(world_size)
    losses = list(expected.losses)
    return {"calls": [{
        "backbone_calls": 3, "head_calls": 3,
        "inputs": [x.clone() for x, _ in expected.batches[rank]],
        "losses": losses, "returned": "list", "returned_length": len(losses),
        "returned_text": repr(losses),
        "backbone": {k: v.clone() for k, v in expected.reference["backbone"].items()},
        "head": {k: v.clone() for k, v in expected.reference["head"].items()}}]}


DAMAGE = [
    ((), None), ((), {}), (("calls",), []), (("calls",), "x"), (("calls", 0), None),
    (("calls", 0, "backbone_calls"), "3"), (("calls", 0, "backbone_calls"), 4),
    (("calls", 0, "head_calls"), 2), (("calls", 0, "inputs"), "x"),
    (("calls", 0, "inputs"), []), (("calls", 0, "inputs", 0), "a string"),
    (("calls", 0, "inputs", 0), torch.zeros(4, 5)), (("calls", 0, "inputs", 0), torch.zeros(())),
    (("calls", 0, "inputs", 0), torch.zeros(4, 6, dtype=torch.float64)),
    (("calls", 0, "inputs", 0), torch.zeros(4, 6).to_sparse()),
    (("calls", 0, "losses"), "1.0"), (("calls", 0, "losses"), [1.0]),
    (("calls", 0, "losses"), [float("nan")] * 3), (("calls", 0, "losses"), [1, 2, 3]),
    (("calls", 0, "returned_length"), "3"), (("calls", 0, "returned_length"), 10**9),
    (("calls", 0, "returned"), None), (("calls", 0, "backbone"), []),
    (("calls", 0, "backbone"), {"x" * 100_000: 1}), (("calls", 0, "head", "weight"), "nan"),
    (("calls", 0, "head", "weight"), torch.zeros(3, dtype=torch.int64)),
    (("calls", 0, "head", "bias"), torch.zeros(3, dtype=torch.complex64)),
    (("calls", 0, "backbone", "net.0.weight"), None),
]


def test_honest_reports_pass_the_judge():
    hidden.judge_with_reference([honest_report(2, rank) for rank in range(2)], 2, [SITUATION])


def test_every_written_out_result_is_the_reference_and_replays():
    """The visible checks hold neither the one-process training nor the replay of the mistakes
    (replaying the right loop is the answer): each visible situation's results are written out,
    held here to the hidden checks' reference and replay."""
    assert {(2, *situation) for situation in checks.VISIBLE} == set(checks.VISIBLE_EXPECTED)
    for situation in checks.VISIBLE:
        written = checks.VISIBLE_EXPECTED[(2, *situation)]
        entry = hidden.written_out_entry(2, checks.Situation(*situation))
        for module in checks.MODULES:
            assert_digests_close(written["reference"][module], entry["reference"][module])
        assert written["losses"] == pytest.approx(entry["losses"], rel=1e-6, abs=1e-7)
        for mine, theirs in zip(written["own_losses"], entry["own_losses"], strict=True):
            assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-7)
        assert written["moved"] == pytest.approx(entry["moved"], rel=1e-5)
        assert [index for index, _ in written["mistakes"]] == [i for i, _ in entry["mistakes"]]
        for (_, mine), (_, theirs) in zip(written["mistakes"], entry["mistakes"]):
            assert_digests_close(dict(enumerate(mine)), dict(enumerate(theirs)))
    for name in ("expected_for", "replay", "_diagnosis"):
        assert not hasattr(checks, name)


def test_the_visible_judge_refuses_a_situation_without_a_written_out_result():
    with pytest.raises(LookupError, match="grader bug: no written-out result"):
        checks.judge_training([honest_report(2, rank) for rank in range(2)], 2, [SITUATION])


@pytest.mark.parametrize("path, value", DAMAGE, ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    reports = [honest_report(2, rank) for rank in range(2)]
    reports[1] = altered(reports[1], path, value)
    with pytest.raises(CheckFailed) as failed:
        hidden.judge_with_reference(reports, 2, [SITUATION])
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
