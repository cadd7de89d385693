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
# # Exercise 10: tune this job
#
# A colleague's DDP training function, `slow_job` below, trains the right model: its numerics
# are fine. Its communication is not. You write `tune_this_job`, the same training with the
# knobs of chapter 10 set right, and the tests hold it to a **communication budget**: the
# all-reduces per optimizer step, counted call by call and byte by byte. Nothing is timed: bytes
# and calls are the same on every machine, and they are what the knobs change.
#
# **How your code runs.** Each test calls your function in every rank of a real process group
# (gloo, CPU, 1 to 4 ranks) with a model (each rank's built from a different seed), this rank's
# micro-batches, `accumulation_steps` and a learning rate. Your function wraps the model in
# `DistributedDataParallel` itself: the constructor's arguments are part of the tuning. The
# tests count every collective your ranks make, on any process group — when the class is graded,
# by the grader's relay between the ranks, which your code cannot bypass — and compare the
# trained weights with what the slow job computes (within 1e-5: float32 sums in another order
# differ in the last bits).
#
# **Self-check** from the repository root: `pytest exercises/10_performance/tune_this_job.ipynb`.
# Hidden tests (1 and 4 ranks, a frozen parameter, data no rank can guess, edge cases) run when
# the notebook is graded. Keep the function name and signature exactly as given, and do not
# reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import tune_this_job as checks

setup_notebook("tune_this_job")


# %% [markdown] nbgrader={"grade": false, "grade_id": "slow-job-text", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## The slow job
#
# Read it, run the cell after it, and find what it sends. Chapter 10 covers each knob:
# section 2 (buckets, and what an explicit `bucket_cap_mb` does), the `no_sync` and
# `find_unused_parameters` paragraphs (`ddp_knobs.py`: bytes and calls per optimizer step), and
# chapter 07 (DDP's reducer all-reduces a map of the used parameters on every synchronised
# backward when `find_unused_parameters=True`).

# %% nbgrader={"grade": false, "grade_id": "slow-job", "locked": true, "schema_version": 3, "solution": false, "task": false}
def slow_job(model: nn.Module, micro_batches: list, accumulation_steps: int, lr: float) -> None:
    """Train `model` with DDP and SGD, accumulating gradients over `accumulation_steps`
    micro-batches per optimizer step (the last group may be shorter). Correct, but slow."""
    ddp_model = DDP(model, bucket_cap_mb=0.0001, find_unused_parameters=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for start in range(0, len(micro_batches), accumulation_steps):
        group = micro_batches[start:start + accumulation_steps]
        for inputs, targets in group:
            loss = nn.functional.mse_loss(ddp_model(inputs), targets) / len(group)
            loss.backward()
            logged = loss.detach() * len(group)
            dist.all_reduce(logged)  # the global loss, for the log
            logged = logged.item() / dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()


print(checks.count_communication(slow_job))

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-tune", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `tune_this_job(model, micro_batches, accumulation_steps, lr)` (10 points)
#
# Write it as the docstring below says. `checks.count_communication(tune_this_job)` counts what
# your version sends, beside the budget, the way the tests count it.

# %% nbgrader={"grade": false, "grade_id": "tune-this-job", "locked": false, "schema_version": 3, "solution": true, "task": false}
def tune_this_job(model: nn.Module, micro_batches: list, accumulation_steps: int,
                  lr: float) -> None:
    """`slow_job`'s training, with its numerics, within the communication budget.

    Called on every rank of the default process group, each with its own `model` (initial
    values differ between ranks: DDP's constructor copies rank 0's) and its own micro-batches
    (the same number on every rank, all with the same number of rows).

    Numerics: exactly `slow_job`'s. For each group of `accumulation_steps` consecutive
    micro-batches (the last group shorter when the count is not a multiple; no micro-batches: no
    step), ONE plain SGD step (`lr`, no momentum) on the gradient of the MSE loss averaged over
    the group's micro-batches and over all ranks. Train `model` itself, in place (wrap it in
    `DistributedDataParallel`, whose constructor copies rank 0's initial values to every rank;
    the tests read `model`'s parameters afterwards). Which code all-reduces the gradients is
    yours to choose: DDP's reducer with its knobs set right, or an all-reduce of your own (say,
    of one flattened gradient, after backwards under `no_sync()`): the tests count what is sent,
    not who sends it.

    The budget, counted over the whole call by the tests, on every process group (the default
    one and any you create: a group of your own is communication too):

    * the all-reduces carry exactly the model's trainable gradient bytes ONCE per optimizer step
      (every gradient element once; with one rank, at most that) and nothing else: no logged
      loss, nothing DDP sends only because of a constructor argument this model does not need;
    * at most `max(1, ceil(gradient bytes / 1 MiB))` all-reduce calls per optimizer step;
    * no collective besides all-reduces, except what DDP does for its own setup (an all-gather
      that checks the parameters' shapes, broadcasts of rank 0's parameters and, after the
      first step, of the rebuilt buckets' order): at most 6 such calls, and at most the model's
      parameter bytes + 1 KiB.

    Args:
        model: this rank's model: every parameter takes part in every forward, and it has no
            buffers (DDP would broadcast buffers before every synchronised forward, which this
            budget does not allow for).
        micro_batches: this rank's list of `(inputs, targets)` pairs.
        accumulation_steps: micro-batches per optimizer step, an int >= 1.
        lr: SGD's learning rate.

    Returns:
        None: `model` is trained in place.

    Raises:
        ValueError: `accumulation_steps` is less than 1 (raised first: before `model` changes
            or anything is sent).
    """
    ### BEGIN SOLUTION
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, not {accumulation_steps}")
    ddp_model = DDP(model)  # default buckets; every parameter is used: no unused-parameter search
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for start in range(0, len(micro_batches), accumulation_steps):
        group = micro_batches[start:start + accumulation_steps]
        for position, (inputs, targets) in enumerate(group):
            last = position == len(group) - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                loss = nn.functional.mse_loss(ddp_model(inputs), targets) / len(group)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ### END SOLUTION


# %%
# Try it: what your version sends, beside the budget.
print(checks.count_communication(tune_this_job))

# %% nbgrader={"grade": true, "grade_id": "test-job-within-budget", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, 6 micro-batches in groups of 3: the budget, and the weights.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import tune_this_job as checks
integrity.assert_untampered()
checks.check_job_within_budget(tune_this_job)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-job-numerics", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, groups of 2, and a short last group.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import tune_this_job as checks
integrity.assert_untampered()
checks.check_job_numerics_unchanged(tune_this_job)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-job-without-accumulation", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 3 ranks, one micro-batch per step, and one group of all micro-batches.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import tune_this_job as checks
integrity.assert_untampered()
checks.check_job_without_accumulation(tune_this_job)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-job-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 1, 3 and 4 ranks, a frozen bias, data drawn at random on each rank, more
# accumulation steps than micro-batches, no micro-batches, accumulation_steps < 1.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import tune_this_job as hidden
hidden.check_tune_this_job(tune_this_job)
print("passed")
### END HIDDEN TESTS
