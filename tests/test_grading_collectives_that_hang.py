"""The checks of exercise collectives_that_hang (chapter 09): the solution passes every visible and
hidden check through the trusted grader; every given function of the notebook still fails the way
its lab says on this PyTorch (a gloo abort with gloo's own message, a hang with the rank blocked
where the lab says); the tempting wrong fixes fail the check they should, and the other right
fixes pass. The exercise: solutions/09_debugging/collectives_that_hang.nb.py."""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from autograder.hidden import collectives_that_hang as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import collectives_that_hang as checks
from ddpcourse.launcher import RankError, RankTimeoutError, run_ranks
from rank_lines import message_of
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOURCE = SOLUTIONS / "09_debugging" / "collectives_that_hang.ipynb"
NAMES = ("train_and_log", "fit_and_evaluate", "train_on_shard", "train_skipping_bad_batches",
         "gather_predictions")
GIVEN_CELLS = ("given-log", "given-evaluate", "given-shard", "given-skip", "given-gather")
VISIBLE = (checks.check_train_and_log, checks.check_fit_and_evaluate, checks.check_train_on_shard,
           checks.check_train_skipping_bad_batches, checks.check_gather_predictions)
SHORT = 2.0  # seconds: the givens' hangs are real, any deadline shows them
GLOO_ABORT = "Received data size doesn't match expected size"


def from_the_notebook(cell_id: str, name: str):
    """A function as the source notebook's cell ``cell_id`` defines it, in a fresh namespace."""
    namespace = {"torch": torch, "dist": dist, "F": F, "DDP": DDP, "DataLoader": DataLoader}
    exec(compile(solution_code(SOURCE, cell_id), "<student notebook>", "exec"), namespace)
    return namespace[name]


def solutions():
    return [from_the_notebook(name, name) for name in NAMES]


def given(lab: int):
    return from_the_notebook(GIVEN_CELLS[lab], "buggy_" + NAMES[lab])


# --- the solution, judged as the autograder judges it ------------------------------------------


def test_the_trusted_grader_passes_the_solution_and_fails_a_given(host):
    """The visible checks through the autograder's path (observations come back as data; the
    judge runs here). The hidden checks run on the solution notebook itself
    (tests/test_exercises.py executes its test cells)."""
    for check, fn in zip(VISIBLE, solutions()):
        check(submitted(fn, host))
    with pytest.raises(CheckFailed, match="rank 1: was killed by SIGABRT"):
        checks.check_gather_predictions(submitted(given(4), host), timeout=SHORT)


def test_the_written_out_truths_are_the_graders():
    """Every visible case's written-out truth is what the grader's simulation computes (so a
    written-out value cannot drift from it), and the visible module simulates nothing itself."""
    truths = hidden.written_out()
    assert checks.WRITTEN_OUT.keys() == truths.keys()
    for lab, by_situation in truths.items():
        assert checks.WRITTEN_OUT[lab].keys() == by_situation.keys(), lab
        for key, truth in by_situation.items():
            assert _close(checks.WRITTEN_OUT[lab][key], truth), (lab, key)
    for name in ("expected_log", "expected_evaluate", "expected_shard", "expected_skip",
                 "expected_gather", "_ddp_step", "_replicas"):
        assert not hasattr(checks, name), name
    with pytest.raises(RuntimeError, match="no written-out truth"):
        checks.written_out("gather")(3, hidden.GATHER_SITUATIONS[3][0])


