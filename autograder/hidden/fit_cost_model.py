"""Hidden checks for chapter 10's fit_cost_model and predict_step_time, and the grader's
reference for both (the exercise's answer: it lives only here).

Hidden fit cases: latency-dominated data (the times do not grow with size within the noise: β
is infinite), flat data (exactly constant times: β is infinite, and float paths, the reference's
included, may land at β ≈ 1e25 instead: the tolerance's floor), bandwidth-dominated data (the
unconstrained fit has α < 0), rows unordered and of several dtypes (int8, bfloat16), a sweep
measured twice (rows of one size are separate points), busy-machine outliers, 3 and 8 ranks, too
few rows, bad rows (a negative count, one size spelt in three dtypes, a bad timing among good
ones, a row without timings beside two good sizes).
Hidden step cases: one rank (no all-reduce, not even α), an infinite β, a gradient larger than
the cap, a cap of one byte, a bucket that reaches the cap exactly, a left-over of zero bytes,
every gradient ready at the end, no gradients, bad arguments (each range of the contract).
"""

from __future__ import annotations

import math

from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises.fit_cost_model import (ITEMSIZE, KIB, MIB, ONE_SIZE, SIX, SWEEP,
                                                        STEP_CASES, fit_spec, judge_fits,
                                                        judge_steps, make_measurements,
                                                        observe_fit, observe_steps, step_spec)


def _points(measurements: list[dict]) -> list[tuple[float, float]]:
    """(bytes each rank sends, best seconds) per row, the rows checked."""
    if not isinstance(measurements, list) or not measurements:
        raise ValueError("no measurements")
    points = []
    for row in measurements:
        count, dtype, ranks, times = row["count"], row["dtype"], row["ranks"], row["time_us"]
        if dtype not in ITEMSIZE:
            raise ValueError(f"unknown dtype {dtype!r}")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if not isinstance(ranks, int) or ranks < 2:
            raise ValueError(f"ranks must be >= 2, got {ranks!r}")
        if not times or min(times) <= 0:
            raise ValueError("every row needs at least one positive time")
        points.append((2 * (ranks - 1) / ranks * count * ITEMSIZE[dtype], min(times) * 1e-6))
    if len({x for x, _ in points}) < 2:
        raise ValueError("fitting α and β needs at least two distinct sizes")
    return points


def reference_fit(measurements: list[dict]) -> tuple[float, float]:
    """The contract's fit: minimise Σ((α + s·x − t)/t)² over α >= 0, s >= 0 (s = 1/β) on the best
    time t of each row, x = 2(N−1)/N · count · itemsize; β = 1/s, or inf when s = 0."""
    points = _points(measurements)
    w = [1 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))

    def loss(alpha, slope):
        return sum(((alpha + slope * x - t) / t) ** 2 for x, t in points)

    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    alpha = (st - slope * sx) / sw
    if alpha < 0 or slope <= 0:  # the optimum lies on an edge of α >= 0, s >= 0
        edges = [(0.0, max(0.0, sxt / sxx)), (max(0.0, st / sw), 0.0)]
        alpha, slope = min(edges, key=lambda edge: loss(*edge))
    return alpha, (1 / slope if slope > 0 else math.inf)


def reference_step(kwargs: dict) -> float:
    """The contract's step time: buckets filled in ready order and closed at the cap, each
    all-reduced when its last gradient is ready and the previous all-reduce is done."""
    alpha, beta = kwargs["alpha_s"], kwargs["beta_bytes_per_s"]
    world_size, cap = kwargs["world_size"], kwargs["bucket_cap_bytes"]
    forward, backward, optimizer = kwargs["forward_s"], kwargs["backward_s"], kwargs["optimizer_s"]
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError("world_size must be an int >= 1")
    if alpha < 0 or not beta > 0 or not cap > 0 or min(forward, backward, optimizer) < 0:
        raise ValueError("bad link, cap or times")
    buckets, size, previous = [], 0, 0.0
    for nbytes, ready in kwargs["gradients"]:
        if nbytes < 0 or not previous <= ready <= backward:
            raise ValueError("bad gradient")
        previous = ready
        size += nbytes
        if size >= cap:
            buckets.append((size, ready))
            size = 0
    if size:
        buckets.append((size, previous))
    end = 0.0
    if world_size > 1:
        for nbytes, ready in buckets:
            end = max(ready, end) + alpha + 2 * (world_size - 1) / world_size * nbytes / beta
    return forward + max(backward, end) + optimizer


