"""Chapter 09, debugging: visible checks for the exercise ``replicas_that_disagree`` (three labs
in which the ranks of a job quietly stop being one job), and the cases the hidden checks reuse.

The contracts are the docstrings of ``join_the_job``, ``train_with_temperature`` and
``train_and_evaluate`` in solutions/09_debugging/replicas_that_disagree.nb.py (students:
exercises/09_debugging/replicas_that_disagree.ipynb).

Each check is a :class:`~ddpcourse.grading.checks.Case`: a rank builds its inputs, calls the
student's function and reports only data (what came back, what its process group did, every
parameter and buffer afterwards); the judge, which never runs the student's code, computes the
reference itself and compares.

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

Tolerances: the ranks add the same numbers in another order than the judge does, and float32
addition is not associative: within ``ATOL + RTOL * |w|`` (a right fix is at most ~1e-7 away,
measured by tests/test_grading_replicas_that_disagree.py; the wrong fixes there are off by 1e-3
or more).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, Case, CheckFailed, cut_text,
                                      every_ranks_calls, group_problem, judge_each_rank, observed,
                                      reported_tensors, run_student, safe_text, type_name)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
FEATURES, HIDDEN, CLASSES = 6, 16, 3
ATOL, RTOL = 1e-5, 1e-5
GROUP_TIMEOUT_S = 3.0  # a process group that cannot form gives up after this
MAX_TEXT = 600
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


def one_process_temperature(s: Situation, world_size: int) -> dict:
    """ONE process: rank 0's initial model and temperature, the global batch of each step (every
    rank's batch, concatenated), the mean loss, plain SGD."""
    model, criterion = make_model(model_seed(s, 0)), make_criterion(s, 0)
    everyone = [make_batches(s, rank) for rank in range(world_size)]
    params = [*model.parameters(), *criterion.parameters()]
    for step in range(s.steps):
        x = torch.cat([batches[step][0] for batches in everyone])
        y = torch.cat([batches[step][1] for batches in everyone])
        grads = torch.autograd.grad(criterion(model(x), y), params)
        _sgd_step(params, grads, s.lr)
    return {"model": _state(model), "criterion": _state(criterion)}


def _sgd_step(params, grads, lr: float) -> None:
    """What plain ``torch.optim.SGD`` does (no momentum, no weight decay), without importing
    the optimizers (their first import costs the judge seconds)."""
    with torch.no_grad():
        for p, grad in zip(params, grads):
            p.add_(grad, alpha=-lr)


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


def replay_temperature(s: Situation, world_size: int, mistake: str) -> list[dict]:
    """Every rank's final state for a known mistake, replayed in one process: the model's
    gradients averaged (it is inside DDP), the temperature's gradients not ("outside"), or the
    temperature then averaged once at the end ("averaged at the end"), or rank 0's temperature
    copied to every rank after each step ("broadcast each step")."""
    model = make_model(model_seed(s, 0))
    temperatures = [make_criterion(s, rank) for rank in range(world_size)]
    everyone = [make_batches(s, rank) for rank in range(world_size)]
    params = list(model.parameters())
    with torch.no_grad():
        for step in range(s.steps):
            model_grads = [torch.zeros_like(p) for p in params]
            for rank, criterion in enumerate(temperatures):
                x, y = everyone[rank][step]
                with torch.enable_grad():
                    loss = criterion(model(x), y)
                    grads = torch.autograd.grad(loss, [*params, criterion.log_temperature])
                for total, grad in zip(model_grads, grads[:-1]):
                    total += grad / world_size
                criterion.log_temperature.add_(grads[-1], alpha=-s.lr)
            _sgd_step(params, model_grads, s.lr)
            if mistake == "broadcast each step":
                for criterion in temperatures[1:]:
                    criterion.log_temperature.copy_(temperatures[0].log_temperature)
        if mistake == "averaged at the end":
            mean = torch.stack([c.log_temperature for c in temperatures]).mean()
            for criterion in temperatures:
                criterion.log_temperature.copy_(mean)
    return [{"model": _state(model), "criterion": _state(c)} for c in temperatures]


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


