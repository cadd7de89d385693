"""The checks of exercise survive_a_killed_worker (chapter 08: a training loop that resumes after
torchrun restarts it) pass a right loop, catch each plausible wrong one with a message that
names the mistake (in the ranks, and once under torchrun with a really killed worker), run
through the trusted grader's path, and read the ranks' reports as untrusted data. The judge's
reference (one process) equals real DDP bit for bit: the right loop passing proves it. The
exercise: solutions/08_checkpoints/survive_a_killed_worker.nb.py.
"""

from __future__ import annotations

import os
import sys
import tempfile

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autograder.hidden import survive_a_killed_worker as hidden
from ddpcourse.grading.checks import Case, CheckFailed, run_student
from ddpcourse.grading.exercises import survive_a_killed_worker as checks
from ddpcourse.grading.written_out import digests
from trusted_path import altered, submitted
from written_out_values import assert_digests_close

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
# The loops below travel by value, also from a rank on to the torchrun workers it launches,
# which cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_train(resume=True, rng="each", optimizer=True, first="next", hook="after-save",
               write="atomic"):
    """A train() with one rule changed; the defaults give the right one.

    resume: load the checkpoint at all. rng: restore "each" rank's state, "rank0"'s on every
    rank, or "none". optimizer: restore it. first: continue with the "next" step or "same"
    (the saved step again). hook: call on_step "after-save" or "before-save". write: rank 0
    writes "atomic"ally, "direct"ly onto the path, or every rank writes a file of its own
    ("per-rank", no barrier), or rank 0 writes atomically but nobody waits ("no-barrier")."""
    def train(ddp_model, optimizer_, batch_at, total_steps, checkpoint_dir, checkpoint_every,
              on_step):
        rank = dist.get_rank()
        path = os.path.join(checkpoint_dir, "checkpoint.pt")
        done = 0
        if resume and os.path.exists(path):
            state = torch.load(path, map_location="cpu", weights_only=True)
            ddp_model.module.load_state_dict(state["model"])
            if optimizer:
                optimizer_.load_state_dict(state["optimizer"])
            if rng != "none":
                torch.set_rng_state(state["rng"][rank if rng == "each" else 0])
            done = state["step"] - (1 if first == "same" else 0)
        for step in range(done + 1, total_steps + 1):
            inputs, targets = batch_at(step)
            loss = F.mse_loss(ddp_model(inputs), targets)
            optimizer_.zero_grad()
            loss.backward()
            optimizer_.step()
            if hook == "before-save":
                on_step(step)
            if step % checkpoint_every == 0:
                states = [None] * dist.get_world_size()
                dist.all_gather_object(states, torch.get_rng_state())
                state = {"model": ddp_model.module.state_dict(), "step": step,
                         "optimizer": optimizer_.state_dict(), "rng": states}
                if write == "direct" and rank == 0:
                    torch.save(state, path)
                elif write == "per-rank" or rank == 0:
                    handle, temporary = tempfile.mkstemp(dir=checkpoint_dir)
                    with os.fdopen(handle, "wb") as file:
                        torch.save(state, file)
                    os.replace(temporary, path if rank == 0 else f"{path}.{rank}")
                if write not in ("per-rank", "no-barrier"):
                    dist.barrier()
            if hook == "after-save":
                on_step(step)
    return train


RIGHT = make_train()
STOP = checks.setting(seed=1, total_steps=7, every=2, stops=(5,))


def stopped(train, s=STOP, world_size=2):
    """Judged bit for bit, with the hidden checks' reference (any situation)."""
    return run_student(hidden.STOPPED, world_size, train, s)


def test_every_written_out_weight_is_the_uninterrupted_runs():
    """The visible checks hold no uninterrupted run (it yields the answer): the final weights of
    their situations are written out as digests, held here to the hidden checks' reference."""
    visible = [STOP, checks.setting(seed=2, total_steps=8, every=3, fault="kill", fault_rank=1,
                                    fault_step=5)]
    assert {checks.situation_key(s) for s in visible} == set(checks.VISIBLE_WEIGHTS)
    for s in visible:
        assert_digests_close(checks.written_out_weights(s),
                             digests(hidden.uninterrupted_weights(s)))
    assert not hasattr(checks, "uninterrupted_weights")
    with pytest.raises(LookupError, match="grader bug: no written-out weights"):
        checks.written_out_weights(checks.setting(seed=99))


