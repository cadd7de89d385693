"""Hidden checks for chapter 08's resumable_checkpoint: the save at 1, 3 and 4 ranks (only rank
0 writes, whatever the world size; the 4 ranks as 2 machines of 2, where LOCAL_RANK is not RANK),
over an existing checkpoint and for step 0; the load with SGD
(momentum, weight decay) and AdamW, whose states differ from Adam's, at 1, 3 and 4 ranks; the
crash with SGD; the resume with SGD and AdamW. Every situation runs the visible module's Cases."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student, together
from ddpcourse.grading.exercises.resumable_checkpoint import CRASH, LOAD, RESUME, SAVE, setting

SITUATIONS = [
    (SAVE, 1, setting(seed=11, optimizer="sgd", step=0)),
    (SAVE, 3, setting(seed=12, optimizer="adamw", steps=3, step=7, previous=True)),
    (SAVE, 4, setting(seed=13, optimizer="sgd", steps=1, nodes=2)),  # LOCAL_RANK != RANK
    (CRASH, 1, setting(seed=14, optimizer="sgd", steps=3)),
    (LOAD, 1, setting(seed=15, optimizer="sgd", steps=2)),
    (LOAD, 3, setting(seed=16, optimizer="adamw", steps=4)),
    (LOAD, 4, setting(seed=17, optimizer="sgd", steps=1, step=0)),
    (RESUME, 1, setting(seed=18, optimizer="sgd", steps=3, more=3)),
    (RESUME, 2, setting(seed=19, optimizer="adamw", steps=1, more=4)),
]


def check_resumable_checkpoint(save_checkpoint, load_checkpoint) -> None:
    __tracebackhide__ = True  # noqa: F841
    functions = together(save_checkpoint, load_checkpoint)
    for case, world_size, s in SITUATIONS:
        run_student(case, world_size, functions, s, hide_internals=True)
