# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: $jupytext_version
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise $number: $slug (FILL IN a title)
#
# FILL IN: the situation this exercise is about, in a few sentences, and what the lesson
# (`chapters/$assignment/`) showed that this asks one step beyond. As scaffolded it is a working
# example: `$slug(tensor)` returns the sum of a tensor over every rank.
#
# **Self-check** from the repository root: `pytest exercises/$assignment`.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import $slug as checks
from ddpcourse.launcher import run_ranks

setup_notebook("$slug")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-$grade_id", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `$slug(tensor) -> torch.Tensor` (3 points)
#
# FILL IN: what to write, and why a distributed job needs it. The contract (the name, the
# signature, what it returns and raises) is stated once, in the docstring below.

# %% nbgrader={"grade": false, "grade_id": "$grade_id", "locked": false, "schema_version": 3, "solution": true, "task": false}
def $slug(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over every rank of the default process group, as a new tensor.

    Every rank calls it with a 1-D tensor of the same length and dtype, and every rank gets the
    same sum back. `tensor` itself is left as it was.

    Args:
        tensor: this rank's values.

    Returns:
        A new tensor of `tensor`'s shape and dtype: the element-wise sum over the ranks.
    """
    ### BEGIN SOLUTION
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total
    ### END SOLUTION


# %%
# Try it: two processes, rank r holding [r + 1, r + 1, r + 1].
def try_it(rank, world_size):
    return $slug(torch.full((3,), float(rank + 1)))

run_ranks(try_it, 2, timeout=15)

# %% nbgrader={"grade": true, "grade_id": "test-$grade_id-two-ranks", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): two ranks, each with a tensor of its own: each gets the sum, its tensor unchanged.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import $slug as checks
integrity.assert_untampered()
checks.check_${slug}_two_ranks($slug)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-$grade_id-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) one rank and three ranks, float64, a tensor of one element.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import $slug as hidden
hidden.check_$slug($slug)
print("passed")
### END HIDDEN TESTS
