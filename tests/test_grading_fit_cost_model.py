"""The checks of exercise fit_cost_model (chapter 10: fit_cost_model, predict_step_time) pass the
solution, hold every written-out visible value to the hidden reference, and catch the wrong
answers a careless fit or timeline gives (each wrong version is the solution with one mistake).
The exercise: solutions/10_performance/fit_cost_model.nb.py."""

from __future__ import annotations

import math

import pytest

from autograder.hidden import fit_cost_model as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse import cost_model as cm
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import fit_cost_model as checks
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")

SOURCE = SOLUTIONS / "10_performance" / "fit_cost_model.ipynb"
FIT = solution_code(SOURCE, "fit-cost-model")
PREDICT = solution_code(SOURCE, "predict-step-time")


def build(code: str, name: str, *replacements: tuple[str, str]):
    """The solution's function ``name``, with each (old, new) applied once."""
    for old, new in replacements:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    namespace = {"math": math}
    exec(compile(code, "<student notebook>", "exec"), namespace)
    return namespace[name]


def fit(*replacements):
    return build(FIT, "fit_cost_model", *replacements)


def predict(*replacements):
    return build(PREDICT, "predict_step_time", *replacements)


def test_the_solution_passes_visible_and_hidden_checks():
    checks.check_fit_exact_data(fit())
    checks.check_fit_noisy_repeats(fit())
    hidden.check_fit_cost_model(fit())
    checks.check_predict_step_time(predict())
    hidden.check_predict_step_time(predict())


def test_every_written_out_value_is_the_reference():
    """The visible checks hold no fit and no timeline (they are the exercise's answer): their
    cases' answers are written out, held here to the hidden reference."""
    assert set(checks.VISIBLE_FITS) == set(checks.FIT_CASES)
    for name, spec in checks.FIT_CASES.items():
        assert checks.VISIBLE_FITS[name] == pytest.approx(
            hidden.reference_fit(checks.make_measurements(*spec)), rel=1e-12), name
    assert set(checks.VISIBLE_STEPS) == set(checks.STEP_CASES)
    for name, kwargs in checks.STEP_CASES.items():
        assert checks.VISIBLE_STEPS[name] == pytest.approx(hidden.reference_step(kwargs),
                                                           rel=1e-12), name
    for module in (checks,):
        assert not [n for n in vars(module) if n.startswith("reference")]


def test_the_reference_fit_recovers_known_parameters_and_its_edges():
    exact = checks.make_measurements(*checks.FIT_CASES["exact"])
    assert hidden.reference_fit(exact) == pytest.approx((50e-6, 2e9), rel=1e-9)
    noisy = checks.make_measurements(*checks.FIT_CASES["noisy repeats"])
    alpha, beta = hidden.reference_fit(noisy)
    assert alpha == pytest.approx(80e-6, rel=0.05) and beta == pytest.approx(2.5e9, rel=0.05)
    latency, bandwidth = (checks.make_measurements(*spec) for spec in hidden.HIDDEN_FITS[:2])
    assert hidden.reference_fit(latency)[1] == math.inf  # the times do not grow with the size
    assert hidden.reference_fit(bandwidth)[0] == 0.0  # the unconstrained α is negative
    # the constrained optimum is no worse than any other point of the quadrant
    points = hidden._points(bandwidth)
    best = hidden.reference_fit(bandwidth)

    def loss(alpha, beta):
        return sum(((alpha + x / beta - t) / t) ** 2 for x, t in points)

    for a, b in [(1e-7, best[1]), (0.0, best[1] * 1.01), (0.0, best[1] * 0.99)]:
        assert loss(*best) <= loss(a, b)


