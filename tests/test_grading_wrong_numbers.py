"""The checks of exercise wrong_numbers (chapter 09: padded evaluation, a missing set_epoch,
gradient clipping inside no_sync) pass the notebook's solutions in every situation, visible and
hidden, with room to spare within their tolerances; hold every written-out truth of the visible
cases to the grader's reference; catch the notebook's given functions the way its labs say, and
the tempting wrong fixes; count the gradient all-reduces through the grader's broker too; and read
the ranks' reports as untrusted data. The exercise: solutions/09_debugging/wrong_numbers.nb.py."""

from __future__ import annotations

import contextlib
import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from autograder import trusted
from autograder.hidden import wrong_numbers as hidden
from autograder.relayed import RelayedRanks
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed, run_observation
from ddpcourse.grading.exercises import wrong_numbers as checks
from ddpcourse.launcher import pickle_by_value, wait_until_warm
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot", "warm_ranks")
# This module's functions travel to the ranks by value, as a notebook's do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOURCE = SOLUTIONS / "09_debugging" / "wrong_numbers.ipynb"
TIMEOUT_S = 60  # only catches a hang of the tests themselves; the checks keep their own deadline


def from_the_notebook(cell_id: str, name: str):
    """A function as the source notebook's cell ``cell_id`` defines it (the setup cell's names)."""
    namespace = {"contextlib": contextlib, "torch": torch, "dist": dist, "F": F,
                 "DataLoader": DataLoader, "Subset": Subset,
                 "DistributedSampler": DistributedSampler}
    exec(compile(solution_code(SOURCE, cell_id), "<student notebook>", "exec"), namespace)
    return namespace[name]


accuracy = from_the_notebook("accuracy", "accuracy")
train_epochs = from_the_notebook("train-epochs", "train_epochs")
train_clipped = from_the_notebook("train-clipped", "train_clipped")
given_accuracy = from_the_notebook("given-accuracy", "given_accuracy")
given_train_epochs = from_the_notebook("given-train-epochs", "given_train_epochs")
given_train_clipped = from_the_notebook("given-train-clipped", "given_train_clipped")


@pytest.fixture(scope="module")
def warm_ranks():
    """As the notebook's setup cell does: ranks forked from the server that has torch._dynamo
    imported, so the checks' short deadline never pays for DDP's first import on a busy machine."""
    wait_until_warm()


def every_situation(visible, hidden_by_world_size):
    return [(2, visible)] + list(hidden_by_world_size.items())


# --- (a) the solutions pass every situation, well within the tolerances -------------------------


def test_the_solutions_pass_every_visible_and_hidden_situation_well_within_the_tolerances():
    """Observed once per situation, judged as the checks judge (the visible cases by their
    written-out truth and by the grader's, the hidden ones by the grader's); the largest distance
    from one process is measured against the allowance the module docstring states."""
    worst = 0.0
    for world_size, situations in every_situation(checks.VISIBLE_ACCURACY,
                                                  hidden.ACCURACY_SITUATIONS):
        reports = run_observation(checks.observe_accuracy, world_size,
                                  pickle_by_value(accuracy), (situations,), TIMEOUT_S)
        hidden.judge_accuracy(reports, world_size, situations)
        if world_size == 2:
            checks.judge_accuracy(reports, world_size, situations)
    for world_size, situations in every_situation(checks.VISIBLE_EPOCHS,
                                                  hidden.EPOCH_SITUATIONS):
        reports = run_observation(checks.observe_epochs, world_size,
                                  pickle_by_value(train_epochs), (situations,), TIMEOUT_S)
        hidden.judge_epochs(reports, world_size, situations)
        if world_size == 2:
            checks.judge_epochs(reports, world_size, situations)
        for number, s in enumerate(situations):
            reference = hidden.epochs_truth(s, world_size)["weights"]
            weights = reports[0]["calls"][number]["weights"]
            worst = max(worst, *((weights[n] - reference[n]).abs().max().item()
                                 for n in reference))
    for world_size, situations in every_situation(checks.VISIBLE_CLIPPING,
                                                  hidden.CLIPPING_SITUATIONS):
        for s in situations:
            reports = run_observation(checks.observe_clipped, world_size,
                                      pickle_by_value(train_clipped), (s,), TIMEOUT_S)
            hidden.judge_clipped(reports, world_size, s)
            if world_size == 2:
                checks.judge_clipped(reports, world_size, s)
            truth = hidden.clipping_truth(s, world_size)
            worst = max(worst, *(abs(a - b) for a, b in zip(reports[0]["norms"],
                                                            truth["norms"])))
            observed = reports[0]["gradients"] + [reports[0]["weights"]]
            for got, want in zip(observed, truth["gradients"] + [truth["weights"]]):
                worst = max(worst, *((got[n] - want[n]).abs().max().item() for n in want))
    assert worst < checks.ATOL / 10, worst


