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
# # Exercise 02: what does each rank hold? DDP vs FSDP2, byte by byte
#
# Chapter 02 measured, tensor by tensor, what every rank holds after one Adam step
# (`chapters/02_dp_ddp_fsdp/memory_per_rank.py`). The source article claims that under DDP each
# card stores only "its own share" and no full copy of the gradients; the chapter's table shows the
# opposite: every DDP rank holds everything, and holding less is what FSDP is for.
#
# Here you turn that table into a **prediction from the model's parameters alone**, exact to the
# byte. The tests then train the same model for real, in 1 to 4 ranks of a gloo process group,
# under DDP and under FSDP2, count what each rank holds, and compare with your numbers.
#
# **Self-check** from the repository root: `pytest exercises/02_dp_ddp_fsdp`.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import math

import torch
from torch import nn

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import memory_per_rank as checks
from ddpcourse.launcher import run_ranks

setup_notebook("memory_per_rank")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-bytes-per-rank", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `bytes_per_rank(model, world_size, rank, strategy) -> dict` (7 points)
#
# Chapter 02's table, as a function: implement `bytes_per_rank` as its docstring below says. It
# spells out what each strategy keeps on a rank, how FSDP2 splits a parameter, what counts as a
# parameter's gradient and Adam state, and what raises `ValueError`.
#
# Where the facts come from (PyTorch v2.13.0): FSDP2 chunks each parameter with
# [`torch.chunk` padded with empty chunks](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/fsdp/_fully_shard/_fsdp_common.py#L134-L140)
# and keeps [chunk `rank`, in a padded buffer](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/fsdp/_fully_shard/_fsdp_param.py#L298-L325);
# Adam creates [`step` as `torch.tensor(0.0)` on the CPU and `exp_avg` / `exp_avg_sq` with
# `zeros_like(p)`](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/optim/adam.py#L169-L184),
# so the moments follow the local shard, and `step` is float32 unless torch's default dtype is
# float64 ([`_get_scalar_dtype`](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/optim/optimizer.py#L210-L215)).
# The tests measure all of it again on every run.

# %% nbgrader={"grade": false, "grade_id": "bytes-per-rank", "locked": false, "schema_version": 3, "solution": true, "task": false}
def bytes_per_rank(model: nn.Module, world_size: int, rank: int, strategy: str) -> dict[str, int]:
    """Bytes of parameters, gradients and Adam state rank `rank` holds after one Adam step.

    The bytes that rank `rank` of a job of `world_size` ranks holds after one `torch.optim.Adam`
    step (default settings, on the CPU) when `model` is trained under `strategy`:

    * `"ddp"`: `DistributedDataParallel(model)`. Every rank holds the full parameters, the full
      gradients and the full Adam state. DDP's gradient bucket buffers are not counted here
      (chapter 02 shows them: by default as large as the gradients).
    * `"fsdp"`: FSDP2, `fully_shard(layer)` on every layer that has parameters, then
      `fully_shard(model)`, as chapter 02 does. Every parameter is split along dim 0 like
      `torch.chunk(p, world_size, dim=0)`; rank `r` holds chunk `r`, and an empty shard when there
      are fewer chunks than ranks. For example 7 rows over 3 ranks are 3 + 3 + 1 rows; 2 rows over
      3 ranks are 1 + 1 + 0; 5 rows over 4 ranks are 2 + 2 + 1 + 0 (`torch.chunk` gives only
      3 chunks). A shard of a `(rows, cols)` weight has `shard_rows * cols` elements.

    What counts, for each parameter `p` (bytes = elements x `p.element_size()`):

    * `params`: every parameter, also those with `requires_grad=False` (FSDP2 shards them too).
    * `grads`: the gradient of every parameter with `requires_grad=True`: as large as the parameter
      (DDP) or as its shard (FSDP2). Frozen parameters get no gradient.
    * `adam_state`: for every parameter that got a gradient, Adam keeps `exp_avg` and `exp_avg_sq`,
      each as large as the parameter (DDP) or its shard (FSDP2), plus a `step` counter: a 0-d
      float32 tensor of 4 bytes, one per parameter, whatever the parameter's dtype and also for a
      rank whose shard is empty. Frozen parameters get no Adam state.

    Under FSDP2 a DTensor's local shard is what the rank owns: `p.to_local()`. FSDP2 stores it in a
    buffer padded to `ceil(rows / world_size)` rows; that padding is not counted (the tests count
    `p.to_local().numel() * p.element_size()`, and the same for gradients and Adam's tensors).

    Use only the model's parameters (shapes, dtypes, `requires_grad`): no process group exists when
    the tests call this function.

    Args:
        model: the model to be trained; only its parameters are read.
        world_size: the number of ranks of the job.
        rank: the rank whose bytes to return, in `[0, world_size)`.
        strategy: `"ddp"` or `"fsdp"`.

    Returns:
        `{"params": int, "grads": int, "adam_state": int}`. Values are Python `int`s and must match
        the measurement exactly (bytes are integers, no tolerance).

    Raises:
        ValueError: for a `strategy` other than `"ddp"` / `"fsdp"` and for a `rank` outside
            `[0, world_size)`.
    """
    ### BEGIN SOLUTION
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"unknown strategy {strategy!r}: use 'ddp' or 'fsdp'")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    step_bytes = 4  # Adam's step counter: a 0-d float32 tensor per parameter
    held = {"params": 0, "grads": 0, "adam_state": 0}
    for p in model.parameters():
        numel = p.numel()
        if strategy == "fsdp":  # torch.chunk along dim 0: ceil(rows / N) rows, the last ones fewer
            rows = p.shape[0]
            per_chunk = math.ceil(rows / world_size)
            mine = max(0, min(per_chunk, rows - rank * per_chunk))
            numel = mine * (numel // rows)
        nbytes = numel * p.element_size()
        held["params"] += nbytes
        if p.requires_grad:
            held["grads"] += nbytes
            held["adam_state"] += 2 * nbytes + step_bytes
    return held
    ### END SOLUTION


# %%
# Try it: your prediction for every rank of 3, for a model whose rows do not divide by 3.
model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 2))
for strategy in ("ddp", "fsdp"):
    for rank in range(3):
        print(strategy, rank, bytes_per_rank(model, 3, rank, strategy))

# %% nbgrader={"grade": true, "grade_id": "test-bytes-per-rank-even-model", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks train Linear(8, 16), Linear(16, 8), Linear(8, 4) one Adam step under DDP and under FSDP2; what each rank holds is measured.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import memory_per_rank as checks
integrity.assert_untampered()
checks.check_bytes_per_rank_even_model(bytes_per_rank)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-bytes-per-rank-bad-arguments", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): an unknown strategy and ranks outside [0, world_size) raise ValueError.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import memory_per_rank as checks
integrity.assert_untampered()
checks.check_bytes_per_rank_rejects_bad_arguments(bytes_per_rank)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-bytes-per-rank-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 1, 3 and 4 ranks, rows that do not divide, float64, frozen parameters, a bias smaller than the world size, more bad arguments.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import memory_per_rank as hidden
hidden.check_bytes_per_rank(bytes_per_rank)
print("passed")
### END HIDDEN TESTS