def test_the_visible_judge_compares_with_the_written_out_weights():
    reports = stopped(RIGHT)
    checks.judge_stopped(reports, 2, STOP)
    wrong = reports[1]["final"]["3.bias"] + 1e-3
    with pytest.raises(CheckFailed, match=r"final weights differ from an uninterrupted run "
                                          r"\('3.bias'\): its sum is"):
        checks.judge_stopped([reports[0], altered(reports[1], ["final", "3.bias"], wrong)], 2,
                             STOP)


def test_the_right_loop_passes_every_check_without_torchrun():
    checks.check_resumes_after_a_stop(RIGHT)
    for world_size, s in hidden.STOPPED_SITUATIONS:
        stopped(RIGHT, s, world_size)


@pytest.mark.parametrize("train, message", [
    (make_train(resume=False), "started again from step 1, redoing 4 step(s)"),
    (make_train(rng="none"), "every rank's random-number state"),
    (make_train(rng="rank0"), "final weights differ from an uninterrupted run"),
    (make_train(optimizer=False), "the optimizer's state"),
    (make_train(first="same"), "its first step was 4, expected 5"),
    (make_train(write="direct"), "at the checkpoint of step 2, rank 0 moved no file into place"),
    (make_train(write="per-rank"), "rank 1: .*this rank wrote in the checkpoint directory"),
], ids=["from-scratch", "no-rng", "rank0-rng-everywhere", "no-optimizer", "redo-saved-step",
        "not-atomic", "a-file-per-rank"])
def test_a_wrong_loop_is_caught_with_what_went_wrong(train, message):
    with pytest.raises(CheckFailed, match=message.replace("(", r"\(").replace(")", r"\)")):
        stopped(train)


def test_a_hook_called_before_the_save_loses_the_checkpoint_of_that_step():
    at_a_checkpoint = checks.setting(seed=5, total_steps=6, every=2, stops=(4,))
    stopped(RIGHT, at_a_checkpoint)
    with pytest.raises(CheckFailed, match="its first step was 3, expected 5"):
        stopped(make_train(hook="before-save"), at_a_checkpoint)


def test_a_killed_worker_really_restarts_the_group_and_the_resumed_run_is_judged():
    """Under torchrun (one launch): the SIGKILL in attempt 0, a new pid for every rank in
    attempt 1, the steps redone from the last checkpoint, the right weights; the same report
    with other weights or other steps fails."""
    s = checks.setting(seed=2, total_steps=6, every=2, fault="kill", fault_rank=1, fault_step=3)
    [report] = run_student(hidden.KILLED, 1, RIGHT, s, timeout=checks.LAUNCH_TIMEOUT_S + 30)
    events = report["events"]
    killed = [e for e in events if e["event"] == "kill"]
    assert [(e["attempt"], e["rank"], e["step"]) for e in killed] == [(0, 1, 3)]
    pids = {a: {e["rank"]: e["pid"] for e in events if e["attempt"] == a and e["event"] == "started"}
            for a in (0, 1)}
    assert set(pids[0]) == set(pids[1]) == {0, 1}
    assert not set(pids[0].values()) & set(pids[1].values())
    assert [e["step"] for e in events if e["attempt"] == 1 and e["rank"] == 0
            and e["event"] == "step"] == [3, 4, 5, 6]  # redone from the checkpoint of step 2
    nudged = report["final"]["0.weight"].clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1.0))
    with pytest.raises(CheckFailed, match="SIGKILLed after step 3.*final weights differ"):
        hidden.judge_killed_bit_for_bit([altered(report, ["final", "0.weight"], nudged)], 1, s)
    from_scratch = [e | {"step": e["step"] - 2} if e["attempt"] == 1 and e["event"] == "step"
                    else e for e in events]
    with pytest.raises(CheckFailed, match="rank 0 after the restart: started again from step 1"):
        hidden.judge_killed_bit_for_bit([report | {"events": from_scratch}], 1, s)
    with pytest.raises(CheckFailed, match="exited with code 1"):
        hidden.judge_killed_bit_for_bit([report | {"returncode": 1}], 1, s)


def raises_at_once(ddp_model, optimizer_, batch_at, total_steps, checkpoint_dir,
                   checkpoint_every, on_step):
    raise NotImplementedError("not written yet")