def test_the_reference_step_agrees_with_the_package_where_the_package_applies():
    """Gradients ready at a steady rate in bytes: ddpcourse.cost_model.step_time's assumption,
    under which both timelines must agree (one model, two descriptions)."""
    sizes = [300_000, 50_000, 700_000, 20_000, 900_000]
    backward, cap = 0.03, 400_000
    total, ready, gradients = sum(sizes), 0, []
    for nbytes in sizes:
        ready += nbytes
        gradients.append([nbytes, backward * ready / total])
    buckets = cm.bucket_sizes(list(reversed(sizes)), cap)
    for world_size, beta in [(2, 1e9), (4, 2e8), (1, 1e9)]:
        link = cm.Link(60e-6, beta)
        theirs = cm.step_time(forward_s=0.01, backward_s=backward, optimizer_s=0.002,
                              buckets=buckets, world_size=world_size, link=link).step_s
        ours = hidden.reference_step(checks.step_spec(60e-6, beta, world_size, gradients, cap,
                                                      0.01, backward, 0.002))
        assert ours == pytest.approx(theirs, rel=1e-9)


def test_the_packages_step_time_does_not_pass():
    """The package assumes a steady rate; the profile of the visible cases is not one."""
    def via_package(alpha_s, beta_bytes_per_s, world_size, gradients, bucket_cap_bytes,
                    forward_s, backward_s, optimizer_s):
        from ddpcourse import cost_model

        sizes = [b for b, _ in gradients]
        buckets = cost_model.bucket_sizes(list(reversed(sizes)), bucket_cap_bytes)
        return cost_model.step_time(forward_s=forward_s, backward_s=backward_s,
                                    optimizer_s=optimizer_s, buckets=buckets,
                                    world_size=world_size,
                                    link=cost_model.Link(alpha_s, beta_bytes_per_s)).step_s

    with pytest.raises(CheckFailed, match="overlap|expected"):
        checks.check_predict_step_time(via_package)


