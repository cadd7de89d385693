"""Hidden checks for chapter 07's train_steps: world sizes 1, 3 and 4; accumulation_steps of 1
and larger than the number of micro-batches; no micro-batches at all; a tail at 3 and 4 ranks;
momentum (a missed zero_grad or an extra step shows in every later step); a cross-entropy loss;
bad accumulation_steps. Every situation runs the visible module's Cases (passed as data), so it
runs only in the trusted grader, with the communication counted by its broker."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.train_steps import BAD_STEPS, run_settings, setting

ONE_RANK = [setting(5, 2, seed=11), setting(3, 5, seed=12)]
THREE_RANKS = [setting(7, 3, seed=13, momentum=0.9), setting(4, 1, seed=14, loss="cross_entropy"),
               setting(0, 2, seed=15)]
FOUR_RANKS = [setting(6, 4, rows=2, seed=16, loss="cross_entropy", momentum=0.5),
              setting(2, 8, seed=17)]
BAD_VALUES = [0, -2]


def check_train_steps(train_steps) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, settings in [(1, ONE_RANK), (3, THREE_RANKS), (4, FOUR_RANKS)]:
        run_settings(train_steps, world_size, settings, hide_internals=True)
    run_student(BAD_STEPS, 2, train_steps, BAD_VALUES, hide_internals=True)