def replay_batchnorm(s: Situation, world_size: int, buffers: str) -> list[dict]:
    """Every rank's final state and evaluation output, replayed in one process: gradients
    averaged over the ranks (DDP), each rank normalising with its own batch's statistics; the
    running statistics are

    * ``"rank 0"``: rank 0's, broadcast before every forward through the wrapper, the last time
      before the evaluation (DDP's default): the reference;
    * ``"own"``: each rank's own (``broadcast_buffers=False``, ``forward_sync_buffers=False``);
    * ``"own last step"``: rank 0's broadcast before each training forward, then each rank's
      last forward updated its own, and the evaluation bypassed the wrapper;
    * ``"averaged"``: each rank's own, then the mean over the ranks."""
    model = make_batchnorm_model(model_seed(s, 0))
    everyone = [make_batches(s, rank) for rank in range(world_size)]
    params = list(model.parameters())
    names = [name for name, _ in model.named_buffers()]
    held = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(world_size)]
    model.train()
    for step in range(s.steps):
        if buffers not in ("own", "averaged"):
            held = [{n: b.clone() for n, b in held[0].items()} for _ in range(world_size)]
        totals = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            _load_buffers(model, held[rank])
            x, y = everyone[rank][step]
            grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
            held[rank] = {n: b.clone() for n, b in model.named_buffers()}
            for total, grad in zip(totals, grads):
                total += grad / world_size
        _sgd_step(params, totals, s.lr)
    if buffers == "rank 0":
        held = [dict(held[0]) for _ in range(world_size)]
    elif buffers == "averaged":
        mean = {n: (torch.stack([h[n].double() for h in held]).mean(0).to(held[0][n].dtype)
                    if held[0][n].is_floating_point() else held[0][n]) for n in names}
        held = [dict(mean) for _ in range(world_size)]
    results = []
    model.eval()
    for rank in range(world_size):
        _load_buffers(model, held[rank])
        with torch.no_grad():
            output = model(eval_inputs(s))
        results.append({"model": _state(model), "output": output})
    return results


def _load_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


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


def _close(got: dict, want: dict) -> bool:
    return all(torch.allclose(got[n].double(), want[n].double(), rtol=RTOL, atol=ATOL)
               for n in want)


def _largest(got: dict, want: dict) -> tuple[float, str]:
    return max(((got[n].double() - want[n].double()).abs().max().item(), n) for n in want)


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
                                      f"{diff:.3g} (allowed {ATOL:g} + {RTOL:g} * |w|).{why}")
        judge_each_rank(states, wrong)


def judge_temperature(observations, world_size, situations):
    with _one_thread():
        _judge_temperature(observations, world_size, situations)


def judge_batchnorm(observations, world_size, situations):
    with _one_thread():
        _judge_batchnorm(observations, world_size, situations)


def _judge_temperature(observations, world_size, situations):
    reports = every_ranks_calls(observations, len(situations))
    for number, situation in enumerate(situations):
        s = Situation(*situation)
        what = s.describe(world_size)
        calls = [report[number] for report in reports]
        reference = one_process_temperature(s, world_size)
        judge_each_rank(calls, _judge_group)
        states = []

        def read(rank, call):
            states.append({k: reported_tensors(observed(call, k, dict), reference[k],
                                               f"{what}: the {k}'s")
                           for k in ("model", "criterion")})

        judge_each_rank(calls, read)
        replays = {m: replay_temperature(s, world_size, m) for m in TEMPERATURE_MISTAKES}
        _judge_states(states, reference, replays, TEMPERATURE_MISTAKES, what,
                      ("model", "criterion"))


def _judge_batchnorm(observations, world_size, situations):
    reports = every_ranks_calls(observations, len(situations))
    for number, situation in enumerate(situations):
        s = Situation(*situation)
        what = s.describe(world_size)
        calls = [report[number] for report in reports]
        [reference, *_] = replay_batchnorm(s, world_size, "rank 0")
        judge_each_rank(calls, _judge_group)
        states = []

        def read(rank, call):
            output = observed(call, "output", (torch.Tensor, type(None)))
            if output is None:
                raise CheckFailed(f"{what}: train_and_evaluate returned "
                                  f"{cut_text(observed(call, 'returned', str), 80)}, expected "
                                  "the evaluation's output tensor")
            states.append({"model": reported_tensors(observed(call, "model", dict),
                                                     wanted["model"], f"{what}: the model's"),
                           "evaluation": reported_tensors({"output": output},
                                                          wanted["evaluation"],
                                                          f"{what}: the evaluation's")})

        wanted = {"model": reference["model"], "evaluation": {"output": reference["output"]}}
        judge_each_rank(calls, read)
        replays = {m: [{"model": r["model"], "evaluation": {"output": r["output"]}}
                       for r in replay_batchnorm(s, world_size, m)] for m in BATCHNORM_MISTAKES}
        _judge_states(states, wanted, replays, BATCHNORM_MISTAKES, what,
                      ("model", "evaluation"))


TEMPERATURE = Case(observe_temperature, judge_temperature)
BATCHNORM = Case(observe_batchnorm, judge_batchnorm)

VISIBLE_JOIN = [("torchrun", 1), ("srun", 1), ("torchrun-in-srun", 1), ("none", 1)]
VISIBLE_TRAINING = [tuple(Situation(steps=4, rows=8, lr=0.5, seed=0))]


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
