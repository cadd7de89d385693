"""Chapter 10, a cost model that predicts: visible checks for ``fit_cost_model`` and
``predict_step_time``, and the cases the hidden checks reuse.

The contract is the docstrings of ``fit_cost_model`` and ``predict_step_time`` in
solutions/10_performance/fit_cost_model.nb.py (students:
exercises/10_performance/fit_cost_model.ipynb).

Both functions are plain arithmetic, so each case runs them in one fresh process without a
process group (:class:`~ddpcourse.grading.checks.Case` with ``init_process_group=False``): the
rank builds the inputs from the case's arguments (:func:`make_measurements`, generated data with
known α and β, noise included), calls the student's function on its own copy and reports what
came back (or what it raised) as data. The judge never runs the student's code.

What this module does NOT hold is the answer: no fit and no step timeline. The visible judges
compare with values written out for the visible cases only (:data:`VISIBLE_FITS`,
:data:`VISIBLE_STEPS`: literals, held to the grader's reference by
tests/test_grading_fit_cost_model.py); the hidden checks judge their own cases with the
reference in autograder/hidden/fit_cost_model.py. ``ddpcourse.cost_model`` does not solve either
contract: its ``step_time`` assumes gradients arrive at a steady rate in bytes, where
``predict_step_time`` is given each gradient's measured ready time, and the package has no fit.
"""

from __future__ import annotations

import copy
import math
import random
from pathlib import Path
from typing import Any, Callable

from ddpcourse.grading.checks import Case, CheckFailed, judge_each_rank, observed, run_student
from ddpcourse.grading.forbidden import call_watching
from ddpcourse.grading.left_unchanged import identical

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# The fit's tolerance, as the contract states it: |got − want| <= FIT_RTOL·|want| + a floor, for α
# (seconds) and for s = 1/β (seconds per byte, 0 where β is infinite). The contract's least
# squares has one answer; float paths differ in the last bits, and where the answer sits on an
# edge (α = 0, or s = 0: β = ∞) they land beside it: α ≈ 1e-21 s, or s ≈ ±1e-24 s/B (β ≈ 1e24
# B/s) on flat data. The floors are far below every quantity of the cases (times >= 5 µs, s >=
# 5e-11 s/B) and far above those rounding errors.
FIT_RTOL = 1e-6
ALPHA_FLOOR_S = 1e-12
SLOPE_FLOOR_S_PER_BYTE = 1e-18  # where β is ∞: any β >= 1e18 B/s, or math.inf
STEP_RTOL, STEP_ATOL = 1e-9, 1e-12
_MAX_TEXT = 300  # of a text a rank reports, in a message


def _text(value: Any, limit: int = _MAX_TEXT) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- the inputs: generated measurements with known parameters -----------------------------------


def make_measurements(alpha_s: float, beta_bytes_per_s: float, sizes: list[int],
                      ranks: list[int], dtypes: list[str], repeats: int, noise: float,
                      seed: int, shuffled: bool = False) -> list[dict]:
    """nccl-tests-style rows, one per (size, ranks): ``count`` elements of ``dtype`` (the dtypes
    taken in turn), ``ranks``, and ``time_us``: ``repeats`` timings in microseconds of
    ``α + 2(N−1)/N · bytes / β``, each slowed by ``1 + noise·|gauss|`` and, one repeat in five, by
    a busy machine (×1.5 to ×4): interference only ever adds time. ``shuffled``: the rows in a
    random order (a fit must not rely on sorted rows)."""
    rng = random.Random(seed)
    rows = []
    turn = 0
    for n_ranks in ranks:
        for size in sizes:
            dtype = dtypes[turn % len(dtypes)]
            turn += 1
            count = size // ITEMSIZE[dtype]
            nbytes = count * ITEMSIZE[dtype]
            true_s = alpha_s + 2 * (n_ranks - 1) / n_ranks * nbytes / beta_bytes_per_s
            times = []
            for _ in range(repeats):
                slow = 1 + noise * abs(rng.gauss(0, 1))
                if repeats > 1 and rng.random() < 0.2:
                    slow *= rng.uniform(1.5, 4.0)
                times.append(true_s * slow * 1e6)
            rows.append({"count": count, "dtype": dtype, "ranks": n_ranks, "time_us": times})
    if shuffled:
        rng.shuffle(rows)
    return rows


