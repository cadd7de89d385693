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
# # Exercise 10: a cost model that predicts
#
# Chapter 10 fits the α–β model of one all-reduce, `t = α + 2(N−1)/N · bytes / β`, to a
# bandwidth sweep, and predicts a DDP step from it. Here you write both halves yourself, as a
# practitioner does with the numbers of a new cluster: `fit_cost_model` turns nccl-tests-style
# measurements into α and β, and `predict_step_time` turns α, β and a profile of one backward
# pass (when each gradient became ready) into the time of a step.
#
# Neither is in the course's package: `ddpcourse.cost_model.step_time` assumes that gradients
# arrive at a steady rate in bytes, where you are given each gradient's measured ready time; and
# there is no fit in it.
#
# **How your code runs.** Each test calls your functions in a fresh process (no process group:
# they are arithmetic) on generated data whose α and β the test knows, with noise, and compares
# what they return with the contract's answer. Nothing is timed.
#
# **Self-check** from the repository root: `pytest exercises/10_performance/fit_cost_model.ipynb`.
# Hidden tests (latency-dominated data, more dtypes and world sizes, one rank, an infinite
# bandwidth, bad arguments) run when the notebook is graded. Keep the function names and
# signatures exactly as given.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import math

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import fit_cost_model as checks

setup_notebook("fit_cost_model")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-fit", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 1. `fit_cost_model(measurements) -> (alpha_s, beta_bytes_per_s)` (5 points)
#
# Each measurement is one row of a bandwidth sweep, as nccl-tests prints it: `count` elements of
# `dtype` all-reduced over `ranks` processes, timed several times (`time_us`, microseconds).
# Three things a careless fit gets wrong:
#
# * **units**: `count` is elements, not bytes (a float16 element is 2 bytes, a float64 one 8), and
#   the times are microseconds while α is in seconds;
# * **noise**: a busy machine only ever *adds* time, so the fastest repeat of a row is the best
#   estimate of what the network costs; a mean drags in the interference;
# * **scale**: the times span four orders of magnitude (1 KiB to 256 MiB), so an ordinary least
#   squares lets the largest messages decide α alone. Weigh each point by its relative error.
#
# And two edge cases: with one message size only, α and β cannot both be told apart; with
# latency-dominated data (tiny messages) the times need not grow with the size at all, and β is
# then infinite (the data show no bandwidth limit), never negative.
#
# `chapters/10_performance/allreduce_bandwidth.py` measures such a sweep on your machine (in
# bytes and seconds); `ITEMSIZE` below gives the bytes per element of each dtype name.

