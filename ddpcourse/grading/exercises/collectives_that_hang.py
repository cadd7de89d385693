"""Chapter 09, collectives that hang: visible checks for the five functions of exercise
collectives_that_hang, and the cases the hidden checks reuse.

The contracts are the docstrings of ``train_and_log``, ``fit_and_evaluate``, ``train_on_shard``,
``train_skipping_bad_batches`` and ``gather_predictions`` in
solutions/09_debugging/collectives_that_hang.nb.py (students:
exercises/09_debugging/collectives_that_hang.ipynb). Each runs on every rank of a gloo group.

Every lab is one :class:`~ddpcourse.grading.checks.Case`. In the ranks, ``observe`` builds the
rank's model and data from the situation, calls the student's function and returns only data
(what it returned or logged, the model's state afterwards). The judge, which never runs the
student's code, compares it with the situation's truth: the values asked for exactly (steps,
logged values, gathered rows) or within ``ATOL + RTOL * |x|`` (float results of training: the
ranks add in another order than one process), and bit-identical parameters on every rank. This
module ships to students and is importable where their code runs, so it computes no truth (no
simulated DDP training, no expected gather): the visible cases' truths are written out
(:data:`WRITTEN_OUT`; a model's tensors as their sum and norm), the hidden cases' are computed by
autograder/hidden/collectives_that_hang.py on the grader's side, which simulates the ranks in one
process (each rank's own batch, gradients averaged as DDP averages them, rank 0's buffers
broadcast before a forward as DDP does) and is held to :data:`WRITTEN_OUT` by
tests/test_grading_collectives_that_hang.py. Every launch has a deadline of ``HANG_DEADLINE_S``
seconds (a right solution needs well under one): a hang fails with every rank's stack, a gloo
abort with gloo's message, each with a hint at the fix (:data:`HINTS`).

Each lab also asks a diagnosis of the given code's failure (``diagnose_<lab>()``: which rank,
blocked in what, at which step, which collective met which). Its answer space is small enough to
try every value against any check that tells right from wrong, so nothing here judges it or knows
it: :func:`~ddpcourse.grading.exercises.read_the_logs.observe_diagnosis` only records the returned
dict, and the expected facts and the explanation of each failure (printed in the graded feedback)
live in autograder/hidden/collectives_that_hang.py, judged by autograder/hidden/diagnoses.py.
The visible checks print nothing after a pass.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import IterableDataset

from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, Case, CheckFailed, RemoteFunction,
                                      cut_text, every_ranks_calls, judge_each_rank, observed,
                                      reported_tensors,
                                      run_student, safe_text, type_name)
from ddpcourse.grading.written_out import sum_and_norm, table_lookup
from ddpcourse.launcher import wait_until_ready

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
HANG_DEADLINE_S = min(CHECK_TIMEOUT_S, 8.0)  # a hang fails fast; start-up of warm ranks is ~0.1 s
ATOL, RTOL = 1e-5, 1e-5
IN_FEATURES, HIDDEN = 4, 8
MAX_ITEMS = 256  # of a returned list or a logged sequence
MAX_ROWS = 4096  # of a returned tensor
MAX_TEXT = 300

ABORT_HINT = ("gloo aborts a process (SIGABRT, no Python exception) when a collective receives "
              "more bytes than the tensor it was given: 'Received data size doesn't match "
              "expected size. Is there a distributed collective mismatch in your code?'")


def _text(value: Any) -> str:
    return cut_text(value, MAX_TEXT)


def _run(case: Case, world_size: int, fn, situations, hint: str, timeout: float | None,
         hide_internals: bool) -> None:
    """``run_student`` with the lab's hint added to a hang or an abort; ``timeout`` None:
    ``HANG_DEADLINE_S``."""
    __tracebackhide__ = True  # noqa: F841
    timeout = HANG_DEADLINE_S if timeout is None else timeout
    if not isinstance(fn, RemoteFunction):
        wait_until_ready()  # the short deadline is for the student's code, not for start-up
    try:
        run_student(case, world_size, fn, situations, timeout=timeout,
                    hide_internals=hide_internals)
    except CheckFailed as failed:
        text = str(failed)
        if "did not finish within" in text:
            raise CheckFailed(f"{text}\nHint: {hint}") from None
        if "SIGABRT" in text:
            raise CheckFailed(f"{text}\n{ABORT_HINT}. Hint: {hint}") from None
        raise


# --- models and data: built the same way in the ranks, the judge and the notebook ---------------


def make_linear(seed: int) -> nn.Linear:
    """The regression model of labs 1, 3 and 4 (every rank's starts different)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(IN_FEATURES, 1)


def make_bn_model(seed: int) -> nn.Sequential:
    """The model of lab 2: BatchNorm has buffers (running statistics), which DDP broadcasts."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(),
                             nn.Linear(HIDDEN, 1))


def model_seed(seed: int, rank: int) -> int:
    return 1000 * seed + 17 * rank + 1


def make_batch(seed: int, rank: int, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: ``x`` rows and a target ``y`` to regress."""
    generator = torch.Generator().manual_seed(100_003 * seed + 7919 * rank + 31 * step + 11)
    x = torch.randn(rows, IN_FEATURES, generator=generator)
    return x, (x.sum(dim=1, keepdim=True) + 0.5).sin()


def make_batches(seed: int, rank: int, steps: int, rows: int) -> list:
    return [make_batch(seed, rank, step, rows) for step in range(1, steps + 1)]


class Shard(IterableDataset):
    """One rank's shard of a stream: ``length`` samples ``(x, y)``, one at a time; like a real
    stream, it does not know its length (no ``__len__``)."""

    def __init__(self, seed: int, rank: int, length: int):
        super().__init__()
        self.seed, self.rank, self.length = seed, rank, length

    def __iter__(self):
        x, y = make_batch(self.seed, self.rank, 0, self.length)
        for i in range(self.length):
            yield x[i], y[i]


def shard_batches(seed: int, rank: int, length: int, batch_size: int) -> list:
    """The batches ``DataLoader(Shard(...), batch_size)`` yields (the last one may be smaller)."""
    x, y = make_batch(seed, rank, 0, length)
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, length, batch_size)]


