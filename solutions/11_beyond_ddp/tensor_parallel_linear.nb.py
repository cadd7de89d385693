# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise 11: tensor-parallel linear layers by hand
#
# Megatron-style tensor parallelism splits one `nn.Linear` over the ranks of a tensor-parallel
# group. A **column-parallel** layer keeps a block of the weight's rows (output features): every
# rank sees the whole input and computes its slice of the output. A **row-parallel** layer keeps
# a block of the weight's columns (input features): every rank sees its slice of the input, and
# the partial outputs are summed across the group. Chained (column, element-wise activation,
# row) they compute an MLP with one all-reduce in forward and one in backward. Chapter 11 shows
# the same with DTensor's `ColwiseParallel` / `RowwiseParallel`; here you write the layers and
# their collectives yourself.
#
# **How your code runs.** Each test builds dense `nn.Linear` layers, wraps them in your classes in
# every rank of a real process group (`run_ranks`), runs one forward and one backward, and
# compares the outputs and every gradient with the dense layers' in one process. Do **not** call
# `init_process_group` in this notebook.
#
# **Self-check** from the repository root:
# `pytest exercises/11_beyond_ddp/tensor_parallel_linear.ipynb` runs this notebook and reports
# each visible test. Hidden tests (edge cases) run when the notebook is graded.
#
# **Rules.** Keep the class names and signatures exactly as given (they are the grading
# contract). Do not reassign library functions: the tests check for it and fail.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.checks import together
from ddpcourse.grading.exercises import tensor_parallel_linear as checks
from ddpcourse.launcher import run_ranks

setup_notebook("tensor_parallel_linear")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-tensor-parallel-linear", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `ColumnParallelLinear` and `RowParallelLinear` (12 points)
#
# Implement both as their docstrings say. Each needs one collective, in forward for one of them
# and in backward for the other. We suggest writing each as a `torch.autograd.Function` whose
# `forward` and `backward` say what happens in each direction; the tests judge only what the
# layers compute (outputs and gradients), so any other way that behaves as the docstrings say (a
# gradient hook, say) passes too. Mind what the docstrings say about calling a layer twice and
# about an input that is used elsewhere as well: a hook on the caller's tensor does not survive
# that.
#
# Hint: in a column-parallel layer every rank uses the whole input, so the input's gradient is a
# sum over the ranks of each rank's part. In a row-parallel layer each rank's output is a partial
# sum, and the bias belongs to the whole sum, not to each part.

