"""The checks of exercise collectives_that_hang (chapter 09): the solution passes every visible and
hidden check through the trusted grader; every given function of the notebook still fails the way
its lab says on this PyTorch (a gloo abort with gloo's own message, a hang with the rank blocked
where the lab says); the tempting wrong fixes fail the check they should, and the other right
fixes pass. Each lab's diagnosis, judged by the hidden module only, is what the given code does
(every expected value derived again from runs of the given code, its gradient all-reduces traced
with the step each rank was in); a wrong field fails named, and the explanation comes with the
graded feedback, never from the visible module. The exercise:
solutions/09_debugging/collectives_that_hang.nb.py."""

from __future__ import annotations

import math
import re
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


def from_the_notebook(cell_id: str, name: str, ddp=DDP):
    """A function as the source notebook's cell ``cell_id`` defines it, in a fresh namespace."""
    namespace = {"torch": torch, "dist": dist, "F": F, "DDP": ddp, "DataLoader": DataLoader}
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
    """Equal, floats within half the judges' tolerance (``checks.RTOL``, ``checks.ATOL``): a
    value written out on one machine and one computed here agree only to float32's rounding,
    which differs with the CPU's kernels (up to ~1e-6 relative, measured on an AMD EPYC against
    values written on another machine), and half leaves the other half to the student's own
    rounding, so a visible verdict is the reference's on any machine."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=checks.RTOL / 2, abs_tol=checks.ATOL / 2)
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
    assert " in all_reduce\n" in failure_of(hung.value, 0).stack


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
        # Only rank 1 calls: gloo checks the sizes on the calling rank before a byte moves. (With
        # both ranks calling, rank 1's raise closes its connection, and under load rank 0's
        # "Connection reset by peer" can reach the launcher first and hide rank 1's error.)
        if rank == 1:
            dist.all_gather([torch.zeros(4) for _ in range(world_size)], torch.zeros(3))

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


# --- the diagnoses: each expected value, derived again from a run of the given code ------------

DEADLINE = 4.0  # seconds: the givens hang for good; a little more than SHORT for a loaded machine


def traced_ddp(trace: str):
    """A DDP class for the given code's namespace that appends one line per event to
    ``trace``-RANK (a file, so that it survives a hang or an abort): ``all_reduce S`` when the
    gradient all-reduce of step S starts, ``paired S P`` when it completes, P being the step of
    the other rank's all-reduce that met it (each of the 2 ranks adds its step to the bucket:
    the sum is both steps), and ``evaluated`` after an eval-mode forward returned."""

    class TracedDDP(DDP):
        def __init__(self, module, **kwargs):
            super().__init__(module, **kwargs)
            self.step = 0
            self.register_comm_hook(self, _tagged_all_reduce)

        def note(self, *words):
            with open(f"{trace}-{dist.get_rank()}", "a") as out:
                out.write(" ".join(map(str, words)) + "\n")

        def forward(self, *args, **kwargs):
            self.step += self.module.training  # a training forward starts a step
            result = super().forward(*args, **kwargs)
            if not self.module.training:
                self.note("evaluated")
            return result

    return TracedDDP


def _tagged_all_reduce(ddp, bucket):
    ddp.note("all_reduce", ddp.step)
    tagged = torch.cat([bucket.buffer(), torch.tensor([float(ddp.step)])])

    def done(future):
        total = future.value()[0]
        ddp.note("paired", ddp.step, int(total[-1].item()) - ddp.step)
        return total[:-1] / dist.get_world_size()

    return dist.all_reduce(tagged, async_op=True).get_future().then(done)


def failure_of(error: RankError, rank: int):
    """Rank ``rank``'s RankFailure (``error.failures`` leads with the rank that failed first)."""
    return next(failure for failure in error.failures if failure.rank == rank)


def trace_of(trace, rank: int) -> list[list[str]]:
    with open(f"{trace}-{rank}") as lines:
        return [line.split() for line in lines]


def failures_of(fn, *args) -> RankError:
    """The RankError of ``fn`` run on 2 gloo ranks (it must fail)."""
    with pytest.raises(RankError) as failed:
        run_ranks(fn, 2, *args, timeout=DEADLINE, backend="gloo", relay_output=False)
    return failed.value


def function_in(stack: str, file_end: str) -> str:
    """The innermost function of ``stack`` (most recent call first) in a file ending in
    ``file_end``; ``"<student notebook>"``'s caller: the call on the given code's line."""
    frames = re.findall(r'File "([^"]+)", line \d+ in (\S+)', stack)
    if file_end == "<student notebook>":
        given = next(i for i, (path, _) in enumerate(frames) if path == file_end)
        return frames[given - 1][1]
    return next(name for path, name in frames if path.endswith(file_end))


def demo_log(rank, world_size, train_and_log, log_every):
    """Lab 1's Run-it: 4 steps of 4 rows, seed 0."""
    model = checks.make_linear(checks.model_seed(0, rank))
    train_and_log(model, checks.make_batches(0, rank, 4, 4), 0.1, log_every, lambda *_: None)