def _close(a, b) -> bool:
    """Equal, floats to 1e-12 relative (a written-out repr and a fresh computation)."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def test_the_solution_passes_the_hidden_judges_of_the_visible_situations():
    """The grader's judges (full tensors, not sums and norms) accept the solution where the
    written-out truths do."""
    for case, fn, situations in zip((hidden.LOG, hidden.EVALUATE, hidden.SHARD, hidden.SKIP,
                                     hidden.GATHER), solutions(),
                                    (checks.VISIBLE_LOG, checks.VISIBLE_EVALUATE,
                                     checks.VISIBLE_SHARD, checks.VISIBLE_SKIP,
                                     checks.VISIBLE_GATHER)):
        checks._run(case, 2, fn, situations, "", None, False)


# --- the givens fail the way the labs say ---------------------------------------------------------


def test_the_given_log_aborts_in_gloo_or_hangs_when_nothing_follows(capfd):
    """Logging mid-run: rank 0's one-float all-reduce meets rank 1's gradient all-reduce and gloo
    kills rank 0. Logging at the last step: rank 0 waits in all_reduce, rank 1 returned."""
    with pytest.raises(CheckFailed, match=r"rank 0: was killed by SIGABRT \(exit code -6\)"):
        checks.check_train_and_log(given(0), timeout=SHORT)
    assert GLOO_ABORT in capfd.readouterr().out

    def log_at_the_last_step(rank, world_size, train_and_log):
        model = checks.make_linear(checks.model_seed(0, rank))
        train_and_log(model, checks.make_batches(0, rank, 4, 4), 0.1, 4, lambda *_: None)

    with pytest.raises(RankTimeoutError) as hung:
        run_ranks(log_at_the_last_step, 2, given(0), timeout=SHORT, backend="gloo",
                  relay_output=False)
    assert hung.value.failed_ranks == [0]
    assert " in all_reduce\n" in hung.value.failures[0].stack


@pytest.mark.parametrize("lab, blocked", [(1, "in _sync_buffers"), (2, "in backward"),
                                          (3, "in backward")])
def test_the_given_hangs_with_the_rank_blocked_where_the_lab_says(lab, blocked):
    with pytest.raises(CheckFailed) as failed:
        VISIBLE[lab](given(lab), timeout=SHORT)
    text = str(failed.value)
    assert text.startswith(("rank 0: ", "ranks 0 and 1: ")), text
    rank0 = message_of(text, 0)
    assert rank0.startswith(f"did not finish within {SHORT:g} s"), text
    assert blocked in rank0 and checks.HINTS[list(checks.HINTS)[lab]] in text


def test_the_given_gather_aborts_the_smaller_rank_in_gloo(capfd):
    """And, as the lab says too, output tensors of another size than the input raise a plain
    RuntimeError instead."""
    with pytest.raises(CheckFailed, match=r"rank 1: was killed by SIGABRT") as failed:
        checks.check_gather_predictions(given(4), timeout=SHORT)
    assert checks.HINTS["gather"] in str(failed.value)
    assert GLOO_ABORT in capfd.readouterr().out

    def outputs_of_the_largest_size(rank, world_size):
        local = torch.zeros(4 - rank)
        dist.all_gather([torch.zeros(4) for _ in range(world_size)], local)

    with pytest.raises(RankError, match=r"ProcessGroupGloo::allgather: invalid tensor size at "
                                        r"index 0 \(expected \(3\), got \(4\)\)"):
        run_ranks(outputs_of_the_largest_size, 2, timeout=SHORT, backend="gloo",
                  relay_output=False)


# --- wrong fixes and other right fixes ------------------------------------------------------------


def logs_on_every_rank(model, batches, lr, log_every, log):
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for step, (x, y) in enumerate(batches, start=1):
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % log_every == 0:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            log(step, mean_loss.item() / dist.get_world_size())


def logs_its_own_loss(model, batches, lr, log_every, log):
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for step, (x, y) in enumerate(batches, start=1):
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0 and step % log_every == 0:
            log(step, loss.item())


def _evaluate(evaluation):
    """fit_and_evaluate whose evaluation after each epoch is ``evaluation(ddp_model, batch)``
    (a float or None)."""
    def fit_and_evaluate(model, batches, eval_batch, epochs, lr):
        ddp_model = DDP(model)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
        history = []
        for _ in range(epochs):
            for x, y in batches:
                loss = F.mse_loss(ddp_model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            value = evaluation(ddp_model, eval_batch)
            if dist.get_rank() == 0:
                history.append(value)
        return history
    return fit_and_evaluate


def _on_every_rank_through_the_wrapper(ddp_model, batch):
    ddp_model.eval()
    with torch.no_grad():
        value = F.mse_loss(ddp_model(batch[0]), batch[1]).item()
    ddp_model.train()
    return value


def _rank0_module_in_train_mode(ddp_model, batch):
    if dist.get_rank() == 0:
        with torch.no_grad():
            return F.mse_loss(ddp_model.module(batch[0]), batch[1]).item()


def _rank0_module_left_in_eval_mode(ddp_model, batch):
    if dist.get_rank() == 0:
        ddp_model.module.eval()
        with torch.no_grad():
            return F.mse_loss(ddp_model.module(batch[0]), batch[1]).item()


def counts_first_then_agrees(model, shard, batch_size, lr):
    """Another right fix: count the batches, agree on the minimum, then train."""
    count = torch.tensor([len(list(DataLoader(shard, batch_size=batch_size)))])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for _, (x, y) in zip(range(int(count)), DataLoader(shard, batch_size=batch_size)):
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return int(count)


def joins(model, shard, batch_size, lr):
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    steps = 0
    with Join([ddp_model]):
        for x, y in DataLoader(shard, batch_size=batch_size):
            loss = F.mse_loss(ddp_model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
    return steps


def _skip_loop(stop_on_own_loss, only_nan=False):
    def train_skipping_bad_batches(model, batches, lr, stop_below):
        ddp_model = DDP(model)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
        applied = []
        for step, (x, y) in enumerate(batches, start=1):
            loss = F.mse_loss(ddp_model(x), y)
            if only_nan:  # "not finite" read as NaN: an inf loss is trained on
                bad = torch.tensor([1 if torch.isnan(loss) else 0])
            else:
                bad = torch.tensor([0 if torch.isfinite(loss) else 1])
            dist.all_reduce(bad)
            if bad.item():
                continue
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            applied.append(step)
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            own = loss.item() if stop_on_own_loss else mean_loss.item() / dist.get_world_size()
            if own < stop_below:
                break
        return applied
    return train_skipping_bad_batches


def test_a_skip_that_only_looks_for_nan_fails_on_the_hidden_inf_batch():
    """The contract skips a step whose loss is not finite on any rank; ``isnan`` passes every
    visible situation (NaN and empty batches) and trains on the hidden batch whose loss is inf."""
    only_nan = _skip_loop(stop_on_own_loss=False, only_nan=True)
    checks.check_train_skipping_bad_batches(only_nan)
    with_inf = [situation for situation in hidden.SKIP_SITUATIONS[3]
                if any(kind == "inf" for _, _, kind in situation[4])]
    assert with_inf
    with pytest.raises(CheckFailed, match="the steps every rank applies"):
        checks._run(hidden.SKIP, 3, only_nan, with_inf, checks.HINTS["skip"], None, False)
    checks._run(hidden.SKIP, 3, _skip_loop(stop_on_own_loss=False), with_inf,
                checks.HINTS["skip"], None, False)


def zeroes_bad_gradients(model, batches, lr, stop_below):
    """The bad rank still joins the backward, with its loss replaced by 0: the others' gradients
    are halved at that step, and the step is applied."""
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    applied = []
    for step, (x, y) in enumerate(batches, start=1):
        loss = F.mse_loss(ddp_model(x), y)
        finite = bool(torch.isfinite(loss))
        optimizer.zero_grad()
        (loss if finite else torch.nan_to_num(loss) * 0).backward()
        optimizer.step()
        applied.append(step)
        mean_loss = loss.detach().clone() if finite else torch.zeros(())
        dist.all_reduce(mean_loss)
        if mean_loss.item() / dist.get_world_size() < stop_below:
            break
    return applied


def gathers_objects(local):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return torch.cat(everyone)


def pads_without_cutting(local):
    size = torch.tensor([local.shape[0]])
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    padded = local.new_zeros((max(int(n) for n in sizes), *local.shape[1:]))
    padded[:local.shape[0]] = local
    everyone = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, padded)
    return torch.cat(everyone)


@pytest.mark.parametrize("check, wrong, message", [
    (checks.check_train_and_log, logs_on_every_rank, "only rank 0 logs; rank 1 called log 2 times"),
    (checks.check_train_and_log, logs_its_own_loss, "the mean of every rank's loss is"),
    (checks.check_fit_and_evaluate, _evaluate(_rank0_module_in_train_mode),
     "BatchNorm normalises with its running statistics"),
    (checks.check_fit_and_evaluate, _evaluate(_rank0_module_left_in_eval_mode),
     "left in eval mode"),
    (checks.check_train_on_shard, joins, "the fewest batches of any shard"),
    (checks.check_train_skipping_bad_batches, _skip_loop(stop_on_own_loss=True),
     "rank 1: did not finish within"),
    (checks.check_train_skipping_bad_batches, zeroes_bad_gradients, "the steps every rank applies"),
    (checks.check_gather_predictions, pads_without_cutting, "no padding"),
], ids=lambda v: getattr(v, "__name__", "")[:30])
def test_the_checks_catch_wrong_fixes(check, wrong, message):
    with pytest.raises(CheckFailed) as failed:
        check(wrong, timeout=SHORT)
    assert message in str(failed.value), str(failed.value)


def test_other_right_fixes_pass():
    """Every rank evaluating through the wrapper, counting the batches first, gathering
    objects."""
    checks.check_fit_and_evaluate(_evaluate(_on_every_rank_through_the_wrapper))
    checks.check_train_on_shard(counts_first_then_agrees)
    checks.check_gather_predictions(gathers_objects)


# --- the situations test what they claim -----------------------------------------------------------


def test_the_early_stops_are_never_decided_by_rounding_and_one_stops_on_the_mean_only():
    """Every step's mean loss is at least 5% away from stop_below, and in one visible situation a
    rank's own loss is below stop_below steps before the mean is (a rank stopping on its own
    loss leaves the others)."""
    situations = [(2, s) for s in checks.VISIBLE_SKIP] + [
        (n, s) for n, cases in hidden.SKIP_SITUATIONS.items() for s in cases]
    stops, skips = 0, 0
    for world_size, situation in situations:
        applied, _, margin = hidden.expected_skip(world_size, situation)
        assert margin > 0.05, (world_size, situation, margin)
        stops += applied[-1] < situation[1]
        skips += len(applied) < applied[-1]
    assert stops >= 2 and skips >= 3


def test_shard_situations_cover_equal_longer_and_empty_shards():
    lengths = [s[0] for cases in hidden.SHARD_SITUATIONS.values() for s in cases]
    assert any(len(set(ls)) == 1 for ls in lengths) and any(0 in ls for ls in lengths)
    assert hidden.expected_shard(4, hidden.SHARD_SITUATIONS[4][1])[0] == 0


# --- the judges read the ranks' reports as untrusted data ----------------------------------------


GATHER_SITUATION = ([4, 3], "labels", 0)


def honest_gather(rank):
    want = hidden.expected_gather(2, GATHER_SITUATION)
    return {"calls": [{"gathered": want.clone(), "returned": "Tensor", "returned_length": -1,
                       "returned_text": "tensor(...)", "shape": list(want.shape)}]}


@pytest.mark.parametrize("path, value", [
    ((), None), (("calls",), []), (("calls", 0), "x"), (("calls", 0, "gathered"), "x"),
    (("calls", 0, "gathered"), torch.zeros(7)), (("calls", 0, "gathered"), torch.zeros(8)),
    (("calls", 0, "gathered"), torch.zeros(7, dtype=torch.int64)),
], ids=repr)
def test_a_damaged_report_fails_its_rank_only(path, value):
    reports = [honest_gather(0), altered(honest_gather(1), path, value)]
    with pytest.raises(CheckFailed) as failed:
        checks.judge_gather(reports, 2, [GATHER_SITUATION])
    text = str(failed.value)
    assert text.startswith("rank 1:") and "rank 0:" not in text and len(text) < 5000


def test_honest_reports_pass():
    checks.judge_gather([honest_gather(0), honest_gather(1)], 2, [GATHER_SITUATION])
    assert math.isfinite(hidden.expected_skip(2, checks.VISIBLE_SKIP[0])[2])
