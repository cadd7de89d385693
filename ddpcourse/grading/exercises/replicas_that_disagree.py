"""Chapter 09, debugging: visible checks for the exercise ``replicas_that_disagree`` (three labs
in which the ranks of a job quietly stop being one job), and the cases the hidden checks reuse.

The contracts are the docstrings of ``join_the_job``, ``train_with_temperature`` and
``train_and_evaluate`` in solutions/09_debugging/replicas_that_disagree.nb.py (students:
exercises/09_debugging/replicas_that_disagree.ipynb).

Each check is a :class:`~ddpcourse.grading.checks.Case`: a rank builds its inputs, calls the
student's function and reports only data (what came back, what its process group did, every
parameter and buffer afterwards); the judge, which never runs the student's code, compares it
with the situation's truth. This module computes no truth (no one-process training, no replay):
the visible cases' truths are written out (:data:`WRITTEN_OUT`, each tensor as its sum and norm),
the hidden cases' computed by autograder/hidden/replicas_that_disagree.py on the grader's side,
which tests/test_grading_replicas_that_disagree.py holds them to.

* ``JOINED`` (lab 12, the rank read from ``SLURM_PROCID`` with a default of 0): processes started
  with no group, each given the variables of a launcher (torchrun's, srun's, torchrun started by
  srun, none at all). The student's function must read its identity from the launcher that is
  there, join one group of every process with it (a shared ``file://`` store), and raise when
  no launcher's variables are set. The judge knows each process's identity from the launcher it
  emulated; it also checks that an all-reduce of one-hot vectors reached every process.
* ``TEMPERATURE`` (lab 13, a learnable temperature outside the DDP wrapper): the model and the
  temperature must end bit-identical on every rank and equal to ONE process training rank 0's
  initial model and temperature on the global batch (all ranks' batches of a step).
* ``BATCHNORM`` (lab 14, ``broadcast_buffers=False`` with BatchNorm; torch 2.13 names it
  ``forward_sync_buffers``): parameters, running
  statistics and the evaluation output must be identical on every rank and equal to what DDP's
  default semantics give: the gradient averaged over the ranks, the running statistics rank 0's
  (DDP broadcasts rank 0's buffers before each forward through the wrapper). The judge replays
  the ranks in one process (there is no single-process equivalent: each rank normalises with its
  own batch's statistics).

Each lab also asks for a diagnosis (``diagnose_<lab>()``: facts of what its given code does).
Nothing here knows or judges it: the expected facts and the labs' explanations live in
autograder/hidden/replicas_that_disagree.py, judged by autograder/hidden/diagnoses.py, and no
visible check looks at a diagnosis or prints an explanation.

Tolerances: the ranks add the same numbers in another order than the judge does, and float32
addition is not associative: within ``ATOL + RTOL * |w|`` (a right fix is at most ~1e-7 away,
measured by tests/test_grading_replicas_that_disagree.py; the wrong fixes there are off by 1e-3
or more).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, Case, CheckFailed, cut_text,
                                      every_ranks_calls, group_problem, judge_each_rank, observed,
                                      reported_tensors, run_student, safe_text, type_name)
from ddpcourse.grading.written_out import sum_and_norm, table_lookup

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
FEATURES, HIDDEN, CLASSES = 6, 16, 3
ATOL, RTOL = 1e-5, 1e-5
GROUP_TIMEOUT_S = 3.0  # a process group that cannot form gives up after this
MAX_TEXT = 600
# A situation's truth: what a judge compares with. This module computes none: the visible cases'
# are written out (WRITTEN_OUT), the hidden cases' computed by
# autograder/hidden/replicas_that_disagree.py on the grader's side.
Truth = Callable[..., dict]
TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_NNODES")


# --- lab 12: who am I? --------------------------------------------------------------------------


def launcher_env(launcher: str, rank: int, world_size: int, nodes: int) -> dict[str, str]:
    """The variables a launcher gives process ``rank`` of ``world_size`` on ``nodes`` machines
    (processes numbered node by node):

    * ``torchrun``: torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...;
    * ``srun``: one task per process, SLURM's ``SLURM_PROCID``, ``SLURM_LOCALID``, ...;
    * ``torchrun-in-srun``: srun starts one torchrun per machine (one task per node), and torchrun
      starts the processes: SLURM's variables describe the torchrun task, not the process;
    * ``none``: no launcher (``python train.py``)."""
    per_node = world_size // nodes
    node, local = divmod(rank, per_node)
    torchrun = {"RANK": rank, "LOCAL_RANK": local, "WORLD_SIZE": world_size,
                "LOCAL_WORLD_SIZE": per_node, "GROUP_RANK": node}
    env = {
        "torchrun": torchrun,
        "srun": {"SLURM_PROCID": rank, "SLURM_LOCALID": local, "SLURM_NTASKS": world_size,
                 "SLURM_NODEID": node, "SLURM_NNODES": nodes},
        "torchrun-in-srun": {**torchrun, "SLURM_PROCID": node, "SLURM_LOCALID": 0,
                             "SLURM_NTASKS": nodes, "SLURM_NODEID": node,
                             "SLURM_NNODES": nodes},
        "none": {},
    }[launcher]
    return {name: str(value) for name, value in env.items()}


def identity(launcher: str, rank: int, world_size: int, nodes: int) -> tuple[int, int, int]:
    """The (rank, local_rank, world_size) a process started this way has."""
    return rank, rank % (world_size // nodes), world_size


def _described(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": safe_text(lambda: exc, MAX_TEXT),
            "runtime_error": isinstance(exc, RuntimeError)}


def _answer(got: Any) -> list[int] | None:
    if isinstance(got, tuple) and len(got) == 3 and all(type(v) is int for v in got):
        return list(got)
    return None


def observe_join(rank, world_size, join_the_job, situations, token):
    """For every ``(launcher, nodes)``: this process gets that launcher's variables (and none of
    the others'), calls ``join_the_job`` with a ``file://`` store shared by the processes and a
    short timeout, and reports what came back and what its group did. The processes wait for
    each other between situations (on a store of the check's own), so that a group that never
    formed leaves no store file behind and every situation starts together."""
    coordination = dist.FileStore(_store_path(token, "coordination"), world_size)
    calls = []
    for number, (launcher, nodes) in enumerate(situations):
        for name in TORCHRUN + SLURM:
            os.environ.pop(name, None)
        os.environ.update(launcher_env(launcher, rank, world_size, nodes))
        path = _store_path(token, str(number))
        call: dict = {"answer": None, "repr": "", "raised": None, "group": None}
        try:
            got = join_the_job(f"file://{path}", timedelta(seconds=GROUP_TIMEOUT_S))
            call.update(answer=_answer(got), repr=safe_text(lambda: repr(got), MAX_TEXT))
        except Exception as exc:  # noqa: BLE001 - reported: raising is right for "none"
            call["raised"] = _described(exc)
        if dist.is_initialized():
            call["group"] = _group_report(rank, world_size)
            dist.destroy_process_group()
        calls.append(call)
        coordination.add(f"done-{number}", 1)
        while coordination.add(f"done-{number}", 0) < world_size:
            time.sleep(0.01)
        if rank == 0 and os.path.exists(path):  # what a group that never formed left behind
            os.remove(path)
    return {"calls": calls}


def _store_path(token: str, name: str) -> str:
    # The temporary folder: the same for every process, also in the grader's sandbox.
    return os.path.join(tempfile.gettempdir(), f"ddpcourse-join-{token}-{name}")


def _group_report(process: int, processes: int) -> dict:
    """Who this process is in its group, and which of the job's processes an all-reduce of
    one-hot vectors reached."""
    report: dict = {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    reached = torch.zeros(processes)
    reached[process] = 1
    try:
        dist.all_reduce(reached)
        report["reached"] = [int(v) for v in reached.tolist()]
    except Exception as exc:  # noqa: BLE001 - a group whose peers never come: the finding
        report["error"] = safe_text(lambda: f"{type(exc).__name__}: {exc}", MAX_TEXT)
    return report


def _join_what(launcher: str, world_size: int, nodes: int) -> str:
    where = f"{nodes} machines" if nodes > 1 else "one machine"
    return {"torchrun": f"under torchrun ({world_size} processes on {where})",
            "srun": f"under srun ({world_size} tasks on {where})",
            "torchrun-in-srun": f"under torchrun started by srun (one task per machine, "
                                f"{world_size} processes on {where})",
            "none": f"with no launcher's variables ({world_size} processes started by hand)"
            }[launcher]


def judge_join(observations, world_size, situations, token):
    reports = every_ranks_calls(observations, len(situations))
    for number, (launcher, nodes) in enumerate(situations):
        calls = [report[number] for report in reports]
        what = _join_what(launcher, world_size, nodes)
        if launcher == "none":
            judge_each_rank(calls, lambda rank, call: _judge_refused(call, what))
            continue
        answers = [observed(call, "answer", (list, type(None))) for call in calls]
        everyone_zero = world_size > 1 and all(a is not None and a[0] == 0 for a in answers)
        judge_each_rank(calls, lambda rank, call: _judge_joined(
            rank, call, identity(launcher, rank, world_size, nodes), world_size, what,
            everyone_zero))


def _raised_text(call: dict) -> str | None:
    raised = observed(call, "raised", (dict, type(None)))
    if raised is None:
        return None
    return (f"{cut_text(observed(raised, 'type', str), 80)}: "
            f"{cut_text(observed(raised, 'message', str), MAX_TEXT)}")


def _judge_refused(call: dict, what: str) -> None:
    raised = observed(call, "raised", (dict, type(None)))
    if raised is None:
        group = observed(call, "group", (dict, type(None)))
        joined = (f" and joined a group as rank {cut_text(group.get('rank'), 20)} of "
                  f"{cut_text(group.get('world_size'), 20)}" if group else "")
        raise CheckFailed(f"{what}: expected RuntimeError (no launcher says who this process "
                          f"is: never guess rank 0), but it returned "
                          f"{cut_text(observed(call, 'repr', str), MAX_TEXT)}{joined}")
    message = cut_text(observed(raised, "message", str), MAX_TEXT)
    if not observed(raised, "runtime_error", bool):
        raise CheckFailed(f"{what}: expected RuntimeError, got {_raised_text(call)}")
    missing = [name for name in ("RANK", "SLURM_PROCID") if name not in message]
    if missing:
        raise CheckFailed(f"{what}: the RuntimeError must name the variables it looked for "
                          f"({', '.join(missing)} missing); it said: {message}")
    if observed(call, "group", (dict, type(None))) is not None:
        raise CheckFailed(f"{what}: it raised, but only after joining a process group: raise "
                          "before init_process_group")


def _judge_joined(rank, call, expected, world_size, what, everyone_zero) -> None:
    raised = _raised_text(call)
    answer = observed(call, "answer", (list, type(None)))
    if answer is not None and not all(type(v) is int for v in answer):
        raise CheckFailed("the rank's report has an 'answer' that is not three ints")
    hint = (" Every process believes it is rank 0: the launcher that started them does not set "
            "the variable read (SLURM_PROCID), and its default 0 was taken for an answer."
            if everyone_zero else "")
    if raised is not None:
        if "timeout" in raised.lower() and not hint:
            hint = (" The group never formed: each process waited for a peer that never came. "
                    "Do two processes claim the same rank (read from a variable this launcher "
                    "does not set, with a default of 0)?")
        raise CheckFailed(f"{what}: process {rank} expected {expected}, but it raised "
                          f"{raised}.{hint}")
    if answer is None or tuple(answer) != expected:
        raise CheckFailed(f"{what}: process {rank} expected (rank, local_rank, world_size) = "
                          f"{expected}, got {cut_text(observed(call, 'repr', str), MAX_TEXT)}."
                          f"{hint}")
    group = observed(call, "group", (dict, type(None)))
    if group is None:
        raise CheckFailed(f"{what}: process {rank} returned the right identity but joined no "
                          "process group: call init_process_group with it")
    if "error" in group:
        raise CheckFailed(f"{what}: process {rank}'s group could not all-reduce: "
                          f"{cut_text(observed(group, 'error', str), MAX_TEXT)}")
    got = (observed(group, "rank", int), observed(group, "world_size", int))
    if got != (expected[0], world_size):
        raise CheckFailed(f"{what}: process {rank} is rank {got[0]} of {got[1]} in its group, "
                          f"expected rank {expected[0]} of {world_size}")
    if observed(group, "reached", list) != [1] * world_size:
        raise CheckFailed(f"{what}: process {rank}'s all-reduce did not reach every process "
                          "of the job exactly once")


JOINED = Case(observe_join, judge_join)


# --- models and data of labs 13 and 14 --------------------------------------------------------


class TemperedLoss(nn.Module):
    """Cross-entropy of the logits divided by a learnable temperature ``exp(log_temperature)``."""

    def __init__(self, log_temperature: float = 0.0):
        super().__init__()
        self.log_temperature = nn.Parameter(torch.tensor(float(log_temperature)))

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits / self.log_temperature.exp(), targets)


class Situation(NamedTuple):
    """One training run: ``steps`` steps of ``rows`` rows per rank, SGD at ``lr``; ``seed``
    chooses every rank's initial weights and data; ``temperatures``: each rank starts its
    temperature differently (else log_temperature is 0 on every rank)."""

    steps: int
    rows: int
    lr: float
    seed: int
    temperatures: bool = False

    def describe(self, world_size: int) -> str:
        return (f"{world_size} rank(s), {self.steps} steps of {self.rows} rows per rank, "
                f"lr {self.lr}, seed {self.seed}")


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def make_batchnorm_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def make_criterion(s: Situation, rank: int) -> TemperedLoss:
    start = 0.25 * (rank + 1) * (-1) ** rank if s.temperatures else 0.0
    return TemperedLoss(start)


def make_batches(s: Situation, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: every rank's data is drawn around a centre of its own, so per-rank
    statistics (and gradients) really differ."""
    generator = torch.Generator().manual_seed(1000 * s.seed + rank)
    batches = []
    for _ in range(s.steps):
        x = torch.randn(s.rows, FEATURES, generator=generator) * (1 + rank) + rank
        batches.append((x, torch.randint(0, CLASSES, (s.rows,), generator=generator)))
    return batches


def eval_inputs(s: Situation) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7 + s.seed)
    return torch.randn(5, FEATURES, generator=generator)