def reference_fit_of(spec: tuple) -> tuple[float, float]:
    return reference_fit(make_measurements(*spec))


def judge_fits_with_reference(observations, world_size, specs, errors):
    """The visible judge, with the reference fit of each case's rows."""
    judge_fits(reference_fit_of, observations, world_size, specs, errors)


def judge_steps_with_reference(observations, world_size, cases, errors):
    """The visible judge, with the reference step time of each case."""
    judge_steps(reference_step, observations, world_size, cases, errors)


FITS_WITH_REFERENCE = Case(observe_fit, judge_fits_with_reference)
STEPS_WITH_REFERENCE = Case(observe_steps, judge_steps_with_reference)

HIDDEN_FITS = [
    # latency-dominated: 8 B .. 2 KiB at 10 GB/s is under 1% of α: the slope drowns in the noise
    # and comes out negative (β = inf)
    fit_spec(40e-6, 1e10, [8 * 2**k for k in range(9)], repeats=3, noise=0.05, seed=13),
    # bandwidth-dominated, α tiny: the unconstrained fit's α is negative
    fit_spec(1e-9, 1e9, [MIB * 2**k for k in range(8)], ranks=(2,), repeats=2, noise=0.05,
             seed=12),
    # int8 and bfloat16 rows, 3 and 8 ranks, many repeats with outliers
    fit_spec(120e-6, 6e8, SWEEP, ranks=(3, 8), dtypes=("int8", "bfloat16"), repeats=7,
             noise=0.1, seed=13),
    # the rows in a random order
    fit_spec(60e-6, 3e9, SWEEP, repeats=3, noise=0.04, seed=15, shuffled=True),
    # two sizes only, exact
    fit_spec(5e-6, 2e10, [KIB, 64 * MIB], ranks=(2,), repeats=1, noise=0.0, seed=14),
    # flat: exactly constant times (β = ∞). The exact answer is s = 0; float paths land beside
    # it (here the reference gives β ≈ 1.7e25 B/s, torch.linalg.lstsq's path math.inf): the
    # contract's floor accepts both
    fit_spec(7e-6, math.inf, [64 * 4**k for k in range(6)], repeats=1, noise=0.0),
    # the sweep measured twice: rows of one size are two points, not one
    fit_spec(70e-6, 1.5e9, SWEEP, ranks=(2, 2), repeats=3, noise=0.05, seed=16),
]
HIDDEN_FIT_ERRORS = [
    (ONE_SIZE[:1], "a single row"),
    ([{"count": 10, "dtype": "complex32", "ranks": 2, "time_us": [5.0]},
      {"count": 1000, "dtype": "complex32", "ranks": 2, "time_us": [9.0]}], "an unknown dtype"),
    ([{"count": 10, "dtype": "float32", "ranks": 2, "time_us": [5.0]},
      {"count": 1000, "dtype": "float32", "ranks": 2, "time_us": [0.0]}], "a time of 0"),
    # three rows each, so that skipping the bad row or timing still leaves two sizes to fit
    ([{"count": 10, "dtype": "float32", "ranks": 2, "time_us": [5.0]},
      {"count": 1000, "dtype": "float32", "ranks": 2, "time_us": [9.0, 0.0, 8.5]},
      {"count": 100_000, "dtype": "float32", "ranks": 2, "time_us": [260.0]}],
     "a time of 0 among good ones"),
    ([{"count": 10, "dtype": "float32", "ranks": 2, "time_us": [5.0, 5.5]},
      {"count": 1000, "dtype": "float32", "ranks": 2, "time_us": [9.0]},
      {"count": 100_000, "dtype": "float32", "ranks": 2, "time_us": [-3.0, 260.0]}],
     "a negative time among good ones"),
    ([{"count": 10, "dtype": "float32", "ranks": 2, "time_us": [5.0]},
      {"count": 1000, "dtype": "float32", "ranks": 2, "time_us": [9.0]},
      {"count": 100_000, "dtype": "float32", "ranks": 2, "time_us": []}],
     "a row without timings"),
    ([{"count": -256, "dtype": "float32", "ranks": 2, "time_us": [10.0]},
      {"count": 4096, "dtype": "float32", "ranks": 2, "time_us": [20.0]},
      {"count": 65536, "dtype": "float32", "ranks": 2, "time_us": [150.0]}], "a negative count"),
    ([{"count": 1024, "dtype": "float32", "ranks": 2, "time_us": [30.0]},
      {"count": 2048, "dtype": "float16", "ranks": 2, "time_us": [31.0]},
      {"count": 512, "dtype": "float64", "ranks": 2, "time_us": [29.0]}],
     "one size (4 KiB) in three dtypes"),
]

