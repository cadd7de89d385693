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


# --- every clause of both contracts, each broken alone, graded as the grader grades ------------
#
# The contract is the stubs' docstrings (solutions/10_performance/fit_cost_model.nb.py). Each row
# is one clause, the solution with that clause broken and nothing else, and the check (visible or
# hidden) that takes its points: run through the trusted grader's path (the function pickled as
# the kernel leaves it, observed in the sandbox's ranks, judged here). The one check named runs
# (a wrong answer that fails it has lost marks; the others need not run), with the message a
# student would read.
EXACT, NOISY, HIDDEN_FIT = (checks.check_fit_exact_data, checks.check_fit_noisy_repeats,
                            hidden.check_fit_cost_model)
VISIBLE_STEP, HIDDEN_STEP = checks.check_predict_step_time, hidden.check_predict_step_time
FIT_ANSWER = "expected \\(alpha_s, beta_bytes_per_s\\)"
BUCKET = ("        size += nbytes\n        if size >= bucket_cap_bytes:\n"
          "            buckets.append((size, ready))\n            size = 0\n")

FIT_CLAUSES = [  # (clause, the wrong answer's replacements, the check that catches it, message)
    ("itemsize: bfloat16 is 2 bytes (not 4)", [('"bfloat16": 2', '"bfloat16": 4')], HIDDEN_FIT,
     FIT_ANSWER),
    ("count is elements (not bytes)", [("* count * ITEMSIZE[dtype]", "* count")], NOISY,
     "count is elements, not bytes"),
    ("x has the bus factor 2(N-1)/N of each row's N", [("2 * (ranks - 1) / ranks * count",
                                                        "count")], NOISY, FIT_ANSWER),
    ("time_us is microseconds", [("min(times) * 1e-6", "min(times)")], EXACT, "microseconds"),
    ("rows in any order (not assumed ascending)",
     [("if len({x for x, _ in points}) < 2:",
       "if len({x for x, _ in points}) < 2 or points[-1][0] <= points[0][0]:")], HIDDEN_FIT,
     "expected a tuple of two floats.*raised ValueError"),
    ("the rows are not modified (time_us sorted in place)",
     [("        if not times or min(times) <= 0:",
       "        times.sort()\n        if not times or min(times) <= 0:")], NOISY,
     "modified the rows it was given"),
    ("each row gives one point (rows of one size not merged)",
     [("    w = [1 / t**2", "    points = [(x, min(t for x2, t in points if x2 == x))\n"
       "              for x in sorted({x for x, _ in points})]\n    w = [1 / t**2")],
     HIDDEN_FIT, FIT_ANSWER),
    ("t is the smallest timing (not the mean)", [("min(times) * 1e-6",
                                                  "sum(times) / len(times) * 1e-6")], NOISY,
     "BEST time"),
    ("least squares on the relative error (not unweighted)",
     [("w = [1 / t**2 for _, t in points]", "w = [1.0 for _ in points]")], NOISY,
     "relative error"),
    ("alpha >= 0 (not left negative)", [("if alpha < 0 or s <= 0:", "if s <= 0:")], HIDDEN_FIT,
     FIT_ANSWER + " = \\(0\\.0"),
    ("s >= 0: beta never negative", [("if alpha < 0 or s <= 0:", "if alpha < 0:")], HIDDEN_FIT,
     FIT_ANSWER + " = .*inf"),
    ("the edge that leaves the smaller sum (not always alpha = 0)",
     [("key=lambda edge: loss(*edge))", "key=lambda edge: -edge[1])")], HIDDEN_FIT,
     FIT_ANSWER + " = .*inf"),
    ("beta = inf when s == 0 (not 0)", [("(1 / s if s > 0 else math.inf)",
                                         "(1 / s if s > 0 else 0.0)")], HIDDEN_FIT,
     FIT_ANSWER + " = .*inf"),
    ("within 1e-6 relative (a fit off by 1e-5)", [("    return alpha, (1 / s",
                                                   "    alpha *= 1 + 1e-5\n"
                                                   "    return alpha, (1 / s")], EXACT,
     FIT_ANSWER),
    ("the floor: beta >= 1e18 B/s where it is infinite (not capped at 1e15)",
     [("(1 / s if s > 0 else math.inf)", "1 / max(s, 1e-15)")], HIDDEN_FIT,
     FIT_ANSWER + " = .*inf"),
    ("returns a tuple (not a list)", [("    return alpha, (1 / s if s > 0 else math.inf)",
                                       "    return [alpha, (1 / s if s > 0 else math.inf)]")],
     EXACT, "expected a tuple of two floats.*got \\["),
    ("no rows: ValueError (not (0, inf))", [('        raise ValueError("no measurements")',
                                            "        return 0.0, math.inf")], EXACT,
     "no measurements.*expected ValueError"),
    ("ranks < 2: ValueError", [("count < 0 or ranks < 2", "count < 0 or ranks < 1")], EXACT,
     "one rank.*expected ValueError"),
    ("a negative count: ValueError", [("count < 0 or ranks < 2", "ranks < 2")], HIDDEN_FIT,
     "negative count.*expected ValueError"),
    ("an unknown dtype: ValueError (not taken as 4 bytes)",
     [('        if dtype not in ITEMSIZE:\n            raise ValueError(f"unknown dtype '
       '{dtype!r}")\n', ""), ("* count * ITEMSIZE[dtype]", "* count * ITEMSIZE.get(dtype, 4)")],
     HIDDEN_FIT, "unknown dtype.*expected ValueError"),
    ("no timings: ValueError (the row not skipped)",
     [("        if not times or min(times) <= 0:",
       "        if not times:\n            continue\n        if min(times) <= 0:")], HIDDEN_FIT,
     "without timings.*expected ValueError"),
    ("a timing <= 0: ValueError (not dropped)",
     [("        if not times or min(times) <= 0:",
       "        times = [t for t in times if t > 0]\n        if not times or min(times) <= 0:")],
     HIDDEN_FIT, "among good ones.*expected ValueError"),
    ("fewer than two distinct x: ValueError (distinct x, not distinct counts)",
     [("if len({x for x, _ in points}) < 2:",
       'if len({row["count"] for row in measurements}) < 2:')],
     HIDDEN_FIT, "three dtypes.*expected ValueError"),
]