def fit_spec(alpha_s, beta, sizes, ranks=(2, 4), dtypes=("float32",), repeats=5, noise=0.05,
             seed=0, shuffled=False) -> tuple:
    """A fit case as plain data (the rank rebuilds the rows with :func:`make_measurements`)."""
    return (alpha_s, beta, list(sizes), list(ranks), list(dtypes), repeats, noise, seed,
            shuffled)


KIB, MIB = 1024, 1024 * 1024
SWEEP = [KIB * 4**k for k in range(10)]  # 1 KiB .. 256 MiB, as chapter 10's benchmark

# The visible fit cases, by name.
FIT_CASES = {
    # exact timings, one repeat: the fit must give back the parameters themselves
    "exact": fit_spec(50e-6, 2e9, SWEEP, ranks=(2,), repeats=1, noise=0.0),
    # five noisy repeats per point, 2 and 4 ranks: the best of the repeats, weighted fit
    "noisy repeats": fit_spec(80e-6, 2.5e9, SWEEP, repeats=5, noise=0.03, seed=1),
    # float16 and float64 rows: a size is count × the dtype's bytes
    "mixed dtypes": fit_spec(30e-6, 4e9, SWEEP[::2], ranks=(2, 3, 4),
                             dtypes=("float16", "float64", "float32"), repeats=3, noise=0.02,
                             seed=2),
}

# What the contract's fit gives for each visible case: (alpha_s, beta_bytes_per_s). Written out
# (the visible checks hold no fit); tests/test_grading_fit_cost_model.py holds them to the
# reference of autograder/hidden/fit_cost_model.py.
VISIBLE_FITS: dict[str, tuple[float, float]] = {
    "exact": (5.0000000000000016e-05, 1999999999.9999998),
    "noisy repeats": (8.039628542217719e-05, 2482218362.7314963),
    "mixed dtypes": (2.9925666297110265e-05, 3811091212.3396435),
}

# Rows that break the contract's preconditions: each must raise ValueError.
ONE_SIZE = [{"count": 1024, "dtype": "float32", "ranks": 2, "time_us": [90.0, 95.0]},
            {"count": 1024, "dtype": "float32", "ranks": 2, "time_us": [88.0]}]
VISIBLE_FIT_ERRORS = [
    (ONE_SIZE, "one message size only: α and β cannot both be told"),
    ([], "no measurements"),
    ([{"count": 256, "dtype": "float32", "ranks": 1, "time_us": [10.0]},
      {"count": 4096, "dtype": "float32", "ranks": 2, "time_us": [20.0]},
      {"count": 65536, "dtype": "float32", "ranks": 2, "time_us": [150.0]}],
     "a row of one rank: nothing crosses a link"),
]


# --- predict_step_time: its cases ------------------------------------------------------------

def step_spec(alpha_s, beta, world_size, gradients, bucket_cap_bytes, forward_s, backward_s,
              optimizer_s) -> dict:
    """A predict_step_time call as plain data: its keyword arguments."""
    return {"alpha_s": alpha_s, "beta_bytes_per_s": beta, "world_size": world_size,
            "gradients": [list(g) for g in gradients], "bucket_cap_bytes": bucket_cap_bytes,
            "forward_s": forward_s, "backward_s": backward_s, "optimizer_s": optimizer_s}


# Six gradients of a small model, in the order backward produces them: (bytes, ready at s).
SIX = [(40_000, 0.002), (400_000, 0.004), (4_000, 0.0045), (400_000, 0.008), (4_000, 0.0085),
       (1_600_000, 0.02)]
