"""The checks of exercise replicas_that_disagree (chapter 09): every broken function of the
notebook's locked cells still fails the way its lab says (so a PyTorch that changes a failure
turns this red), the tempting fixes fail with a message naming the mistake, other right fixes
pass, the solution passes through the trusted grader, and the judges read the ranks' reports as
untrusted data. The labs' diagnoses: every expected fact of the hidden module is what a run of
the given code shows, a wrong or missing field fails naming that field, the explanation is
printed either way, and the visible module holds neither the facts nor the explanations. The
exercise: solutions/09_debugging/replicas_that_disagree.nb.py; the solution passing every visible
and hidden check is tests/test_exercises.py's.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autograder.hidden import replicas_that_disagree as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import replicas_that_disagree as checks
from ddpcourse.launcher import run_bounded, run_ranks
from rank_lines import ranks_named
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks never import this module

SOURCE = SOLUTIONS / "09_debugging" / "replicas_that_disagree.ipynb"
VISIBLE = checks.VISIBLE_TRAINING


def from_the_notebook(cell_id: str, name: str, **names):
    """A function as the source notebook's cell ``cell_id`` defines it; ``names`` replace what
    the setup cell would bind (a DDP that counts what it does)."""
    namespace = {"os": os, "torch": torch, "dist": dist, "nn": nn, "F": F, "DDP": DDP,
                 "timedelta": timedelta, "TemperedLoss": checks.TemperedLoss, **names}
    exec(compile(solution_code(SOURCE, cell_id), "<student notebook>", "exec"), namespace)
    return namespace[name]


def judged(judge, observations, world_size, situations, *args):
    """The judge's verdict on one situation of a shared launch: None, or its message."""
    try:
        judge(observations, world_size, situations, *args)
    except CheckFailed as failed:
        return str(failed)
    return None


def in_situation(observations, number):
    return [{"calls": [observation["calls"][number]]} for observation in observations]


# --- lab 12: join the job ------------------------------------------------------------------------


def join_the_job_silently_alone(init_method, timeout):
    """The world size read the same way as the rank: SLURM_NTASKS with a default of 1."""
    rank = int(os.environ.get("SLURM_PROCID", 0))
    world_size = int(os.environ.get("SLURM_NTASKS", 1))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, int(os.environ.get("SLURM_LOCALID", 0)), world_size


def _join(names, init_method, timeout):
    rank, local_rank, world_size = (int(os.environ[name]) for name in names)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, local_rank, world_size


def join_preferring_slurm(init_method, timeout):
    if "SLURM_PROCID" in os.environ:
        return _join(("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"), init_method, timeout)
    if "RANK" in os.environ:
        return _join(("RANK", "LOCAL_RANK", "WORLD_SIZE"), init_method, timeout)
    raise RuntimeError("neither RANK nor SLURM_PROCID is set")


def join_defaulting_to_torchrun(init_method, timeout):
    """Reads RANK first, but still guesses (rank 0 of 1) when nothing is set."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, local_rank, world_size


def join_with_rank_as_local_rank(init_method, timeout):
    """Right on one machine only: the local rank is taken to be the rank."""
    names = (("RANK", "RANK", "WORLD_SIZE") if "RANK" in os.environ
             else ("SLURM_PROCID", "SLURM_PROCID", "SLURM_NTASKS") if "SLURM_PROCID" in os.environ
             else None)
    if names is None:
        raise RuntimeError("neither RANK nor SLURM_PROCID is set")
    return _join(names, init_method, timeout)


def test_the_given_join_fails_under_torchrun_and_guesses_without_a_launcher():
    """One launch, judged situation by situation: under torchrun (also started by srun) both
    processes claim rank 0 of 2 and the group's store gives up ("Wait timeout") after the
    timeout; under srun it is right; with no launcher each process forms a group of its own."""
    given = from_the_notebook("given-join", "given_join_the_job")
    situations = checks.VISIBLE_JOIN
    token = os.urandom(8).hex()
    observations = run_ranks(checks.observe_join, 2, given, situations, token,
                             init_process_group=False, timeout=60, relay_output=False)
    verdicts = {launcher: judged(checks.judge_join, in_situation(observations, number), 2,
                                 [(launcher, nodes)], token)
                for number, (launcher, nodes) in enumerate(situations)}
    for launcher in ("torchrun", "torchrun-in-srun"):
        assert "it raised RuntimeError: Wait timeout" in verdicts[launcher], verdicts[launcher]
        assert "Do two processes claim the same rank" in verdicts[launcher]
        assert ranks_named(verdicts[launcher])[:2] == [0, 1]
    assert verdicts["srun"] is None
    assert "expected RuntimeError" in verdicts["none"]
    assert "joined a group as rank 0 of 1" in verdicts["none"]
    assert not [name for name in os.listdir(tempfile.gettempdir()) if token in name]


TORCHRUN_JOB = """
import os
from datetime import timedelta
import torch.distributed as dist

