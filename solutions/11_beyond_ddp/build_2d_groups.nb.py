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
# # Exercise 11: the groups of 2-D parallelism
#
# Data parallelism times tensor parallelism: the `world_size` ranks form a grid of
# `world_size // tp_size` rows (one per data-parallel replica) and `tp_size` columns. The ranks of
# a row hold the shards of one model copy and exchange activations (the **tensor-parallel
# group**); the ranks of a column hold the same shard in different replicas and average its
# gradients (the **data-parallel group**). Chapter 11 builds this grid with
# `init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))`; here you build both kinds of
# group yourself with `dist.new_group`.
#
# **How your code runs.** Each test calls your function inside `run_ranks(fn, world_size)`, which
# starts `world_size` processes, joins them in a process group, and calls your function in each.
# Do **not** call `init_process_group` in this notebook.
#
# **Self-check** from the repository root: `pytest exercises/11_beyond_ddp/build_2d_groups.ipynb`
# runs this notebook and reports each visible test. Hidden tests (edge cases) run when the
# notebook is graded.
#
# **Rules.** Keep the function name and signature exactly as given (they are the grading
# contract). Do not reassign library functions: the tests check for it and fail.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import build_2d_groups as checks
from ddpcourse.launcher import run_ranks

setup_notebook("build_2d_groups")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-build-2d-groups", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `build_2d_groups(world_size, tp_size)` (8 points)
#
# Implement it as its docstring says. By default `dist.new_group(ranks)` is a collective of the
# **default** group: every rank must call it, for every group, in the same order, even for the
# groups it is not a member of (it gets a placeholder back for those), because torch names each
# new group by counting these calls. With `dist.new_group(ranks, use_local_synchronization=True)`
# only the group's members call it (the group is named after its ranks); then every rank must
# still create its groups in one global order (all tensor-parallel groups before the
# data-parallel ones, say), or overlapping groups can wait for each other forever. Either way is
# fine: the tests judge the groups you return, not how you called `new_group`.

# %% nbgrader={"grade": false, "grade_id": "build-2d-groups", "locked": false, "schema_version": 3, "solution": true, "task": false}
def build_2d_groups(world_size: int, tp_size: int):
    """This rank's data-parallel and tensor-parallel process groups of a (dp x tp) grid.

    Called on every rank of the default group, with `world_size = dist.get_world_size()`. The
    ranks form `world_size // tp_size` tensor-parallel groups of `tp_size` **contiguous** ranks
    (`[0 .. tp_size-1]`, `[tp_size .. 2*tp_size-1]`, ...) and `tp_size` data-parallel groups, each
    holding the ranks at the same position in every tensor-parallel group (`[0, tp_size,
    2*tp_size, ...]`, `[1, tp_size+1, ...]`, ...). Build them with `dist.new_group` (every rank
    for every group, or only the members with `use_local_synchronization=True`) and return the
    two this rank belongs to. Not with `init_device_mesh` or `DeviceMesh`: that is how the
    lesson builds this very grid, and the exercise is to build it yourself.

    Requirements the tests check (in real process groups of 1 to 4 ranks):

    * each group returned holds exactly the ranks above (`dist.get_process_group_ranks`), and a
      real `all_reduce` over it reaches exactly those ranks;
    * the default group still works afterwards;
    * no code of `torch/distributed/device_mesh.py` (`init_device_mesh`, `DeviceMesh`) runs
      during the call;
    * `tp_size = 1` (pure data parallelism) and `tp_size = world_size` (pure tensor parallelism)
      work; a `tp_size` that is not a positive divisor of `world_size` raises `ValueError` on
      every rank.

    Args:
        world_size: the number of ranks in the default group.
        tp_size: ranks per tensor-parallel group.

    Returns:
        tuple: `(dp_group, tp_group)`, the two `ProcessGroup`s this rank is a member of.
    """
    ### BEGIN SOLUTION
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide world_size={world_size}")
    rank = dist.get_rank()
    dp_group = tp_group = None
    for start in range(0, world_size, tp_size):  # every rank creates every group, same order
        group = dist.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            tp_group = group
    for position in range(tp_size):
        group = dist.new_group(list(range(position, world_size, tp_size)))
        if rank % tp_size == position:
            dp_group = group
    return dp_group, tp_group
    ### END SOLUTION


# %%
# Try it: 4 ranks, tensor-parallel groups of 2; who is in which group?
def try_groups(rank, world_size):
    dp_group, tp_group = build_2d_groups(world_size, 2)
    return {"dp": dist.get_process_group_ranks(dp_group),
            "tp": dist.get_process_group_ranks(tp_group)}

run_ranks(try_groups, 4, timeout=30, backend="gloo")

# %% nbgrader={"grade": true, "grade_id": "test-2x2-grid", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 4 ranks, tp_size 2: members, and an all_reduce over each group.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import build_2d_groups as checks
integrity.assert_untampered()
checks.check_two_by_two(build_2d_groups)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-one-dimension", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 3 ranks, tp_size 1 (data parallel only) and tp_size 3 (tensor parallel only).
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import build_2d_groups as checks
integrity.assert_untampered()
checks.check_one_dimension(build_2d_groups)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-not-a-divisor", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 3 ranks, tp_size 2 raises ValueError on every rank.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import build_2d_groups as checks
integrity.assert_untampered()
checks.check_not_a_divisor(build_2d_groups)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-build-2d-groups-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) 1, 2 and 4 ranks, every tp_size, invalid sizes.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import build_2d_groups as hidden
hidden.check_build_2d_groups(build_2d_groups)
print("passed")
### END HIDDEN TESTS