STEP_CASES = {
    # every all-reduce fits under backward but the last bucket's
    "overlap": step_spec(50e-6, 1e9, 2, SIX, 500_000, 0.01, 0.02, 0.003),
    # a slow link: the all-reduces queue behind each other and stick out far past backward
    "queued": step_spec(100e-6, 1e8, 4, SIX, 500_000, 0.01, 0.02, 0.003),
    # one bucket for everything: it can only start when backward is over
    "one bucket": step_spec(50e-6, 1e9, 2, SIX, 25 * MIB, 0.01, 0.02, 0.003),
}
VISIBLE_STEPS: dict[str, float] = {  # written out, like VISIBLE_FITS
    "overlap": 0.034654,
    "queued": 0.05792,
    "one bucket": 0.035498,
}
VISIBLE_STEP_ERRORS = [
    ({**STEP_CASES["overlap"], "world_size": 0}, "world_size 0"),
    ({**STEP_CASES["overlap"], "beta_bytes_per_s": 0.0}, "a bandwidth of 0"),
    ({**STEP_CASES["overlap"], "gradients": [[1000, 0.004], [1000, 0.002]]},
     "ready times out of order"),
]


# --- in the rank: the calls, as data ----------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def describe_call(fn: Callable, args: tuple = (), kwargs: dict | None = None) -> dict:
    """What ``fn(*args, **kwargs)`` did, as data (NotImplementedError, a stub's, propagates),
    and whether it modified the arguments it was given (its own copy of ``args`` and ``kwargs``,
    compared after the call with them)."""
    kwargs = kwargs or {}
    given = (copy.deepcopy(args), copy.deepcopy(kwargs))
    try:
        got = fn(*given[0], **given[1])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - described as data, judged outside the rank
        return {"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                "message": _text(exc, 500), "type": "", "repr": "", "values": None,
                "tuple": False, "modified": not identical(given, (args, kwargs))}
    values = None
    if isinstance(got, (tuple, list)) and len(got) <= 8:
        values = [_number(v) for v in got]
    elif _number(got) is not None:
        values = [_number(got)]
    return {"raised": None, "value_error": False, "message": "", "type": type(got).__name__,
            "repr": _text(repr(got), 300), "values": values, "tuple": isinstance(got, tuple),
            "modified": not identical(given, (args, kwargs))}


# The chapter's benchmark fits the lesson's curve with a function the contract asks the student
# to write (with more to it: rows, units, repeats, edge cases); a call into that file is reported.
LESSON_FIT = str(Path(__file__).resolve().parents[3] / "benchmarks" / "ch10_allreduce.py")


def observe_fit(rank, world_size, fit_cost_model, specs, errors):
    """Every fit case's and every error case's call, each on its own copy of the rows, and the
    functions of the lesson's benchmark that the calls reached."""
    def calls():
        return {"cases": [describe_call(fit_cost_model, (make_measurements(*spec),))
                          for spec in specs],
                "errors": [describe_call(fit_cost_model, (rows,)) for rows, _ in errors]}

    watched = call_watching(calls, (), {}, LESSON_FIT, quiet=False)
    if watched.exception is not None:
        raise watched.exception
    return {**watched.result, "lesson_calls": [_text(n, 200) for n in watched.forbidden_calls[:10]],
            "hook_removed": watched.hook_removed}


def observe_steps(rank, world_size, predict_step_time, cases, errors):
    """Every predict_step_time call (keyword arguments), and every error case's."""
    return {"cases": [describe_call(predict_step_time, (), kwargs) for kwargs in cases],
            "errors": [describe_call(predict_step_time, (), kwargs) for kwargs, _ in errors]}


# --- in the judge ----------------------------------------------------------------------------


def _reported(observation: Any, key: str, count: int) -> list:
    calls = observed(observation, key, list)
    if len(calls) != count or not all(isinstance(c, dict) for c in calls):
        raise CheckFailed("the rank's report does not have one entry per call")
    return calls


def _returned_numbers(call: dict, shown: str, want: str, count: int,
                      a_tuple: bool = False) -> list[float]:
    raised = observed(call, "raised", (str, type(None)))
    if raised is not None:
        raise CheckFailed(f"{shown}: expected {want}, but it raised {_text(raised, 80)}: "
                          f"{_text(observed(call, 'message', str))}")
    values = observed(call, "values", (list, type(None)))
    if values is None or len(values) != count or not all(
            isinstance(v, float) for v in values) or (
            a_tuple and observed(call, "tuple", bool) is not True):
        raise CheckFailed(f"{shown}: expected {want}, got {_text(observed(call, 'repr', str))} "
                          f"({_text(observed(call, 'type', str), 80)})")
    return values


