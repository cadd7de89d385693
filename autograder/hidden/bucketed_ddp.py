"""Hidden checks for chapter 05's DDP exercises: world sizes 1-4, float64, frozen, unused and
tied parameters, a bucket cap far below one parameter. They judge values and buckets; overlap,
judged by its own visible test, is not judged again (one mistake, one lost test)."""

from __future__ import annotations

from ddpcourse.grading.exercises.bucketed_ddp import BROADCAST, BUCKETED_TRAINING
from ddpcourse.grading.checks import run_student


def _hidden(case, world_size, fn, *args):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, *args, hide_internals=True)


def check_broadcast_parameters(broadcast_parameters) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, variant, dtype, seed in [(1, "plain", "float32", 3), (4, "batchnorm",
                                             "float32", 4), (2, "unused", "float64", 5),
                                             (4, "tied", "float64", 6)]:
        _hidden(BROADCAST, world_size, broadcast_parameters, variant, dtype, seed)


def check_bucketed_ddp(BucketedDDP) -> None:
    __tracebackhide__ = True  # noqa: F841
    cases = [  # world size, bucket_cap_mb, variant, dtype, seed
        (1, 0.001, "plain", "float32", 3),
        (3, 0.001, "frozen", "float32", 4),
        (4, 1e-9, "plain", "float32", 5),
        (2, 1e-6, "unused", "float32", 6),
        (2, 0.0015, "unused", "float32", 7),
        (3, 1e-6, "tied", "float32", 8),
        (2, 0.002, "tied", "float64", 9),
    ]
    for world_size, bucket_cap_mb, variant, dtype, seed in cases:
        _hidden(BUCKETED_TRAINING, world_size, BucketedDDP, bucket_cap_mb, variant, dtype,
                seed, 3, "values and buckets")  # overlap has its own visible test