def demo_evaluate(rank, world_size, fit_and_evaluate, make_model=checks.make_bn_model):
    """Lab 2's Run-it: 2 epochs of 3 steps of 6 rows."""
    model = make_model(checks.model_seed(0, rank))
    return fit_and_evaluate(model, checks.make_batches(0, rank, 3, 6),
                            checks.make_batch(0, 99, 0, 12), 2, 0.1)


def demo_shard(rank, world_size, train_on_shard):
    """Lab 3's Run-it: shards of 10 and 7 samples, batches of 3."""
    model = checks.make_linear(checks.model_seed(0, rank))
    return train_on_shard(model, checks.Shard(0, rank, [10, 7][rank]), 3, 0.1)


def demo_skip(rank, world_size, train_skipping_bad_batches):
    """Lab 4's Run-it: 6 steps, a NaN in rank 1's batch of step 2."""
    model = checks.make_linear(checks.model_seed(0, rank))
    return train_skipping_bad_batches(model, checks.lab4_batches(0, rank, 6, 4, [[1, 2, "nan"]]),
                                      0.1, 0.05)


def demo_gather(rank, world_size, gather_predictions, rows=(4, 3)):
    """Lab 5's Run-it: rank 0 holds 4 labels, rank 1 holds 3."""
    return gather_predictions(checks.predictions(0, rank, rows[rank], "labels")).tolist()


def traced_given(lab: int, trace) -> object:
    return from_the_notebook(GIVEN_CELLS[lab], "buggy_" + NAMES[lab], traced_ddp(str(trace)))



def derived(lab: str, facts: dict) -> dict:
    """``facts`` as the hidden module compares them (its own normalization)."""
    return {field: hidden.normalize(hidden.KINDS[field], value) for field, value in facts.items()}


def expected(lab: str) -> dict:
    return derived(lab, hidden.DIAGNOSES[lab])


def test_the_log_diagnosis_is_what_the_given_code_does(tmp_path):
    """(a) logging at the last step: one rank left, blocked in a torch.distributed function.
    (b) logging at step 2: gloo aborts a rank, whose log all-reduce met the other rank's gradient
    all-reduce of the step the trace shows started and never paired."""
    hung = failures_of(demo_log, given(0), 4)
    assert isinstance(hung, RankTimeoutError) and len(hung.failed_ranks) == 1
    [hung_rank] = hung.failed_ranks
    aborted = failures_of(demo_log, given(0), 2)
    [killed] = [f for f in aborted.failures if f.kind == "exited"]
    assert killed.exitcode == -6
    traced = failures_of(demo_log, traced_given(0, tmp_path / "trace"), 2)
    assert [f.rank for f in traced.failures if f.kind == "exited"] == [killed.rank]
    assert " in all_reduce\n" in failure_of(traced, killed.rank).stack  # its log all-reduce
    last = trace_of(tmp_path / "trace", 1 - killed.rank)[-1]
    assert last[0] == "all_reduce"  # started, never paired
    assert derived("log", {
        "hung_rank": hung_rank,
        "hung_in": function_in(failure_of(hung, hung_rank).stack, "distributed_c10d.py"),
        "aborted_rank": killed.rank, "paired_with_step": int(last[1])}) == expected("log")


def test_the_evaluate_diagnosis_is_what_the_given_code_does(tmp_path):
    """Rank 0 waits in DDP's buffer broadcast after completing the evaluations the trace shows;
    the same run with a model without buffers returns on every rank."""
    hung = failures_of(demo_evaluate, traced_given(1, tmp_path / "trace"))
    assert isinstance(hung, RankTimeoutError) and len(hung.failed_ranks) == 1
    [rank] = hung.failed_ranks
    waits_in = function_in(failure_of(hung, rank).stack, "nn/parallel/distributed.py")
    assert " in _sync_buffers\n" in failure_of(hung, rank).stack  # DDP's buffer sync, as explained
    evaluated = [line for line in trace_of(tmp_path / "trace", rank) if line == ["evaluated"]]
    try:
        run_ranks(demo_evaluate, 2, given(1), checks.make_linear, timeout=DEADLINE,
                  backend="gloo", relay_output=False)
        hangs_without_buffers = False
    except RankTimeoutError:
        hangs_without_buffers = True
    assert not list(checks.make_linear(0).buffers()) and list(checks.make_bn_model(0).buffers())
    assert derived("evaluate", {
        "hung_rank": rank, "collective": "broadcast" if "broadcast" in waits_in else waits_in,
        "evaluations_completed": len(evaluated),
        "hangs_without_buffers": hangs_without_buffers}) == expected("evaluate")


