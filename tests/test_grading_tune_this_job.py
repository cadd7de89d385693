"""The checks of exercise tune_this_job (chapter 10: the slow DDP job, tuned within a
communication budget) pass the solution, fail the slow job and each slow knob on its own with a
message that names it, catch wrong numerics, hold the visible cases' written-out digests to the
hidden reference run, count the all-reduces through the grader's broker (and a process group of
the student's own, which the broker never sees), hold accumulation_steps < 1 to its ValueError,
pass a differently written answer (DDP for setup, one all-reduce of a flattened gradient), and
read the ranks' reports as untrusted data. The exercise:
solutions/10_performance/tune_this_job.nb.py."""

from __future__ import annotations

import contextlib

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from autograder import trusted
from autograder.hidden import tune_this_job as hidden
from autograder.relayed import RelayedRanks
from autograder.sources import SOLUTIONS, grade_id, solution_code
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import tune_this_job as checks
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")

SOURCE = SOLUTIONS / "10_performance" / "tune_this_job.ipynb"
SOLUTION = solution_code(SOURCE, "tune-this-job")
SLOW_JOB = next(cell.source for cell in nbformat.read(SOURCE, as_version=4).cells
                if grade_id(cell) == "slow-job").split("\n\nprint(")[0]
NAMESPACE = {"torch": torch, "dist": dist, "nn": nn, "DDP": DDP, "contextlib": contextlib}


def build(*replacements: tuple[str, str], source: str = SOLUTION, name: str = "tune_this_job"):
    """The solution (or the slow job) with each (old, new) applied once."""
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = dict(NAMESPACE)
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace[name]


NO_NO_SYNC = ("with contextlib.nullcontext() if last else ddp_model.no_sync():",
              "with contextlib.nullcontext():")
FIND_UNUSED = ("ddp_model = DDP(model)", "ddp_model = DDP(model, find_unused_parameters=True)")
TINY_BUCKETS = ("ddp_model = DDP(model)", "ddp_model = DDP(model, bucket_cap_mb=0.0001)")
LOGGED_LOSS = ("                loss.backward()\n", "                loss.backward()\n"
               "                logged = loss.detach().clone()\n"
               "                dist.all_reduce(logged)\n")
TAIL_BY_K = ("/ len(group)", "/ accumulation_steps")
NO_VALUE_ERROR = ("    if accumulation_steps < 1:\n        raise ValueError(",
                  "    if False:\n        raise ValueError(")
# The loss logged over a gloo group of the job's own, where one can be made. The in-rank audit of
# the student's notebook counts it; when a class is graded the broker cannot: with one rank the
# group forms inside the rank's sandbox, and with more it cannot form at all (each sandbox has its
# own store and network), so the job logs nothing there. Before the rank reported what escaped
# the broker, this answer passed every graded case.
PRIVATE_GROUP = (("ddp_model = DDP(model)",
                  "try:\n        log_group = dist.new_group(backend='gloo', "
                  "timeout=__import__('datetime').timedelta(seconds=2))\n"
                  "    except Exception:\n        log_group = None\n    ddp_model = DDP(model)"),
                 (LOGGED_LOSS[0], LOGGED_LOSS[1].replace(
                     "dist.all_reduce(logged)",
                     "log_group is None or dist.all_reduce(logged, group=log_group)")))

# A differently written correct answer, which the contract accepts: DDP for setup only, every
# backward under no_sync(), then one all-reduce of the flattened gradient per optimizer step.
FLATTENED = '''
def tune_this_job(model, micro_batches, accumulation_steps, lr):
    if not accumulation_steps >= 1:
        raise ValueError("accumulation_steps < 1")
    ddp_model = DDP(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr)
    for start in range(0, len(micro_batches), accumulation_steps):
        group = micro_batches[start:start + accumulation_steps]
        with ddp_model.no_sync():
            for inputs, targets in group:
                (nn.functional.mse_loss(ddp_model(inputs), targets) / len(group)).backward()
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        optimizer.step()
        optimizer.zero_grad()
'''