def model_seed(s: Situation, rank: int) -> int:
    return 100 * s.seed + 17 * rank + 1


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


# --- lab 13: the temperature outside the wrapper ------------------------------------------------


def observe_temperature(rank, world_size, train_with_temperature, situations):
    calls = []
    for situation in situations:
        s = Situation(*situation)
        model, criterion = make_model(model_seed(s, rank)), make_criterion(s, rank)
        returned = train_with_temperature(model, criterion, make_batches(s, rank), s.lr)
        calls.append({"returned": type_name(returned), "model": _state(model),
                      "criterion": _state(criterion),
                      "group": group_problem(rank, world_size, "train_with_temperature")})
    return {"calls": calls}


@contextlib.contextmanager
def _one_thread():
    """The judge's tiny models on one thread: on a loaded machine, two threads per matrix
    product of this size are many times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


TEMPERATURE_MISTAKES = {
    "outside": "the temperature is outside the DDP wrapper: its gradients are never averaged, "
               "so every rank's temperature follows its own data",
    "averaged at the end": "the temperature is averaged over the ranks once, at the end: the "
                           "ranks then agree, but every step before used a temperature of its "
                           "own (average the gradients of every step: put it inside DDP)",
    "broadcast each step": "rank 0's temperature is copied to every rank after each step: the "
                           "ranks agree, but the temperature learns from rank 0's data only",
}


# --- lab 14: BatchNorm's running statistics -------------------------------------------------------


def observe_batchnorm(rank, world_size, train_and_evaluate, situations):
    calls = []
    for situation in situations:
        s = Situation(*situation)
        model = make_batchnorm_model(model_seed(s, rank))
        output = train_and_evaluate(model, make_batches(s, rank), s.lr, eval_inputs(s))
        calls.append({"output": output.detach().clone() if isinstance(output, torch.Tensor)
                      else None, "returned": type_name(output), "model": _state(model),
                      "group": group_problem(rank, world_size, "train_and_evaluate")})
    return {"calls": calls}


BATCHNORM_MISTAKES = {
    "own": "every rank keeps its own running statistics (broadcast_buffers=False, or "
           "forward_sync_buffers=False): each rank's BatchNorm has averaged its own batches, so "
           "evaluation differs per rank",
    "own last step": "the running statistics were broadcast before each training step, but the "
                     "last step's forward updated each rank's own, and the evaluation bypassed "
                     "the wrapper (model or ddp.module), which would have broadcast rank 0's",
    "averaged": "each rank kept its own running statistics and they were averaged at the end: "
                "the ranks agree, but DDP keeps rank 0's (forward_sync_buffers=True, the "
                "default), and that is the contract",
}


# --- judging labs 13 and 14 ---------------------------------------------------------------------


# How a tensor of a visible case's truth is written out: its sum and its 2-norm (float64).
digest = sum_and_norm


def _difference(got: torch.Tensor, want: Any) -> tuple[float, bool]:
    """How far ``got`` is from ``want`` (a tensor: element-wise ``ATOL + RTOL * |w|``; a
    written-out :func:`digest`: within ``numel * ATOL + RTOL * sqrt(numel) * norm``, which bounds
    what the element-wise tolerance allows) and whether that is within the tolerance."""
    if isinstance(want, torch.Tensor):
        return ((got.double() - want.double()).abs().max().item(),
                torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL))
    diff = max(abs(a - b) for a, b in zip(digest(got), want))
    return diff, diff <= ATOL * got.numel() + RTOL * math.sqrt(got.numel()) * want[1]


def _close(got: dict, want: dict) -> bool:
    return all(_difference(got[n], want[n])[1] for n in want)


def _largest(got: dict, want: dict) -> tuple[float, str]:
    return max((_difference(got[n], want[n])[0], n) for n in want)


def _templates(make) -> dict[str, torch.Tensor]:
    """The names, shapes and dtypes a rank's report of a module's state must have."""
    with torch.random.fork_rng(devices=[]):
        return _state(make())


def _judge_group(rank: int, call: dict) -> None:
    problem = observed(call, "group", (str, type(None)))
    if problem is not None:
        raise CheckFailed(cut_text(problem, MAX_TEXT))


def _judge_states(states: list[dict], reference: dict, replays: dict, mistakes: dict,
                  what: str, kinds: tuple[str, ...]) -> None:
    """Replicas first (they must be bit-identical), then each rank against the reference; when
    wrong, the known mistake that reproduces every rank's state, if one does."""
    def known_mistake() -> str:
        for mistake, replayed in replays.items():
            if all(all(_close(state[k], again[k]) for k in kinds)
                   for state, again in zip(states, replayed)):
                return f" These are the states of a run where {mistakes[mistake]}."
        return ""

    identical = all(torch.equal(state[k][n], states[0][k][n])
                    for state in states for k in kinds for n in states[0][k])
    if not identical:
        why = known_mistake()

        def differ(rank, state):
            for k in kinds:
                for name in state[k]:
                    if not torch.equal(state[k][name], states[0][k][name]):
                        gap = (state[k][name].double() - states[0][k][name].double()).abs()
                        raise CheckFailed(
                            f"{what}: rank {rank}'s {k} {name!r} differs from rank 0's (by up to "
                            f"{gap.max().item():.3g}): the replicas disagree.{why}")
        judge_each_rank(states, differ)
    if not all(all(_close(state[k], reference[k]) for k in kinds) for state in states):
        why = known_mistake()

        def wrong(rank, state):
            for k in kinds:
                if not _close(state[k], reference[k]):
                    diff, name = _largest(state[k], reference[k])
                    raise CheckFailed(f"{what}: the {k}'s {name!r} is off the reference by "
                                      f"{diff:.3g}.{why}")
        judge_each_rank(states, wrong)