def bad_batch(seed: int, rank: int, step: int, rows: int, kind: str) -> tuple:
    """Lab 4's batch that must be skipped: a NaN (``kind="nan"``) or an infinity (``"inf"``,
    whose loss is inf: not finite, yet not NaN) in its first row, or no rows at all."""
    x, y = make_batch(seed, rank, step, rows)
    if kind == "empty":
        return x[:0], y[:0]
    x = x.clone()
    x[0, 0] = float("inf") if kind == "inf" else float("nan")
    return x, y


def lab4_batches(seed: int, rank: int, steps: int, rows: int, bad: list) -> list:
    """Lab 4's batches of one rank; ``bad`` lists ``[rank, step, kind]``."""
    kinds = {(r, s): kind for r, s, kind in bad}
    return [bad_batch(seed, rank, step, rows, kinds[rank, step]) if (rank, step) in kinds
            else make_batch(seed, rank, step, rows) for step in range(1, steps + 1)]


def predictions(seed: int, rank: int, rows: int, kind: str) -> torch.Tensor:
    """Lab 5: a rank's predictions: class indices (``labels``, int64) or scores (float32)."""
    generator = torch.Generator().manual_seed(7919 * seed + 101 * rank + 3)
    if kind == "labels":
        return torch.randint(0, 10, (rows,), generator=generator)
    return torch.randn(rows, 3, generator=generator)


# --- observed in the ranks: data only ------------------------------------------------------------


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu").clone() for name, t in module.state_dict().items()}