STEP_CLAUSES = [  # (clause, the wrong answer's replacements, the check that catches it)
    ("world_size is an int", [("not isinstance(world_size, int) or world_size < 1",
                               "world_size < 1")], HIDDEN_STEP),
    ("alpha_s >= 0", [("alpha_s < 0 or not beta", "not beta")], HIDDEN_STEP),
    ("beta_bytes_per_s > 0", [("not beta_bytes_per_s > 0 or not bucket", "not bucket")],
     VISIBLE_STEP),
    ("bucket_cap_bytes > 0", [("or not bucket_cap_bytes > 0:", ":")], HIDDEN_STEP),
    ("forward_s, backward_s, optimizer_s >= 0 (not forward_s alone)",
     [("min(forward_s, backward_s, optimizer_s) < 0", "forward_s < 0")], HIDDEN_STEP),
    ("nbytes >= 0", [("if nbytes < 0 or not last_ready", "if not last_ready")], HIDDEN_STEP),
    ("ready times non-decreasing", [("nbytes < 0 or not last_ready <= ready <= backward_s",
                                     "nbytes < 0")], VISIBLE_STEP),
    ("ready times >= 0", [("buckets, size, last_ready = [], 0, 0.0",
                           "buckets, size, last_ready = [], 0, -math.inf")], HIDDEN_STEP),
    ("ready times <= backward_s", [("<= ready <= backward_s", "<= ready")], HIDDEN_STEP),
    ("a bucket closes when it holds at least the cap (not more than it)",
     [("if size >= bucket_cap_bytes:", "if size > bucket_cap_bytes:")], HIDDEN_STEP),
    ("a gradient is never split", [(BUCKET, "        size += nbytes\n"
                                    "        while size >= bucket_cap_bytes:\n"
                                    "            buckets.append((bucket_cap_bytes, ready))\n"
                                    "            size -= bucket_cap_bytes\n")], VISIBLE_STEP),
    ("a gradient above the cap joins what came before it",
     [("    buckets, size, last_ready = [], 0, 0.0\n",
       "    buckets, size, last_ready = [], 0, 0.0\n    previous = 0.0\n"),
      (BUCKET, "        if nbytes >= bucket_cap_bytes and size:\n"
               "            buckets.append((size, previous))\n            size = 0\n"
               "        previous = ready\n" + BUCKET)], HIDDEN_STEP),
    ("what is left at the end is the last bucket",
     [("    if size:\n        buckets.append((size, last_ready))\n", "")], VISIBLE_STEP),
    ("a left-over of zero bytes is no bucket",
     [("    buckets, size, last_ready = [], 0, 0.0\n",
       "    buckets, size, last_ready = [], 0, 0.0\n    held = False\n"),
      ("        size += nbytes\n", "        size += nbytes\n        held = True\n"),
      ("            size = 0\n", "            size, held = 0, False\n"),
      ("    if size:\n", "    if held:\n")], HIDDEN_STEP),
    ("a bucket is ready when its last gradient is (not its first)",
     [("        last_ready = ready\n        size += nbytes\n",
       "        last_ready = ready\n        first = ready if not size else first\n"
       "        size += nbytes\n"), ("buckets.append((size, ready))",
                                    "buckets.append((size, first))")], VISIBLE_STEP),
    ("one all-reduce at a time, in bucket order",
     [("max(ready, link_free) + alpha_s", "ready + alpha_s")], VISIBLE_STEP),
    ("an all-reduce lasts alpha + 2(N-1)/N bytes / beta (the bus factor)",
     [("factor = 2 * (world_size - 1) / world_size", "factor = 1.0")], VISIBLE_STEP),
    ("alpha per all-reduce (not once per step)",
     [("link_free = max(ready, link_free) + alpha_s + factor",
       "link_free = max(ready, link_free) + factor"),
      ("    return forward_s + max(", "    link_free += alpha_s if buckets and world_size > 1 "
                                     "else 0.0\n    return forward_s + max(")], VISIBLE_STEP),
    ("beta = inf: alpha alone (not a free link)",
     [("    if world_size > 1:", "    if world_size > 1 and beta_bytes_per_s != math.inf:")],
     HIDDEN_STEP),
    ("one rank makes no all-reduce, not even alpha", [("if world_size > 1:",
                                                       "if world_size >= 1:")], HIDDEN_STEP),
    ("the step: forward + max(backward, end of the last all-reduce) + optimizer",
     [("forward_s + max(backward_s, link_free)", "forward_s + backward_s + link_free")],
     VISIBLE_STEP),
    ("returns a float (not a tensor)",
     [("    return forward_s + max(backward_s, link_free) + optimizer_s",
       "    import torch\n"
       "    return torch.tensor(forward_s + max(backward_s, link_free) + optimizer_s)")],
     VISIBLE_STEP),
]


