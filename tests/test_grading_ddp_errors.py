"""The checks of exercise ddp_errors (chapter 09: DDP's own errors) pass the reference solution,
visible and hidden, through the trusted grader (the ranks' traffic counted by its broker); each
broken function of the notebook's locked `given-*` cells still fails the way the lab's text says
on this torch (so a PyTorch that changes the failure turns CI red); and the tempting wrong fixes
fail the check they should. Each lab's diagnosis passes its hidden check as the solution
answers it, and fails it, naming the field, when a field is wrong; the hidden module's expected
diagnoses are derived again from runs of the given code; the visible module holds none of them.
The exercise: solutions/09_debugging/ddp_errors.nb.py."""

from __future__ import annotations

import os
import re
import sys
import tempfile
import traceback
from unittest import mock

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autograder import trusted
from autograder.hidden import ddp_errors as hidden
from autograder.relayed import RelayedRanks
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed, audited_traffic, run_student
from ddpcourse.grading.exercises import ddp_errors as checks
from ddpcourse.grading.exercises.read_the_logs import observe_diagnosis
from ddpcourse.launcher import run_ranks
from rank_lines import ranks_named
from trusted_path import altered, submitted
from written_out_values import assert_digests_close

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOURCE = SOLUTIONS / "09_debugging" / "ddp_errors.ipynb"
FINISHED_REDUCTION = ("Expected to have finished reduction in the prior iteration before "
                      "starting a new one")
READY_TWICE = "has been marked as ready twice"


def from_the_notebook(cell_id: str, *names: str):
    """Functions as the source notebook's cell ``cell_id`` defines them."""
    namespace = {"torch": torch, "dist": dist, "nn": nn, "F": F, "DDP": DDP}
    exec(compile(solution_code(SOURCE, cell_id), "<student notebook>", "exec"), namespace)
    return tuple(namespace[name] for name in names)


(GIVEN_AUX,) = from_the_notebook("given-unused-head", "given_train_with_aux")
GIVEN_SAVE, GIVEN_RESUME = from_the_notebook("given-checkpoint", "given_save_checkpoint",
                                             "given_resume")
(GIVEN_TOWER,) = from_the_notebook("given-reentrant", "given_train_tower")
(SOLUTION_AUX,) = from_the_notebook("train_with_aux", "train_with_aux")
(SOLUTION_SAVE,) = from_the_notebook("save_checkpoint", "save_checkpoint")
(SOLUTION_RESUME,) = from_the_notebook("resume", "resume")
(SOLUTION_TOWER,) = from_the_notebook("train_tower", "train_tower")
# Each lab's diagnosis as the solution notebook answers it, by lab.
SOLUTION_DIAGNOSES = {lab: from_the_notebook(f"diagnose-{lab.replace('_', '-')}",
                                             f"diagnose_{lab}")[0]
                      for lab in ("unused_head", "checkpoint", "reentrant")}


# --- lab 1: fixes, right and wrong -----------------------------------------------------------


def _aux_loop(model, batches, lr, ddp_kwargs=None, aux_always=False):
    ddp_model = DDP(model, **(ddp_kwargs or {}))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y, aux_y in batches:
        out, aux = ddp_model(x, with_aux=aux_always or aux_y is not None)
        loss = F.cross_entropy(out, y)
        if aux_y is not None:
            loss = loss + F.cross_entropy(aux, aux_y)
        elif aux_always:
            loss = loss + 0 * aux.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def aux_times_zero(model, batches, lr):
    _aux_loop(model, batches, lr, aux_always=True)


def aux_find_unused(model, batches, lr):
    _aux_loop(model, batches, lr, {"find_unused_parameters": True})


def aux_find_unused_and_frozen(model, batches, lr):
    model.aux.requires_grad_(False)
    _aux_loop(model, batches, lr, {"find_unused_parameters": True})


def aux_static_graph(model, batches, lr):
    _aux_loop(model, batches, lr, {"static_graph": True})


def aux_frozen(model, batches, lr):
    model.aux.requires_grad_(False)
    _aux_loop(model, batches, lr)


def aux_left_out_of_the_wrapper(model, batches, lr):
    """"Remove it from the model", when the model is given: DDP wraps only the parts the loss
    uses, so it never broadcasts the aux head, and every rank keeps its own."""
    used = DDP(nn.Sequential(model.backbone, nn.Tanh(), model.head))
    optimizer = torch.optim.SGD(used.parameters(), lr=lr)
    for x, y, _ in batches:
        loss = F.cross_entropy(used(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# --- lab 10 -----------------------------------------------------------------------------------


def save_on_every_rank(ddp_model, optimizer, path):
    torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()},
               path)
    dist.barrier()


