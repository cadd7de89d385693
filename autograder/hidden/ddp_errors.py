"""Hidden checks for chapter 09's ddp_errors, and the truth of every situation.

Grader-only (the sandbox hides this folder from the student's code): one process's training of
each lab (:func:`unused_reference`, :func:`resume_reference`, :func:`tower_reference`), which the
visible module must not hold (GRADING_DESIGN.md). The hidden situations: an aux head trained on
some steps only (3 and 2 ranks: freezing it, or static_graph=True, is then wrong), one rank; a
resume with SGD and momentum on 3 ranks and on one; a block applied twice per forward (4 ranks:
reentrant checkpointing then fails even without find_unused_parameters). Every situation runs the
visible module's ``observe_*``, judged here with these truths; the communication-audited ones (the
aux head) stay at 3 ranks or fewer, each rank a sandbox of its own when a class is graded.

``python -m autograder.hidden.ddp_errors`` prints the visible cases' truths as the visible module
writes them out (``WRITTEN_OUT``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpcourse.grading.checks import Case, run_student, together
from ddpcourse.grading.exercises import ddp_errors as visible
from ddpcourse.grading.exercises.ddp_errors import (_rank_seed, _state, aux_batches, aux_loss,
                                                    make_net, make_optimizer, make_tower,
                                                    net_batch, resume_setting, tower_batches,
                                                    tower_setting, unused_setting)
from ddpcourse.grading.written_out import table_literal

UNUSED_SITUATIONS = [
    (3, unused_setting(seed=11, steps=5, rows=3, aux_steps=(1, 2))),
    (1, unused_setting(seed=12, steps=3)),
    (2, unused_setting(seed=13, steps=4, rows=2, aux_steps=(0, 3), lr=0.3)),
]
RESUME_SITUATIONS = [
    (3, resume_setting(seed=14, optimizer="sgd", steps=2, more=3)),
    (1, resume_setting(seed=15, steps=4, more=2)),
]
TOWER_SITUATIONS = [(4, tower_setting(seed=16, repeats=2, steps=3, rows=3))]


def unused_reference(s: dict, world_size: int) -> dict[str, torch.Tensor]:
    """One process: rank 0's initial model, plain SGD, each step's gradient the mean over the
    ranks of each rank's loss gradient (what DDP's average gives)."""
    model = visible.make_two_heads(_rank_seed(s["seed"], 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    every = [aux_batches(s, rank) for rank in range(world_size)]
    for step in range(s["steps"]):
        optimizer.zero_grad()
        total = sum(aux_loss(model, *every[rank][step]) for rank in range(world_size))
        (total / world_size).backward()
        optimizer.step()
    return _state(model)


def resume_reference(s: dict, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, ``steps`` steps: each rank's gradient divided by the world size, then summed
    in rank order, as DDP does (exact for one or two ranks)."""
    model = make_net(_rank_seed(s["seed"], 0))
    optimizer = make_optimizer(s["optimizer"], model)
    params = list(model.parameters())
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            x, y = net_batch(s["seed"], step, rank)
            grads.append(torch.autograd.grad(F.cross_entropy(model(x), y), params))
        for index, param in enumerate(params):
            total = grads[0][index] / world_size
            for other in grads[1:]:
                total = total + other[index] / world_size
            param.grad = total
        optimizer.step()
    return _state(model)


def tower_reference(s: dict, world_size: int) -> dict[str, torch.Tensor]:
    model = make_tower(_rank_seed(s["seed"], 0), s["repeats"])
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    every = [tower_batches(s, rank) for rank in range(world_size)]
    for step in range(s["steps"]):
        optimizer.zero_grad()
        total = sum(F.cross_entropy(model(every[r][step][0]), every[r][step][1])
                    for r in range(world_size))
        (total / world_size).backward()
        optimizer.step()
    return _state(model)


def unused_truth(s: dict, world_size: int) -> dict:
    return {"weights": unused_reference(s, world_size)}


def resume_truth(s: dict, world_size: int) -> dict:
    return {"saved": resume_reference(s, world_size, s["steps"]),
            "final": resume_reference(s, world_size, s["steps"] + s["more"])}


def tower_truth(s: dict, world_size: int) -> dict:
    return {"weights": tower_reference(s, world_size)}


def judge_unused(observations, world_size, s):
    visible.judge_unused_against(unused_truth, observations, world_size, s)


def judge_resume(observations, world_size, s):
    visible.judge_resume_against(resume_truth, observations, world_size, s)


def judge_checkpointed(observations, world_size, s):
    visible.judge_checkpointed_against(tower_truth, observations, world_size, s)


UNUSED = Case(visible.observe_unused, judge_unused, audit_traffic=True)
RESUME = Case(visible.observe_resume, judge_resume)
CHECKPOINTED = Case(visible.observe_checkpointed, judge_checkpointed)


def check_ddp_errors(train_with_aux, save_checkpoint, resume, train_tower) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, s in UNUSED_SITUATIONS:
        run_student(UNUSED, world_size, train_with_aux, s, hide_internals=True)
    for world_size, s in RESUME_SITUATIONS:
        run_student(RESUME, world_size, together(save_checkpoint, resume), s, hide_internals=True)
    for world_size, s in TOWER_SITUATIONS:
        run_student(CHECKPOINTED, world_size, train_tower, s, hide_internals=True)


# --- the visible cases' truths, written out -----------------------------------------------------


def written_out() -> dict[str, dict[str, dict]]:
    """The visible cases' truths as ``visible.WRITTEN_OUT`` holds them: each tensor as its
    :func:`~ddpcourse.grading.exercises.ddp_errors.digest`."""
    def digests(truth: dict) -> dict:
        return {key: {name: visible.digest(t) for name, t in state.items()}
                for key, state in truth.items()}

    return {"unused": {visible.situation_key(visible.VISIBLE_UNUSED, 2):
                       digests(unused_truth(visible.VISIBLE_UNUSED, 2))},
            "resume": {visible.situation_key(visible.VISIBLE_RESUME, 2):
                       digests(resume_truth(visible.VISIBLE_RESUME, 2))},
            "tower": {visible.situation_key(visible.VISIBLE_TOWER, 2):
                      digests(tower_truth(visible.VISIBLE_TOWER, 2))}}


if __name__ == "__main__":
    print(table_literal(written_out()))