# %% nbgrader={"grade": false, "grade_id": "fit-cost-model", "locked": false, "schema_version": 3, "solution": true, "task": false}
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def fit_cost_model(measurements: list[dict]) -> tuple[float, float]:
    """Fit α (seconds per call) and β (bus bandwidth, bytes/s) of `t = α + 2(N−1)/N · n / β`.

    Each measurement is a dict `{"count": int, "dtype": str, "ranks": int, "time_us": [float,
    ...]}`: an all-reduce of `count` elements of `dtype` (one of "float64", "float32",
    "bfloat16", "float16", "int8": 8, 4, 2, 2, 1 bytes) over `ranks` processes, timed once per
    entry of `time_us`, in microseconds. The rows may come in any order.

    The fit, exactly. It has one answer `(α*, β*)`, and the tests allow float rounding only:
    `|α − α*| <= 1e-6·α* + 1e-12 s`, and `β > 0` with `|1/β − 1/β*| <= 1e-6/β* + 1e-18 s/B`
    (`1/β` is 0 for `β = math.inf`: where `β*` is infinite, `math.inf` or any `β >= 1e18` B/s
    passes, since rounding can leave a tiny slope where the exact one is 0).

    * each row gives one point, rows of the same size included: `x = 2(N−1)/N · count ·
      itemsize` (bytes each rank sends, N = ranks) and `t` = the SMALLEST of its `time_us`, in
      seconds;
    * minimise `Σ ((α + s·x − t) / t)²` (least squares on the relative error) over `α >= 0` and
      `s >= 0`; `β = 1/s`, or `math.inf` when `s == 0` (latency-dominated data: the times do not
      grow with the size). When the unconstrained minimum has `α < 0` or `s <= 0`, the
      constrained one lies on an edge: `α = 0` (best `s >= 0`) or `s = 0` (best `α >= 0`),
      whichever leaves the smaller sum.

    Args:
        measurements: the rows, not modified (neither the list, nor a row, nor its `time_us`).

    Returns:
        `(alpha_s, beta_bytes_per_s)`, two floats.

    Raises:
        ValueError: no rows; a row with `ranks < 2`, a negative `count`, an unknown `dtype`, no
            timings or a timing `<= 0` (even beside good ones: never skipped); fewer than two
            distinct `x` (one size only, in bytes: 1024 float32 and 2048 float16 elements are
            one size).
    """
    ### BEGIN SOLUTION
    if not measurements:
        raise ValueError("no measurements")
    points = []
    for row in measurements:
        count, dtype, ranks, times = row["count"], row["dtype"], row["ranks"], row["time_us"]
        if dtype not in ITEMSIZE:
            raise ValueError(f"unknown dtype {dtype!r}")
        if count < 0 or ranks < 2:
            raise ValueError(f"count must be >= 0 and ranks >= 2: {row}")
        if not times or min(times) <= 0:
            raise ValueError(f"a row needs positive timings: {row}")
        points.append((2 * (ranks - 1) / ranks * count * ITEMSIZE[dtype], min(times) * 1e-6))
    if len({x for x, _ in points}) < 2:
        raise ValueError("one message size only: α and β cannot both be fitted")

    w = [1 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))

    def loss(alpha, s):
        return sum(((alpha + s * x - t) / t) ** 2 for x, t in points)

    s = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    alpha = (st - s * sx) / sw
    if alpha < 0 or s <= 0:
        alpha, s = min([(0.0, max(0.0, sxt / sxx)), (max(0.0, st / sw), 0.0)],
                       key=lambda edge: loss(*edge))
    return alpha, (1 / s if s > 0 else math.inf)
    ### END SOLUTION


# %%
# Try it: rows generated with α = 50 µs and β = 2 GB/s, five noisy repeats each.
rows = checks.make_measurements(50e-6, 2e9, [1024 * 4**k for k in range(10)], [2, 4],
                                ["float32"], 5, 0.03, 0)
print(rows[0])
print(fit_cost_model(rows))

# %% nbgrader={"grade": true, "grade_id": "test-fit-exact", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): exact timings give back α and β; one size only, no rows, one rank: ValueError.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import fit_cost_model as checks
integrity.assert_untampered()
checks.check_fit_exact_data(fit_cost_model)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-fit-noisy", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): noisy repeats (2 and 4 ranks) and rows of float16 / float64 / float32.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import fit_cost_model as checks
integrity.assert_untampered()
checks.check_fit_noisy_repeats(fit_cost_model)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-fit-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) latency-dominated, flat and bandwidth-dominated data, int8 / bfloat16, 3 and 8
# ranks, shuffled rows, a sweep measured twice, two sizes only, bad rows.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import fit_cost_model as hidden
hidden.check_fit_cost_model(fit_cost_model)
print("passed")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-predict", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 2. `predict_step_time(...)` (5 points)
#
# A profile of one backward pass tells you, for each gradient, its size and when it was ready
# (the last layer's first). DDP groups the gradients into buckets in that order and all-reduces a
# bucket as soon as its last gradient is ready — one all-reduce at a time (one communication
# stream), so a bucket also waits for the previous one. Communication that ends before backward
# does is hidden; what sticks out is added to the step. Write the timeline as the docstring says.
#
# Hint: keep two clocks, the time the current bucket is ready and the time the link becomes
# free; an all-reduce starts at the later of the two.

