"""Hidden checks for chapter 00: all_to_all, one rank for every collective, edge values, and the
self-test against more ways for an all-reduce to go wrong."""

from __future__ import annotations

from ddpcourse.grading.exercises.health_check import (BANDWIDTH, CORRUPTIONS, SELF_TEST,
                                                     SINGLE_RANK)
from ddpcourse.grading.checks import run_student

CASES = [
    ("all_to_all", 2**24, 2e-3, 4),
    ("all_to_all", 2**20, 1e-3, 1),
    ("reduce_scatter", 2**20, 1e-3, 1),
    ("all_gather", 3 * 2**20, 1e-3, 3),
    ("broadcast", 2**20, 1e-3, 1),
    ("reduce", 123_456_789, 0.5, 7),
    ("all_reduce", 0, 1e-3, 4),  # an empty message is allowed: 0 GB/s
    ("all_reduce", 2**30, 1, 16),  # whole seconds as an int
    ("all_reduce", 8, 2.5e-6, 3),
]
ERRORS = [
    (("all-reduce", 2**20, 1e-3, 2), "a misspelt collective"),
    (("", 2**20, 1e-3, 2), "an empty name"),
    (("broadcast", 2**20, 1e-3, -3), "a negative world_size"),
    (("all_gather", 2**20, -1e-3, 2), "negative seconds"),
    (("reduce", -(2**20), 1e-3, 2), "negative bytes"),
]


def _hidden(case, world_size, fn, *args, **kwargs):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, *args, hide_internals=True, **kwargs)


def check_bus_bandwidth(bus_bandwidth) -> None:
    __tracebackhide__ = True  # noqa: F841
    _hidden(BANDWIDTH, 1, bus_bandwidth, CASES, ERRORS, init_process_group=False)


def check_all_reduce_self_test(all_reduce_self_test) -> None:
    __tracebackhide__ = True  # noqa: F841
    for corruption in CORRUPTIONS:
        for world_size in (2, 4):
            _hidden(SELF_TEST, world_size, all_reduce_self_test, corruption)
    _hidden(SELF_TEST, 3, all_reduce_self_test)  # and the group works for the next test
    _hidden(SINGLE_RANK, 1, all_reduce_self_test)