def test_the_solution_passes_visible_and_hidden_checks():
    right = build()
    checks.check_job_within_budget(right)
    checks.check_job_numerics_unchanged(right)
    checks.check_job_without_accumulation(right)
    hidden.check_tune_this_job(right)


def test_every_written_out_digest_is_the_reference_runs():
    """The visible checks hold no reference run: the digests of their cases' final weights are
    written out, held here to the hidden reference."""
    keys = set()
    for name, settings in checks.VISIBLE_SETTINGS.items():
        world_size = checks.VISIBLE_WORLD_SIZES[name]
        for s in settings:
            key = checks.case_key(s, world_size)
            keys.add(key)
            seeds = [checks.data_seed_of(s, rank) for rank in range(world_size)]
            reference = checks.digest(hidden.reference_run(s, world_size, seeds))
            assert set(checks.VISIBLE_DIGESTS[key]) == set(reference)
            for param, values in reference.items():
                assert checks.VISIBLE_DIGESTS[key][param] == pytest.approx(values, abs=1e-6)
    assert keys == set(checks.VISIBLE_DIGESTS)
    assert not [n for n in vars(checks) if n.startswith("reference")]


def test_the_slow_job_has_the_reference_numerics_and_breaks_the_budget():
    slow = build(source=SLOW_JOB, name="slow_job")
    with pytest.raises(CheckFailed) as failed:
        checks.check_job_within_budget(slow)
    message = str(failed.value)
    assert "counted: 48 call(s), 35592 bytes" in message, message
    for knob in ("find_unused_parameters=True is not needed", "a logged global loss",
                 "ddp_model.no_sync()"):
        assert knob in message, knob
    counted = checks.count_communication(slow)
    assert counted["all_reduce_calls"] == 48 and counted["budget"] == {"calls": 2,
                                                                        "bytes": 11808}


@pytest.mark.parametrize("replacements, check, message", [
    ([NO_NO_SYNC], checks.check_job_within_budget,
     r"6 gradients' worth of bytes for 2 optimizer step\(s\)"),
    ([FIND_UNUSED], checks.check_job_within_budget,
     r"all-reduces of 24 bytes \(4 per parameter\).*find_unused_parameters=True is not needed"),
    ([TINY_BUCKETS], checks.check_job_within_budget, "the buckets are too small"),
    ([LOGGED_LOSS], checks.check_job_within_budget, "a logged global loss"),
    ([TAIL_BY_K], checks.check_job_numerics_unchanged, "is not the slow job's"),
    ([("/ len(group)", "")], checks.check_job_within_budget, "is not the slow job's"),
    ([("optimizer.zero_grad()", "pass")], checks.check_job_numerics_unchanged,
     "is not the slow job's"),
    ([("ddp_model = DDP(model)", "import copy; model = copy.deepcopy(model); "
       "ddp_model = DDP(model)")], checks.check_job_without_accumulation,
     "the replicas are no longer identical"),
    ([("ddp_model = DDP(model)", "ddp_model = model"), NO_NO_SYNC],
     checks.check_job_within_budget, r"counted: 0 call\(s\), 0 bytes"),
    ([("lr=lr", "lr=lr, momentum=0.9")], checks.check_job_within_budget,
     "is not the slow job's"),
], ids=["no-no_sync", "find_unused_parameters", "tiny-buckets", "logged-loss", "tail-divided-by-k",
        "no-scaling", "no-zero_grad", "trains-a-copy", "no-ddp", "momentum"])