def _floats(values: Any) -> list[float] | None:
    if not isinstance(values, (list, tuple)):
        return None
    out = []
    for value in values[:MAX_ITEMS]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        out.append(float(value))
    return out


def _ints(values: Any) -> list[int] | None:
    if not isinstance(values, (list, tuple)):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values[:MAX_ITEMS]):
        return None
    return [int(v) for v in values[:MAX_ITEMS]]


def _returned(result: Any) -> dict:
    return {"returned": type_name(result),
            "returned_length": len(result) if isinstance(result, (list, tuple)) else -1,
            "returned_text": safe_text(lambda: repr(result), 120)}


def observe_log(rank, world_size, fn, situations) -> dict:
    """Lab 1: ``train_and_log(model, batches, lr, log_every, log)``; records every log call."""
    calls = []
    for rows, steps, lr, log_every, seed in situations:
        model = make_linear(model_seed(seed, rank))
        logged: list = []

        def log(step, value, logged=logged):
            if len(logged) < MAX_ITEMS:
                logged.append([step if isinstance(step, int) else type_name(step),
                               float(value) if isinstance(value, (int, float)) else
                               type_name(value)])

        fn(model, make_batches(seed, rank, steps, rows), lr, log_every, log)
        calls.append({"logged": logged, "state": _state(model)})
    return {"calls": calls}


def observe_evaluate(rank, world_size, fn, situations) -> dict:
    """Lab 2: ``fit_and_evaluate(model, batches, eval_batch, epochs, lr)``."""
    calls = []
    for rows, steps, epochs, lr, seed in situations:
        model = make_bn_model(model_seed(seed, rank))
        result = fn(model, make_batches(seed, rank, steps, rows),
                    make_batch(seed, 99, 0, 2 * rows), epochs, lr)
        calls.append({"history": _floats(result), **_returned(result), "state": _state(model),
                      "training": model.training})
    return {"calls": calls}


def observe_shard(rank, world_size, fn, situations) -> dict:
    """Lab 3: ``train_on_shard(model, shard, batch_size, lr)``; ``situations`` hold every rank's
    shard length."""
    calls = []
    for lengths, batch_size, lr, seed in situations:
        model = make_linear(model_seed(seed, rank))
        result = fn(model, Shard(seed, rank, lengths[rank]), batch_size, lr)
        calls.append({"steps": result if isinstance(result, int) and not isinstance(result, bool)
                      else None, **_returned(result), "state": _state(model)})
    return {"calls": calls}


def observe_skip(rank, world_size, fn, situations) -> dict:
    """Lab 4: ``train_skipping_bad_batches(model, batches, lr, stop_below)``."""
    calls = []
    for rows, steps, lr, stop_below, bad, seed in situations:
        model = make_linear(model_seed(seed, rank))
        result = fn(model, lab4_batches(seed, rank, steps, rows, bad), lr, stop_below)
        calls.append({"applied": _ints(result), **_returned(result), "state": _state(model)})
    return {"calls": calls}


def observe_gather(rank, world_size, fn, situations) -> dict:
    """Lab 5: ``gather_predictions(local)``."""
    calls = []
    for rows, kind, seed in situations:
        result = fn(predictions(seed, rank, rows[rank], kind))
        ok = (isinstance(result, torch.Tensor) and result.layout == torch.strided
              and result.dim() >= 1 and result.shape[0] <= MAX_ROWS)
        calls.append({"gathered": result.detach().to("cpu").clone() if ok else None,
                      **_returned(result),
                      "shape": list(result.shape) if isinstance(result, torch.Tensor) else None})
    return {"calls": calls}


# --- the judge: the truth of a situation against what the ranks did ----------------------------
#
# This module computes no truth: no simulated DDP training, no expected gather. A judge gets
# ``truth(world_size, situation)``: the visible cases' is written out below (WRITTEN_OUT), the
# hidden cases' is computed by autograder/hidden/collectives_that_hang.py on the grader's side.