def _expect_value_errors(calls: list, errors: list, name: str) -> None:
    for call, (_, what) in zip(calls, errors):
        raised = observed(call, "raised", (str, type(None)))
        if observed(call, "value_error", bool) is not True:
            got = (f"it raised {_text(raised, 80)}: {_text(observed(call, 'message', str))}"
                   if raised else f"it returned {_text(observed(call, 'repr', str))}")
            raise CheckFailed(f"{name} ({what}): expected ValueError, {got}")


def fit_hint(got: tuple[float, float], want: tuple[float, float]) -> str:
    """What a fit that is off by a unit's factor most likely did."""
    (alpha, beta), (want_alpha, want_beta) = got, want
    if want_alpha > 0 and math.isclose(alpha, want_alpha * 1e6, rel_tol=1e-3):
        return " (α is 1e6 times too large: time_us is in microseconds, α in seconds)"
    if want_alpha > 0 and math.isclose(alpha, want_alpha * 1e-6, rel_tol=1e-3):
        return " (α is 1e6 times too small: time_us is in microseconds, α in seconds)"
    if math.isfinite(beta) and math.isfinite(want_beta):
        ratio = beta / want_beta
        for factor, text in ((1e6, "time_us is in microseconds"),
                             (2.0, "the bytes each rank sends are 2(N−1)/N × the message"),
                             (4.0, "count is elements, not bytes: multiply by the dtype's size"),
                             (0.25, "count is elements, not bytes: multiply by the dtype's size"),
                             (0.5, "the bytes each rank sends are 2(N−1)/N × the message")):
            if math.isclose(ratio, factor, rel_tol=0.05):
                return f" (β is about {factor:g} times the expected value: {text})"
    return (" (fit the BEST time of each row, by least squares on the relative error: "
            "minimise Σ((α + x/β − t)/t)²)")


def _within(got: float, want: float, floor: float) -> bool:
    """``|got − want| <= FIT_RTOL·|want| + floor`` (False for nan or an infinite ``got``)."""
    return abs(got - want) <= FIT_RTOL * abs(want) + floor


def expect_fit(got: list[float], want: tuple[float, float], shown: str) -> None:
    """The contract's tolerance: α within 1e-6 relative + 1e-12 s; β > 0, and s = 1/β (0 for an
    infinite β) within 1e-6 relative + 1e-18 s/B."""
    alpha, beta = got
    want_alpha, want_beta = want
    ok_alpha = _within(alpha, want_alpha, ALPHA_FLOOR_S)
    ok_beta = beta > 0 and _within(1 / beta, 1 / want_beta, SLOPE_FLOOR_S_PER_BYTE)
    if not (ok_alpha and ok_beta):
        raise CheckFailed(f"{shown}: expected (alpha_s, beta_bytes_per_s) = ({want_alpha!r}, "
                          f"{want_beta!r}), got ({alpha!r}, {beta!r})"
                          + fit_hint((alpha, beta), want))


FitReference = Callable[[tuple], tuple[float, float]]


def written_out_fit(spec: tuple) -> tuple[float, float]:
    """The visible cases' fits, from :data:`VISIBLE_FITS`; any other case is a grader bug."""
    for name, known in FIT_CASES.items():
        if tuple(known) == tuple(spec):
            return VISIBLE_FITS[name]
    raise LookupError(f"grader bug: no written-out fit for the case {spec!r}: add it to "
                      "VISIBLE_FITS, or judge it with the hidden checks' reference")


