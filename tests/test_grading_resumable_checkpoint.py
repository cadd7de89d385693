"""The checks of exercise resumable_checkpoint (chapter 08: save_checkpoint and load_checkpoint)
pass a right pair, catch each plausible wrong one with a message that names the mistake, once
(each check gives the student's half the grader's own other half), run through the trusted
grader's path (two submitted functions joined without being unpickled there), and read the
ranks' reports as untrusted data. The exercise: solutions/08_checkpoints/resumable_checkpoint.nb.py.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

from autograder.hidden import resumable_checkpoint as hidden
from ddpcourse.grading.checks import CheckFailed, run_student, together
from ddpcourse.grading.exercises import resumable_checkpoint as checks
from rank_lines import message_of
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


def make_save(writer="rank0", atomic="same-dir", barrier="after", prefix=False, extras=True,
              optimizer=True):
    """A save_checkpoint with one rule changed; the defaults give the right one.

    writer: "rank0", "every" rank, or "local_rank0" (LOCAL_RANK == 0: one writer per machine).
    atomic: "same-dir" (temporary file next to it, os.replace), "direct" (torch.save to the
    path), "other-dir" (temporary file in the temp folder, moved), "only-with-extras" (same-dir
    when given extra keyword arguments, else direct).
    barrier: "after" the write, "before" it, or "none"."""
    def save_checkpoint(path, ddp_model, optimizer_, step, **extra):
        if barrier == "before":
            dist.barrier()
        rank = int(os.environ["LOCAL_RANK"]) if writer == "local_rank0" else dist.get_rank()
        if writer == "every" or rank == 0:
            state = {"model": (ddp_model if prefix else ddp_model.module).state_dict(),
                     "step": step, **(extra if extras else {})}
            if optimizer:
                state["optimizer"] = optimizer_.state_dict()
            if atomic == "direct" or (atomic == "only-with-extras" and not extra):
                torch.save(state, path)
            else:
                same_dir = atomic in ("same-dir", "only-with-extras")
                folder = os.path.dirname(path) if same_dir else tempfile.gettempdir()
                handle, temporary = tempfile.mkstemp(dir=folder)
                with os.fdopen(handle, "wb") as file:
                    torch.save(state, file)
                    file.flush()
                    os.fsync(file.fileno())
                if same_dir:
                    os.replace(temporary, path)
                else:
                    shutil.move(temporary, path)
        if barrier == "after":
            dist.barrier()
    return save_checkpoint


def make_load(where="every", model=True, optimizer=True, returns="step"):
    """A load_checkpoint with one rule changed: where ("every" rank, or "rank0" only), whether it
    restores the model and the optimizer, what it returns ("step", "step+1", "tensor")."""
    def load_checkpoint(path, ddp_model, optimizer_):
        state = None
        if where == "every" or dist.get_rank() == 0:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if model:
                ddp_model.module.load_state_dict(state["model"])
            if optimizer:
                optimizer_.load_state_dict(state["optimizer"])
        step = torch.load(path, weights_only=True)["step"]
        return {"step": step, "step+1": step + 1, "tensor": torch.tensor(step)}[returns]
    return load_checkpoint


RIGHT = (make_save(), make_load())


def test_the_reference_pair_passes_every_check():
    checks.check_save_writes_the_contract(*RIGHT)
    checks.check_a_crash_keeps_the_previous_checkpoint(*RIGHT)
    checks.check_load_restores_every_rank(*RIGHT)
    checks.check_resume_is_bit_exact(*RIGHT)
    hidden.check_resumable_checkpoint(*RIGHT)


@pytest.mark.parametrize("pair, check, message", [
    ((make_save(barrier="none"), make_load()), checks.check_save_writes_the_contract,
     r"rank 1: .*when this rank's save_checkpoint returned, the checkpoint did not exist yet"),
    ((make_save(barrier="before"), make_load()), checks.check_save_writes_the_contract,
     r"rank 1: .*returned, the checkpoint did not exist yet"),
    ((make_save(writer="every"), make_load()), checks.check_save_writes_the_contract,
     r"rank 1: .*this rank wrote to the checkpoint's directory.*only rank 0 may write"),
    ((make_save(atomic="direct"), make_load()), checks.check_save_writes_the_contract,
     r"moved a file onto the final path 0 times"),
    ((make_save(atomic="direct"), make_load()), checks.check_a_crash_keeps_the_previous_checkpoint,
     r"its first \(normal\) save: rank 0 moved a file onto the final path 0 times"),
    ((make_save(atomic="other-dir"), make_load()), checks.check_save_writes_the_contract,
     r"not in the checkpoint's directory"),
    ((make_save(prefix=True), make_load()), checks.check_save_writes_the_contract,
     r"keys start with 'module.'"),
    ((make_save(extras=False), make_load()), checks.check_save_writes_the_contract,
     r"never serialised its extra keyword arguments"),
    ((make_save(extras=False), make_load()), checks.check_a_crash_keeps_the_previous_checkpoint,
     r"yet it returned normally"),
    ((make_save(optimizer=False), make_load()), checks.check_save_writes_the_contract,
     r"the file's dict has keys"),
    ((make_save(), make_load(where="rank0")), checks.check_load_restores_every_rank,
     r"rank 1: load_checkpoint .*'inp.weight' differs"),
    ((make_save(), make_load(optimizer=False)), checks.check_load_restores_every_rank,
     r"ranks 0 and 1: .*the optimizer after loading.*parameter 0's 'step' differs"),
    ((make_save(), make_load(returns="step+1")), checks.check_load_restores_every_rank,
     r"expected the step 3 \(an int"),
    ((make_save(), make_load(returns="tensor")), checks.check_resume_is_bit_exact,
     r"load_checkpoint returned tensor\(2\), expected 2"),
    ((make_save(), make_load(optimizer=False)), checks.check_resume_is_bit_exact,
     r"the resumed model against the uninterrupted one, bit for bit: 'inp.weight' differs"),
], ids=["no-barrier", "barrier-before-the-write", "every-rank-writes", "not-atomic",
        "not-atomic-crash", "temporary-elsewhere", "module-prefix", "extras-dropped",
        "extras-dropped-crash", "no-optimizer-saved", "load-on-rank-0-only",
        "optimizer-not-loaded", "returns-step-plus-one", "returns-a-tensor",
        "resume-without-optimizer"])
def test_a_wrong_pair_is_caught_with_what_went_wrong(pair, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(*pair)


def test_each_mistake_fails_only_its_own_check():
    """A broken load does not fail the save checks, and a broken save not the load check."""
    save_only_wrong = (make_save(barrier="none"), make_load())
    checks.check_load_restores_every_rank(*save_only_wrong)
    load_only_wrong = (make_save(), make_load(optimizer=False))
    checks.check_save_writes_the_contract(*load_only_wrong)
    checks.check_a_crash_keeps_the_previous_checkpoint(*load_only_wrong)


def test_a_rank_that_returns_early_is_caught_over_an_existing_checkpoint_too():
    """The old file loads fine: the rank must find the new step there."""
    with pytest.raises(CheckFailed) as failed:
        run_student(checks.SAVE, 3, together(make_save(barrier="none"), make_load()),
                    checks.setting(seed=5, previous=True))
    assert "was still the previous one (step -1)" in message_of(str(failed.value), 2)


def test_a_writer_chosen_by_local_rank_is_caught_on_two_machines():
    """``LOCAL_RANK == 0`` is rank 0 on one machine; every visible check passes. On 2 machines
    of 2 ranks (the hidden save at 4 ranks), rank 2 writes too."""
    local = (make_save(writer="local_rank0"), make_load())
    checks.check_save_writes_the_contract(*local)
    checks.check_resume_is_bit_exact(*local)
    [two_machines] = [s for case, world_size, s in hidden.SITUATIONS if s["nodes"] > 1]
    with pytest.raises(CheckFailed) as failed:
        run_student(checks.SAVE, 4, together(*local), two_machines)
    assert "on 2 machines" in message_of(str(failed.value), 2)
    assert "only rank 0 may write (RANK, not LOCAL_RANK" in message_of(str(failed.value), 2)


def test_every_save_is_audited_not_only_the_one_given_extra_arguments():
    """A save that writes atomically only when the call looks like the write-audit's (extra
    keyword arguments) writes the final path itself in the crash and resume checks."""
    pretends = (make_save(atomic="only-with-extras"), make_load())
    checks.check_save_writes_the_contract(*pretends)
    with pytest.raises(CheckFailed, match=r"its save: rank 0 moved a file onto the final path 0"):
        checks.check_resume_is_bit_exact(*pretends)
    with pytest.raises(CheckFailed, match=r"its first \(normal\) save: rank 0 moved a file onto"):
        checks.check_a_crash_keeps_the_previous_checkpoint(*pretends)


def test_the_hidden_checks_catch_an_optimizer_hard_coded_in_the_load():
    def load_adam_only(path, ddp_model, optimizer_):
        state = torch.load(path, weights_only=True)
        ddp_model.module.load_state_dict(state["model"])
        if isinstance(optimizer_, torch.optim.Adam):
            optimizer_.load_state_dict(state["optimizer"])
        return state["step"]

    checks.check_load_restores_every_rank(make_save(), load_adam_only)
    with pytest.raises(CheckFailed, match=r"sgd.*the optimizer after loading"):
        hidden.check_resumable_checkpoint(make_save(), load_adam_only)


def test_through_the_trusted_grader_two_submitted_functions_are_joined(host):
    """The grader never unpickles a submission: it joins the two payloads into one that the
    sandbox's ranks unpickle as the pair."""
    save, load = (submitted(fn, host) for fn in RIGHT)
    checks.check_resume_is_bit_exact(save, load)
    with pytest.raises(CheckFailed, match="only rank 0 may write"):
        checks.check_save_writes_the_contract(submitted(make_save(writer="every"), host), load)