def test_the_written_out_truths_are_the_graders():
    """Every visible case's written-out truth is what the grader's reference computes (so a
    written-out value cannot drift from it), and the visible module computes none itself."""
    assert checks.WRITTEN_OUT.keys() == hidden.written_out().keys()
    for lab, truths in hidden.written_out().items():
        assert checks.WRITTEN_OUT[lab].keys() == truths.keys(), lab
        for key, truth in truths.items():
            assert _close(checks.WRITTEN_OUT[lab][key], truth), (lab, key)
    for name in ("sampler_order", "epochs_truth", "clipping_truth", "accuracy_truth",
                 "expected_batches", "epochs_reference", "accumulated_reference"):
        assert not hasattr(checks, name), name
    with pytest.raises(RuntimeError, match="no written-out truth"):
        checks.written_out("clipped")(checks.clipping_situation(6, 3, 0.3, seed=99), 2)


def _close(a, b) -> bool:
    """Equal, floats within half the judges' tolerance (``checks.RTOL``, ``checks.ATOL``): a
    value written out on one machine and one computed here agree only to float32's rounding,
    which differs with the CPU's kernels (up to ~1e-6 relative, measured on an AMD EPYC against
    values written on another machine), and half leaves the other half to the student's own
    rounding."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=checks.RTOL / 2, abs_tol=checks.ATOL / 2)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def test_the_clipping_situations_tell_the_given_loop_from_the_fix():
    """In every visible situation some step's averaged gradient is longer than max_norm (so the
    clip acts); in one hidden situation none is (a clip that never acts still returns norms)."""
    for s in checks.VISIBLE_CLIPPING:
        assert max(hidden.clipping_truth(s, 2)["norms"]) > s["max_norm"], s
    ws, s = 4, hidden.CLIPPING_SITUATIONS[4][1]
    assert max(hidden.clipping_truth(s, ws)["norms"]) < s["max_norm"]


# --- (b) the given functions fail the way the labs say -----------------------------------------


def test_the_given_evaluation_counts_the_padding():
    with pytest.raises(CheckFailed, match=r"returned 0\.5, the exact accuracy is 3 / 7 = "
                                          r"0\.428571: DistributedSampler\(shuffle=False\) pads "
                                          r"the data set to 8 samples"):
        checks.check_accuracy(given_accuracy)


def test_the_given_loop_repeats_epoch_0s_order():
    with pytest.raises(CheckFailed, match=r"rank 0: .* in epoch 1, rank 0 saw samples .*: that "
                                          r"is epoch 0's order again(.|\n)*rank 1: "):
        checks.check_train_epochs(given_train_epochs)


def test_the_given_clipping_returns_a_norm_that_is_not_the_averaged_gradients():
    """The given loop's ranks agree and its steps are within max_norm: only the norm (and then
    the weights) tell, and the message explains where the clip went wrong."""
    with pytest.raises(CheckFailed, match=r"accumulation_steps=3, max_norm=0\.3, 2 rank\(s\): at "
                                          r"optimizer step 0 the norm returned is .*AVERAGED over "
                                          r"the ranks(.|\n)*A clip inside no_sync\(\) measures"):
        checks.check_train_clipped(given_train_clipped)


# --- (c) the tempting wrong fixes -------------------------------------------------------------


def evaluation(padding: str):
    """An evaluation with DistributedSampler(shuffle=False). padding: "drop_last" (the sampler
    drops the tail), "total" (the padded duplicates counted, divided by len(dataset)),
    "everything" (every rank evaluates every sample, no communication), "last_rank" (the last
    rank drops its last sample, the padded one when 2 ranks pad 1; with more ranks, the padding
    can be on several ranks: every rank >= n % world_size ends with one)."""
    def wrong_accuracy(model, dataset, batch_size):
        rank, world_size, n = dist.get_rank(), dist.get_world_size(), len(dataset)
        if padding == "everything":
            with torch.no_grad():
                right = sum((model(x).argmax(1) == y).sum().item()
                            for x, y in DataLoader(dataset, batch_size=batch_size))
            return right / n
        sampler = DistributedSampler(dataset, shuffle=False, drop_last=padding == "drop_last")
        indices = list(sampler)
        if padding == "last_rank" and rank == world_size - 1 and n % world_size:
            indices = indices[:-1]
        counts = torch.zeros(2)
        with torch.no_grad():
            for x, y in DataLoader(Subset(dataset, indices), batch_size=batch_size):
                counts[0] += (model(x).argmax(1) == y).sum()
                counts[1] += len(y)
        dist.all_reduce(counts)
        return (counts[0] / (n if padding == "total" else counts[1])).item()
    return wrong_accuracy


@pytest.mark.parametrize("padding, message", [
    ("drop_last", r"no rank evaluated sample\(s\) \[6\]: that is what "
                  r"DistributedSampler\(drop_last=True\) leaves out"),
    ("total", r"the 1 padded sample\(s\) \(repeats of the first ones\) were counted as answers"),
    ("everything", r"rank 0 evaluated 7 samples; a rank's share is at most ceil\(7 / 2\) = 4"),
])
def test_a_tempting_wrong_evaluation_is_caught(padding, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_accuracy(evaluation(padding))


def test_a_fix_for_2_ranks_only_passes_the_visible_check_and_fails_the_hidden_one():
    two_ranks_only = evaluation("last_rank")
    checks.check_accuracy(two_ranks_only)
    with pytest.raises(CheckFailed, match=r"10 samples, batch_size=2, 3 rank\(s\): returned "):
        hidden.check_accuracy(two_ranks_only)


def test_set_epoch_after_the_epoch_repeats_epoch_0():
    def set_too_late(ddp_model, optimizer, dataset, epochs, batch_size, seed):
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
        for epoch in range(epochs):
            for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
                optimizer.zero_grad()
                F.mse_loss(ddp_model(x), y).backward()
                optimizer.step()
            sampler.set_epoch(epoch)

    with pytest.raises(CheckFailed, match=r"in epoch 1, rank 0 saw .*epoch 0's order again"):
        checks.check_train_epochs(set_too_late)


def clipping(rule: str):
    """A wrong fix. "before_last": clip at the start of the group's last micro-batch (one rank's
    partial sum, before DDP averages); "after_step": clip after optimizer.step() (nothing
    clipped); "clipped_norm": clip right, but return the norm after clipping; "forward_outside":
    the forward of every micro-batch outside no_sync() (DDP all-reduces every backward);
    "divide_by_k": the shorter last group's losses divided by accumulation_steps."""
    def wrong_clipped(ddp_model, optimizer, micro_batches, accumulation_steps, max_norm):
        norms, count = [], len(micro_batches)
        params = list(ddp_model.parameters())
        for i, (x, y) in enumerate(micro_batches):
            first = i - i % accumulation_steps
            group_size = min(accumulation_steps, count - first)
            divisor = accumulation_steps if rule == "divide_by_k" else group_size
            last = i == first + group_size - 1
            if not last:
                if rule == "forward_outside":
                    loss = F.mse_loss(ddp_model(x), y) / divisor
                    with ddp_model.no_sync():
                        loss.backward()
                else:
                    with ddp_model.no_sync():
                        (F.mse_loss(ddp_model(x), y) / divisor).backward()
                continue
            if rule == "before_last":
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if i > first else None
            (F.mse_loss(ddp_model(x), y) / divisor).backward()
            if rule == "before_last":
                norm = norm if norm is not None else torch.nn.utils.clip_grad_norm_(params,
                                                                                    max_norm)
            elif rule == "clipped_norm":
                torch.nn.utils.clip_grad_norm_(params, max_norm)
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            elif rule != "after_step":
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
            if rule == "after_step":
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.zero_grad()
            norms.append(float(norm))
        return norms
    return wrong_clipped