# %% nbgrader={"grade": false, "grade_id": "predict-step-time", "locked": false, "schema_version": 3, "solution": true, "task": false}
def predict_step_time(alpha_s: float, beta_bytes_per_s: float, world_size: int,
                      gradients: list, bucket_cap_bytes: int, forward_s: float,
                      backward_s: float, optimizer_s: float) -> float:
    """Predict the seconds of one DDP step from the α–β model and a profile of backward.

    * `gradients`: `[(nbytes, ready_s), ...]` in the order backward produces them; `ready_s` is
      when that gradient is ready, in seconds from the start of backward, non-decreasing, within
      `[0, backward_s]`.
    * Buckets (DDP's rule, with an explicit `bucket_cap_mb`): go through the gradients in that
      order, adding each to the open bucket; close the bucket as soon as it holds at least
      `bucket_cap_bytes` (reaching the cap exactly closes it; a gradient is never split: one
      larger than the cap fills a bucket by itself, or with what came before it). What is left at
      the end is the last bucket, if it holds any bytes (a left-over of zero-byte gradients is no
      bucket: nothing to all-reduce). A bucket is ready when its last gradient is.
    * All-reduces run one at a time, in bucket order: each starts when its bucket is ready AND
      the previous all-reduce has ended, and lasts `alpha_s + 2(N−1)/N · bucket bytes /
      beta_bytes_per_s` (N = `world_size`; `beta_bytes_per_s` may be `math.inf`: then `alpha_s`
      alone). One rank makes no all-reduce at all (not even α).
    * The step: `forward_s + max(backward_s, end of the last all-reduce) + optimizer_s`.

    Args:
        alpha_s, beta_bytes_per_s: the link (`alpha_s >= 0`, `beta_bytes_per_s > 0`).
        world_size: ranks, an int >= 1.
        gradients: the profile, as above (possibly empty).
        bucket_cap_bytes: the cap, > 0.
        forward_s, backward_s, optimizer_s: one rank's measured times, >= 0.

    Returns:
        The step's seconds, a float (the tests allow rounding: 1e-9 relative, or 1e-12 s).

    Raises:
        ValueError: any argument outside the ranges above (negative bytes, a ready time before
            the previous one or outside `[0, backward_s]`, ...).
    """
    ### BEGIN SOLUTION
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if alpha_s < 0 or not beta_bytes_per_s > 0 or not bucket_cap_bytes > 0:
        raise ValueError("alpha_s must be >= 0, beta_bytes_per_s and bucket_cap_bytes > 0")
    if min(forward_s, backward_s, optimizer_s) < 0:
        raise ValueError("times must be >= 0")
    buckets, size, last_ready = [], 0, 0.0
    for nbytes, ready in gradients:
        if nbytes < 0 or not last_ready <= ready <= backward_s:
            raise ValueError(f"bad gradient ({nbytes}, {ready}): bytes >= 0, ready times "
                             "non-decreasing within [0, backward_s]")
        last_ready = ready
        size += nbytes
        if size >= bucket_cap_bytes:
            buckets.append((size, ready))
            size = 0
    if size:
        buckets.append((size, last_ready))
    link_free = 0.0
    if world_size > 1:
        factor = 2 * (world_size - 1) / world_size
        for nbytes, ready in buckets:
            link_free = max(ready, link_free) + alpha_s + factor * nbytes / beta_bytes_per_s
    return forward_s + max(backward_s, link_free) + optimizer_s
    ### END SOLUTION


# %%
# Try it: six gradients (bytes, ready after s), 2 ranks at 1 GB/s, buckets of 500 kB.
profile = [(40_000, 0.002), (400_000, 0.004), (4_000, 0.0045), (400_000, 0.008),
           (4_000, 0.0085), (1_600_000, 0.02)]
for cap in (1, 500_000, 25 * 2**20):
    print(cap, predict_step_time(50e-6, 1e9, 2, profile, cap, 0.01, 0.02, 0.003))

# %% nbgrader={"grade": true, "grade_id": "test-predict-step-time", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): overlap with backward, all-reduces queued on a slow link, one bucket; bad
# arguments raise ValueError.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import fit_cost_model as checks
integrity.assert_untampered()
checks.check_predict_step_time(predict_step_time)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-predict-step-time-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) one rank, an infinite β, a gradient above the cap, a cap of one byte, a bucket at
# the cap exactly, a zero-byte left-over, every gradient ready at the end, no gradients, bad
# arguments.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import fit_cost_model as hidden
hidden.check_predict_step_time(predict_step_time)
print("passed")
### END HIDDEN TESTS