{given}

try:
    given_join_the_job("env://", timedelta(seconds=1))
except Exception as exc:
    print(f"RANK {{os.environ['RANK']}}: {{type(exc).__name__}}: {{exc}}", flush=True)
    raise
"""


def test_under_real_torchrun_the_given_join_fails_in_the_agents_store(tmp_path, no_orphans):
    """The lab's text on torchrun's own store: both processes claim rank 0 of 2 and each waits
    for rank 1's key until the timeout."""
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_JOB.format(given=solution_code(SOURCE, "given-join")))
    done = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(script)], timeout=120)
    assert not done.timed_out and done.returncode != 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert (f"RANK {rank}: DistStoreError: wait timeout after 1000ms, keys: "
                "/default_pg/0//cpu//0/1") in done.stdout, done.stdout + done.stderr[-3000:]


def test_a_world_size_read_the_same_way_makes_every_process_a_job_of_its_own():
    """The lab's other variant: nothing fails, every process is rank 0 of 1, and an all-reduce
    reaches only the process itself."""
    with pytest.raises(CheckFailed) as failed:
        checks.run_join(join_the_job_silently_alone, 2, [("torchrun", 1)])
    text = str(failed.value)
    assert "process 1 expected (rank, local_rank, world_size) = (1, 1, 2), got (0, 0, 1)" in text
    assert "Every process believes it is rank 0" in text


@pytest.mark.parametrize("wrong, check, message", [
    (join_preferring_slurm, checks.check_join_the_job, "under torchrun started by srun"),
    (join_defaulting_to_torchrun, checks.check_join_the_job,
     "expected RuntimeError (no launcher says who this process is"),
], ids=["slurm-first", "default-rank-0"])
def test_the_join_check_catches_half_fixes(wrong, check, message):
    with pytest.raises(CheckFailed) as failed:
        check(wrong)
    assert message in str(failed.value)


def test_only_the_hidden_checks_two_machines_show_a_local_rank_taken_for_the_rank():
    checks.check_join_the_job(join_with_rank_as_local_rank)
    with pytest.raises(CheckFailed, match=r"process 2 expected \(rank, local_rank, world_size\) "
                                          r"= \(2, 0, 4\), got \(2, 2, 4\)"):
        checks.run_join(join_with_rank_as_local_rank, 4, [("torchrun", 2)])


# --- lab 13: the temperature outside the wrapper ------------------------------------------------