def judge_temperature_against(truth: Truth, observations, world_size, situations):
    """``truth(s, world_size)``: ``{"reference": {"model": ..., "criterion": ...}`` of ONE process
    on the global batches, ``"replays": {mistake: [every rank's states]}}`` for
    :data:`TEMPERATURE_MISTAKES`."""
    with _one_thread():
        _judge_temperature(truth, observations, world_size, situations)


def judge_batchnorm_against(truth: Truth, observations, world_size, situations):
    """``truth(s, world_size)``: ``{"reference": {"model": ..., "evaluation": {"output": ...}}``
    of DDP's default semantics replayed, ``"replays": {mistake: [every rank's]}}`` for
    :data:`BATCHNORM_MISTAKES`."""
    with _one_thread():
        _judge_batchnorm(truth, observations, world_size, situations)


def _judge_temperature(truth, observations, world_size, situations):
    reports = every_ranks_calls(observations, len(situations))
    templates = {"model": _templates(lambda: make_model(0)),
                 "criterion": _templates(TemperedLoss)}
    for number, situation in enumerate(situations):
        s = Situation(*situation)
        what = s.describe(world_size)
        calls = [report[number] for report in reports]
        judge_each_rank(calls, _judge_group)
        states = []

        def read(rank, call):
            states.append({k: reported_tensors(observed(call, k, dict), templates[k],
                                               f"{what}: the {k}'s")
                           for k in ("model", "criterion")})

        judge_each_rank(calls, read)
        known = truth(s, world_size)
        _judge_states(states, known["reference"], known["replays"], TEMPERATURE_MISTAKES, what,
                      ("model", "criterion"))


