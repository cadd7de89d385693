"""Hidden checks for chapter 11's ColumnParallelLinear / RowParallelLinear: one rank, two
tensor-parallel groups side by side on 4 ranks (each with its own input: a layer that reduces
over the default group instead of its own mixes them), layers without bias, 4-way splits, and each
layer called twice before one backward with a residual around it ("repeat": a layer that hooks the
caller's input tensor, or sums its gradient once per module, fails there)."""

from __future__ import annotations

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.tensor_parallel_linear import LAYERS

# (world_size, mode, sizes, bias, seed, tp_size)
HIDDEN_CASES = [
    (1, "mlp", (3, 4, 2), True, 11, 1),
    (4, "repeat", (4, 6, 4), False, 12, 2),
    (4, "row", (8, 3, 3), True, 13, 4),
]


def check_tensor_parallel_linear(classes) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size, *args in HIDDEN_CASES:
        run_student(LAYERS, world_size, classes, *args, hide_internals=True)