def _temperature_loop(model, criterion, batches, lr, after_backward=None, after_step=None,
                      at_end=None):
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD([*ddp_model.parameters(), *criterion.parameters()], lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        criterion(ddp_model(x), y).backward()
        if after_backward:
            after_backward(criterion)
        optimizer.step()
        if after_step:
            after_step(criterion)
    if at_end:
        at_end(criterion)


def _average(tensors):
    for tensor in tensors:
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()


def temperature_reseeded(model, criterion, batches, lr):
    """The tempting fix of the start: a temperature made afresh after seeding every rank alike."""
    torch.manual_seed(0)
    criterion.log_temperature.data.copy_(torch.zeros(()))
    _temperature_loop(model, criterion, batches, lr)


def temperature_averaged_at_the_end(model, criterion, batches, lr):
    _temperature_loop(model, criterion, batches, lr,
                      at_end=lambda c: _average([c.log_temperature.data]))


def temperature_broadcast_each_step(model, criterion, batches, lr):
    _temperature_loop(model, criterion, batches, lr,
                      after_step=lambda c: dist.broadcast(c.log_temperature.data, 0))


def temperature_gradient_averaged_by_hand(model, criterion, batches, lr):
    """Right when every rank's temperature starts equal (visible), wrong when they do not."""
    _temperature_loop(model, criterion, batches, lr,
                      after_backward=lambda c: _average([c.log_temperature.grad]))


def temperature_in_a_ddp_of_its_own(model, criterion, batches, lr):
    ddp_model, ddp_criterion = DDP(model), DDP(criterion)
    optimizer = torch.optim.SGD([*ddp_model.parameters(), *ddp_criterion.parameters()], lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        ddp_criterion(ddp_model(x), y).backward()
        optimizer.step()


OUTSIDE = "the temperature is outside the DDP wrapper"


def test_the_given_temperature_loop_fails_naming_the_parameter_outside_the_wrapper():
    given = from_the_notebook("given-temperature", "given_train_with_temperature")
    with pytest.raises(CheckFailed) as failed:
        checks.check_train_with_temperature(given)
    text = str(failed.value)
    assert "rank 1's criterion 'log_temperature' differs from rank 0's" in text
    assert OUTSIDE in text and "rank 1's model" not in text  # DDP still averages the model's


@pytest.mark.parametrize("wrong, message", [
    (temperature_reseeded, OUTSIDE),
    (temperature_averaged_at_the_end, "averaged over the ranks once, at the end"),
    (temperature_broadcast_each_step, "copied to every rank after each step"),
], ids=["reseeded", "averaged-at-end", "broadcast-each-step"])
def test_the_temperature_check_catches_fixes_that_hide_the_symptom(wrong, message):
    with pytest.raises(CheckFailed) as failed:
        checks.check_train_with_temperature(wrong)
    assert message in str(failed.value)


def test_other_right_temperature_fixes_pass_and_the_hidden_start_needs_syncing():
    checks.check_train_with_temperature(temperature_in_a_ddp_of_its_own)
    checks.check_train_with_temperature(temperature_gradient_averaged_by_hand)
    with pytest.raises(CheckFailed, match="criterion 'log_temperature' differs"):
        run_student(hidden.TEMPERATURE, 3, temperature_gradient_averaged_by_hand,
                    hidden.TRAINING_SITUATIONS[3])


# --- lab 14: BatchNorm's running statistics ------------------------------------------------


def _batchnorm_loop(model, batches, lr, eval_x, broadcast_buffers=True, bypass=False,
                    before_eval=None):
    ddp_model = DDP(model, broadcast_buffers=broadcast_buffers)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
    if before_eval:
        before_eval(model)
    ddp_model.eval()
    with torch.no_grad():
        return ddp_model.module(eval_x) if bypass else ddp_model(eval_x)


def batchnorm_with_the_new_name_off(model, batches, lr, eval_x):
    """torch 2.13's name for the same switch: buffers still synced once, at construction."""
    ddp_model = DDP(model, forward_sync_buffers=False)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
    ddp_model.eval()
    with torch.no_grad():
        return ddp_model(eval_x)


def batchnorm_evaluated_around_the_wrapper(model, batches, lr, eval_x):
    return _batchnorm_loop(model, batches, lr, eval_x, bypass=True)


def _floating_buffers(model):
    return [b for b in model.buffers() if b.is_floating_point()]


def batchnorm_statistics_averaged_at_the_end(model, batches, lr, eval_x):
    return _batchnorm_loop(model, batches, lr, eval_x, broadcast_buffers=False,
                           before_eval=lambda m: _average(_floating_buffers(m)))


def batchnorm_broadcast_by_hand(model, batches, lr, eval_x):
    """Right: no broadcast during training, rank 0's buffers broadcast before the evaluation
    (the training forward never reads the running statistics)."""
    def broadcast(m):
        for buffer in m.buffers():
            dist.broadcast(buffer, 0)
    return _batchnorm_loop(model, batches, lr, eval_x, broadcast_buffers=False, bypass=True,
                           before_eval=broadcast)


def batchnorm_synced(model, batches, lr, eval_x):
    return _batchnorm_loop(nn.SyncBatchNorm.convert_sync_batchnorm(model), batches, lr, eval_x)


def test_the_given_batchnorm_loop_fails_naming_broadcast_buffers():
    given = from_the_notebook("given-batchnorm", "given_train_and_evaluate")
    with pytest.raises(CheckFailed) as failed:
        checks.check_train_and_evaluate(given)
    text = str(failed.value)
    assert "rank 1's model '1.running_mean' differs from rank 0's" in text
    assert "broadcast_buffers=False" in text


def test_torch_2_13_warns_that_broadcast_buffers_is_deprecated():
    """The lab's claim: the old name still works and warns (FutureWarning)."""
    def wrap(rank, world_size):
        import warnings
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            DDP(nn.BatchNorm1d(2), broadcast_buffers=False)
        return [str(w.message) for w in seen if w.category is FutureWarning]

    for messages in run_ranks(wrap, 2, timeout=30, backend="gloo"):
        assert any(m.startswith("`broadcast_buffers` is deprecated. Use `forward_sync_buffers`")
                   for m in messages), messages


@pytest.mark.parametrize("wrong, message", [
    (batchnorm_with_the_new_name_off, "forward_sync_buffers=False"),
    (batchnorm_evaluated_around_the_wrapper, "the evaluation bypassed the wrapper"),
    (batchnorm_statistics_averaged_at_the_end, "they were averaged at the end"),
    (batchnorm_synced, "SyncBatchNorm layers only work with GPU modules"),
], ids=["forward-sync-off", "bypass", "averaged", "sync-batchnorm"])
def test_the_batchnorm_check_catches_fixes_that_hide_the_symptom(wrong, message):
    with pytest.raises(CheckFailed) as failed:
        checks.check_train_and_evaluate(wrong)
    assert message in str(failed.value)


def test_a_broadcast_by_hand_before_the_evaluation_also_passes():
    checks.check_train_and_evaluate(batchnorm_broadcast_by_hand)


def test_sync_batchnorm_refuses_the_cpu_in_training_even_without_ddp():
    """The lab's claim about SyncBatchNorm.forward (the DDP constructor's refusal is checked
    above): it needs a GPU (or XPU, ...) input when the group has more than one rank."""
    def forward(rank, world_size):
        layer = nn.SyncBatchNorm(4)
        try:
            layer(torch.randn(3, 4))
        except ValueError as exc:
            return str(exc)
        return None

    for message in run_ranks(forward, 2, timeout=30, backend="gloo"):
        assert message and message.startswith("SyncBatchNorm expected input tensor to be on GPU")


# --- the judges --------------------------------------------------------------------------------


def test_the_replays_of_right_runs_are_the_references_and_the_mistakes_differ():
    with checks._one_thread():
        _replays_are_fair()


def _replays_are_fair():
    for world_size, situation in ((2, VISIBLE[0]), (4, hidden.TRAINING_SITUATIONS[4][0])):
        s = checks.Situation(*situation)
        one = hidden.one_process_temperature(s, world_size)
        for mistake in checks.TEMPERATURE_MISTAKES:
            replayed = hidden.replay_temperature(s, world_size, mistake)
            assert not all(checks._close(r["criterion"], one["criterion"]) for r in replayed)
        reference = hidden.replay_batchnorm(s, world_size, "rank 0")[0]
        for mistake in checks.BATCHNORM_MISTAKES:
            replayed = hidden.replay_batchnorm(s, world_size, mistake)
            assert not all(checks._close(r["model"], reference["model"]) for r in replayed)


def test_the_written_out_truths_are_the_graders():
    """Every visible case's written-out truth is what the grader's one-process training and
    replays compute (so a written-out value cannot drift from them); the visible module trains
    and replays nothing itself."""
    truths = hidden.written_out()
    assert checks.WRITTEN_OUT.keys() == truths.keys()
    for lab, by_situation in truths.items():
        assert checks.WRITTEN_OUT[lab].keys() == by_situation.keys(), lab
        for key, truth in by_situation.items():
            assert _close_values(checks.WRITTEN_OUT[lab][key], truth), (lab, key)
    for name in ("one_process_temperature", "replay_temperature", "replay_batchnorm",
                 "_sgd_step"):
        assert not hasattr(checks, name), name
    with pytest.raises(RuntimeError, match="no written-out truth"):
        checks.written_out("batchnorm")(checks.Situation(*hidden.TRAINING_SITUATIONS[3][0]), 3)


def _close_values(a, b) -> bool:
    """Equal, floats within half the judges' tolerance (``checks.RTOL``, ``checks.ATOL``): a
    value written out on one machine and one computed here agree only to float32's rounding,
    which differs with the CPU's kernels (up to ~1e-6 relative, measured on an AMD EPYC against
    values written on another machine), and half leaves the other half to the student's own
    rounding, so a visible verdict is the reference's on any machine."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=checks.RTOL / 2, abs_tol=checks.ATOL / 2)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close_values(x, y) for x, y in zip(a, b))
    return a == b


def test_through_the_trusted_grader_the_solution_passes(host, capsys):
    """As a class is graded: the ranks run in the observation host (processes with no group
    share their store files there too), the verdict is computed here. A visible check that
    passes prints nothing: the explanations are the graded diagnoses' feedback."""
    checks.check_join_the_job(submitted(from_the_notebook("join-the-job", "join_the_job"), host))
    checks.check_train_with_temperature(
        submitted(from_the_notebook("train-with-temperature", "train_with_temperature"), host))
    checks.check_train_and_evaluate(
        submitted(from_the_notebook("train-and-evaluate", "train_and_evaluate"), host))
    assert "What the given code did" not in capsys.readouterr().out
    for lab in LABS:
        check = getattr(hidden, f"check_{lab}_diagnosis")
        check(submitted(from_the_notebook(f"diagnose-{lab}", f"diagnose_{lab}"), host))
        assert "What the given code did" in capsys.readouterr().out, lab


def test_the_judges_read_reports_as_untrusted_data():
    """Rank 1's report is damaged: the verdict names rank 1 only, in a message of bounded size."""
    right = from_the_notebook("train-with-temperature", "train_with_temperature")
    temperature = run_student(checks.TEMPERATURE, 2, right, VISIBLE)
    right = from_the_notebook("train-and-evaluate", "train_and_evaluate")
    batchnorm = run_student(checks.BATCHNORM, 2, right, VISIBLE)
    damage = [
        (checks.judge_temperature, temperature, (), "not a dict"),
        (checks.judge_temperature, temperature, ("calls",), []),
        (checks.judge_temperature, temperature, ("calls", 0, "criterion"), None),
        (checks.judge_temperature, temperature, ("calls", 0, "criterion", "log_temperature"),
         torch.zeros(2)),
        (checks.judge_temperature, temperature, ("calls", 0, "model", "0.weight"), "x" * 10**5),
        (checks.judge_temperature, temperature, ("calls", 0, "group"), 3),
        (checks.judge_batchnorm, batchnorm, ("calls", 0, "output"), "x"),
        (checks.judge_batchnorm, batchnorm, ("calls", 0, "output"), torch.zeros(2, 2)),
        (checks.judge_batchnorm, batchnorm, ("calls", 0, "model", "1.num_batches_tracked"),
         torch.zeros((), dtype=torch.float32)),
    ]
    for judge, reports, path, value in damage:
        judge(reports, 2, VISIBLE)
        with pytest.raises(CheckFailed) as failed:
            judge([reports[0], altered(reports[1], path, value)], 2, VISIBLE)
        message = str(failed.value)
        assert message.startswith("rank 1:") and "rank 0:" not in message, (path, message)
        assert len(message) < 5000
    join = [{"calls": [{"answer": [r, r, 2], "repr": "", "raised": None,
                        "group": {"rank": r, "world_size": 2, "reached": [1, 1]}}]}
            for r in range(2)]
    checks.judge_join(join, 2, [("torchrun", 1)], "t")
    for path, value in [(("calls", 0, "answer"), ["1", 1, 2]),
                        (("calls", 0, "group", "reached"), [1, 0]),
                        (("calls", 0, "group"), {"error": "x" * 10**5}),
                        (("calls", 0, "raised"), {"type": 1})]:
        with pytest.raises(CheckFailed) as failed:
            checks.judge_join([join[0], altered(join[1], path, value)], 2, [("torchrun", 1)], "t")
        assert str(failed.value).startswith("rank 1:") and len(str(failed.value)) < 5000


# --- the diagnoses: graded by the hidden checks only -----------------------------------------

LABS = ("join", "temperature", "batchnorm")


def solution_diagnosis(lab: str) -> dict:
    return from_the_notebook(f"diagnose-{lab}", f"diagnose_{lab}")()


def wrong_fields(lab: str, answer) -> str:
    """What the hidden judge says of ``answer``, one line per field ('' when it is right)."""
    return "\n".join(hidden.DIAGNOSED.wrong_fields(lab, answer))


def test_the_solutions_diagnoses_are_the_graders():
    for lab in LABS:
        assert wrong_fields(lab, solution_diagnosis(lab)) == ""


# A wrong value of each field, of the right type (the message names the field), and answers a
# student may write in another form that must count as right.
WRONG = {"claimed_rank": 1, "world_size": 1, "unclaimed_rank": 0, "raised_in": "barrier",
         "parameter": "0.weight", "first_step": 2, "averaged_tensors": 5,
         "differing": ["1.running_mean", "1.running_var", "1.num_batches_tracked"],
         "default_syncs": 4}
OTHER_FORMS = {"join": {"raised_in": "dist.init_process_group()"},
               "temperature": {"parameter": "criterion.log_temperature"},
               "batchnorm": {"differing": ["running_var", "1.running_mean"]}}


@pytest.mark.parametrize("lab, field", [(lab, field) for lab in LABS
                                        for field in hidden.DIAGNOSES[lab]])
def test_a_wrong_or_missing_field_fails_naming_that_field_only(lab, field):
    right = solution_diagnosis(lab)
    others = [name for name in right if name != field]
    for answer, says in [({**right, field: WRONG[field]}, "is not what the given code does"),
                         ({name: right[name] for name in others}, "is missing"),
                         ({**right, field: 1.5}, "should be")]:
        message = wrong_fields(lab, answer)
        assert f"'{field}'" in message and says in message, message
        verdict = message.split(" (the dict has")[0]  # a missing field's note lists the keys
        assert not any(f"'{name}'" in verdict for name in others), message


def test_other_forms_of_a_right_answer_pass_and_a_bool_is_no_int():
    for lab, forms in OTHER_FORMS.items():
        assert wrong_fields(lab, {**solution_diagnosis(lab), **forms}) == ""
    assert "'first_step' should be an int" in wrong_fields(
        "temperature", {**solution_diagnosis("temperature"), "first_step": True})


def test_a_wrong_diagnosis_still_gets_the_explanation(capsys):
    """Through a rank, as graded: the verdict names the field and ends with the lab's
    explanation (the grader keeps a failing cell's message, not what it printed); a right one
    prints the explanation; a function that returns no dict fails too."""
    def off_by_a_step():
        return {"parameter": "log_temperature", "first_step": 2, "averaged_tensors": 4}

    with pytest.raises(CheckFailed, match="'first_step' = 2 is not what the given code does"
                       ) as failed:
        hidden.check_temperature_diagnosis(off_by_a_step)
    assert hidden.EXPLANATIONS["temperature"].rstrip() in str(failed.value)
    with pytest.raises(CheckFailed, match="must return a dict .* it returned a int") as failed:
        hidden.check_join_diagnosis(lambda: 0)
    assert "What the given code did" in str(failed.value)
    hidden.check_batchnorm_diagnosis(lambda: solution_diagnosis("batchnorm"))
    assert hidden.EXPLANATIONS["batchnorm"].rstrip() in capsys.readouterr().out


def test_the_visible_module_holds_no_explanation_and_no_diagnosis():
    """A student can import the visible module: it must not hand over what the diagnoses ask."""
    for name in ("EXPLANATIONS", "DIAGNOSED", "DIAGNOSES", "DIAGNOSIS_KINDS",
                 "check_join_diagnosis", "check_temperature_diagnosis",
                 "check_batchnorm_diagnosis"):
        assert not hasattr(checks, name), name
    for name, value in vars(checks).items():
        if isinstance(value, dict):
            for answers in hidden.DIAGNOSES.values():
                assert not answers.keys() <= value.keys(), name
    # No field's name as a key either ("world_size" is also a key of the join's reports).
    source = Path(checks.__file__).read_text()
    for answers in hidden.DIAGNOSES.values():
        for field in answers.keys() - {"world_size"}:
            assert f'"{field}"' not in source and f"'{field}'" not in source, field


def _same(lab: str, observed_facts: dict) -> None:
    """The hidden module's expected diagnosis of ``lab`` is what a run of the given code showed."""
    expected = hidden.DIAGNOSES[lab]
    assert observed_facts.keys() == expected.keys()
    for field, value in observed_facts.items():
        kind = hidden.DIAGNOSIS_KINDS[field]
        assert (hidden.normalize_diagnosis(kind, value)
                == hidden.normalize_diagnosis(kind, expected[field])), (lab, field, value)


def _join_as_run(rank, world_size, given, path):
    """The "Run it" cell's processes (torchrun's variables, no SLURM_*): what each passes to
    init_process_group, and the torch.distributed function its exception came out of (the
    outermost frame in distributed_c10d.py)."""
    import traceback
    for name in checks.TORCHRUN + checks.SLURM:
        os.environ.pop(name, None)
    os.environ.update(checks.launcher_env("torchrun", rank, world_size, 1))
    passed, real = {}, dist.init_process_group

    def spy(*args, **kwargs):
        passed.update(rank=kwargs["rank"], world_size=kwargs["world_size"])
        return real(*args, **kwargs)

    dist.init_process_group = spy
    try:
        given(f"file://{path}", timedelta(seconds=3))
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        frames = [frame.name for frame in traceback.extract_tb(exc.__traceback__)
                  if frame.filename.endswith("distributed_c10d.py")]
        return {**passed, "raised_in": frames[0] if frames else None}
    finally:
        dist.init_process_group = real
    return {**passed, "raised_in": None}


def test_the_join_diagnosis_is_what_the_given_code_does(tmp_path):
    given = from_the_notebook("given-join", "given_join_the_job")
    runs = run_ranks(_join_as_run, 2, given, str(tmp_path / "store"), init_process_group=False,
                     timeout=60, relay_output=False)
    claimed = {run["rank"] for run in runs}
    [world_size] = {run["world_size"] for run in runs}
    [raised_in] = {run["raised_in"] for run in runs}
    [rank] = claimed  # every process claims the same rank
    [unclaimed] = set(range(world_size)) - claimed
    _same("join", {"claimed_rank": rank, "world_size": world_size, "unclaimed_rank": unclaimed,
                   "raised_in": raised_in})


class Snapshots:
    """The batches of a given loop, which record ``snapshot()`` before handing out each batch and
    once after the last: entry k is the state after k steps."""

    def __init__(self, batches, snapshot):
        self.batches, self.snapshot, self.states = batches, snapshot, []

    def __iter__(self):
        for batch in self.batches:
            self.states.append(self.snapshot())
            yield batch
        self.states.append(self.snapshot())


class GradientsAveraged(DDP):
    """DDP whose all-reduces (the default hook's) record which parameters they carried."""

    made: ClassVar[list] = []

    def __init__(self, *args, **kwargs):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        super().__init__(*args, **kwargs)
        self.averaged: set[int] = set()
        GradientsAveraged.made.append(self)

        def record(state, bucket):
            self.averaged.update(id(p) for p in bucket.parameters())
            return default_hooks.allreduce_hook(None, bucket)

        self.register_comm_hook(None, record)


class BufferSyncsCounted(DDP):
    """DDP with its default buffer sync (the given code's ``broadcast_buffers=False`` dropped),
    counting the forwards that start by broadcasting rank 0's buffers."""

    syncs = 0

    def __init__(self, module, broadcast_buffers=True):
        super().__init__(module)

    def _sync_buffers(self):
        BufferSyncsCounted.syncs += 1
        return super()._sync_buffers()


def _temperature_as_run(rank, world_size, given):
    s = checks.Situation(*VISIBLE[0])
    model, criterion = checks.make_model(checks.model_seed(s, rank)), checks.make_criterion(s, rank)
    named = {**dict(model.named_parameters()), **dict(criterion.named_parameters())}
    batches = Snapshots(checks.make_batches(s, rank),
                        lambda: {name: p.detach().clone() for name, p in named.items()})
    given(model, criterion, batches, s.lr)
    [wrapper] = GradientsAveraged.made
    return {"states": batches.states,
            "averaged": sorted(name for name, p in named.items() if id(p) in wrapper.averaged)}


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(name for name in a if not torch.equal(a[name], b[name]))


def _first_step(runs) -> int:
    return next(step for step, states in enumerate(zip(*(run["states"] for run in runs)))
                if _differing(*states))


def test_the_temperature_diagnosis_is_what_the_given_code_does():
    given = from_the_notebook("given-temperature", "given_train_with_temperature",
                              DDP=GradientsAveraged)
    runs = run_ranks(_temperature_as_run, 2, given, timeout=60, relay_output=False)
    [parameter] = _differing(runs[0]["states"][-1], runs[1]["states"][-1])
    [averaged] = {len(run["averaged"]) for run in runs}
    _same("temperature", {"parameter": parameter, "first_step": _first_step(runs),
                          "averaged_tensors": averaged})
    assert len(runs[0]["states"][0]) == 5  # the optimizer steps 5 tensors, DDP averages 4


def _batchnorm_as_run(rank, world_size, given, counted):
    s = checks.Situation(*VISIBLE[0])
    model = checks.make_batchnorm_model(checks.model_seed(s, rank))
    batches = Snapshots(checks.make_batches(s, rank), lambda: checks._state(model))
    given(model, batches, s.lr, checks.eval_inputs(s))
    counted(checks.make_batchnorm_model(checks.model_seed(s, rank)), checks.make_batches(s, rank),
            s.lr, checks.eval_inputs(s))
    return {"states": batches.states, "syncs": BufferSyncsCounted.syncs}


def test_the_batchnorm_diagnosis_is_what_the_given_code_does():
    given = from_the_notebook("given-batchnorm", "given_train_and_evaluate")
    counted = from_the_notebook("given-batchnorm", "given_train_and_evaluate",
                                DDP=BufferSyncsCounted)
    runs = run_ranks(_batchnorm_as_run, 2, given, counted, timeout=60, relay_output=False)
    [syncs] = {run["syncs"] for run in runs}
    _same("batchnorm", {"differing": _differing(runs[0]["states"][-1], runs[1]["states"][-1]),
                        "first_step": _first_step(runs), "default_syncs": syncs})
