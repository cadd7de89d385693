"""Hidden checks for chapter 11's ShardedOptimizer: 1, 3 and 4 ranks, SGD with momentum and
AdamW, more steps, element counts that do not divide by the world size (the model "uneven": 259
elements, on 4 ranks); on 3 and 4 ranks every rank's gradients differ outside its own piece, so
pieces cut another way than the contract's (floor-sized, round-robin) or the whole optimizer run
in every rank end with wrong weights."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.sharded_optimizer import MEMORY, WEIGHTS

# (case, world_size, model, optimizer, kwargs, steps, seed, other_pieces_differ)
# (the 4-rank case first: 259 elements cut floor-sized or round-robin differ there from ceil-sized
# contiguous pieces, and a wrong cut fails without waiting for the other launches)
HIDDEN_CASES = [
    (WEIGHTS, 4, "uneven", "AdamW", (("lr", 0.05), ("weight_decay", 0.1)), 5, 6, True),
    (WEIGHTS, 1, "three", "Adam", (("lr", 0.1),), 2, 3, False),
    (WEIGHTS, 3, "three", "SGD", (("lr", 0.1), ("momentum", 0.9)), 4, 4, True),
    (MEMORY, 3, "three", "AdamW", (("lr", 0.05), ("weight_decay", 0.1)), 2, 5, False),
]


def check_sharded_optimizer(ShardedOptimizer) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for case, world_size, *args in HIDDEN_CASES:
        run_student(case, world_size, ShardedOptimizer, *args, hide_internals=True)