def test_a_wrong_job_is_caught_with_what_went_wrong(replacements, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(build(*replacements))


ZEROS_INSTEAD = '''
def tune_this_job(model, micro_batches, accumulation_steps, lr):
    """Each rank trains on its own data and all-reduces a gradient-sized tensor of zeros."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    size = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for start in range(0, len(micro_batches), accumulation_steps):
        group = micro_batches[start:start + accumulation_steps]
        for inputs, targets in group:
            (nn.functional.mse_loss(model(inputs), targets) / len(group)).backward()
        dist.all_reduce(torch.zeros(size))
        optimizer.step()
        optimizer.zero_grad()
'''

# Rebuilds every rank's micro-batches from the visible module's generator, guessing the case's
# seed from its own first micro-batch, and trains one process on them: no gradient travels, a
# gradient-sized tensor of zeros stands in for the all-reduce.
REBUILDS_THE_OTHER_RANKS_DATA = '''
def tune_this_job(model, micro_batches, accumulation_steps, lr):
    from ddpcourse.grading.exercises import tune_this_job as case
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = micro_batches[0][0].shape[0] if micro_batches else 1
    s = None
    for seed in range(20):
        guess = case.setting(len(micro_batches), accumulation_steps, rows, seed, lr)
        mine = case.micro_batches(guess, case.data_seed_of(guess, rank))
        if micro_batches and torch.equal(mine[0][0], micro_batches[0][0]):
            s = guess
            break
    torch.nn.parallel.DistributedDataParallel(model)  # rank 0's initial state, as DDP gives it
    everyone = ([case.micro_batches(s, case.data_seed_of(s, r)) for r in range(world_size)]
                if s else [micro_batches])
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    size = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for start in range(0, len(micro_batches), accumulation_steps):
        group = [b for batches in everyone for b in batches[start:start + accumulation_steps]]
        x = torch.cat([b[0] for b in group])
        y = torch.cat([b[1] for b in group])
        nn.functional.mse_loss(model(x), y).backward()
        dist.all_reduce(torch.zeros(size))
        optimizer.step()
        optimizer.zero_grad()
'''


def test_a_gradient_sized_tensor_of_zeros_fails():
    with pytest.raises(CheckFailed, match="the replicas are no longer identical"):
        checks.check_job_numerics_unchanged(build(source=ZEROS_INSTEAD))


def test_data_drawn_at_random_defeats_a_job_that_rebuilds_the_other_ranks_data():
    """The visible cases' data follow from their seeds, so a job that rebuilds them passes there
    (it communicates nothing but zeros); the hidden cases' data come from seeds each rank draws,
    which no other rank can rebuild."""
    cheat = build(source=REBUILDS_THE_OTHER_RANKS_DATA)
    checks.check_job_numerics_unchanged(cheat)
    with pytest.raises(CheckFailed, match="no longer identical|compared with the slow job's"):
        hidden.check_tune_this_job(cheat)


@pytest.fixture(scope="module")
def relayed():
    """Ranks linked only by the grader's broker (unsandboxed here: the tests' functions are
    trusted), as the autograder grades communication-audited cases."""
    with RelayedRanks(lambda rank, relay_dir: trusted.ObservationHost(
            one_rank=True, dynamo=checks.AUDITED_CASES_BUILD_DDP)) as ranks:
        yield ranks


def test_through_the_broker_the_budget_is_counted(host, relayed):
    checks.check_job_within_budget(submitted(build(), host, relayed))
    with pytest.raises(CheckFailed, match="find_unused_parameters=True is not needed"):
        checks.check_job_within_budget(submitted(build(FIND_UNUSED), host, relayed))


ONE_RANK = next(settings for world_size, settings in hidden.HIDDEN if world_size == 1)[:1]


def test_through_the_broker_a_process_group_of_ones_own_is_counted(host, relayed):
    """With one rank a private gloo group forms inside the rank's sandbox and its all-reduces
    never reach the broker; the rank's own audit of what escaped it catches them. The solution
    passes the same one-rank case."""
    checks.run_settings(hidden.JOB_WITH_REFERENCE, submitted(build(), host, relayed), 1, ONE_RANK)
    with pytest.raises(CheckFailed, match=r"never carried \(\[4, 4, 4, 4, 4\].*process group of "
                       "your own"):
        hidden.check_tune_this_job(submitted(build(*PRIVATE_GROUP), host, relayed))


def test_accumulation_steps_below_one_raise_value_error_first(host, relayed):
    """Through the broker, as graded: the solution and the flattened answer raise first. Without
    the check, 0 fails in range() only after DDP's setup has given rank 1 rank 0's weights, and -2
    trains nothing and returns; with the check after DDP's setup, rank 1's weights changed and
    rank 0 sent its state before the ValueError."""
    for right in (build(), build(source=FLATTENED)):
        run_student(checks.BAD_STEPS, 2, submitted(right, host, relayed), hidden.BAD_VALUES)
    late = ("        raise ValueError(f\"accumulation_steps must be at least 1, not "
            "{accumulation_steps}\")\n    ddp_model = DDP(model)",
            "        pass\n    ddp_model = DDP(model)\n    if accumulation_steps < 1:\n"
            "        raise ValueError(accumulation_steps)")
    for wrong, parts in [
            (NO_VALUE_ERROR, ["rank 0: tune_this_job(..., accumulation_steps=-2): expected "
                              "ValueError (accumulation_steps must be an int >= 1), it returned "
                              "None", "rank 1: tune_this_job(..., accumulation_steps=0): the "
                              "model changed before the ValueError"]),
            (late, ["rank 0: tune_this_job with accumulation_steps [0, -2]: ",  # DDP's setup, twice
                    " collective call(s) before the ValueError", "rank 1: tune_this_job(..., "
                    "accumulation_steps=0): the model changed before the ValueError"])]:
        with pytest.raises(CheckFailed) as failed:
            run_student(checks.BAD_STEPS, 2, submitted(build(wrong), host, relayed),
                        hidden.BAD_VALUES)
        for part in parts:
            assert part in str(failed.value), str(failed.value)


def test_the_flattened_answer_passes_the_visible_checks_through_the_broker(host, relayed):
    checks.check_job_within_budget(submitted(build(source=FLATTENED), host, relayed))


def test_the_cases_models_have_no_buffers():
    """The contract's model has none: DDP broadcasts buffers before every synchronised forward,
    which the setup budget does not allow for."""
    settings = [s for group in checks.VISIBLE_SETTINGS.values() for s in group]
    settings += [s for _, group in hidden.HIDDEN for s in group]
    for s in settings:
        assert not list(checks.initial_model(s, 0).buffers()), s


def observations(world_size=2, s=None):
    from ddpcourse.grading.checks import run_observation
    from ddpcourse.launcher import pickle_by_value

    s = s or checks.VISIBLE_SETTINGS["budget"][0]
    return s, run_observation(checks.observe_job, world_size, pickle_by_value(build()), (s,), 60)


def test_the_judge_reads_reports_as_untrusted_data():
    s, reports = observations()
    checks.judge_visible_job(reports, 2, s)  # as reported: right
    weights = reports[1]["weights"]
    forged = [
        (["traffic", "collective_calls"], [["all_reduce", "lots"]], "malformed"),
        (["traffic"], {}, "lacks 'collective_calls'"),
        (["traffic", "collective_calls"], [["all_reduce", 11808], ["all_gather", 11808]],
         "only DDP's own setup may communicate"),
        (["weights", "inp.weight"], "a tensor", "as float32 tensors"),
        (["weights"], {**weights, "extra": torch.zeros(1)}, "as float32 tensors"),
        (["returned"], "int", "must return None"),
        (["data_seed"], 5, "not the case's"),
        (["unrelayed_calls"], [["all_reduce", 4]], r"never carried \(\[4\]"),
        (["unrelayed_calls"], [["broadcast", 4]] * 9, "never carried"),
        (["unrelayed_calls"], [["all_reduce", "4"]], "malformed"),
        (["unrelayed_calls"], "none", "'unrelayed_calls' of type str"),
        ([], None, "lacks 'raised'"),
    ]
    for path, value, message in forged:
        with pytest.raises(CheckFailed, match=message):
            checks.judge_visible_job([reports[0], altered(reports[1], path, value)], 2, s)
    bumped = {**weights, "out.bias": weights["out.bias"] + 1e-7}
    with pytest.raises(CheckFailed, match="no longer identical"):
        checks.judge_visible_job([reports[0], altered(reports[1], ["weights"], bumped)], 2, s)


def test_the_visible_judge_refuses_a_case_without_a_written_out_digest():
    s, reports = observations()
    other = checks.setting(6, 3, seed=1, lr=0.2)
    with pytest.raises(LookupError, match="grader bug: no written-out digest"):
        checks.expect_written_out(reports[0]["weights"], other, 2, [], "")
