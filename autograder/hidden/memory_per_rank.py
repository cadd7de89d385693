"""Hidden checks for chapter 02: 1, 3 and 4 ranks, uneven rows, float64, frozen parameters."""

from __future__ import annotations

from ddpcourse.grading.exercises.memory_per_rank import DOUBLE, ERRORS, UNEVEN, run_memory
from ddpcourse.grading.checks import run_student

BAD_ARGUMENTS = [(3, 3, "ddp"), (4, -1, "ddp"), (3, 0, "dp"), (1, 1, "fsdp"), (4, 0, "zero")]


def check_bytes_per_rank(bytes_per_rank) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(ERRORS, 1, bytes_per_rank, BAD_ARGUMENTS, init_process_group=False,
                hide_internals=True)
    run_memory(bytes_per_rank, 1, [UNEVEN], hide_internals=True)
    for world_size in (3, 4):
        run_memory(bytes_per_rank, world_size, [UNEVEN, DOUBLE], hide_internals=True)
