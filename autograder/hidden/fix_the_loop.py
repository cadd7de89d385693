"""Hidden checks for chapter 07's fix_the_loop: 1, 3 and 4 ranks, other batch sizes, step counts,
learning rates and seeds, every check at once (in place, rows, replicas, weights, losses). They
run the visible module's observation (the situations are passed as data), so they run only in the
trusted grader.

Here, and only here, are the grader's reference (:func:`expected_for`: one process trained on
the global batches) and the replay of the plausible mistakes (:func:`replay`: N ranks simulated
in one process, which replays the right loop too): both compute the answer, so the visible module
(the ranks import it) only has their results for its own situations written out
(VISIBLE_EXPECTED), made by :func:`written_out_entry` and held to it by
tests/test_grading_fix_the_loop.py."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.fix_the_loop import (ALL_CHECKS, MISTAKES, MODULES, RIGHT,
                                                      Expected, Mistake, Situation, Sync, _close,
                                                      _state, flat_state, global_batches,
                                                      inputs_for, judge_training_with,
                                                      make_backbone, make_head, observe_training)
from ddpcourse.grading.written_out import digest, digests

SITUATIONS = {  # world_size: [(rows per rank, steps, lr, seed), ...]
    1: [(5, 3, 0.3, 2), (4, 2, 1.0, 3)],
    3: [(3, 3, 0.5, 4), (2, 4, 0.8, 5)],
    4: [(2, 3, 0.4, 6), (5, 2, 0.5, 7)],
}


@contextlib.contextmanager
def _one_thread():
    """The judge's replays are thousands of tiny ops: on a busy machine, torch's intra-op threads
    cost several times what they save (measured: 0.9 s of CPU instead of 0.2 s to replay 19
    mistakes of one situation)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def expected_for(world_size: int, situation: Situation) -> Expected:
    """The reference: one process on the global batches, each rank's own losses, and the
    replay of the mistakes as the diagnosis."""
    rows, steps, lr, seed = situation.rows, situation.steps, situation.lr, situation.seed
    batches, starts = inputs_for(world_size, situation)
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), _one_thread():
        backbone, head = _modules_from(starts[0])
        own_losses: list[list[float]] = [[] for _ in range(world_size)]
        optimizer = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=lr)
        losses = []
        for step, (x, y) in enumerate(global_batches(world_size, rows, steps, seed)):
            optimizer.zero_grad()
            logits = head(backbone(x))
            loss = F.cross_entropy(logits, y)
            for rank in range(world_size):
                mine = slice(rank * rows, (rank + 1) * rows)
                own_losses[rank].append(F.cross_entropy(logits[mine], y[mine]).item())
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    reference = {"backbone": _state(backbone), "head": _state(head)}
    moved = max((reference[m][name].double() - starts[0][m][name].double()).abs().max().item()
                for m in MODULES for name in reference[m])
    expected = Expected(batches, starts, reference, losses, own_losses, moved, lambda *_: "")
    expected.diagnose = lambda states, agree: _diagnosis(states, world_size, situation, expected,
                                                         agree)
    return expected


def _modules_from(state: dict) -> tuple[nn.Module, nn.Module]:
    backbone, head = make_backbone(0), make_head(0)
    backbone.load_state_dict(state["backbone"])
    head.load_state_dict(state["head"])
    return backbone, head


def replay(mistake: Mistake, world_size: int, situation: Situation,
           expected: Expected) -> list[dict]:
    """Every rank's modules after ``situation`` when the loop makes ``mistake``: the ranks are
    simulated in this process, their gradients averaged, summed or kept as the mistake says."""
    reduction = "sum" if mistake.loss.startswith("sum") else "mean"
    scale = 1 / world_size if mistake.loss.endswith("/N") else 1.0
    syncs = {"backbone": mistake.backbone, "head": mistake.head}
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), _one_thread():
        ranks = []
        for rank in range(world_size):
            modules = dict(zip(MODULES, _modules_from(expected.starts[rank])))
            for name in MODULES:
                if syncs[name].init == "rank0":
                    modules[name].load_state_dict(expected.starts[0][name])
            ranks.append(modules)
        for step in range(situation.steps):
            for rank, modules in enumerate(ranks):
                for module in modules.values():
                    module.zero_grad()
                x, y = expected.batches[rank][step]
                logits = modules["head"](modules["backbone"](x))
                (F.cross_entropy(logits, y, reduction=reduction) * scale).backward()
            for name in MODULES:
                _combine_and_step(name, syncs[name], ranks, situation.lr)
    return [{name: _state(modules[name]) for name in MODULES} for modules in ranks]


def _combine_and_step(name: str, sync: Sync, ranks: list, lr: float) -> None:
    params = [list(modules[name].parameters()) for modules in ranks]
    with torch.no_grad():
        for i in range(len(params[0])):
            grads = torch.stack([p[i].grad for p in params])
            combined = {"mean": grads.mean(0), "sum": grads.sum(0)}.get(sync.grad)
            for rank, p in enumerate(params):
                p[i].add_(combined if combined is not None else grads[rank], alpha=-lr)
        if sync.after == "rank0":
            for p in params[1:]:
                for mine, rank0s in zip(p, params[0]):
                    mine.copy_(rank0s)


def _diagnosis(states: list[dict], world_size: int, situation: Situation, expected: Expected,
               replicas_agree: bool) -> str:
    """Which plausible mistake reproduces what every rank holds, in words, or ''."""
    for mistake in MISTAKES:
        if mistake.agrees != replicas_agree:
            continue
        if world_size == 1 and (mistake.head != RIGHT or mistake.backbone != RIGHT):
            continue  # one rank: nothing to average, so no mistake of synchronisation shows
        replayed = replay(mistake, world_size, situation, expected)
        if all(_close(r, expected.reference) for r in replayed):
            continue  # the same as the right loop here: it explains nothing
        if all(_close(states[rank], replayed[rank]) for rank in range(world_size)):
            return mistake.explain(world_size, situation)
    return ""


def written_out_entry(world_size: int, situation: Situation) -> dict:
    """What the visible module writes out for one of its situations (see VISIBLE_EXPECTED)."""
    expected = expected_for(world_size, situation)
    mistakes = []
    for index, mistake in enumerate(MISTAKES):
        if world_size == 1 and (mistake.head != RIGHT or mistake.backbone != RIGHT):
            continue
        replayed = replay(mistake, world_size, situation, expected)
        if all(_close(r, expected.reference) for r in replayed):
            continue
        mistakes.append((index, [digest(flat_state(state)) for state in replayed]))
    return {"reference": {m: digests(expected.reference[m]) for m in MODULES},
            "losses": expected.losses, "own_losses": expected.own_losses,
            "moved": expected.moved, "mistakes": mistakes}


def judge_with_reference(observations, world_size, situations, checks=ALL_CHECKS):
    judge_training_with(expected_for, observations, world_size, situations, checks)


TRAINING = Case(observe_training, judge_with_reference)


def check_train(train) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size, situations in SITUATIONS.items():
        run_student(TRAINING, world_size, train, situations, ALL_CHECKS, hide_internals=True)