def judge_fits(reference: FitReference, observations, world_size, specs, errors) -> None:
    """Each case's (α, β), a tuple, against ``reference(spec)`` (:func:`expect_fit`); each error
    case must raise ValueError; no call may modify the rows it was given."""
    wants = [reference(spec) for spec in specs]

    def judge_rank(rank, observation):
        calls = _reported(observation, "cases", len(specs))
        reached = observed(observation, "lesson_calls", list)
        if reached:
            raise CheckFailed("fit_cost_model must fit the model itself, not call the lesson's "
                              f"benchmark: it reached {', '.join(map(str, reached))} "
                              "(benchmarks/ch10_allreduce.py)")
        if observed(observation, "hook_removed", bool) is not False:
            raise CheckFailed("fit_cost_model replaced the grader's profile hook "
                              "(sys.setprofile), which watches what it calls")
        error_calls = _reported(observation, "errors", len(errors))
        shown_calls = [(f"fit_cost_model on {len(spec[2]) * len(spec[3])} rows (α = {spec[0]:g} "
                        f"s, β = {spec[1]:g} B/s, {spec[5]} repeat(s), dtypes {spec[4]})", call)
                       for spec, call in zip(specs, calls)]
        for shown, call in shown_calls + [(f"fit_cost_model ({what})", call)
                                          for (_, what), call in zip(errors, error_calls)]:
            if observed(call, "modified", bool) is not False:
                raise CheckFailed(f"{shown}: it modified the rows it was given (the list, a row "
                                  "or a row's time_us): the contract says they are not "
                                  "modified; work on copies")
        for (shown, call), want in zip(shown_calls, wants):
            got = _returned_numbers(call, shown, "a tuple of two floats (alpha_s, "
                                    "beta_bytes_per_s)", 2, a_tuple=True)
            expect_fit(got, want, shown)
        _expect_value_errors(error_calls, errors, "fit_cost_model")

    judge_each_rank(observations, judge_rank)


def judge_visible_fits(observations, world_size, specs, errors) -> None:
    judge_fits(written_out_fit, observations, world_size, specs, errors)


StepReference = Callable[[dict], float]


def written_out_step(kwargs: dict) -> float:
    for name, known in STEP_CASES.items():
        if known == kwargs:
            return VISIBLE_STEPS[name]
    raise LookupError(f"grader bug: no written-out step time for {kwargs!r}: add it to "
                      "VISIBLE_STEPS, or judge it with the hidden checks' reference")


def _shown_step(kwargs: dict) -> str:
    shown = ", ".join(f"{k}={_text(v, 120)}" for k, v in kwargs.items())
    return f"predict_step_time({shown})"


def judge_steps(reference: StepReference, observations, world_size, cases, errors) -> None:
    wants = [reference(kwargs) for kwargs in cases]

    def judge_rank(rank, observation):
        for kwargs, want, call in zip(cases, wants, _reported(observation, "cases", len(cases))):
            shown = _shown_step(kwargs)
            (got,) = _returned_numbers(call, shown, "a float (seconds)", 1)
            if not math.isclose(got, want, rel_tol=STEP_RTOL, abs_tol=STEP_ATOL):
                raise CheckFailed(f"{shown}: expected {want!r} s, got {got!r} s")
        _expect_value_errors(_reported(observation, "errors", len(errors)), errors,
                             "predict_step_time")

    judge_each_rank(observations, judge_rank)


def judge_visible_steps(observations, world_size, cases, errors) -> None:
    judge_steps(written_out_step, observations, world_size, cases, errors)


FITS = Case(observe_fit, judge_visible_fits)
STEPS = Case(observe_steps, judge_visible_steps)


def _run(case: Case, fn, cases: list, errors: list, **kwargs) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, 1, fn, cases, errors, init_process_group=False, **kwargs)


def check_fit_exact_data(fit_cost_model) -> None:
    """Exact timings: the fit gives back α and β; one size only, no rows, one rank: ValueError."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(FITS, fit_cost_model, [FIT_CASES["exact"]], VISIBLE_FIT_ERRORS)


def check_fit_noisy_repeats(fit_cost_model) -> None:
    """Noisy repeats (the best of each row) and rows of float16/float64 (count × dtype size)."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(FITS, fit_cost_model, [FIT_CASES["noisy repeats"], FIT_CASES["mixed dtypes"]], [])


def check_predict_step_time(predict_step_time) -> None:
    """Overlap with backward, all-reduces queued on a slow link, one bucket; bad arguments."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(STEPS, predict_step_time, list(STEP_CASES.values()), VISIBLE_STEP_ERRORS)