@pytest.mark.parametrize("mistake, replacements, check, message", [
    ("count taken as bytes", [("* count * ITEMSIZE[dtype]", "* count")],
     checks.check_fit_noisy_repeats, "count is elements, not bytes"),
    ("microseconds taken as seconds", [("min(times) * 1e-6", "min(times)")],
     checks.check_fit_exact_data, "microseconds"),
    ("no bus factor", [("2 * (ranks - 1) / ranks * count", "count")],
     checks.check_fit_noisy_repeats, r"expected \(alpha_s, beta_bytes_per_s\)"),
    ("the mean of the repeats", [("min(times) * 1e-6", "sum(times) / len(times) * 1e-6")],
     checks.check_fit_noisy_repeats, "BEST time"),
    ("an unweighted fit", [("w = [1 / t**2 for _, t in points]", "w = [1.0 for _ in points]")],
     checks.check_fit_noisy_repeats, "relative error"),
    ("one size accepted", [("if len({x for x, _ in points}) < 2:\n", "if False:\n")],
     checks.check_fit_exact_data, "one message size only.*expected ValueError"),
    ("one rank accepted", [("count < 0 or ranks < 2", "count < 0 or ranks < 1")],
     checks.check_fit_exact_data, "one rank.*expected ValueError"),
    ("β negative on latency-dominated data", [("if alpha < 0 or s <= 0:", "if alpha < 0:")],
     hidden.check_fit_cost_model, r"expected \(alpha_s, beta_bytes_per_s\) = .*inf"),
    ("α left negative", [("if alpha < 0 or s <= 0:", "if s <= 0:")],
     hidden.check_fit_cost_model, r"expected \(alpha_s, beta_bytes_per_s\) = \(0\.0"),
])
def test_fit_checks_catch(mistake, replacements, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(fit(*replacements))


@pytest.mark.parametrize("mistake, replacements, check", [
    ("no waiting for the previous all-reduce",
     [("max(ready, link_free) + alpha_s", "ready + alpha_s")], checks.check_predict_step_time),
    ("the whole message per rank, no bus factor",
     [("factor = 2 * (world_size - 1) / world_size", "factor = 1.0")],
     checks.check_predict_step_time),
    ("a bucket closed before it passes the cap",
     [("        size += nbytes\n        if size >= bucket_cap_bytes:",
       "        if size and size + nbytes > bucket_cap_bytes:\n            buckets.append((size, "
       "last_ready))\n            size = 0\n        size += nbytes\n        if False:")],
     checks.check_predict_step_time),
    ("communication never hidden", [("forward_s + max(backward_s, link_free)",
                                     "forward_s + backward_s + link_free")],
     checks.check_predict_step_time),
    ("the left-over bucket forgotten", [("    if size:\n        buckets.append((size, "
                                         "last_ready))\n", "")], hidden.check_predict_step_time),
    ("α paid on one rank", [("if world_size > 1:", "if world_size >= 1:")],
     hidden.check_predict_step_time),
    ("no validation of ready times", [("nbytes < 0 or not last_ready <= ready <= backward_s",
                                       "nbytes < 0")], checks.check_predict_step_time),
])
def test_step_checks_catch(mistake, replacements, check):
    with pytest.raises(CheckFailed, match="predict_step_time"):
        check(predict(*replacements))


def test_the_visible_judges_refuse_a_case_without_a_written_out_value():
    other = checks.fit_spec(1e-5, 1e9, checks.SWEEP, seed=99)
    with pytest.raises(LookupError, match="grader bug: no written-out fit"):
        checks.judge_visible_fits([{}], 1, [other], [])
    with pytest.raises(LookupError, match="grader bug: no written-out step time"):
        checks.judge_visible_steps([{"cases": [{"raised": None, "values": [1.0]}],
                                     "errors": []}], 1,
                                   [checks.step_spec(0, 1e9, 2, [], 1, 0, 0, 0)], [])


def test_reports_are_read_as_untrusted_data():
    from ddpcourse.grading.checks import run_observation
    from ddpcourse.launcher import pickle_by_value

    specs = [checks.FIT_CASES["exact"]]
    errors = checks.VISIBLE_FIT_ERRORS
    (report,) = run_observation(checks.observe_fit, 1, pickle_by_value(fit()), (specs, errors),
                                60, init_process_group=False)
    checks.judge_visible_fits([report], 1, specs, errors)
    for path, value, message in [
        ([], None, "lacks 'cases'"), (["cases"], [], "one entry per call"),
        (["cases", 0, "values"], ["a", 1.0], "expected a tuple of two floats"),
        (["cases", 0, "values"], [1.0, 2.0], r"expected \(alpha_s"),
        (["cases", 0, "raised"], 5, "of type int"),
        (["errors", 0, "value_error"], "yes", "'value_error' of type str"),
        (["errors", 0, "value_error"], False, "expected ValueError"),
    ]:
        with pytest.raises(CheckFailed, match=message):
            checks.judge_visible_fits([altered(report, path, value)], 1, specs, errors)


def test_judged_by_the_trusted_grader(host):
    checks.check_fit_noisy_repeats(submitted(fit(), host))
    hidden.check_predict_step_time(submitted(predict(), host))
    with pytest.raises(CheckFailed, match="count is elements"):
        checks.check_fit_noisy_repeats(submitted(fit(("* count * ITEMSIZE[dtype]", "* count")),
                                                 host))


def test_calling_the_benchmarks_fit_fails_visibly_and_hidden():
    """benchmarks/ch10_allreduce.py fits (bytes, ranks, best seconds) points by the same least
    squares, and ships to students: a submission that converts the rows and calls it is told, by
    the visible checks already, to fit the model itself (the calls are watched in the rank)."""
    def via_benchmark(measurements):
        from pathlib import Path

        from ddpcourse.imports import import_by_path

        root = Path(checks.__file__).resolve().parents[3]
        bench = import_by_path("ch10_allreduce_for_a_test",
                               root / "benchmarks" / "ch10_allreduce.py")
        sizes = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
        link = bench.fit_alpha_beta([(row["count"] * sizes[row["dtype"]], row["ranks"],
                                      min(row["time_us"]) * 1e-6) for row in measurements])
        return link.alpha_s, link.beta_bytes_per_s

    for check in (checks.check_fit_noisy_repeats, hidden.check_fit_cost_model):
        with pytest.raises(CheckFailed, match=r"not call the lesson's benchmark.*fit_alpha_beta"):
            check(via_benchmark)