def _judge_batchnorm(truth, observations, world_size, situations):
    reports = every_ranks_calls(observations, len(situations))
    templates = {"model": _templates(lambda: make_batchnorm_model(0)),
                 "evaluation": {"output": torch.zeros(5, CLASSES)}}
    for number, situation in enumerate(situations):
        s = Situation(*situation)
        what = s.describe(world_size)
        calls = [report[number] for report in reports]
        judge_each_rank(calls, _judge_group)
        states = []

        def read(rank, call):
            output = observed(call, "output", (torch.Tensor, type(None)))
            if output is None:
                raise CheckFailed(f"{what}: train_and_evaluate returned "
                                  f"{cut_text(observed(call, 'returned', str), 80)}, expected "
                                  "the evaluation's output tensor")
            states.append({"model": reported_tensors(observed(call, "model", dict),
                                                     templates["model"], f"{what}: the model's"),
                           "evaluation": reported_tensors({"output": output},
                                                          templates["evaluation"],
                                                          f"{what}: the evaluation's")})

        judge_each_rank(calls, read)
        known = truth(s, world_size)
        _judge_states(states, known["reference"], known["replays"], BATCHNORM_MISTAKES, what,
                      ("model", "evaluation"))


VISIBLE_JOIN = [("torchrun", 1), ("srun", 1), ("torchrun-in-srun", 1), ("none", 1)]
VISIBLE_TRAINING = [tuple(Situation(steps=4, rows=8, lr=0.5, seed=0))]


