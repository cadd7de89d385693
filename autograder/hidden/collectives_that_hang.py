"""Hidden checks for chapter 09's collectives_that_hang, and the truth of every situation.

Grader-only (the sandbox hides this folder from the student's code): the ranks simulated in one
process (each rank's own batch, gradients averaged as DDP averages them, rank 0's buffers
broadcast before a forward as DDP does), which gives each situation's truth, and the expected
gather; the visible module holds none of it (GRADING_DESIGN.md).

The hidden situations: 3 and 4 ranks for every lab, and the situations a 2-rank fix can get
right by luck: other shard lengths (one of them empty, all equal), a bad batch on rank 0 or on two
ranks at once, an empty batch, a batch whose loss is inf (not finite, though not NaN), no bad
batch at all, an early stop decided by the mean although one rank's own loss is already below the
threshold, a last batch of one row, equal sizes. They run the visible module's ``observe_*``,
judged here with these truths, only in the trusted grader.

``python -m autograder.hidden.collectives_that_hang`` prints the visible cases' truths as the
visible module writes them out (``WRITTEN_OUT``).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from ddpcourse.grading.checks import Case
from ddpcourse.grading.exercises import collectives_that_hang as visible
from ddpcourse.grading.exercises.collectives_that_hang import (
    HINTS, _run, _state, digest, lab4_batches, make_batch, make_batches, make_bn_model,
    make_linear, model_seed, predictions, shard_batches)
from ddpcourse.grading.written_out import table_literal

LOG_SITUATIONS = {3: [(3, 5, 0.1, 2, 2)], 4: [(2, 3, 0.2, 1, 3)]}
EVALUATE_SITUATIONS = {3: [(4, 2, 3, 0.1, 4)], 4: [(3, 2, 1, 0.2, 5)]}
SHARD_SITUATIONS = {
    3: [([5, 9, 12], 2, 0.1, 6), ([6, 6, 6], 3, 0.1, 7)],
    4: [([8, 3, 8, 10], 4, 0.2, 8), ([4, 0, 5, 6], 2, 0.1, 9)],
}
SKIP_SITUATIONS = {
    3: [(4, 6, 0.1, 0.05, [[0, 1, "nan"], [2, 1, "nan"]], 2),
        (4, 5, 0.1, 0.05, [[2, 3, "empty"], [0, 2, "inf"]], 3),
        (4, 8, 0.3, 0.25, [], 4)],
    4: [(3, 6, 0.2, 0.05, [[3, 2, "nan"], [1, 4, "empty"]], 5),
        (3, 8, 0.3, 0.2, [[0, 1, "nan"]], 6)],
}
GATHER_SITUATIONS = {
    3: [([3, 3, 1], "labels", 2), ([2, 4, 3], "scores", 3)],
    4: [([3, 3, 2, 2], "labels", 4), ([5, 5, 5, 5], "scores", 5), ([1, 2, 1, 4], "labels", 6)],
}


def _ddp_step(modules: list, batches: list, lr: float, sync_buffers: bool = False) -> list:
    """One DDP step of every simulated rank: rank 0's buffers first (DDP's pre-forward
    broadcast), each rank's forward and backward on its own batch, gradients averaged, plain
    SGD. Returns each rank's loss (before the step)."""
    with torch.no_grad():
        if sync_buffers:
            for module in modules[1:]:
                for mine, rank0s in zip(module.buffers(), modules[0].buffers()):
                    mine.copy_(rank0s)
    losses = []
    for module, (x, y) in zip(modules, batches):
        module.zero_grad()
        loss = F.mse_loss(module(x), y)
        loss.backward()
        losses.append(loss.item())
    with torch.no_grad():
        for params in zip(*(list(m.parameters()) for m in modules)):
            mean = torch.stack([p.grad for p in params]).mean(0)
            for p in params:
                p.add_(mean, alpha=-lr)
    return losses


def _replicas(make, world_size: int, seed: int) -> list:
    """Every simulated rank's module, all with rank 0's initial parameters (DDP's constructor
    broadcasts them, buffers included)."""
    rank0 = make(model_seed(seed, 0)).state_dict()
    modules = []
    for _ in range(world_size):
        module = make(0)
        module.load_state_dict(rank0)
        modules.append(module)
    return modules