@pytest.mark.parametrize("replacements, check, message",
                         [pytest.param(*row[1:], id=row[0]) for row in FIT_CLAUSES])
def test_each_clause_of_fit_cost_model_broken_alone_loses_marks(host, replacements, check,
                                                                 message):
    with pytest.raises(CheckFailed, match=message):
        check(submitted(fit(*replacements), host))


@pytest.mark.parametrize("replacements, check",
                         [pytest.param(*row[1:], id=row[0]) for row in STEP_CLAUSES])
def test_each_clause_of_predict_step_time_broken_alone_loses_marks(host, replacements, check):
    with pytest.raises(CheckFailed, match="predict_step_time"):
        check(submitted(predict(*replacements), host))


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
        (["cases", 0, "modified"], True, "modified the rows"),
        (["errors", 1, "modified"], None, "'modified' of type NoneType"),
        (["cases", 0, "tuple"], False, "expected a tuple of two floats"),
    ]:
        with pytest.raises(CheckFailed, match=message):
            checks.judge_visible_fits([altered(report, path, value)], 1, specs, errors)


def fit_by_lstsq(measurements):
    """A correct fit written otherwise: float64 torch.linalg.lstsq on the rows scaled by 1/t, and
    the edge chosen by which constraint the unconstrained optimum breaks (the same edge as the
    smaller sum: for this loss, if α < 0 the optimum is on α = 0, if s <= 0 on s = 0)."""
    import math

    import torch

    itemsize = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
    if len(measurements) == 0:
        raise ValueError("no rows")
    xs, ts = [], []
    for row in measurements:
        n, times = row["ranks"], row["time_us"]
        if row["dtype"] not in itemsize or row["count"] < 0 or n < 2 or len(times) == 0 or any(
                t <= 0 for t in times):
            raise ValueError(f"bad row: {row}")
        xs.append(2 * (n - 1) / n * row["count"] * itemsize[row["dtype"]])
        ts.append(min(times) / 1e6)
    if len(set(xs)) < 2:
        raise ValueError("one size only")
    t = torch.tensor(ts, dtype=torch.float64)
    a = torch.stack([1 / t, torch.tensor(xs, dtype=torch.float64) / t], dim=1)
    ones = torch.ones(len(ts), 1, dtype=torch.float64)
    alpha, s = torch.linalg.lstsq(a, ones).solution.flatten().tolist()
    if alpha < 0:
        alpha, s = 0.0, torch.linalg.lstsq(a[:, 1:], ones).solution.item()
    elif s <= 0:
        alpha, s = torch.linalg.lstsq(a[:, :1], ones).solution.item(), 0.0
    return alpha, (math.inf if s == 0 else 1 / s)