def situation_key(s: Situation, world_size: int) -> str:
    """How :data:`WRITTEN_OUT` names a situation."""
    return f"{world_size} ranks, {tuple(s)!r}"


# The truths of the visible cases, as autograder/hidden/replicas_that_disagree.py computes them
# (`python -m autograder.hidden.replicas_that_disagree` prints them again): the reference and
# every known mistake's states, each tensor as its sum and norm.
WRITTEN_OUT: dict[str, dict[str, dict]] = {
    'temperature': {
        '2 ranks, (4, 8, 0.5, 0, False)': {
            'reference': {
                'model': {
                    '0.weight': [0.35238052578642964, 2.1781668926831266],
                    '0.bias': [1.0490230098366737, 0.923378280964515],
                    '2.weight': [0.6558364033699036, 1.0834950392894431],
                    '2.bias': [-0.010590434074401855, 0.25211528797082833],
                },
                'criterion': {
                    'log_temperature': [0.09518131613731384, 0.09518131613731384],
                },
            },
            'replays': {
                'outside': [
                    {
                        'model': {
                            '0.weight': [0.3482995652593672, 2.1786143969053233],
                            '0.bias': [1.0511251538991928, 0.9230316693529187],
                            '2.weight': [0.6558365598320961, 1.0834950729880026],
                            '2.bias': [-0.010590419173240662, 0.25208942378177046],
                        },
                        'criterion': {
                            'log_temperature': [0.09875980019569397, 0.09875980019569397],
                        },
                    },
                    {
                        'model': {
                            '0.weight': [0.3482995652593672, 2.1786143969053233],
                            '0.bias': [1.0511251538991928, 0.9230316693529187],
                            '2.weight': [0.6558365598320961, 1.0834950729880026],
                            '2.bias': [-0.010590419173240662, 0.25208942378177046],
                        },
                        'criterion': {
                            'log_temperature': [0.09336566925048828, 0.09336566925048828],
                        },
                    },
                ],
                'averaged at the end': [
                    {
                        'model': {
                            '0.weight': [0.3482995652593672, 2.1786143969053233],
                            '0.bias': [1.0511251538991928, 0.9230316693529187],
                            '2.weight': [0.6558365598320961, 1.0834950729880026],
                            '2.bias': [-0.010590419173240662, 0.25208942378177046],
                        },
                        'criterion': {
                            'log_temperature': [0.09606273472309113, 0.09606273472309113],
                        },
                    },
                    {
                        'model': {
                            '0.weight': [0.3482995652593672, 2.1786143969053233],
                            '0.bias': [1.0511251538991928, 0.9230316693529187],
                            '2.weight': [0.6558365598320961, 1.0834950729880026],
                            '2.bias': [-0.010590419173240662, 0.25208942378177046],
                        },
                        'criterion': {
                            'log_temperature': [0.09606273472309113, 0.09606273472309113],
                        },
                    },
                ],
                'broadcast each step': [
                    {
                        'model': {
                            '0.weight': [0.3507518917322159, 2.178255096860105],
                            '0.bias': [1.0509427674114704, 0.9228629600200535],
                            '2.weight': [0.6558365682139993, 1.0837505776267957],
                            '2.bias': [-0.010590419173240662, 0.249622740661776],
                        },
                        'criterion': {
                            'log_temperature': [0.09860731661319733, 0.09860731661319733],
                        },
                    },
                    {
                        'model': {
                            '0.weight': [0.3507518917322159, 2.178255096860105],
                            '0.bias': [1.0509427674114704, 0.9228629600200535],
                            '2.weight': [0.6558365682139993, 1.0837505776267957],
                            '2.bias': [-0.010590419173240662, 0.249622740661776],
                        },
                        'criterion': {
                            'log_temperature': [0.09860731661319733, 0.09860731661319733],
                        },
                    },
                ],
            },
        },
    },
    'batchnorm': {
        '2 ranks, (4, 8, 0.5, 0, False)': {
            'reference': {
                'model': {
                    '0.weight': [0.5196915338747203, 2.209735942096999],
                    '0.bias': [1.2231958657503128, 0.9163993543471293],
                    '1.weight': [15.836358726024628, 3.9604310638023064],
                    '1.bias': [-0.1108083943836391, 0.1454766212495144],
                    '1.running_mean': [0.4853144269436598, 0.28079934497148784],
                    '1.running_var': [12.089042603969574, 3.030120851334474],
                    '1.num_batches_tracked': [4.0, 4.0],
                    '3.weight': [0.655836395919323, 1.0907562428280286],
                    '3.bias': [-0.01059044897556305, 0.24034960212192386],
                },
                'evaluation': {
                    'output': [1.7894168496131897, 1.9252077412190722],
                },
            },
            'replays': {
                'own': [
                    {
                        'model': {
                            '0.weight': [0.5196915338747203, 2.209735942096999],
                            '0.bias': [1.2231958657503128, 0.9163993543471293],
                            '1.weight': [15.836358726024628, 3.9604310638023064],
                            '1.bias': [-0.1108083943836391, 0.1454766212495144],
                            '1.running_mean': [0.4853144269436598, 0.28079934497148784],
                            '1.running_var': [12.089042603969574, 3.030120851334474],
                            '1.num_batches_tracked': [4.0, 4.0],
                            '3.weight': [0.655836395919323, 1.0907562428280286],
                            '3.bias': [-0.01059044897556305, 0.24034960212192386],
                        },
                        'evaluation': {
                            'output': [1.7894168496131897, 1.9252077412190722],
                        },
                    },
                    {
                        'model': {
                            '0.weight': [0.5196915338747203, 2.209735942096999],
                            '0.bias': [1.2231958657503128, 0.9163993543471293],
                            '1.weight': [15.836358726024628, 3.9604310638023064],
                            '1.bias': [-0.1108083943836391, 0.1454766212495144],
                            '1.running_mean': [0.6435046307742596, 0.8590341880493401],
                            '1.running_var': [18.35157710313797, 4.670171215498039],
                            '1.num_batches_tracked': [4.0, 4.0],
                            '3.weight': [0.655836395919323, 1.0907562428280286],
                            '3.bias': [-0.01059044897556305, 0.24034960212192386],
                        },
                        'evaluation': {
                            'output': [0.7158510312438011, 1.5046014674354793],
                        },
                    },
                ],
                'own last step': [
                    {
                        'model': {
                            '0.weight': [0.5196915338747203, 2.209735942096999],
                            '0.bias': [1.2231958657503128, 0.9163993543471293],
                            '1.weight': [15.836358726024628, 3.9604310638023064],
                            '1.bias': [-0.1108083943836391, 0.1454766212495144],
                            '1.running_mean': [0.4853144269436598, 0.28079934497148784],
                            '1.running_var': [12.089042603969574, 3.030120851334474],
                            '1.num_batches_tracked': [4.0, 4.0],
                            '3.weight': [0.655836395919323, 1.0907562428280286],
                            '3.bias': [-0.01059044897556305, 0.24034960212192386],
                        },
                        'evaluation': {
                            'output': [1.7894168496131897, 1.9252077412190722],
                        },
                    },
                    {
                        'model': {
                            '0.weight': [0.5196915338747203, 2.209735942096999],
                            '0.bias': [1.2231958657503128, 0.9163993543471293],
                            '1.weight': [15.836358726024628, 3.9604310638023064],
                            '1.bias': [-0.1108083943836391, 0.1454766212495144],
                            '1.running_mean': [0.6243309639394283, 0.455683867572759],
                            '1.running_var': [13.505149245262146, 3.399760580203846],
                            '1.num_batches_tracked': [4.0, 4.0],
                            '3.weight': [0.655836395919323, 1.0907562428280286],
                            '3.bias': [-0.01059044897556305, 0.24034960212192386],
                        },
                        'evaluation': {
                            'output': [1.3439572006464005, 1.7892545670742017],
                        },
                    },
                ],
                'averaged': [
                    {
                        'model': {
                            '0.weight': [0.5196915338747203, 2.209735942096999],
                            '0.bias': [1.2231958657503128, 0.9163993543471293],
                            '1.weight': [15.836358726024628, 3.9604310638023064],
                            '1.bias': [-0.1108083943836391, 0.1454766212495144],
                            '1.running_mean': [0.5644095223397017, 0.5114156950242129],
                            '1.running_var': [15.220309734344482, 3.841237360505115],
                            '1.num_batches_tracked': [4.0, 4.0],
                            '3.weight': [0.655836395919323, 1.0907562428280286],
                            '3.bias': [-0.01059044897556305, 0.24034960212192386],
                        },
                        'evaluation': {
                            'output': [1.2120698243379593, 1.6605462654321617],
                        },
                    },
                    {
                        'model': {
                            '0.weight': [0.5196915338747203, 2.209735942096999],
                            '0.bias': [1.2231958657503128, 0.9163993543471293],
                            '1.weight': [15.836358726024628, 3.9604310638023064],
                            '1.bias': [-0.1108083943836391, 0.1454766212495144],
                            '1.running_mean': [0.5644095223397017, 0.5114156950242129],
                            '1.running_var': [15.220309734344482, 3.841237360505115],
                            '1.num_batches_tracked': [4.0, 4.0],
                            '3.weight': [0.655836395919323, 1.0907562428280286],
                            '3.bias': [-0.01059044897556305, 0.24034960212192386],
                        },
                        'evaluation': {
                            'output': [1.2120698243379593, 1.6605462654321617],
                        },
                    },
                ],
            },
        },
    },
}