Truth = Callable[[int, Any], dict]


# How a tensor of a visible case's truth is written out: its sum and its 2-norm (float64).
digest = sum_and_norm


def _templates(module_maker) -> dict[str, torch.Tensor]:
    """The names, shapes and dtypes a rank's report of the model's state must have."""
    return _state(module_maker(0))


def _difference(got: torch.Tensor, want: Any) -> tuple[float, bool]:
    """How far ``got`` is from ``want`` (a tensor: element-wise ``ATOL + RTOL * |w|``; a
    written-out :func:`digest`: within ``numel * ATOL + RTOL * sqrt(numel) * norm``, which bounds
    what the element-wise tolerance allows) and whether that is within the tolerance."""
    if isinstance(want, torch.Tensor):
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        return diff, torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL)
    diff = max(abs(a - b) for a, b in zip(digest(got), want))
    return diff, diff <= ATOL * got.numel() + RTOL * math.sqrt(got.numel()) * want[1]


def _judge_state(state: dict, want: dict, what: str, hint: str, names=None) -> None:
    for name in names if names is not None else want:
        diff, close = _difference(state[name], want[name])
        if not close:
            raise CheckFailed(f"{what}: the model's {name!r} is not what the ranks' training "
                              f"gives (largest difference {diff:.3g}). {hint}")


def _judge_replicas(states: list, names, what: str) -> None:
    for rank, state in enumerate(states):
        for name in names:
            if not torch.equal(state[name], states[0][name]):
                diff = (state[name].double() - states[0][name].double()).abs().max().item()
                raise CheckFailed(f"{what}: the parameter {name!r} differs between rank 0 and "
                                  f"rank {rank} (max difference {diff:.3g}); DDP replicas take "
                                  "identical steps, bit for bit")


def _judge_calls(observations, world_size, situations, judge_one) -> None:
    reports = every_ranks_calls(observations, len(situations))
    for number, situation in enumerate(situations):
        judge_one([report[number] for report in reports], world_size, situation)


def _ranks(world_size: int) -> str:
    return f"{world_size} rank{'s' if world_size > 1 else ''}"


def _parameter_names(state: dict, module_maker) -> list[str]:
    return [name for name, _ in module_maker(0).named_parameters() if name in state]


def judge_log_against(truth: Truth, observations, world_size, situations) -> None:
    """``truth``: ``{"logged": rank 0's [[step, mean loss], ...], "state": the model's}``."""
    templates = _templates(make_linear)

    def judge_one(calls, world_size, situation):
        rows, steps, lr, log_every, seed = situation
        what = (f"{_ranks(world_size)}, {steps} steps of {rows} rows, logging every "
                f"{log_every}")
        known = truth(world_size, situation)
        logged, want = known["logged"], known["state"]
        states = []

        def judge_rank(rank, call):
            state = reported_tensors(observed(call, "state", dict), templates,
                                     f"{what}: the model's")
            states.append(state)
            got = observed(call, "logged", list)
            if rank != 0:
                if got:
                    raise CheckFailed(f"{what}: only rank 0 logs; rank {rank} called log "
                                      f"{len(got)} times: {_text(got)}")
            else:
                _judge_logged(got, logged, what)
            _judge_state(state, want, what, "Every rank must take every step.")

        judge_each_rank(calls, judge_rank)
        _judge_replicas(states, _parameter_names(templates, make_linear), what)

    _judge_calls(observations, world_size, situations, judge_one)