def _one_thread(fn):
    def wrapped(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapped


@_one_thread
def expected_log(world_size, situation) -> tuple[list, dict]:
    """Lab 1: rank 0's log ``[[step, global mean loss], ...]`` and the final state."""
    rows, steps, lr, log_every, seed = situation
    modules = _replicas(make_linear, world_size, seed)
    batches = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
    logged = []
    for step in range(1, steps + 1):
        losses = _ddp_step(modules, [b[step - 1] for b in batches], lr)
        if step % log_every == 0:
            logged.append([step, sum(losses) / world_size])
    return logged, _state(modules[0])


@_one_thread
def expected_evaluate(world_size, situation) -> tuple[list, list]:
    """Lab 2: rank 0's validation losses (eval mode, rank 0's running statistics) after each
    epoch, and every rank's final state. Only rank 0's buffers are judged: the others' last
    forward updated their own running statistics after DDP's last broadcast, unless an
    evaluation through the wrapper on every rank broadcast rank 0's once more."""
    rows, steps, epochs, lr, seed = situation
    modules = _replicas(make_bn_model, world_size, seed)
    batches = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
    x_eval, y_eval = make_batch(seed, 99, 0, 2 * rows)
    history = []
    for _ in range(epochs):
        for step in range(steps):
            _ddp_step(modules, [b[step] for b in batches], lr, sync_buffers=True)
        modules[0].eval()
        with torch.no_grad():
            history.append(F.mse_loss(modules[0](x_eval), y_eval).item())
        modules[0].train()
    return history, [_state(m) for m in modules]


@_one_thread
def expected_shard(world_size, situation) -> tuple[int, dict]:
    """Lab 3: the steps every rank can take (the fewest batches of any shard) and the state."""
    lengths, batch_size, lr, seed = situation
    batches = [shard_batches(seed, rank, lengths[rank], batch_size) for rank in range(world_size)]
    steps = min(len(b) for b in batches)
    modules = _replicas(make_linear, world_size, seed)
    for step in range(steps):
        _ddp_step(modules, [b[step] for b in batches], lr)
    return steps, _state(modules[0])


def _lab4_losses(modules, batches) -> list[float]:
    with torch.no_grad():
        return [F.mse_loss(m(x), y).item() for m, (x, y) in zip(modules, batches)]


@_one_thread
def expected_skip(world_size, situation) -> tuple[list, dict, float]:
    """Lab 4: the steps applied, the state, and how close any step's global mean loss came to
    ``stop_below`` (relative), so that a situation is never decided by rounding."""
    rows, steps, lr, stop_below, bad, seed = situation
    modules = _replicas(make_linear, world_size, seed)
    batches = [lab4_batches(seed, rank, steps, rows, bad) for rank in range(world_size)]
    applied, margin = [], math.inf
    for step in range(1, steps + 1):
        mine = [b[step - 1] for b in batches]
        losses = _lab4_losses(modules, mine)
        if not all(math.isfinite(v) for v in losses):
            continue
        _ddp_step(modules, mine, lr)
        applied.append(step)
        mean = sum(losses) / world_size
        margin = min(margin, abs(mean - stop_below) / stop_below)
        if mean < stop_below:
            break
    return applied, _state(modules[0]), margin


def expected_gather(world_size, situation) -> torch.Tensor:
    rows, kind, seed = situation
    return torch.cat([predictions(seed, rank, rows[rank], kind) for rank in range(world_size)])


# --- each situation's truth, as the judges take it ----------------------------------------------


def log_truth(world_size, situation) -> dict:
    logged, state = expected_log(world_size, situation)
    return {"logged": logged, "state": state}


def evaluate_truth(world_size, situation) -> dict:
    history, states = expected_evaluate(world_size, situation)
    return {"history": history, "state": states[0]}


def shard_truth(world_size, situation) -> dict:
    steps, state = expected_shard(world_size, situation)
    return {"steps": steps, "state": state}


def skip_truth(world_size, situation) -> dict:
    applied, state, _ = expected_skip(world_size, situation)
    return {"applied": applied, "state": state}


def gather_truth(world_size, situation) -> dict:
    return {"gathered": expected_gather(world_size, situation)}


def judge_log(observations, world_size, situations) -> None:
    visible.judge_log_against(log_truth, observations, world_size, situations)


def judge_evaluate(observations, world_size, situations) -> None:
    visible.judge_evaluate_against(evaluate_truth, observations, world_size, situations)


def judge_shard(observations, world_size, situations) -> None:
    visible.judge_shard_against(shard_truth, observations, world_size, situations)


def judge_skip(observations, world_size, situations) -> None:
    visible.judge_skip_against(skip_truth, observations, world_size, situations)


def judge_gather(observations, world_size, situations) -> None:
    visible.judge_gather_against(gather_truth, observations, world_size, situations)


LOG = Case(visible.observe_log, judge_log)
EVALUATE = Case(visible.observe_evaluate, judge_evaluate)
SHARD = Case(visible.observe_shard, judge_shard)
SKIP = Case(visible.observe_skip, judge_skip)
GATHER = Case(visible.observe_gather, judge_gather)


def check_collectives_that_hang(train_and_log, fit_and_evaluate, train_on_shard,
                                train_skipping_bad_batches, gather_predictions) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for case, fn, situations, hint in (
            (LOG, train_and_log, LOG_SITUATIONS, HINTS["log"]),
            (EVALUATE, fit_and_evaluate, EVALUATE_SITUATIONS, HINTS["evaluate"]),
            (SHARD, train_on_shard, SHARD_SITUATIONS, HINTS["shard"]),
            (SKIP, train_skipping_bad_batches, SKIP_SITUATIONS, HINTS["skip"]),
            (GATHER, gather_predictions, GATHER_SITUATIONS, HINTS["gather"])):
        for world_size, cases in situations.items():
            _run(case, world_size, fn, cases, hint, timeout=None, hide_internals=True)


# --- the visible cases' truths, written out -----------------------------------------------------


def written_out() -> dict[str, dict[str, dict]]:
    """The visible cases' truths as ``visible.WRITTEN_OUT`` holds them."""
    def digests(state: dict) -> dict:
        return {name: digest(tensor) for name, tensor in state.items()}

    out: dict[str, dict[str, dict]] = {}
    for lab, situations, truth in (("log", visible.VISIBLE_LOG, log_truth),
                                   ("evaluate", visible.VISIBLE_EVALUATE, evaluate_truth),
                                   ("shard", visible.VISIBLE_SHARD, shard_truth),
                                   ("skip", visible.VISIBLE_SKIP, skip_truth)):
        out[lab] = {}
        for situation in situations:
            known = truth(2, situation)
            out[lab][visible.situation_key(2, situation)] = {
                **{k: v for k, v in known.items() if k != "state"},
                "state": digests(known["state"])}
    out["gather"] = {}
    for situation in visible.VISIBLE_GATHER:
        gathered = gather_truth(2, situation)["gathered"]
        out["gather"][visible.situation_key(2, situation)] = {
            "dtype": str(gathered.dtype).removeprefix("torch."), "values": gathered.tolist()}
    return out


if __name__ == "__main__":
    print(table_literal(written_out()))
