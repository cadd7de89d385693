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
# # Exercise 11: pipeline schedules
#
# A pipeline cuts a model into `p` stages, one per rank, and the batch into `m` micro-batches.
# Each rank runs a list of steps: `"F3"` is the forward of micro-batch 3 on this stage, `"B3"`
# its backward. Chapter 11 draws two such schedules, GPipe and 1F1B, from orders written out for a
# few sizes; here you write them for any number of stages and micro-batches.
#
# **How your function is checked.** It is a plain function (no process group), but the tests call
# it in real ranks: every rank asks it for the schedule, then each rank runs its own list with
# `dist.recv` / `dist.isend` on a small pipeline, and the gradients must equal the unsplit
# model's. The tests also place the steps in unit time slots (`ddpcourse.pipeline.timeline`) to
# count the idle slots and the activations each stage holds.
#
# **Self-check** from the repository root: `pytest exercises/11_beyond_ddp/pipeline_schedule.ipynb`
# runs this notebook and reports each visible test. Hidden tests (edge cases) run when the notebook
# is graded.
#
# **Rules.** Keep the function name and signature exactly as given (they are the grading
# contract). Do not reassign library functions: the tests check for it and fail.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import matplotlib.pyplot as plt

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import pipeline_schedule as checks
from ddpcourse.pipeline import bubble, draw, timeline

setup_notebook("pipeline_schedule")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-pipeline-schedule", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `pipeline_schedule(num_stages, num_microbatches, kind)` (12 points)
#
# Implement it as its docstring says. Draw the timelines before you write code: with one time
# slot per step, stage `s` can run the forward of micro-batch `i` only after stage `s-1` did, and
# its backward only after stage `s+1` did its backward (the last stage: after its own forward).
#
# Hint for 1F1B: stage `s` first runs enough forwards to fill the pipe behind it (`p - 1 - s`,
# but never more than `m`); from then on it runs one forward and one backward in turn, and it
# ends with the backwards left.

# %% nbgrader={"grade": false, "grade_id": "pipeline-schedule", "locked": false, "schema_version": 3, "solution": true, "task": false}
def pipeline_schedule(num_stages: int, num_microbatches: int, kind: str) -> list[list[str]]:
    """Each stage's order of forward and backward steps for a GPipe or 1F1B pipeline.

    Stage `s` runs on rank `s`. A step is `"F<i>"` (the forward of micro-batch `i`, `0 <= i < m`)
    or `"B<i>"` (its backward). Return one list per stage, `num_stages` lists, each holding every
    `F<i>` and `B<i>` exactly once, in the order that stage runs them.

    * `kind="gpipe"`: every stage runs all `m` forwards, then all `m` backwards, each in
      micro-batch order (`F0 F1 ... B0 B1 ...`). Each stage holds the activations of all `m`
      micro-batches at the end of the forwards.
    * `kind="1f1b"` (PipeDream-Flush): stage `s` runs `min(p - 1 - s, m)` warm-up forwards, then
      alternates one forward and one backward (oldest micro-batch first), then runs the
      backwards left. Stage `s` never holds more than `min(p - s, m)` micro-batches at once.

    Requirements the tests check (`p` stages, `m` micro-batches):

    * dependencies: run for real with send/recv (a forward receives from stage `s-1`, a backward
      from stage `s+1`), no stage waits forever, and the gradients equal the unsplit model's;
    * bubble: with every step one time slot and messages free, the schedule lasts
      `2(m + p - 1)` slots, an idle share (bubble) of `(p-1)/(m+p-1)`, for both kinds;
    * activations held: as above for each kind;
    * `p = 1`, `m = 1` and `m < p` work; an unknown `kind` (the two are lower case), or
      `num_stages < 1` or `num_microbatches < 1`, raises `ValueError`.

    Args:
        num_stages: `p`, the number of stages (ranks).
        num_microbatches: `m`, the number of micro-batches per step.
        kind: `"gpipe"` or `"1f1b"`.

    Returns:
        list[list[str]]: `result[s]` is stage `s`'s steps in order.
    """
    ### BEGIN SOLUTION
    if kind not in ("gpipe", "1f1b"):
        raise ValueError(f"kind must be 'gpipe' or '1f1b', not {kind!r}")
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError("a pipeline needs at least one stage and one micro-batch")
    forwards = [f"F{i}" for i in range(num_microbatches)]
    backwards = [f"B{i}" for i in range(num_microbatches)]
    if kind == "gpipe":
        return [forwards + backwards for _ in range(num_stages)]
    order = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_microbatches)
        steps = forwards[:warmup]
        for i in range(num_microbatches - warmup):  # steady state: one forward, one backward
            steps += [forwards[warmup + i], backwards[i]]
        steps += backwards[num_microbatches - warmup:]
        order.append(steps)
    return order
    ### END SOLUTION


# %%
# Try it: your 1F1B for 3 stages and 5 micro-batches, drawn one time slot per step.
order = pipeline_schedule(3, 5, "1f1b")
print(order)
slots = timeline(order)
fig, ax = plt.subplots(figsize=(9, 2))
draw(slots, f"1f1b, p=3, m=5: {bubble(slots)}", ax)

# %% nbgrader={"grade": true, "grade_id": "test-gpipe", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): GPipe, 3 stages and 5 micro-batches run on 3 ranks; 2 stages and 3.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import pipeline_schedule as checks
integrity.assert_untampered()
checks.check_gpipe(pipeline_schedule)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-1f1b", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
# Test (4 points): 1F1B, 3 stages and 5 micro-batches run on 3 ranks; 4 stages and 2.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import pipeline_schedule as checks
integrity.assert_untampered()
checks.check_1f1b(pipeline_schedule)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-unknown-kind", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): an unknown kind raises ValueError.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import pipeline_schedule as checks
integrity.assert_untampered()
checks.check_refuses_unknown_kind(pipeline_schedule)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-pipeline-schedule-hidden", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (4 points) 1, 2 and 4 ranks; one stage, one micro-batch, fewer micro-batches than stages, many
# more; invalid kinds and counts.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import pipeline_schedule as hidden
hidden.check_pipeline_schedule(pipeline_schedule)
print("passed")
### END HIDDEN TESTS
