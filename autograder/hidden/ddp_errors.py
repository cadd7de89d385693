"""Hidden checks for chapter 09's ddp_errors: an aux head trained on some steps only (3 and 2
ranks: freezing it, or static_graph=True, is then wrong), one rank; a resume with SGD and momentum
on 3 ranks and on one; a block applied twice per forward (4 ranks: reentrant checkpointing then
fails even without find_unused_parameters). Every situation runs the visible module's Cases; the
communication-audited ones (the aux head) stay at 3 ranks or fewer, each rank a sandbox of its own
when a class is graded."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student, together
from ddpcourse.grading.exercises.ddp_errors import (CHECKPOINTED, RESUME, UNUSED, resume_setting,
                                                    tower_setting, unused_setting)

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


def check_ddp_errors(train_with_aux, save_checkpoint, resume, train_tower) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, s in UNUSED_SITUATIONS:
        run_student(UNUSED, world_size, train_with_aux, s, hide_internals=True)
    for world_size, s in RESUME_SITUATIONS:
        run_student(RESUME, world_size, together(save_checkpoint, resume), s, hide_internals=True)
    for world_size, s in TOWER_SITUATIONS:
        run_student(CHECKPOINTED, world_size, train_tower, s, hide_internals=True)