def predict_by_bucket_lists(alpha_s, beta_bytes_per_s, world_size, gradients, bucket_cap_bytes,
                            forward_s, backward_s, optimizer_s):
    """A correct timeline written otherwise: buckets as lists of gradients, then the link's
    queue, and the overhang past backward added."""
    if not isinstance(world_size, int) or world_size < 1 or alpha_s < 0:
        raise ValueError("world_size must be an int >= 1 and alpha_s >= 0")
    if beta_bytes_per_s <= 0 or bucket_cap_bytes <= 0 or min(forward_s, backward_s,
                                                             optimizer_s) < 0:
        raise ValueError("beta, the cap and the times must be positive")
    readies = [ready for _, ready in gradients]
    if any(nbytes < 0 for nbytes, _ in gradients) or readies != sorted(readies) or any(
            not 0 <= r <= backward_s for r in readies):
        raise ValueError("bad profile")
    buckets, open_bucket = [], []
    for gradient in gradients:
        open_bucket.append(gradient)
        if sum(nbytes for nbytes, _ in open_bucket) >= bucket_cap_bytes:
            buckets.append(open_bucket)
            open_bucket = []
    if sum(nbytes for nbytes, _ in open_bucket) > 0:
        buckets.append(open_bucket)
    end = 0.0
    for bucket in buckets if world_size > 1 else []:
        nbytes = sum(b for b, _ in bucket)
        end = max(end, bucket[-1][1]) + alpha_s + (
            nbytes * 2 * (world_size - 1) / world_size / beta_bytes_per_s)
    return forward_s + backward_s + max(0.0, end - backward_s) + optimizer_s


def test_correct_answers_keep_full_marks_through_the_trusted_grader(host):
    """The solution, and answers written differently (a float64 least squares by torch, whose
    flat-data β is math.inf where the reference's is about 1.7e25; a timeline of bucket lists),
    pass every check, visible and hidden, as the grader runs them."""
    for fit_cost_model in (fit(), fit_by_lstsq):
        for check in (EXACT, NOISY, HIDDEN_FIT):
            check(submitted(fit_cost_model, host))
    for predict_step_time in (predict(), predict_by_bucket_lists):
        for check in (VISIBLE_STEP, HIDDEN_STEP):
            check(submitted(predict_step_time, host))


def test_the_fit_tolerance_is_the_contracts():
    """|α − α*| <= 1e-6·α* + 1e-12 s; β > 0 and |1/β − 1/β*| <= 1e-6/β* + 1e-18 s/B."""
    flat = checks.make_measurements(*hidden.HIDDEN_FITS[5])
    reference = hidden.reference_fit(flat)
    assert 1e24 < reference[1] < math.inf  # the reference's own rounding leaves a tiny slope
    assert fit_by_lstsq(flat)[1] == math.inf
    for got, want in [((reference[0], math.inf), reference), ((1e-21, 2e9), (0.0, 2e9)),
                      ((0.0, 1e18), (0.0, math.inf)), ((5e-5 * (1 + 9e-7), 2e9 * (1 - 9e-7)),
                                                        (5e-5, 2e9))]:
        checks.expect_fit(list(got), want, "case")
    for got, want in [((2e-12, 2e9), (0.0, 2e9)), ((5e-5 * (1 + 2e-6), 2e9), (5e-5, 2e9)),
                      ((5e-5, 2e9 * (1 + 2e-6)), (5e-5, 2e9)), ((0.0, 5e17), (0.0, math.inf)),
                      ((0.0, -1e30), (0.0, math.inf)), ((0.0, math.nan), (0.0, math.inf)),
                      ((math.nan, 2e9), (0.0, 2e9)), ((0.0, 0.0), (0.0, 2e9))]:
        with pytest.raises(CheckFailed, match=FIT_ANSWER):
            checks.expect_fit(list(got), want, "case")


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