def test_a_loop_that_raises_before_the_fault_is_judged_on_the_first_attempt():
    """A stub (or any loop that raises before the fault) gives its error as the verdict after
    one attempt: its workers end without asking torchrun for a restart, which would only raise
    again."""
    s = checks.setting(seed=2, total_steps=6, every=2, fault="kill", fault_rank=1, fault_step=3)
    observe_only = Case(checks.observe_killed, lambda observations, world_size, s: None)
    [report] = run_student(observe_only, 1, raises_at_once, s,
                           timeout=checks.LAUNCH_TIMEOUT_S + 30)
    assert report["returncode"] == 0 and not report["timed_out"], report["stderr"]
    events = [(e["attempt"], e["rank"], e["event"]) for e in report["events"]]
    assert sorted(events) == [(0, 0, "started"), (0, 0, "train raised"),
                              (0, 1, "started"), (0, 1, "train raised")]
    with pytest.raises(CheckFailed, match="before the fault, rank [01]'s train raised "
                                          "NotImplementedError: not written yet"):
        checks.judge_killed([report], 1, s)


@pytest.mark.parametrize("train, message", [
    (RIGHT, None),
    (make_train(write="direct"), "at the checkpoint of step 2, rank 0 moved no file into place"),
    (make_train(write="no-barrier"), r"rank\(s\) \[1\] went on past step 4 while rank 0 was "
                                     "still writing its checkpoint"),
], ids=["right", "torch.save-onto-the-path", "no-barrier"])
def test_a_worker_killed_while_writing_a_checkpoint(train, message):
    """Issue 27 item 5, under torchrun: rank 0 SIGKILLed inside its write of the checkpoint of
    step 4; the right loop resumes from step 2's; a torch.save onto the path (its writes are
    audited in the workers too) and a rank that does not wait for the write both fail."""
    s = hidden.KILLED_IN_SAVE
    if message is None:
        [report] = run_student(hidden.KILLED, 1, train, s, timeout=checks.LAUNCH_TIMEOUT_S + 30)
        assert [e["step"] for e in report["events"] if e["attempt"] == 1 and e["rank"] == 0
                and e["event"] == "step"] == [3, 4, 5, 6]  # from the checkpoint of step 2
        return
    with pytest.raises(CheckFailed, match=message):
        run_student(hidden.KILLED, 1, train, s, timeout=checks.LAUNCH_TIMEOUT_S + 30)


def test_through_the_trusted_grader_a_submitted_loop_is_judged_here(host):
    checks.check_resumes_after_a_stop(submitted(RIGHT, host))
    with pytest.raises(CheckFailed, match="started again from step 1"):
        checks.check_resumes_after_a_stop(submitted(make_train(resume=False), host))


def test_the_judges_read_reports_as_untrusted_data():
    reports = stopped(RIGHT)
    checks.judge_stopped(reports, 2, STOP)
    for path, value, message in [
        ([], "not a dict", "lacks 'raised'"),
        (["steps"], "1, 2, 3", "'steps' of type str"),
        (["steps"], [[0, 1]], "the steps run were"),
        (["final"], None, "final model's state has keys"),
        (["final", "0.weight"], "a string", "is not a tensor"),
        (["raised"], {"type": 3}, "'type' of type int"),
    ]:
        with pytest.raises(CheckFailed, match=message):
            checks.judge_stopped([reports[0], altered(reports[1], path, value)], 2, STOP)
    killed = checks.setting(seed=3, fault="kill", fault_rank=1, fault_step=5)
    report = {"returncode": 0, "timed_out": False, "stderr": "", "events": [], "final": None}
    with pytest.raises(CheckFailed, match="fault was never injected"):
        checks.judge_killed([report], 1, killed)
    forged = [{"attempt": 0, "rank": 1, "event": "kill", "step": 5},
              {"attempt": 1, "rank": 0, "event": "started"}, "junk", 7]
    with pytest.raises(CheckFailed, match="second attempt had ranks"):
        checks.judge_killed([report | {"events": forged}], 1, killed)
    with pytest.raises(CheckFailed, match="lacks 'timed_out'"):
        checks.judge_killed([{"events": [], "stderr": ""}], 1, killed)
    raised = {"event": "train raised", "error": {"type": "KeyError", "message": "'rng'"}}
    with pytest.raises(CheckFailed, match="before the fault, rank 1's train raised KeyError"):
        checks.judge_killed([report | {"events": [raised | {"attempt": 0, "rank": 1}]}], 1,
                            killed)
    after = [*forged[:2], raised | {"attempt": 1, "rank": 0}]
    with pytest.raises(CheckFailed, match="after the restart, rank 0's train raised KeyError"):
        checks.judge_killed([report | {"events": after, "returncode": 1}], 1, killed)
