"""Hidden checks for chapter 09's replicas_that_disagree: 3 and 4 processes; processes of two
machines (local ranks differ from ranks) under torchrun, srun and torchrun started by srun;
temperatures that start different on every rank (a fix must sync the start too, as DDP's
constructor does); more steps, other batch sizes, learning rates and seeds; one rank. The tempting
fixes (a temperature averaged once at the end or copied from rank 0 after each step, running
statistics averaged at the end, an evaluation that bypasses the wrapper) fail here as in the
visible checks, each named by the judge. Every situation runs the visible module's ``observe_*``,
judged here with the truths computed here, which the visible module must not hold
(GRADING_DESIGN.md): ONE process's training of rank 0's model on the global batches, and every
known mistake replayed in one process.

``python -m autograder.hidden.replicas_that_disagree`` prints the visible cases' truths as the
visible module writes them out (``WRITTEN_OUT``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises import replicas_that_disagree as visible
from ddpcourse.grading.exercises.replicas_that_disagree import (
    BATCHNORM_MISTAKES, TEMPERATURE_MISTAKES, Situation, _state, eval_inputs,
    make_batches, make_batchnorm_model, make_criterion, make_model, model_seed, run_join)
from ddpcourse.grading.written_out import table_literal

JOIN_SITUATIONS = {
    3: [("torchrun", 1), ("srun", 1), ("none", 1)],
    4: [("torchrun", 2), ("srun", 2), ("torchrun-in-srun", 2), ("none", 2)],
}
TRAINING_SITUATIONS = {
    1: [tuple(Situation(steps=3, rows=5, lr=0.3, seed=21, temperatures=True))],
    3: [tuple(Situation(steps=7, rows=6, lr=0.4, seed=22, temperatures=True))],
    4: [tuple(Situation(steps=6, rows=4, lr=0.6, seed=23, temperatures=True))],
}


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


# --- each situation's truth, as the judges take it ----------------------------------------------


def temperature_truth(s: Situation, world_size: int) -> dict:
    return {"reference": one_process_temperature(s, world_size),
            "replays": {m: replay_temperature(s, world_size, m) for m in TEMPERATURE_MISTAKES}}


def _as_judged(replayed: dict) -> dict:
    return {"model": replayed["model"], "evaluation": {"output": replayed["output"]}}


def batchnorm_truth(s: Situation, world_size: int) -> dict:
    return {"reference": _as_judged(replay_batchnorm(s, world_size, "rank 0")[0]),
            "replays": {m: [_as_judged(r) for r in replay_batchnorm(s, world_size, m)]
                        for m in BATCHNORM_MISTAKES}}


def judge_temperature(observations, world_size, situations):
    visible.judge_temperature_against(temperature_truth, observations, world_size, situations)


def judge_batchnorm(observations, world_size, situations):
    visible.judge_batchnorm_against(batchnorm_truth, observations, world_size, situations)


TEMPERATURE = Case(visible.observe_temperature, judge_temperature)
BATCHNORM = Case(visible.observe_batchnorm, judge_batchnorm)


def check_replicas_that_disagree(join_the_job, train_with_temperature,
                                 train_and_evaluate) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, situations in JOIN_SITUATIONS.items():
        run_join(join_the_job, world_size, situations, hide_internals=True)
    for world_size, situations in TRAINING_SITUATIONS.items():
        run_student(TEMPERATURE, world_size, train_with_temperature, situations,
                    hide_internals=True)
        run_student(BATCHNORM, world_size, train_and_evaluate, situations, hide_internals=True)


# --- the visible cases' truths, written out -----------------------------------------------------


def _digests(value):
    if isinstance(value, torch.Tensor):
        return visible.digest(value)
    if isinstance(value, dict):
        return {key: _digests(item) for key, item in value.items()}
    return [_digests(item) for item in value]


def written_out() -> dict[str, dict[str, dict]]:
    """The visible cases' truths as ``visible.WRITTEN_OUT`` holds them: each tensor as its
    :func:`~ddpcourse.grading.exercises.replicas_that_disagree.digest`."""
    out: dict[str, dict[str, dict]] = {"temperature": {}, "batchnorm": {}}
    with visible._one_thread():
        for situation in visible.VISIBLE_TRAINING:
            s = Situation(*situation)
            key = visible.situation_key(s, 2)
            out["temperature"][key] = _digests(temperature_truth(s, 2))
            out["batchnorm"][key] = _digests(batchnorm_truth(s, 2))
    return out


if __name__ == "__main__":
    print(table_literal(written_out()))
