"""Hidden checks for chapter 09's replicas_that_disagree: 3 and 4 processes; processes of two
machines (local ranks differ from ranks) under torchrun, srun and torchrun started by srun;
temperatures that start different on every rank (a fix must sync the start too, as DDP's
constructor does); more steps, other batch sizes, learning rates and seeds; one rank. The tempting
fixes (a temperature averaged once at the end or copied from rank 0 after each step, running
statistics averaged at the end, an evaluation that bypasses the wrapper) fail here as in the
visible checks, each named by the judge. Every situation runs the visible module's Cases."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.replicas_that_disagree import (BATCHNORM, TEMPERATURE,
                                                                Situation, run_join)

JOIN_SITUATIONS = {
    3: [("torchrun", 1), ("srun", 1), ("none", 1)],
    4: [("torchrun", 2), ("srun", 2), ("torchrun-in-srun", 2), ("none", 2)],
}
TRAINING_SITUATIONS = {
    1: [tuple(Situation(steps=3, rows=5, lr=0.3, seed=21, temperatures=True))],
    3: [tuple(Situation(steps=7, rows=6, lr=0.4, seed=22, temperatures=True))],
    4: [tuple(Situation(steps=6, rows=4, lr=0.6, seed=23, temperatures=True))],
}


def check_replicas_that_disagree(join_the_job, train_with_temperature,
                                 train_and_evaluate) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, situations in JOIN_SITUATIONS.items():
        run_join(join_the_job, world_size, situations, hide_internals=True)
    for world_size, situations in TRAINING_SITUATIONS.items():
        run_student(TEMPERATURE, world_size, train_with_temperature, situations,
                    hide_internals=True)
        run_student(BATCHNORM, world_size, train_and_evaluate, situations, hide_internals=True)