@pytest.mark.parametrize("rule, message", [
    ("before_last", r"at optimizer step 0, rank 1's clip measured a gradient norm of .* the "
                    r"ranks measured different gradients"),
    ("after_step", r"the gradient optimizer step 0 applied has norm .*more than max_norm=0\.3"),
    ("clipped_norm", r"at optimizer step 0 the norm returned is 0\.3; the norm of the gradient "
                     r"the step applies, before clipping, is "),
    ("forward_outside", r"expected 2 gradient all-reduce\(s\), one per optimizer step, but the "
                        r"ranks all-reduced the gradients 6 time\(s\)"),
    ("divide_by_k", r"accumulation_steps=2, max_norm=0\.25, 2 rank\(s\): at optimizer step 2 "
                    r"the norm returned is"),
])
def test_a_tempting_wrong_clipping_is_caught(rule, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_train_clipped(clipping(rule))


def test_the_given_clipping_is_right_without_accumulation_and_the_hidden_check_knows():
    """With accumulation_steps=1 nothing runs under no_sync(): the given loop clips the averaged
    gradient. A hidden situation has that; the others catch the loop all the same."""
    s = hidden.CLIPPING_SITUATIONS[3][1]
    assert s["k"] == 1
    checks.run_clipping(hidden.CLIPPED, given_train_clipped, 3, [s])
    with pytest.raises(CheckFailed, match=r"the norm returned is"):
        hidden.check_train_clipped(given_train_clipped)


# --- through the grader's broker, and untrusted reports ------------------------------------------


@pytest.fixture(scope="module")
def relayed():
    """Ranks linked only by the grader's broker (unsandboxed here: the tests' functions are
    trusted), as the autograder grades communication-audited cases."""
    with RelayedRanks(lambda rank, relay_dir: trusted.ObservationHost(
            one_rank=True, dynamo=checks.AUDITED_CASES_BUILD_DDP)) as ranks:
        yield ranks


def test_through_the_broker_the_solution_passes_and_a_forward_outside_no_sync_is_counted(
        host, relayed):
    """One rank (one sandbox host to start, not two): DDP's reducer all-reduces at any world
    size, so the broker's count tells the loops apart there too. The visible cases' truths are
    for 2 ranks: at one rank the grader's judge decides."""
    s = checks.VISIBLE_CLIPPING[:1]
    checks.run_clipping(hidden.CLIPPED, submitted(train_clipped, host, relayed), 1, s)
    with pytest.raises(CheckFailed, match=r"all-reduced the gradients 6 time\(s\)"):
        checks.run_clipping(hidden.CLIPPED, submitted(clipping("forward_outside"), host,
                                                      relayed), 1, s)


def test_the_judges_read_reports_as_untrusted_data():
    s = checks.VISIBLE_CLIPPING[0]
    reports = run_observation(checks.observe_clipped, 2, pickle_by_value(train_clipped),
                              (s,), TIMEOUT_S)
    checks.judge_clipped(reports, 2, s)  # as reported: right
    forged = [
        (["traffic", "collective_calls"], [["all_reduce", "lots"]], "malformed"),
        (["gradients"], [{"0.weight": "a tensor"}] * 2, "gradients is malformed"),
        (["weights"], {"0.weight": torch.zeros(1)}, "as tensors"),
        (["norms"], None, "expected a list of 2 Python float"),
        (["raised"], {"type": "ValueError", "message": "no"}, "raised ValueError: no"),
        ([], None, "lacks 'raised'"),
    ]
    for path, value, message in forged:
        with pytest.raises(CheckFailed, match=message):
            checks.judge_clipped([altered(reports[0], path, value), reports[1]], 2, s)
    situations = checks.VISIBLE_ACCURACY[:1]
    with pytest.raises(CheckFailed, match="calls instead of 1"):
        checks.judge_accuracy([{"calls": []}, {"calls": []}], 2, situations)


def test_uneven_shares_under_ddp_hang_and_the_message_says_why():
    """Shares of 4 and 3 samples in batches of 1: rank 0's fourth backward waits for a rank that
    has finished. A short deadline here; the checks' own is DEADLINE_S."""
    def strided(ddp_model, optimizer, dataset, epochs, batch_size, seed):
        share = Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))
        for _ in range(epochs):
            for x, y in DataLoader(share, batch_size=batch_size, shuffle=True):
                optimizer.zero_grad()
                F.mse_loss(ddp_model(x), y).backward()
                optimizer.step()

    with pytest.raises(CheckFailed, match=r"rank 0: did not finish within 3 s(.|\n)*Hint: under "
                                          r"DDP every backward is an all-reduce"):
        checks.run_lab(checks.EPOCHS, "epochs", 2, strided, [checks.epochs_situation(7, 1, 2)],
                       timeout=3)