# %% nbgrader={"grade": false, "grade_id": "tensor-parallel-linear", "locked": false, "schema_version": 3, "solution": true, "task": false}
class ColumnParallelLinear(nn.Module):
    """`linear` split by output features over the ranks of `group`.

    Built in every rank of `group` (a `ProcessGroup`, e.g. `dist.group.WORLD`) from the same
    dense `linear` (`out_features` divisible by the group's size N). Rank `r` of the group
    (`dist.get_rank(group)`) keeps, as `nn.Parameter`s, only rows
    `[r * out/N, (r+1) * out/N)` of `linear.weight` in `self.weight` (shape `(out/N, in)`) and
    the same slice of `linear.bias` in `self.bias` (`None` when `linear` has no bias). It keeps
    no other copy of the dense weights, and leaves `linear` unchanged.

    `forward(x)`: `x` is the whole input, the same on every rank of the group, `(..., in)`.
    Returns this rank's columns of the dense output, `(..., out/N)`: `linear(x)[..., r*out/N :
    (r+1)*out/N]`.

    Backward: the gradients of `self.weight` and `self.bias` are this rank's slices of the dense
    layer's; the gradient reaching `x` is the dense layer's, the whole of it, on every rank.

    As for any layer, each call is on its own: the layer may be called more than once before one
    backward, and `x` may reach the loss by other paths too (a residual connection); each call
    adds to `x`'s gradient the dense layer's input gradient for that call, and nothing to the
    gradient of the other paths.
    """

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        ### BEGIN SOLUTION
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = linear.out_features // size
        self.group = group
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach()[mine].clone()))
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        class SumInBackward(torch.autograd.Function):
            """Identity forward; the gradient summed over the group in backward."""

            @staticmethod
            def forward(ctx, x, group):
                ctx.group = group
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                grad = grad.contiguous().clone()
                dist.all_reduce(grad, group=ctx.group)
                return grad, None

        return nn.functional.linear(SumInBackward.apply(x, self.group), self.weight, self.bias)
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """`linear` split by input features over the ranks of `group`.

    Built in every rank of `group` from the same dense `linear` (`in_features` divisible by the
    group's size N). Rank `r` of the group keeps, as `nn.Parameter`s, only columns
    `[r * in/N, (r+1) * in/N)` of `linear.weight` in `self.weight` (shape `(out, in/N)`), and the
    whole `linear.bias` in `self.bias` (`None` when `linear` has no bias). It keeps no other copy
    of the dense weights, and leaves `linear` unchanged.

    `forward(x)`: `x` is this rank's columns of the input, `(..., in/N)` (what a
    `ColumnParallelLinear` before it returns). Returns the whole dense output `(..., out)`, the
    same on every rank: the partial products summed over the group, the bias added once.

    Backward (the output's gradient is the same on every rank): the gradient of `self.weight` is
    this rank's columns of the dense layer's, that of `self.bias` the dense layer's whole bias
    gradient, and the gradient reaching `x` is this rank's columns of the dense input gradient.
    Each call is on its own, as for `ColumnParallelLinear`.
    """

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        ### BEGIN SOLUTION
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        columns = linear.in_features // size
        self.group = group
        self.weight = nn.Parameter(
            linear.weight.detach()[:, rank * columns:(rank + 1) * columns].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        class SumInForward(torch.autograd.Function):
            """The partial outputs summed over the group in forward; identity backward."""

            @staticmethod
            def forward(ctx, x, group):
                x = x.contiguous().clone()
                dist.all_reduce(x, group=group)
                return x

            @staticmethod
            def backward(ctx, grad):
                return grad, None

        out = SumInForward.apply(nn.functional.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias
        ### END SOLUTION


# %%
# Try it: a column-then-row MLP on 2 ranks against the dense one.
def try_mlp(rank, world_size):
    torch.manual_seed(0)
    up, down = nn.Linear(4, 8), nn.Linear(8, 4)
    x = torch.randn(2, 4)
    column = ColumnParallelLinear(up, dist.group.WORLD)
    row = RowParallelLinear(down, dist.group.WORLD)
    return (row(torch.relu(column(x))) - down(torch.relu(up(x)))).abs().max().item()

run_ranks(try_mlp, 2, timeout=30, backend="gloo")

# %% nbgrader={"grade": true, "grade_id": "test-column-parallel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): ColumnParallelLinear on 2 ranks: output columns, input and parameter gradients.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import tensor_parallel_linear as checks
integrity.assert_untampered()
checks.check_column_parallel(together(ColumnParallelLinear, RowParallelLinear))
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-row-parallel", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): RowParallelLinear on 2 ranks: whole output, input and parameter gradients.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import tensor_parallel_linear as checks
integrity.assert_untampered()
checks.check_row_parallel(together(ColumnParallelLinear, RowParallelLinear))
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-mlp", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): column -> tanh -> row on 3 ranks equals the dense MLP.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import tensor_parallel_linear as checks
integrity.assert_untampered()
checks.check_mlp(together(ColumnParallelLinear, RowParallelLinear))
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-tensor-parallel-linear-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 1 and 4 ranks, two tensor-parallel groups side by side, layers without bias,
# each layer called twice before one backward with a residual connection.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import tensor_parallel_linear as hidden
hidden.check_tensor_parallel_linear(together(ColumnParallelLinear, RowParallelLinear))
print("passed")
### END HIDDEN TESTS
