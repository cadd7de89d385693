"""Hidden checks for chapter 05: world sizes 1-4, odd lengths, dtypes, seeds, forbidden shortcuts."""

from __future__ import annotations

from ddpcourse.grading.exercises.allreduce_by_hand import AVERAGE_GRADIENTS, RING_ALLREDUCE
from ddpcourse.grading.checks import run_student


def _hidden(case, world_size, fn, *args):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, *args, hide_internals=True)


def check_average_gradients(average_gradients) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size in (1, 3, 4):
        _hidden(AVERAGE_GRADIENTS, world_size, average_gradients, "float32", True, False, 7)
    _hidden(AVERAGE_GRADIENTS, 2, average_gradients, "float64", True, False, 11)
    _hidden(AVERAGE_GRADIENTS, 3, average_gradients, "float32", True, True, 5)  # tied


def check_ring_allreduce(ring_allreduce) -> None:
    __tracebackhide__ = True  # noqa: F841
    cases = [
        (1, (5,), "float32", 1),
        (2, (1,), "int64", 2),
        (2, (3, 5), "float64", 3),
        (3, (1,), "float32", 4),
        (3, (11,), "int64", 5),
        (4, (3,), "float64", 6),
        (4, (13,), "int64", 7),
        (4, (4, 9), "float32", 8),
    ]
    for world_size, shape, dtype, seed in cases:
        _hidden(RING_ALLREDUCE, world_size, ring_allreduce, shape, dtype, seed)
    # bandwidth: every rank's bytes within the ring bounds, also for uneven chunks
    for world_size, numel in [(3, 999), (4, 1001)]:
        _hidden(RING_ALLREDUCE, world_size, ring_allreduce, (numel,), "float64", 9, True)