ONE_BIG = [(4_000, 0.001), (3 * MIB, 0.006), (4_000, 0.0065)]
HIDDEN_STEPS = [
    step_spec(50e-6, 1e9, 1, SIX, 500_000, 0.01, 0.02, 0.003),  # one rank: nothing to reduce
    step_spec(50e-6, math.inf, 8, SIX, 500_000, 0.01, 0.02, 0.003),  # only α counts
    step_spec(20e-6, 5e8, 3, ONE_BIG, MIB, 0.004, 0.007, 0.001),  # a gradient above the cap
    step_spec(80e-6, 2e9, 2, SIX, 1, 0.01, 0.02, 0.0),  # cap of 1 byte: a bucket per gradient
    step_spec(50e-6, 1e9, 4, [(b, 0.02) for b, _ in SIX], 500_000, 0.01, 0.02, 0.003),
    step_spec(50e-6, 1e9, 2, [], 500_000, 0.01, 0.02, 0.003),  # nothing to synchronise
    step_spec(0.0, 1e9, 2, [(0, 0.0), (1000, 0.001)], 10, 0.0, 0.001, 0.0),
    # 40 kB + 400 kB reach the 440 kB cap exactly: the bucket closes there (at least the cap)
    step_spec(100e-6, 1e8, 2, SIX, 440_000, 0.01, 0.02, 0.003),
    # what is left at the end holds 0 bytes: no bucket, no α
    step_spec(50e-6, 1e9, 2, [(1000, 0.001), (0, 0.004)], 10, 0.002, 0.004, 0.001),
]
HIDDEN_STEP_ERRORS = [
    ({**STEP_CASES["overlap"], "alpha_s": -1e-6}, "a negative α"),
    ({**STEP_CASES["overlap"], "bucket_cap_bytes": 0}, "a cap of 0"),
    ({**STEP_CASES["overlap"], "gradients": [[1000, 0.5]]}, "ready after backward ended"),
    ({**STEP_CASES["overlap"], "gradients": [[-5, 0.001]]}, "negative bytes"),
    ({**STEP_CASES["overlap"], "forward_s": -0.001}, "a negative time"),
    ({**STEP_CASES["overlap"], "optimizer_s": -0.001}, "a negative optimizer time"),
    ({**STEP_CASES["overlap"], "gradients": [], "backward_s": -0.001},
     "a negative backward time"),
    ({**STEP_CASES["overlap"], "gradients": [[1000, -0.001], [1000, 0.002]]},
     "a ready time before backward began"),
    ({**STEP_CASES["overlap"], "world_size": 2.0}, "a world_size that is not an int"),
]


def _hidden(case, fn, cases, errors):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, 1, fn, cases, errors, init_process_group=False, hide_internals=True)


def check_fit_cost_model(fit_cost_model) -> None:
    __tracebackhide__ = True  # noqa: F841
    _hidden(FITS_WITH_REFERENCE, fit_cost_model, HIDDEN_FITS, HIDDEN_FIT_ERRORS)


def check_predict_step_time(predict_step_time) -> None:
    __tracebackhide__ = True  # noqa: F841
    _hidden(STEPS_WITH_REFERENCE, predict_step_time, HIDDEN_STEPS, HIDDEN_STEP_ERRORS)
