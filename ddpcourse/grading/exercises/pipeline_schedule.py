"""Chapter 11, pipeline parallelism: visible checks for ``pipeline_schedule``, and the case the
hidden checks reuse.

The contract is the docstring of ``pipeline_schedule`` in
solutions/11_beyond_ddp/pipeline_schedule.nb.py (students:
exercises/11_beyond_ddp/pipeline_schedule.ipynb).

A schedule is judged by what every correct one shares, never against a reference schedule (this
module has none: writing one is the exercise). The judge reads the returned orders and checks,
with :mod:`ddpcourse.pipeline`'s timeline (every forward and backward one slot, messages free):

* the form: ``num_stages`` lists, each holding every ``F<i>`` and ``B<i>`` exactly once;
* the dependencies: no stage waits forever (a backward before its own forward, or a cycle between
  stages, is reported as the deadlock it is, naming what each stuck stage waits for);
* the bubble: the timeline lasts ``2(m + p - 1)`` slots, i.e. a bubble of ``(p-1)/(m+p-1)``;
* the activations held: GPipe runs all forwards then all backwards, each in micro-batch order;
  1F1B's stage ``s`` never holds more than ``min(p - s, m)`` micro-batches at once;
* a refusal: an unknown kind, or fewer than one stage or micro-batch, raises ValueError.

And the grader runs the schedule for real when the case has one rank per stage: each rank runs
its stage of a small Linear + Tanh pipeline in the order returned, with ``dist.recv`` /
``dist.isend`` (:func:`ddpcourse.pipeline.run_steps`). The ranks first agree (two all-reduces)
that they all got the same order and that its timeline has no deadlock; a rank then reports the
steps it ran, the micro-batches it held at once and its gradients, which the judge compares with
the unsplit model's on the whole batch, computed here.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, by_rank, cut_text, expect_close,
                                      observed, run_student, type_name)
from ddpcourse.pipeline import Deadlock, bubble, held_at_once, parse_step, run_steps, timeline

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
KINDS = ("gpipe", "1f1b")
WIDTH, ROWS_PER_MICROBATCH = 4, 2
MAX_STAGES, MAX_STEPS, MAX_STEP_TEXT = 64, 512, 24  # of a reported schedule


# --- what a rank reports ----------------------------------------------------------------------


def plain_schedule(value: Any) -> list[list[str]] | str:
    """The returned value as plain lists of strings, or a description of why it is not one."""
    if not isinstance(value, list):
        return f"a {type_name(value)}, not a list of lists of str"
    if len(value) > MAX_STAGES:
        return f"a list of {len(value)} lists (more than {MAX_STAGES})"
    plain = []
    for s, steps in enumerate(value):
        if not isinstance(steps, list):
            return f"a list whose item {s} is a {type_name(steps)}, not a list of str"
        if len(steps) > MAX_STEPS:
            return f"a list whose item {s} has {len(steps)} steps (more than {MAX_STEPS})"
        if not all(type(step) is str for step in steps):
            return f"a list whose item {s} holds something other than str"
        plain.append([step[:MAX_STEP_TEXT] for step in steps])
    return plain


def call(pipeline_schedule, num_stages, num_microbatches, kind) -> dict:
    try:
        value = pipeline_schedule(num_stages, num_microbatches, kind)
    except Exception as exc:  # noqa: BLE001 - what was raised is the finding
        return {"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                "error": cut_text(f"{type(exc).__name__}: {exc}", 300),
                "traceback": cut_text(traceback.format_exc()[-1500:], 1500)}
    return {"schedule": plain_schedule(value)}


# --- the model a schedule is run on -----------------------------------------------------------


def pipeline_model(num_stages: int) -> nn.Sequential:
    """One Linear + Tanh block per stage, the same weights in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(num_stages)
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                               for _ in range(num_stages)]).double()


def pipeline_batch(num_microbatches: int):
    generator = torch.Generator().manual_seed(1000 + num_microbatches)
    rows = ROWS_PER_MICROBATCH * num_microbatches
    return (torch.randn(rows, WIDTH, generator=generator, dtype=torch.float64),
            torch.randn(rows, WIDTH, generator=generator, dtype=torch.float64))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A micro-batch's share of the whole batch's loss: the micro-batches' losses add up to it."""
    return (out - target).pow(2).sum() / 64


def unsplit_gradients(num_stages: int, num_microbatches: int) -> tuple[float, list]:
    """The whole batch through the unsplit model in one process: the loss, and each stage's
    gradients (weight, bias)."""
    model = pipeline_model(num_stages)
    x, y = pipeline_batch(num_microbatches)
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.item(), [[p.grad for p in block.parameters()] for block in model]