def observations(case, world_size, s):
    from ddpcourse.grading.checks import run_observation
    from ddpcourse.launcher import pickle_by_value

    return run_observation(case.observe, world_size, pickle_by_value(RIGHT), (s,), 60)


def test_the_judges_read_reports_as_untrusted_data():
    s = checks.setting(seed=1)
    reports = observations(checks.SAVE, 2, s)
    checks.judge_save(reports, 2, s)  # as reported: right
    forged = [
        ([], None, "lacks 'raised'"),
        (["serialised"], "0", "'serialised' of type str"),
        (["file", "content", "step"], 3.0, "the file's 'step' is 3.0"),
        (["file", "content", "model", "out.bias"], torch.zeros(2), r"'out.bias' differs"),
        (["writes"], [["replace", "checkpoint.pt", "/elsewhere/x"]], "not in the checkpoint's"),
        (["file", "content"], None, "holds a dict, not a dict|holds a"),
    ]
    for path, value, message in forged:
        with pytest.raises(CheckFailed, match=message):
            checks.judge_save([altered(reports[0], path, value), reports[1]], 2, s)
    s = checks.setting(seed=4)
    resumed = observations(checks.RESUME, 2, s)
    checks.judge_resume(resumed, 2, s)
    weights = resumed[1]["resumed"]
    bumped = {**weights, "out.bias": weights["out.bias"] + 1e-7}
    with pytest.raises(CheckFailed, match="rank 1: .*bit for bit: 'out.bias' differs"):
        checks.judge_resume([resumed[0], altered(resumed[1], ["resumed"], bumped)], 2, s)