def written_out(lab: str) -> Truth:
    """The visible cases' truth for ``lab``: their entry of :data:`WRITTEN_OUT`."""
    return table_lookup(WRITTEN_OUT, lab, situation_key)


def judge_temperature(observations, world_size, situations):
    judge_temperature_against(written_out("temperature"), observations, world_size, situations)


def judge_batchnorm(observations, world_size, situations):
    judge_batchnorm_against(written_out("batchnorm"), observations, world_size, situations)


TEMPERATURE = Case(observe_temperature, judge_temperature)
BATCHNORM = Case(observe_batchnorm, judge_batchnorm)


def run_join(join_the_job, world_size: int, situations, **kwargs) -> None:
    """``world_size`` processes with no group, one launcher's variables after another; a fresh
    token names their store files. The deadline allows every situation a group that never forms
    (it gives up after GROUP_TIMEOUT_S, plus the store's polling)."""
    run_student(JOINED, world_size, join_the_job, situations, os.urandom(8).hex(),
                init_process_group=False,
                timeout=CHECK_TIMEOUT_S + len(situations) * (GROUP_TIMEOUT_S + 2), **kwargs)


def check_join_the_job(join_the_job) -> None:
    run_join(join_the_job, 2, VISIBLE_JOIN)


def check_train_with_temperature(train_with_temperature) -> None:
    run_student(TEMPERATURE, 2, train_with_temperature, VISIBLE_TRAINING)


def check_train_and_evaluate(train_and_evaluate) -> None:
    run_student(BATCHNORM, 2, train_and_evaluate, VISIBLE_TRAINING)