def schedule_digest(schedule: Any) -> int:
    text = json.dumps(schedule, sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")


def execute(rank: int, world_size: int, schedule: Any, num_microbatches: int) -> dict:
    """Run this rank's stage of ``schedule`` with send/recv, once every rank agrees that all got
    the same orders and that they can run (else nothing is sent and the judge says why)."""
    runnable = isinstance(schedule, list) and problem_of(schedule, world_size,
                                                         num_microbatches) is None
    mine = torch.tensor([int(runnable), schedule_digest(schedule)], dtype=torch.int64)
    high, low = mine.clone(), mine.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    if not torch.equal(high, low) or not runnable:
        return {"ran": None}
    stage = pipeline_model(world_size)[rank]
    x, y = pipeline_batch(num_microbatches)
    ran = run_steps(stage, schedule[rank], x.chunk(num_microbatches), y.chunk(num_microbatches),
                    loss_fn)
    return {"ran": ran["ran"], "peak_held": ran["peak_held"], "loss": ran["loss"],
            "grads": [p.grad.detach().clone() for p in stage.parameters()]}


def observe_schedules(rank, world_size, pipeline_schedule, cases):
    """Each case ``(num_stages, num_microbatches, kind)``: what the call returned or raised; a
    case with ``num_stages == world_size`` is then run for real, one stage per rank."""
    reports = []
    for num_stages, num_microbatches, kind in cases:
        report = call(pipeline_schedule, num_stages, num_microbatches, kind)
        if num_stages == world_size and kind in KINDS:
            report["run"] = execute(rank, world_size, report.get("schedule"), num_microbatches)
        reports.append(report)
    return {"cases": reports}


# --- judging a schedule -----------------------------------------------------------------------


def problem_of(schedule: list, num_stages: int, num_microbatches: int) -> str | None:
    """Why ``schedule`` is not a runnable pipeline order for this many stages and micro-batches
    (its form, or a deadlock), or None."""
    if len(schedule) != num_stages:
        return f"it has {len(schedule)} lists of steps; one per stage is {num_stages}"
    wanted = sorted(f"{k}{i}" for k in "FB" for i in range(num_microbatches))
    for s, steps in enumerate(schedule):
        for step in steps:
            try:
                parse_step(step)
            except ValueError as err:
                return f"stage {s}: {err}"
        if sorted(steps) != wanted:
            missing = sorted(set(wanted) - set(steps), key=_step_key)
            twice = sorted({step for step in steps if steps.count(step) > 1}, key=_step_key)
            extra = sorted(set(steps) - set(wanted), key=_step_key)
            said = ([f"lacks {', '.join(missing)}"] if missing else []) + (
                [f"runs {', '.join(twice)} more than once"] if twice else []) + (
                [f"runs {', '.join(extra)}, which is no micro-batch of {num_microbatches}"]
                if extra else [])
            return (f"stage {s} {'; '.join(said)}: every stage runs each of F0..F"
                    f"{num_microbatches - 1} and B0..B{num_microbatches - 1} exactly once")
        for i in range(num_microbatches):
            if steps.index(f"B{i}") < steps.index(f"F{i}"):
                return (f"stage {s} runs B{i} before F{i}: a backward needs the activations its "
                        "own forward saved")
    try:
        timeline(schedule)
    except Deadlock as err:
        return f"its ranks would wait for each other forever: {err}"
    return None


def _step_key(step: str):
    try:
        kind, i = parse_step(step)
    except ValueError:
        return (2, 0, step)
    return (0 if kind == "F" else 1, i, step)


def judge_schedule(schedule: list, num_stages: int, num_microbatches: int, kind: str) -> None:
    """CheckFailed unless ``schedule`` is a deadlock-free ``kind`` schedule with the bubble
    ``(p-1)/(m+p-1)`` and the activations that ``kind`` holds."""
    p, m = num_stages, num_microbatches
    problem = problem_of(schedule, p, m)
    if problem:
        raise CheckFailed(problem)
    counted = bubble(timeline(schedule))
    slots = 2 * (m + p - 1)
    if counted["makespan"] != slots:
        raise CheckFailed(
            f"with one slot per forward or backward its timeline lasts {counted['makespan']} "
            f"slots (idle slots per stage {counted['idle']}: bubble "
            f"{counted['fraction']:.3f}); {kind} lasts 2(m + p - 1) = {slots} slots, a bubble of "
            f"(p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.3f}")
    if kind == "gpipe":
        in_order = [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
        for s, steps in enumerate(schedule):
            if steps != in_order:
                raise CheckFailed(f"stage {s} runs {cut_text(' '.join(steps), 200)}: GPipe runs "
                                  "every forward, then every backward, each in micro-batch order")
    held = [held_at_once(steps) for steps in schedule]
    allowed = [min(p - s, m) for s in range(p)]
    if kind == "1f1b" and any(h > a for h, a in zip(held, allowed)):
        raise CheckFailed(f"the stages hold up to {held} micro-batches' activations at once; "
                          f"1F1B's stage s holds at most min(p - s, m) = {allowed}: after its "
                          "warm-up forwards a stage runs a backward after each forward")


def judge_schedules(observations, world_size, cases):
    """Every rank got the same answer for each case; each answer is judged
    (:func:`judge_schedule`, or the refusal an invalid case needs); the cases run for real
    match the unsplit model."""
    reports, wrong = [], []
    for rank, observation in enumerate(observations):
        try:
            seen = observed(observation, "cases", list)
            if len(seen) != len(cases) or not all(isinstance(r, dict) for r in seen):
                raise CheckFailed(f"the rank's report has {len(seen)} calls instead of "
                                  f"{len(cases)} (did the code replace the check's own functions?)")
            reports.append(seen)
        except CheckFailed as failed:
            wrong.append((rank, str(failed)))
    if wrong:
        raise CheckFailed(by_rank(wrong))
    for index, (p, m, kind) in enumerate(cases):
        what = f"pipeline_schedule({p}, {m}, {kind!r})"
        answers = [_answer(reports[r][index]) for r in range(world_size)]
        if any(a != answers[0] for a in answers[1:]):
            raise CheckFailed(f"{what}: the ranks got different answers "
                              f"({cut_text(answers, 300)}): it must depend on its arguments only")
        report = reports[0][index]
        valid = kind in KINDS and p >= 1 and m >= 1
        if not valid:
            if "raised" in report and observed(report, "value_error", bool):
                continue
            got = (f"raised {cut_text(observed(report, 'error', str), 300)}" if "raised" in report
                   else "returned a schedule")
            raise CheckFailed(f"{what} {got}; it must raise ValueError (kinds: 'gpipe', '1f1b'; "
                              "at least one stage and one micro-batch)")
        if "raised" in report:
            raise CheckFailed(f"{what} raised {observed(report, 'error', str)}\n"
                              f"{observed(report, 'traceback', str)}")
        schedule = report.get("schedule")
        if isinstance(schedule, str):
            raise CheckFailed(f"{what} returned {schedule}")
        _expect_plain(schedule, what)
        try:
            judge_schedule(schedule, p, m, kind)
        except CheckFailed as failed:
            raise CheckFailed(f"{what} = {cut_text(schedule, 400)}:\n{failed}") from None
        if p == world_size:
            judge_run([reports[r][index] for r in range(world_size)], schedule, p, m, what)


def _answer(report: Any):
    if not isinstance(report, dict):
        return "(no report)"
    return report.get("schedule") if "raised" not in report else ("raised", report.get("raised"))


def _expect_plain(schedule: Any, what: str) -> None:
    if not (isinstance(schedule, list) and all(isinstance(s, list) and
                                               all(isinstance(x, str) for x in s)
                                               for s in schedule)):
        raise CheckFailed(f"{what}: the rank's report has {type_name(schedule)} as the schedule")


def judge_run(reports: list, schedule: list, p: int, m: int, what: str) -> None:
    """The schedule as the ranks ran it with send/recv: each rank ran its steps, held what its
    order holds, and ends with the unsplit model's gradients (and, last, its loss)."""
    loss, grads = unsplit_gradients(p, m)
    wrong = []
    for rank, report in enumerate(reports):
        try:
            run = observed(report, "run", dict)
            ran = run.get("ran")
            if ran != schedule[rank]:
                raise CheckFailed(f"ran {cut_text(ran, 200)} instead of its steps "
                                  f"{cut_text(schedule[rank], 200)}")
            if run.get("peak_held") != held_at_once(schedule[rank]):
                raise CheckFailed(f"held {run.get('peak_held')!r} micro-batches at once, its "
                                  f"order holds {held_at_once(schedule[rank])}")
            got = observed(run, "grads", list)
            if len(got) != 2 or not all(isinstance(g, torch.Tensor) for g in got):
                raise CheckFailed("the rank's report has no gradients")
            for name, actual, expected in zip(("weight", "bias"), got, grads[rank]):
                expect_close(actual, expected, f"its stage's {name} gradient", 1e-9, 1e-12)
            reported_loss = run.get("loss")
            if rank == p - 1 and (not isinstance(reported_loss, float)
                                  or abs(reported_loss - loss) > 1e-9 * max(1.0, abs(loss))):
                raise CheckFailed(f"loss {run.get('loss')!r}, the unsplit model's is {loss}")
        except CheckFailed as failed:
            wrong.append((rank, str(failed)))
    if wrong:
        raise CheckFailed(f"{what}, run with send/recv on {p} ranks:\n{by_rank(wrong)}")


SCHEDULES = Case(observe_schedules, judge_schedules)


def check_gpipe(pipeline_schedule) -> None:
    """3 stages, 5 micro-batches, run for real on 3 ranks; 2 stages, 3 micro-batches."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(SCHEDULES, 3, pipeline_schedule, ((3, 5, "gpipe"), (2, 3, "gpipe")))


def check_1f1b(pipeline_schedule) -> None:
    """3 stages, 5 micro-batches, run for real on 3 ranks; 4 stages, 2 micro-batches."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(SCHEDULES, 3, pipeline_schedule, ((3, 5, "1f1b"), (4, 2, "1f1b")))


def check_refuses_unknown_kind(pipeline_schedule) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(SCHEDULES, 1, pipeline_schedule, ((3, 5, "zero-bubble"),))