def test_the_shard_diagnosis_is_what_the_given_code_does(tmp_path):
    """The longer shard's rank is blocked in the call on the given code's line, in the step
    whose gradient all-reduce the trace shows started and never paired."""
    hung = failures_of(demo_shard, traced_given(2, tmp_path / "trace"))
    assert isinstance(hung, RankTimeoutError) and len(hung.failed_ranks) == 1
    [rank] = hung.failed_ranks
    last = trace_of(tmp_path / "trace", rank)[-1]
    assert last[0] == "all_reduce"
    assert derived("shard", {
        "hung_rank": rank,
        "hung_in": function_in(failure_of(hung, rank).stack, "<student notebook>"),
        "hung_at_step": int(last[1])}) == expected("shard")


def test_the_skip_diagnosis_is_what_the_given_code_does(tmp_path):
    """Rank 1 skipped step 2: the trace pairs each of rank 0's later all-reduces with rank 1's
    of another step, and rank 0's last one with none."""
    hung = failures_of(demo_skip, traced_given(3, tmp_path / "trace"))
    assert isinstance(hung, RankTimeoutError) and len(hung.failed_ranks) == 1
    [rank] = hung.failed_ranks
    assert function_in(failure_of(hung, rank).stack, "<student notebook>") == "backward"
    trace = trace_of(tmp_path / "trace", rank)
    assert trace[-1][0] == "all_reduce"
    mixed = [int(own) for event, own, *partner in trace
             if event == "paired" and partner != [own]]
    assert derived("skip", {"hung_rank": rank, "hung_at_step": int(trace[-1][1]),
                            "mixed_steps": mixed}) == expected("skip")


def test_the_gather_diagnosis_is_what_the_given_code_does():
    """gloo aborts the rank holding fewer rows, whichever rank that is."""
    aborted = {}
    for rows in ((4, 3), (3, 4)):
        [killed] = [f for f in failures_of(demo_gather, given(4), rows).failures
                    if f.kind == "exited"]
        aborted[rows] = killed
    assert aborted[(4, 3)].exitcode == aborted[(3, 4)].exitcode
    assert derived("gather", {"aborted_rank": aborted[(4, 3)].rank,
                              "exitcode": aborted[(4, 3)].exitcode,
                              "aborted_rank_swapped": aborted[(3, 4)].rank}) == expected("gather")


LABS = ("log", "evaluate", "shard", "skip", "gather")


def diagnosis(lab: str):
    return from_the_notebook(f"diagnose-{lab}", f"diagnose_{lab}")


def wrong_value(kind: str, value):
    return {"int": lambda v: v + 1, "bool": lambda v: not v, "ints": lambda v: v[:-1],
            "function": lambda v: "barrier" if v != "barrier" else "all_gather"}[kind](value)


@pytest.mark.parametrize("lab", LABS)
def test_the_solution_diagnosis_passes_and_each_wrong_field_fails_named(lab):
    """The solution's answer is the hidden module's; a wrong value in any one field, or a
    missing field, fails with that field named (and only it)."""
    right = diagnosis(lab)()
    wrong_fields = hidden.DIAGNOSED.wrong_fields
    assert wrong_fields(lab, right) == []
    assert right.keys() == hidden.DIAGNOSES[lab].keys()
    for field, value in right.items():
        wrong = wrong_fields(lab, {**right, field: wrong_value(hidden.KINDS[field], value)})
        assert len(wrong) == 1 and wrong[0].startswith(f"{field!r} = "), wrong
        missing = wrong_fields(lab, {k: v for k, v in right.items() if k != field})
        assert len(missing) == 1 and missing[0].startswith(f"{field!r} is missing"), missing
    assert wrong_fields(lab, {**right, next(iter(right)): "1"})[0].endswith("not '1'")


def test_the_hidden_diagnosis_checks_run_the_submitted_function_and_always_explain(host, capsys):
    """Through the autograder's path: a right diagnosis passes and prints the explanation; a
    wrong one fails naming the field, with the explanation in the failure."""
    for lab in LABS:
        getattr(hidden, f"check_{lab}_diagnosis")(submitted(diagnosis(lab), host))
        assert hidden.EXPLANATIONS[lab].rstrip() in capsys.readouterr().out

    def diagnose_gather():
        return {"aborted_rank": 0, "exitcode": -6, "aborted_rank_swapped": 0}

    with pytest.raises(CheckFailed) as failed:
        hidden.check_gather_diagnosis(submitted(diagnose_gather, host))
    text = str(failed.value)
    assert "'aborted_rank' = 0 is not what the given code does" in text
    assert "aborted_rank_swapped" not in text.split("Why the given code failed")[0]
    assert hidden.EXPLANATIONS["gather"].rstrip() in text


def test_the_visible_module_holds_no_diagnosis_and_prints_nothing_after_a_pass(capsys):
    """The diagnoses and explanations live in the hidden module only: the visible module, which
    every student can import, has neither, and its checks print nothing after a pass."""
    for name in ("EXPLANATIONS", "explain", "explanation", "DIAGNOSES", "KINDS",
                 "HINTS_BY_FIELD", "DIAGNOSED"):
        assert not hasattr(checks, name), name
    checks.check_gather_predictions(solutions()[4])
    assert capsys.readouterr().out == ""
