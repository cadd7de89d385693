"""Hidden checks for chapter 09's collectives_that_hang: 3 and 4 ranks for every lab, and the
situations a 2-rank fix can get right by luck: other shard lengths (one of them empty, all equal),
a bad batch on rank 0 or on two ranks at once, an empty batch, a batch whose loss is inf
(not finite, though not NaN), no bad batch at all, an early stop
decided by the mean although one rank's own loss is already below the threshold, a last batch of
one row, equal sizes. They run the visible module's Cases (situations passed as data), so they
run only in the trusted grader."""

from __future__ import annotations

from ddpcourse.grading.exercises.collectives_that_hang import (EVALUATE, GATHER, HINTS, LOG,
                                                               SHARD, SKIP, _run)

LOG_SITUATIONS = {3: [(3, 5, 0.1, 2, 2)], 4: [(2, 3, 0.2, 1, 3)]}
EVALUATE_SITUATIONS = {3: [(4, 2, 3, 0.1, 4)], 4: [(3, 2, 1, 0.2, 5)]}
SHARD_SITUATIONS = {
    3: [([5, 9, 12], 2, 0.1, 6), ([6, 6, 6], 3, 0.1, 7)],
    4: [([8, 3, 8, 10], 4, 0.2, 8), ([4, 0, 5, 6], 2, 0.1, 9)],
}
SKIP_SITUATIONS = {
    3: [(4, 6, 0.1, 0.05, [[0, 1, "nan"], [2, 1, "nan"]], 2),
        (4, 5, 0.1, 0.05, [[2, 3, "empty"], [0, 2, "inf"]], 3),
        (4, 8, 0.3, 0.25, [], 4)],
    4: [(3, 6, 0.2, 0.05, [[3, 2, "nan"], [1, 4, "empty"]], 5),
        (3, 8, 0.3, 0.2, [[0, 1, "nan"]], 6)],
}
GATHER_SITUATIONS = {
    3: [([3, 3, 1], "labels", 2), ([2, 4, 3], "scores", 3)],
    4: [([3, 3, 2, 2], "labels", 4), ([5, 5, 5, 5], "scores", 5), ([1, 2, 1, 4], "labels", 6)],
}


def check_collectives_that_hang(train_and_log, fit_and_evaluate, train_on_shard,
                                train_skipping_bad_batches, gather_predictions) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for case, fn, situations, hint in (
            (LOG, train_and_log, LOG_SITUATIONS, HINTS["log"]),
            (EVALUATE, fit_and_evaluate, EVALUATE_SITUATIONS, HINTS["evaluate"]),
            (SHARD, train_on_shard, SHARD_SITUATIONS, HINTS["shard"]),
            (SKIP, train_skipping_bad_batches, SKIP_SITUATIONS, HINTS["skip"]),
            (GATHER, gather_predictions, GATHER_SITUATIONS, HINTS["gather"])):
        for world_size, cases in situations.items():
            _run(case, world_size, fn, cases, hint, timeout=None, hide_internals=True)