def _judge_logged(got: list, want: list, what: str) -> None:
    steps = [s for s, _ in want]
    if [entry[0] if isinstance(entry, list) and entry else None for entry in got] != steps:
        raise CheckFailed(f"{what}: rank 0 logged the steps "
                          f"{_text([e[0] if isinstance(e, list) and e else e for e in got])}, "
                          f"expected {steps}")
    for (step, value), entry in zip(want, got):
        if len(entry) != 2 or not isinstance(entry[1], float):
            raise CheckFailed(f"{what}: at step {step} rank 0 logged {_text(entry[1:])}, not a "
                              "Python float")
        if not math.isclose(entry[1], value, rel_tol=RTOL, abs_tol=ATOL):
            raise CheckFailed(f"{what}: at step {step} rank 0 logged {entry[1]:.6g}; the mean "
                              f"of every rank's loss is {value:.6g}")


def judge_evaluate_against(truth: Truth, observations, world_size, situations) -> None:
    """``truth``: ``{"history": rank 0's validation loss after each epoch, "state": rank 0's
    model (every rank's parameters; the buffers only rank 0's)}``."""
    templates = _templates(make_bn_model)
    params = _parameter_names(templates, make_bn_model)
    buffers = [name for name in templates if name not in params]

    def judge_one(calls, world_size, situation):
        rows, steps, epochs, lr, seed = situation
        what = f"{_ranks(world_size)}, {epochs} epochs of {steps} steps of {rows} rows"
        known = truth(world_size, situation)
        history, want = known["history"], known["state"]
        states = []

        def judge_rank(rank, call):
            state = reported_tensors(observed(call, "state", dict), templates,
                                     f"{what}: the model's")
            states.append(state)
            if observed(call, "training", bool) is not True:
                raise CheckFailed(f"{what}: the model handed in is left in eval mode; put it "
                                  "back in train mode after evaluating")
            got, length = observed(call, "history", (list, type(None))), observed(
                call, "returned_length", int)
            text = observed(call, "returned_text", str)
            if rank != 0 and (got != [] or length != 0):
                raise CheckFailed(f"{what}: rank {rank} must return an empty list (only rank 0 "
                                  f"evaluates); it returned {_text(text)}")
            if rank == 0:
                if got is None or length != len(history) or not all(
                        math.isfinite(v) for v in got):
                    raise CheckFailed(f"{what}: rank 0 must return {len(history)} floats, one "
                                      f"validation loss per epoch; it returned {_text(text)}")
                for epoch, (value, expected) in enumerate(zip(got, history), start=1):
                    if not math.isclose(value, expected, rel_tol=RTOL, abs_tol=ATOL):
                        raise CheckFailed(
                            f"{what}: after epoch {epoch} rank 0's validation loss is "
                            f"{value:.6g}, expected {expected:.6g} (the model in eval mode: "
                            "BatchNorm normalises with its running statistics, and an "
                            "evaluation never updates them)")
            _judge_state(state, want, what, "Training must be the ranks' DDP training, "
                         "untouched by the evaluation.", params)
            if rank == 0:  # the others' last buffers depend on where the evaluation ran
                _judge_state(state, want, what, "BatchNorm's running statistics on rank 0 "
                             "are updated by its training forwards only: an evaluation in eval "
                             "mode leaves them alone.", buffers)

        judge_each_rank(calls, judge_rank)
        _judge_replicas(states, params, what)

    _judge_calls(observations, world_size, situations, judge_one)


