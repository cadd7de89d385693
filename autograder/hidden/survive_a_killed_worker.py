"""Hidden checks for chapter 08's survive_a_killed_worker: under torchrun, rank 0 raising right
after a checkpoint step (the checkpoint of that very step must be complete and used); without
torchrun, a stop before the first checkpoint (the restart starts at step 1), two stops in one
run, SGD with momentum, and one rank. Every situation runs the visible module's Cases."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.survive_a_killed_worker import STOPPED, run_killed, setting

STOPPED_SITUATIONS = [
    (2, setting(seed=11, total_steps=5, every=3, stops=(2,))),
    (2, setting(seed=12, optimizer="sgd", total_steps=9, every=2, stops=(3, 7))),
    (1, setting(seed=13, total_steps=6, every=2, world_size=1, stops=(4,))),
]


def check_survive_a_killed_worker(train) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, s in STOPPED_SITUATIONS:
        run_student(STOPPED, world_size, train, s, hide_internals=True)
    run_killed(train, setting(seed=14, optimizer="sgd", total_steps=7, every=2, fault="raise",
                              fault_rank=0, fault_step=4), hide_internals=True)
