"""Hidden checks for chapter 08's survive_a_killed_worker: under torchrun, rank 0 raising right
after a checkpoint step (the checkpoint of that very step must be complete and used), and rank 0
SIGKILLed while it writes a checkpoint (the previous one must be intact and used, and no rank may
have gone on before the write was done); without
torchrun, a stop before the first checkpoint (the restart starts at step 1), two stops in one
run, SGD with momentum, and one rank. Every situation runs the visible module's observations and
is judged here with :func:`uninterrupted_weights`, bit for bit: the grader's reference, kept out
of the visible module (the ranks and torchrun's workers import it).
tests/test_grading_survive_a_killed_worker.py holds the visible module's written-out digests
(VISIBLE_WEIGHTS) to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.survive_a_killed_worker import (batch_at, dropout_seed,
                                                                 judge_killed, judge_stopped,
                                                                 make_model, make_optimizer,
                                                                 observe_killed, observe_stopped,
                                                                 run_killed, setting)

KILLED_IN_SAVE = setting(seed=15, total_steps=6, every=2, fault="kill_in_save", fault_rank=0,
                         fault_step=4)
STOPPED_SITUATIONS = [
    (2, setting(seed=11, total_steps=5, every=3, stops=(2,))),
    (2, setting(seed=12, optimizer="sgd", total_steps=9, every=2, stops=(3, 7))),
    (1, setting(seed=13, total_steps=6, every=2, world_size=1, stops=(4,))),
]


def uninterrupted_weights(s: dict) -> dict[str, torch.Tensor]:
    """The reference, in one process: every step, every rank's gradient on its own batch with its
    own dropout stream, averaged as DDP does (divided by the world size, then summed; exact for
    one or two ranks); then the optimizer's step."""
    world_size = s["world_size"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            model = make_model(s["seed"])
            optimizer = make_optimizer(s["optimizer"], model)
            streams = []
            for rank in range(world_size):
                torch.manual_seed(dropout_seed(s["seed"], rank))
                streams.append(torch.get_rng_state())
            params = list(model.parameters())
            for step in range(1, s["total_steps"] + 1):
                per_rank = []
                for rank in range(world_size):
                    torch.set_rng_state(streams[rank])
                    inputs, targets = batch_at(s["seed"], rank, step)
                    loss = F.mse_loss(model(inputs), targets)
                    per_rank.append(torch.autograd.grad(loss, params))
                    streams[rank] = torch.get_rng_state()
                for index, param in enumerate(params):
                    total = per_rank[0][index] / world_size
                    for grads in per_rank[1:]:
                        total = total + grads[index] / world_size
                    param.grad = total
                optimizer.step()
                optimizer.zero_grad()
            return {name: t.detach().clone() for name, t in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def judge_stopped_bit_for_bit(observations, world_size, s):
    judge_stopped(observations, world_size, s, uninterrupted_weights)


def judge_killed_bit_for_bit(observations, world_size, s):
    judge_killed(observations, world_size, s, uninterrupted_weights)


STOPPED = Case(observe_stopped, judge_stopped_bit_for_bit)
KILLED = Case(observe_killed, judge_killed_bit_for_bit)


def check_survive_a_killed_worker(train) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, s in STOPPED_SITUATIONS:
        run_student(STOPPED, world_size, train, s, hide_internals=True)
    run_killed(train, setting(seed=14, optimizer="sgd", total_steps=7, every=2, fault="raise",
                              fault_rank=0, fault_step=4), KILLED, hide_internals=True)
    run_killed(train, KILLED_IN_SAVE, KILLED, hide_internals=True)