def judge_shard_against(truth: Truth, observations, world_size, situations) -> None:
    """``truth``: ``{"steps": the steps every rank takes, "state": the model's}``."""
    templates = _templates(make_linear)

    def judge_one(calls, world_size, situation):
        lengths, batch_size, lr, seed = situation
        what = (f"{_ranks(world_size)}, shards of {lengths} samples, batches of {batch_size}")
        known = truth(world_size, situation)
        steps, want = known["steps"], known["state"]
        states = []

        def judge_rank(rank, call):
            state = reported_tensors(observed(call, "state", dict), templates,
                                     f"{what}: the model's")
            states.append(state)
            got = observed(call, "steps", (int, type(None)))
            if got != steps:
                own = -(-lengths[rank] // batch_size)
                hint = (" - the number of batches of this rank's own shard: the ranks must "
                        "agree on one count" if got == own else "")
                raise CheckFailed(f"{what}: rank {rank} returned "
                                  f"{_text(observed(call, 'returned_text', str))} steps; every "
                                  f"rank takes {steps} (the fewest batches of any shard){hint}")
            _judge_state(state, want, what, f"Every rank takes the first {steps} batches of "
                         "its shard, one DDP step each, and no other.")

        judge_each_rank(calls, judge_rank)
        _judge_replicas(states, _parameter_names(templates, make_linear), what)

    _judge_calls(observations, world_size, situations, judge_one)


def judge_skip_against(truth: Truth, observations, world_size, situations) -> None:
    """``truth``: ``{"applied": the steps every rank applies, "state": the model's}``."""
    templates = _templates(make_linear)

    def judge_one(calls, world_size, situation):
        rows, steps, lr, stop_below, bad, seed = situation
        what = (f"{_ranks(world_size)}, {steps} steps, bad batches {[tuple(b) for b in bad]}, "
                f"stop below {stop_below:g}")
        known = truth(world_size, situation)
        applied, want = known["applied"], known["state"]
        states = []

        def judge_rank(rank, call):
            state = reported_tensors(observed(call, "state", dict), templates,
                                     f"{what}: the model's")
            states.append(state)
            got = observed(call, "applied", (list, type(None)))
            if got != applied or observed(call, "returned_length", int) != len(applied):
                raise CheckFailed(f"{what}: rank {rank} returned "
                                  f"{_text(observed(call, 'returned_text', str))}; the steps "
                                  f"every rank applies are {applied}")
            _judge_state(state, want, what, "Skip a step on every rank when any rank's loss is "
                         "not finite, stop on every rank after the first step whose mean loss "
                         "over the ranks is below stop_below.")

        judge_each_rank(calls, judge_rank)
        _judge_replicas(states, _parameter_names(templates, make_linear), what)

    _judge_calls(observations, world_size, situations, judge_one)


def judge_gather_against(truth: Truth, observations, world_size, situations) -> None:
    """``truth``: ``{"gathered": every rank's rows in rank order}`` (a tensor), or written out
    ``{"dtype": name, "values": nested lists}``."""
    def judge_one(calls, world_size, situation):
        rows, kind, seed = situation
        what = f"{_ranks(world_size)} holding {rows} rows of {kind}"
        known = truth(world_size, situation)
        want = (known["gathered"] if "gathered" in known
                else torch.tensor(known["values"], dtype=getattr(torch, known["dtype"])))

        def judge_rank(rank, call):
            got = observed(call, "gathered", (torch.Tensor, type(None)))
            if got is None:
                raise CheckFailed(f"{what}: gather_predictions must return a tensor; it returned "
                                  f"{_text(observed(call, 'returned_text', str))}")
            if got.shape != want.shape or got.dtype != want.dtype:
                raise CheckFailed(f"{what}: rank {rank} got a {got.dtype} tensor of shape "
                                  f"{tuple(got.shape)}; expected {want.dtype}, "
                                  f"{tuple(want.shape)}: every rank's rows, no padding")
            if not torch.equal(got, want):
                row = int((got != want).reshape(got.shape[0], -1).any(dim=1).nonzero()[0])
                starts = [0]
                for n in rows:
                    starts.append(starts[-1] + n)
                owner = max(r for r in range(world_size) if starts[r] <= row)
                raise CheckFailed(f"{what}: row {row} (rank {owner}'s row {row - starts[owner]}) "
                                  f"is {_text(got[row].tolist())}, expected "
                                  f"{_text(want[row].tolist())}: every rank's rows, in rank "
                                  "order, each exactly once")

        judge_each_rank(calls, judge_rank)

    _judge_calls(observations, world_size, situations, judge_one)



# Shown when a fix hangs or gloo aborts it: how to fix, never what the given code did (that is
# the diagnosis each lab asks, judged and explained only by the hidden checks).
HINTS = {
    "log": "every rank must make the same collectives in the same order: call the all_reduce on "
           "every rank, and only the logging on rank 0",
    "evaluate": "a forward of the DDP wrapper can make a collective, even in eval mode under "
                "no_grad: evaluate on every rank through the wrapper, or on rank 0 through "
                "model.module (no collective)",
    "shard": "agree on the number of steps as you go (e.g. before each step, an all_reduce with "
             "ReduceOp.MIN of 'I still have a batch'), so that every rank stops at the same step",
    "skip": "decide together: all_reduce a flag every rank computes, then every rank acts on the "
            "same result (skip or not, stop or not)",
    "gather": "all_gather needs tensors of the same shape on every rank: gather the sizes "
              "first, pad to the largest, gather, then cut each rank's padding off",
}

# Situations travel to the ranks as plain tuples.
VISIBLE_LOG = [(4, 4, 0.1, 2, 0)]  # (rows, steps, lr, log_every, seed)
VISIBLE_EVALUATE = [(6, 3, 2, 0.1, 0)]  # (rows, steps per epoch, epochs, lr, seed)
VISIBLE_SHARD = [([10, 7], 3, 0.1, 0)]  # (shard lengths by rank, batch_size, lr, seed)
VISIBLE_SKIP = [(4, 6, 0.1, 0.05, [[1, 2, "nan"]], 0),  # (rows, steps, lr, stop_below, bad, seed)
                (4, 8, 0.3, 0.2, [], 1)]
VISIBLE_GATHER = [([4, 3], "labels", 0), ([5, 1], "scores", 1)]  # (rows by rank, kind, seed)


def situation_key(world_size: int, situation) -> str:
    """How :data:`WRITTEN_OUT` names a situation."""
    return f"{world_size} ranks, {situation!r}"


# The truths of the visible cases, as autograder/hidden/collectives_that_hang.py computes them
# (`python -m autograder.hidden.collectives_that_hang` prints them again): logged values, steps
# and gathered rows as they are, each tensor of a model's state as its sum and norm.
WRITTEN_OUT: dict[str, dict[str, dict]] = {
    'log': {
        '2 ranks, (4, 4, 0.1, 2, 0)': {
            'logged': [
                [2, 0.4621429741382599],
                [4, 0.9734540581703186],
            ],
            'state': {
                'weight': [0.46665384620428085, 0.3219415321512544],
                'bias': [-0.1661975085735321, 0.1661975085735321],
            },
        },
    },
    'evaluate': {
        '2 ranks, (6, 3, 2, 0.1, 0)': {
            'history': [0.445078581571579, 0.4157770872116089],
            'state': {
                '0.weight': [1.449191355612129, 1.3968618400471033],
                '0.bias': [-0.5047138333320618, 0.9487443238709282],
                '1.weight': [7.967727184295654, 2.8170703945423807],
                '1.bias': [0.00867975887376815, 0.0183890851527959],
                '1.running_mean': [-0.34903011843562126, 0.47909024568908853],
                '1.running_var': [5.635832726955414, 2.0215255304394426],
                '1.num_batches_tracked': [6.0, 6.0],
                '3.weight': [0.3208255171775818, 0.4815874140640033],
                '3.bias': [-0.13073022663593292, 0.13073022663593292],
            },
        },
    },
    'shard': {
        '2 ranks, ([10, 7], 3, 0.1, 0)': {
            'steps': 3,
            'state': {
                'weight': [0.5411286503076553, 0.3653889102172591],
                'bias': [-0.13289359211921692, 0.13289359211921692],
            },
        },
    },
    'skip': {
        "2 ranks, (4, 6, 0.1, 0.05, [[1, 2, 'nan']], 0)": {
            'applied': [1, 3, 4, 5, 6],
            'state': {
                'weight': [0.4960843361914158, 0.310968273998277],
                'bias': [-0.06020009517669678, 0.06020009517669678],
            },
        },
        '2 ranks, (4, 8, 0.3, 0.2, [], 1)': {
            'applied': [1, 2, 3, 4, 5],
            'state': {
                'weight': [0.5805915296077728, 0.37683201980686565],
                'bias': [0.08255837112665176, 0.08255837112665176],
            },
        },
    },
    'gather': {
        "2 ranks, ([4, 3], 'labels', 0)": {
            'dtype': 'int64',
            'values': [6, 8, 7, 7, 5, 5, 7],
        },
        "2 ranks, ([5, 1], 'scores', 1)": {
            'dtype': 'float32',
            'values': [
                [0.46648895740509033, -0.9024532437324524, 1.565162181854248],
                [1.5427238941192627, 1.1768746376037598, 0.0688575804233551],
                [0.34443172812461853, 1.2826054096221924, 0.9376524090766907],
                [-2.1198363304138184, 0.20064613223075867, -1.5909433364868164],
                [0.14139781892299652, 0.9671911597251892, -1.0081946849822998],
                [0.2999265193939209, 0.36482346057891846, -1.753698468208313],
            ],
        },
    },
}


def written_out(lab: str) -> Truth:
    """The visible cases' truth for ``lab``: their entry of :data:`WRITTEN_OUT`."""
    return table_lookup(WRITTEN_OUT, lab, situation_key)


def judge_log(observations, world_size, situations) -> None:
    judge_log_against(written_out("log"), observations, world_size, situations)


def judge_evaluate(observations, world_size, situations) -> None:
    judge_evaluate_against(written_out("evaluate"), observations, world_size, situations)


def judge_shard(observations, world_size, situations) -> None:
    judge_shard_against(written_out("shard"), observations, world_size, situations)


def judge_skip(observations, world_size, situations) -> None:
    judge_skip_against(written_out("skip"), observations, world_size, situations)


def judge_gather(observations, world_size, situations) -> None:
    judge_gather_against(written_out("gather"), observations, world_size, situations)


LOG = Case(observe_log, judge_log)
EVALUATE = Case(observe_evaluate, judge_evaluate)
SHARD = Case(observe_shard, judge_shard)
SKIP = Case(observe_skip, judge_skip)
GATHER = Case(observe_gather, judge_gather)


def check_train_and_log(fn, timeout: float = HANG_DEADLINE_S) -> None:
    """2 ranks: rank 0 logs the global mean loss every few steps; the ranks stay in step."""
    _run(LOG, 2, fn, VISIBLE_LOG, HINTS["log"], timeout, False)


def check_fit_and_evaluate(fn, timeout: float = HANG_DEADLINE_S) -> None:
    """2 ranks: rank 0 evaluates after every epoch, the last one included."""
    _run(EVALUATE, 2, fn, VISIBLE_EVALUATE, HINTS["evaluate"], timeout, False)


def check_train_on_shard(fn, timeout: float = HANG_DEADLINE_S) -> None:
    """2 ranks, shards of 10 and 7 samples in batches of 3: 3 steps on every rank."""
    _run(SHARD, 2, fn, VISIBLE_SHARD, HINTS["shard"], timeout, False)


def check_train_skipping_bad_batches(fn, timeout: float = HANG_DEADLINE_S) -> None:
    """2 ranks: a NaN batch on rank 1 at step 2; a run that stops early."""
    _run(SKIP, 2, fn, VISIBLE_SKIP, HINTS["skip"], timeout, False)


def check_gather_predictions(fn, timeout: float = HANG_DEADLINE_S) -> None:
    """2 ranks holding 4 and 3 labels, then 5 and 1 rows of scores."""
    _run(GATHER, 2, fn, VISIBLE_GATHER, HINTS["gather"], timeout, False)