def save_a_file_per_rank(ddp_model, optimizer, path):
    torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()},
               f"{path}.{dist.get_rank()}")
    dist.barrier()


def resume_own_file(model, optimizer, path):
    SOLUTION_RESUME(model, optimizer, f"{path}.{dist.get_rank()}")


def save_without_barrier(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(),
                    "optimizer": optimizer.state_dict()}, path)


def save_the_wrapper(ddp_model, optimizer, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    dist.barrier()


def resume_the_model_only(model, optimizer, path):
    model.load_state_dict(torch.load(path, weights_only=True)["model"])


# --- lab 11 -----------------------------------------------------------------------------------


def _tower_loop(model, batches, lr, reentrant=True, ddp_kwargs=None, checkpointing=True):
    if checkpointing:
        model.enable_checkpointing(use_reentrant=reentrant)
    ddp_model = DDP(model, **(ddp_kwargs or {}))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        loss = F.cross_entropy(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def tower_static_graph(model, batches, lr):
    _tower_loop(model, batches, lr, ddp_kwargs={"static_graph": True})


def tower_without_find_unused(model, batches, lr):
    _tower_loop(model, batches, lr)


def tower_pooler_frozen(model, batches, lr):
    model.pooler.requires_grad_(False)
    _tower_loop(model, batches, lr)


def tower_not_checkpointed(model, batches, lr):
    _tower_loop(model, batches, lr, ddp_kwargs={"find_unused_parameters": True},
                checkpointing=False)


# --- the given code fails the way the labs say ------------------------------------------------


def _unused_facts(rank, world_size, train_with_aux, aux_steps):
    s = checks.unused_setting(seed=1, steps=4, aux_steps=aux_steps)
    model = checks.make_two_heads(seed=rank)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with audited_traffic() as traffic:
        try:
            train_with_aux(model, checks.aux_batches(s, rank), s["lr"])
            error = None
        except RuntimeError as exc:
            error = str(exc)
    all_reduces = [c for c in traffic["collective_calls"] if c[0] == "all_reduce"]
    return {"iteration": len(forwards) + 1, "all_reduces": len(all_reduces), "error": error,
            "backbone": model.backbone.weight.detach().clone()}


def test_lab_1_given_raises_at_the_second_iteration_after_a_step_without_all_reduce():
    never, step_one_only = (run_ranks(_unused_facts, 2, GIVEN_AUX, aux_steps, timeout=60)
                            for aux_steps in ((), (0,)))
    for seen in never:
        assert FINISHED_REDUCTION in seen["error"]
        assert "Parameter indices which did not receive grad for rank" in seen["error"]
        assert seen["error"].split("did not receive grad for rank")[1].split(":")[1] \
            .split()[:2] == ["4", "5"]
        assert seen["iteration"] == 2 and seen["all_reduces"] == 0
    assert not torch.equal(never[0]["backbone"], never[1]["backbone"])  # step 1 was local
    for seen in step_one_only:  # used on step 1, skipped on step 2: the third iteration raises
        assert FINISHED_REDUCTION in seen["error"] and seen["iteration"] == 3
    with pytest.raises(CheckFailed, match=FINISHED_REDUCTION):
        checks.check_aux_head_never_used(GIVEN_AUX)


def _checkpoint_facts(rank, world_size, folder):
    path = os.path.join(folder, "checkpoint.pt")
    ddp_model = DDP(checks.make_net(0))
    optimizer = checks.make_optimizer("adam", ddp_model)
    checks.grader_steps(ddp_model, optimizer, 0, range(3), rank)
    GIVEN_SAVE(ddp_model, optimizer, path)
    dist.barrier()
    try:
        GIVEN_RESUME(checks.make_net(1), checks.make_optimizer("adam", ddp_model), path)
        plain = None
    except RuntimeError as exc:
        plain = str(exc)
    resumed = DDP(checks.make_net(1))
    resumed.load_state_dict(torch.load(path))
    fresh_adam = checks.make_optimizer("adam", resumed)
    checks.grader_steps(resumed, fresh_adam, 0, range(3, 6), rank)
    checks.grader_steps(ddp_model, optimizer, 0, range(3, 6), rank)
    return plain, max((a - b).abs().max().item()
                      for a, b in zip(resumed.parameters(), ddp_model.parameters()))


def test_lab_10_given_fails_on_the_prefix_and_resumes_elsewhere_through_the_wrapper():
    with tempfile.TemporaryDirectory() as folder:
        plain, gap = run_ranks(_checkpoint_facts, 2, folder, timeout=60)[0]
    assert plain.startswith("Error(s) in loading state_dict for Net")
    assert "Missing key(s) in state_dict" in plain and \
        'Unexpected key(s) in state_dict: "module.inp.weight"' in plain
    assert gap > 1e-3  # a fresh Adam: the resumed weights part from the uninterrupted ones
    with pytest.raises(CheckFailed, match="rank 0 did not save its optimizer's state"):
        checks.check_resume(GIVEN_SAVE, GIVEN_RESUME)


def test_lab_11_given_raises_marked_ready_twice_on_the_first_backward():
    with pytest.raises(CheckFailed) as failed:
        checks.check_checkpointed_tower(GIVEN_TOWER)
    text = str(failed.value)
    assert "Expected to mark a variable ready only once" in text
    assert {0, 1} <= set(ranks_named(text))


def _tower_errors(rank, world_size, runs):
    """Each run's error (None when it trained): ``(train_tower, repeats, steps)``."""
    errors = []
    for train_tower, repeats, steps in runs:
        s = checks.tower_setting(seed=3, repeats=repeats, steps=steps)
        try:
            train_tower(checks.make_tower(rank, repeats), checks.tower_batches(s, rank), s["lr"])
            errors.append(None)
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_lab_11_the_conditions_each_failure_needs():
    """One reentrant block with find_unused_parameters: "ready twice" on the first backward,
    naming block.0.bias; without the flag the unused pooler raises lab 1's error at the second
    iteration only; a block applied twice raises "ready twice" even without the flag."""
    runs = [(GIVEN_TOWER, 1, 1), (tower_without_find_unused, 1, 1),
            (tower_without_find_unused, 1, 2), (tower_pooler_frozen, 2, 1)]
    for given, one_step, two_steps, twice in run_ranks(_tower_errors, 2, runs, timeout=60):
        assert "Parameter at index 3 with name block.0.bias " + READY_TWICE in given
        assert one_step is None and FINISHED_REDUCTION in two_steps
        assert READY_TWICE in twice


# --- wrong fixes fail the check they should -------------------------------------------------


@pytest.mark.parametrize("wrong, message", [
    (aux_find_unused, "every step all-reduced 24 bytes besides the gradients"),
    (aux_find_unused_and_frozen, "every step all-reduced 16 bytes besides the gradients"),
])
def test_lab_1_find_unused_parameters_is_seen_on_the_wire(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_aux_head_never_used(wrong)


def test_lab_1_fixes_that_only_hold_for_a_head_never_used_fail_the_hidden_checks():
    """Freezing the head and static_graph pass the visible check (no aux labels) and fail when
    the head has labels on some steps; the x0 trick passes both."""
    some_steps = hidden.UNUSED_SITUATIONS[0]
    for fix in (aux_frozen, aux_static_graph, aux_times_zero):
        checks.check_aux_head_never_used(fix)
    with pytest.raises(CheckFailed, match="differs from one process's"):
        run_student(hidden.UNUSED, some_steps[0], aux_frozen, some_steps[1])
    with pytest.raises(CheckFailed, match="Your training graph has changed"):
        run_student(hidden.UNUSED, some_steps[0], aux_static_graph, some_steps[1])
    run_student(hidden.UNUSED, some_steps[0], aux_times_zero, some_steps[1])


def test_lab_1_a_head_left_out_of_the_wrapper_is_never_broadcast():
    with pytest.raises(CheckFailed, match="rank 1's 'aux.weight' differs from rank 0's"):
        checks.check_aux_head_never_used(aux_left_out_of_the_wrapper)


@pytest.mark.parametrize("save, resume, message", [
    (save_on_every_rank, SOLUTION_RESUME, "rank 1: .*only rank 0 may write"),
    (save_a_file_per_rank, resume_own_file, "rank 1: .*only rank 0 may write"),
    (save_without_barrier, SOLUTION_RESUME, "rank 1: .*was not complete yet"),
    (save_the_wrapper, SOLUTION_RESUME, "keys start with 'module.'"),
    (SOLUTION_SAVE, resume_the_model_only, "restore the optimizer's state too"),
], ids=["every-rank", "file-per-rank", "no-barrier", "module-prefix", "no-optimizer"])
def test_lab_10_wrong_fixes(save, resume, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_resume(save, resume)


@pytest.mark.parametrize("wrong, message", [
    (tower_without_find_unused, FINISHED_REDUCTION),
    (tower_not_checkpointed, r"the block's forward ran 3 time\(s\), expected 6"),
])
def test_lab_11_wrong_fixes(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_checkpointed_tower(wrong)


def test_lab_11_a_frozen_pooler_without_the_flag_fails_only_with_a_shared_block():
    checks.check_checkpointed_tower(tower_pooler_frozen)
    with pytest.raises(CheckFailed, match=READY_TWICE):
        run_student(hidden.CHECKPOINTED, hidden.TOWER_SITUATIONS[0][0], tower_pooler_frozen,
                    hidden.TOWER_SITUATIONS[0][1])
    run_student(hidden.CHECKPOINTED, hidden.TOWER_SITUATIONS[0][0], tower_static_graph,
                hidden.TOWER_SITUATIONS[0][1])


# --- the diagnoses: graded by the hidden checks only ------------------------------------------

# A value of the right type but wrong, for each field of every diagnosis.
WRONG_VALUES = {"iteration": 3, "unused_parameters": ["aux.weight"], "gradient_all_reduces": 1,
                "replicas_agree": True, "key_prefix": "model.", "ranks_that_wrote": 1,
                "resumed_adam_step": 4, "backward": 2, "parameter": "block.0.weight",
                "block_forwards": 1}


def test_the_diagnoses_are_the_solutions_and_each_check_explains_after_a_pass(capsys):
    """The solution's diagnose_*() pass their hidden checks (each called in a rank of its own),
    and a passing check prints the lab's explanation: the graded feedback teaches either way."""
    assert set(SOLUTION_DIAGNOSES) == set(hidden.DIAGNOSES) == set(hidden.EXPLANATIONS)
    for lab, diagnose in SOLUTION_DIAGNOSES.items():
        getattr(hidden, f"check_{lab}_diagnosis")(diagnose)
        assert hidden.EXPLANATIONS[lab].strip() in capsys.readouterr().out, lab


@pytest.mark.parametrize("lab, field", [(lab, field) for lab, fields in hidden.DIAGNOSES.items()
                                        for field in fields])
def test_a_wrong_or_missing_field_fails_naming_it_and_still_explains(lab, field):
    judge = hidden.DIAGNOSED.case(lab).judge
    right = SOLUTION_DIAGNOSES[lab]()
    judge([observe_diagnosis(0, 1, lambda: right)], 1)
    wrong = {**right, field: WRONG_VALUES[field]}
    missing = {key: value for key, value in right.items() if key != field}
    for answer, named in ((wrong, f"'{field}' = "), (missing, f"'{field}' is missing")):
        with pytest.raises(CheckFailed) as failed:
            judge([observe_diagnosis(0, 1, lambda answer=answer: answer)], 1)
        text = str(failed.value)
        verdict = text.split("\n\n")[0]
        assert named in verdict and verdict.count("\n* ") == 1, text
        assert hidden.EXPLANATIONS[lab].strip() in text  # the feedback explains a wrong answer too
        expected = hidden.DIAGNOSES[lab][field]
        if isinstance(expected, (str, list)):
            assert repr(expected) not in verdict and str(expected) not in verdict  # no value given


def test_a_wrong_diagnosis_fails_in_its_rank_too():
    """End to end, as graded: every wrong field named, a wrong type said, no crash."""
    def diagnose_reentrant():
        return {"backward": True, "parameter": "block.0.weight"}

    with pytest.raises(CheckFailed) as failed:
        hidden.check_reentrant_diagnosis(diagnose_reentrant)
    text = str(failed.value)
    assert "'backward' should be an int, not True" in text
    assert "'parameter' = 'block.0.weight'" in text and "'block_forwards' is missing" in text


def test_the_answers_forms_the_docstrings_allow_are_accepted():
    judge = hidden.DIAGNOSED.wrong_fields
    assert judge("unused_head", {"iteration": 2, "unused_parameters": [" aux.bias",
                 "module.aux.weight"], "gradient_all_reduces": 0, "replicas_agree": False}) == []
    assert judge("checkpoint", {"key_prefix": "module", "ranks_that_wrote": 2,
                                "resumed_adam_step": 1}) == []
    assert judge("reentrant", {"backward": 1, "parameter": "module.block.0.bias",
                               "block_forwards": 2}) == []
    assert judge("reentrant", {"backward": 1.0, "parameter": "block.0.bias",
                               "block_forwards": 2}) != []


def _given_diagnoses(rank, world_size, folder):
    """Every diagnosis field, as the labs' given code shows it in the Run-it settings: each read
    from what the run did (the error's text, the collectives called, torch.save's calls, the
    state the runs leave), not from the expected values."""
    facts = {}
    # lab 1: the given loop, 4 steps, no aux labels
    s = checks.unused_setting(seed=1, steps=4)
    model = checks.make_two_heads(seed=rank)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    error = None
    with audited_traffic() as traffic:
        try:
            GIVEN_AUX(model, checks.aux_batches(s, rank), s["lr"])
        except RuntimeError as exc:
            error = str(exc)
    assert error is not None and FINISHED_REDUCTION in error
    named = error.split(f"did not receive grad for rank {rank}:")[1].splitlines()[0].split()
    names = [name for name, _ in model.named_parameters()]
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(world_size)]
    dist.all_gather(everyone, weights)
    facts["unused_head"] = {
        "iteration": len(forwards) + 1,
        "unused_parameters": [names[int(index)] for index in named],
        "gradient_all_reduces": sum(name == "all_reduce"
                                    for name, _ in traffic["collective_calls"]),
        "replicas_agree": all(torch.equal(everyone[0], other) for other in everyone[1:])}
    # lab 10: the given save, then the resume through the wrapper with a fresh Adam
    path = os.path.join(folder, "checkpoint.pt")
    ddp_model = DDP(checks.make_net(0))
    optimizer = checks.make_optimizer("adam", ddp_model)
    checks.grader_steps(ddp_model, optimizer, 0, range(3), rank)
    saves, torch_save = [], torch.save

    def counted_save(obj, f, *args, **kwargs):
        saves.append(f)
        return torch_save(obj, f, *args, **kwargs)

    with mock.patch.object(torch, "save", counted_save):
        GIVEN_SAVE(ddp_model, optimizer, path)
    wrote = torch.tensor([saves.count(path)])
    dist.all_reduce(wrote)
    saved = list(torch.load(path))
    plain = list(checks.make_net(1).state_dict())
    prefixes = {key[:-len(name)] for key, name in zip(saved, plain) if key.endswith(name)}
    resumed = DDP(checks.make_net(1))
    resumed.load_state_dict(torch.load(path))
    fresh_adam = checks.make_optimizer("adam", resumed)
    checks.grader_steps(resumed, fresh_adam, 0, range(3, 4), rank)
    steps = {int(state["step"]) for state in fresh_adam.state.values()}
    facts["checkpoint"] = {"key_prefix": prefixes.pop() if len(prefixes) == 1 else prefixes,
                           "ranks_that_wrote": int(wrote), "resumed_adam_step": steps.pop()}
    # lab 11: the given loop, the block applied once per forward
    s = checks.tower_setting(seed=3, repeats=1)
    tower = checks.make_tower(rank, 1)
    forwards = []
    tower.register_forward_pre_hook(lambda *_: forwards.append(1))
    error, frames = None, []
    try:
        GIVEN_TOWER(tower, checks.tower_batches(s, rank), s["lr"])
    except RuntimeError as exc:
        error, frames = str(exc), traceback.extract_tb(exc.__traceback__)
    assert error is not None and READY_TWICE in error
    # raised in Tensor.backward: the backward of the last forward counted
    assert any(frame.name == "backward" and frame.filename.endswith(os.path.join("torch",
               "_tensor.py")) for frame in frames), [frame.name for frame in frames]
    index, name = re.search(r"Parameter at index (\d+) with name (\S+) has been marked", error)\
        .groups()
    assert [name for name, _ in tower.named_parameters()][int(index)] == name
    facts["reentrant"] = {"backward": len(forwards), "parameter": name,
                          "block_forwards": tower.block[1].forwards}
    return facts


def test_the_hidden_diagnoses_are_what_the_given_code_does():
    """On the installed torch, in 2 real ranks: a torch that fails otherwise turns this red, and
    the hidden module's expected values are then to be derived again, never a student's grade."""
    with tempfile.TemporaryDirectory() as folder:
        for facts in run_ranks(_given_diagnoses, 2, folder, timeout=90):
            for lab, expected in hidden.DIAGNOSES.items():
                assert facts[lab] == expected, lab


def test_the_visible_module_holds_no_diagnosis_and_explains_nothing(capsys):
    """The diagnoses and the explanations that give them away live in the hidden module only,
    and a visible check prints nothing after a pass."""
    for name in ("EXPLANATIONS", "DIAGNOSES", "HINTS", "DIAGNOSED"):
        assert not hasattr(checks, name), name
    assert [name for name in vars(checks) if "diagnos" in name.lower()] == []
    checks.check_aux_head_never_used(SOLUTION_AUX)
    checks.check_resume(SOLUTION_SAVE, SOLUTION_RESUME)
    checks.check_checkpointed_tower(SOLUTION_TOWER)
    assert capsys.readouterr().out == ""


# --- the truths: computed on the grader's side only ---------------------------------------------


def test_the_written_out_truths_are_the_graders():
    """Every visible case's written-out truth is what the grader's one-process training computes
    (so a written-out value cannot drift from it), and the visible module trains nothing."""
    truths = hidden.written_out()
    assert checks.WRITTEN_OUT.keys() == truths.keys()
    for lab, by_situation in truths.items():
        assert checks.WRITTEN_OUT[lab].keys() == by_situation.keys(), lab
        for key, truth in by_situation.items():
            for part, state in truth.items():
                written = {name: checks.WRITTEN_OUT[lab][key][part][name] for name in state}
                assert_digests_close(written, state)  # within float32's rounding across CPUs
    for name in ("unused_reference", "resume_reference", "tower_reference"):
        assert not hasattr(checks, name), name
    with pytest.raises(RuntimeError, match="no written-out truth"):
        checks.written_out("tower")(checks.tower_setting(seed=99), 2)


# --- judged by the trusted grader: sandbox-side ranks, traffic counted by its broker ----------


@pytest.fixture(scope="module")
def relayed():
    with RelayedRanks(lambda rank, relay_dir: trusted.ObservationHost(
            one_rank=True, dynamo=checks.AUDITED_CASES_BUILD_DDP)) as ranks:
        yield ranks


def test_the_diagnoses_are_graded_through_the_trusted_grader(host, relayed):
    for lab, diagnose in SOLUTION_DIAGNOSES.items():
        getattr(hidden, f"check_{lab}_diagnosis")(submitted(diagnose, host, relayed))
    with pytest.raises(CheckFailed, match="'iteration' = 3 is not what the given code does"):
        hidden.check_unused_head_diagnosis(submitted(
            lambda: {**SOLUTION_DIAGNOSES["unused_head"](), "iteration": 3}, host, relayed))


def test_the_broker_sees_find_unused_parameters_too(host, relayed):
    with pytest.raises(CheckFailed, match="every step all-reduced 24 bytes"):
        checks.check_aux_head_never_used(submitted(aux_find_unused, host, relayed))


# --- the judges read the ranks' reports as untrusted data ----------------------------------


def _observations(case, world_size, fn, s):
    from ddpcourse.grading.checks import run_observation
    from ddpcourse.launcher import pickle_by_value

    return run_observation(case.observe, world_size, pickle_by_value(fn), (s,), 60)


DAMAGE = [((), None), (("raised",), "x"), (("weights",), []), (("weights", "aux.bias"), "nan"),
          (("traffic",), None), (("traffic", "collective_calls"), [["all_reduce", "9"]]),
          (("traffic", "collective_calls"), "x"), (("block_forwards",), "6"),
          (("file",), None), (("file", "keys"), [1, 2]), (("pickled",), None),
          (("writes",), None), (("on_return",), []), (("resumed",), {"x": 1})]


def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge():
    situations = [(checks.UNUSED, checks.judge_unused, SOLUTION_AUX, checks.VISIBLE_UNUSED),
                  (checks.RESUME, checks.judge_resume, (SOLUTION_SAVE, SOLUTION_RESUME),
                   checks.VISIBLE_RESUME),
                  (checks.CHECKPOINTED, hidden.judge_checkpointed, SOLUTION_TOWER,
                   checks.tower_setting())]
    for case, judge, fn, s in situations:
        reports = _observations(case, 2, fn, s)
        judge(reports, 2, s)  # as reported: right
        for path, value in DAMAGE:
            if path and path[0] not in reports[0]:
                continue
            for rank in (0, 1):
                if len(path) > 1 and not isinstance(reports[rank].get(path[0]), dict):
                    continue  # rank 1 reports no file
                damaged = list(reports)
                damaged[rank] = altered(reports[rank], path, value)
                try:
                    judge(damaged, 2, s)
                except CheckFailed as failed:
                    assert len(str(failed)) < 5000
                else:
                    # rank 1's file is None by design: only rank 0 reports the file
                    assert (path[:1] == ("file",) and rank == 1), (judge.__name__, path, rank)
