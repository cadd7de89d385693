"""The checks of exercise pipeline_schedule (chapter 11: GPipe and 1F1B orders) pass the solution
and catch plausible wrong ones, in the student's kernel and judged by the trusted grader
(autograder/trusted.py). Most wrong answers are judged from a written report (no ranks needed);
a few go through real ranks, a deadlocking order among them. The exercise:
solutions/11_beyond_ddp/pipeline_schedule.nb.py."""

from __future__ import annotations

import pytest

from autograder.hidden import pipeline_schedule as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import pipeline_schedule as checks
from ddpcourse.memory_calculator import bubble_fraction
from ddpcourse.pipeline import bubble, held_at_once, timeline
from rank_lines import names_ranks_first
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")

SOURCE = SOLUTIONS / "11_beyond_ddp" / "pipeline_schedule.ipynb"
SOLUTION = solution_code(SOURCE, "pipeline-schedule")


def build(*replacements: tuple[str, str]):
    """The solution's pipeline_schedule, with each (old, new) applied once."""
    source = SOLUTION
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace: dict = {}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["pipeline_schedule"]


def test_the_solution_passes_visible_and_hidden_checks():
    solution = build()
    checks.check_gpipe(solution)
    checks.check_1f1b(solution)
    checks.check_refuses_unknown_kind(solution)
    hidden.check_pipeline_schedule(solution)


@pytest.mark.parametrize("kind", checks.KINDS)
def test_the_solution_is_the_reference_and_has_the_bubble_and_memory_of_its_kind(kind):
    solution = build()
    for p in range(1, 7):
        for m in range(1, 10):
            order = hidden.reference_schedule(p, m, kind)
            assert solution(p, m, kind) == order
            checks.judge_schedule(order, p, m, kind)
            counted = bubble(timeline(order))
            assert counted["makespan"] == 2 * (m + p - 1)
            assert counted["fraction"] == pytest.approx(bubble_fraction(p, m))
            expected_held = [m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)]
            assert counted["peak_held"] == [held_at_once(steps) for steps in order] == expected_held


def test_no_graded_case_is_one_the_lesson_writes_out():
    """The lesson's written-out orders (chapters/11_beyond_ddp/pipeline_schedules.json) are for
    2 and 4 stages with 4 and 6 micro-batches: a submission that copies them passes nothing."""
    graded = [case for cases in hidden.HIDDEN_CASES.values() for case in cases]
    graded += [(3, 5, "gpipe"), (2, 3, "gpipe"), (3, 5, "1f1b"), (4, 2, "1f1b")]
    assert not {(p, m) for p, m, _ in graded} & {(2, 4), (4, 4), (4, 6)}


# --- wrong orders, judged without ranks ----------------------------------------------------------

GPIPE_3_2 = [["F0", "F1", "B0", "B1"]] * 3
WRONG_ORDERS = [
    ("a backward before its forward", [["F0", "B1", "F1", "B0"], ["F0", "F1", "B0", "B1"]], 2,
     "gpipe", "stage 0 runs B1 before F1"),
    ("stages that wait on each other", [["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]], 2,
     "1f1b", r"wait for each other forever: deadlock: stage 0 at B0 waits for stage 1's B0; "
             r"stage 1 at F1 waits for stage 0's F1"),
    ("a step missing", [["F0", "F1", "B0", "B1"], ["F0", "F1", "B0"]], 2, "gpipe",
     "stage 1 lacks B1"),
    ("a step twice", [["F0", "F1", "B0", "B1", "B1"], ["F0", "F1", "B0", "B1"]], 2, "gpipe",
     "stage 0 runs B1 more than once"),
    ("a micro-batch too many", [["F0", "F1", "F2", "B0", "B1", "B2"]] * 2, 2, "gpipe",
     "stage 0 runs F2, B2, which is no micro-batch of 2"),
    ("lower case", [["f0", "b0"]], 1, "gpipe", "'f0' is not a step"),
    ("one list too few", GPIPE_3_2[:2], 2, "gpipe", "it has 2 lists of steps; one per stage is 3"),
    ("GPipe's backwards in reverse", [["F0", "F1", "B1", "B0"]] * 2, 2, "gpipe",
     "GPipe runs every forward, then every backward, each in micro-batch order"),
    ("1F1B's order returned for GPipe", [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]], 2,
     "gpipe", "GPipe runs every forward"),
    ("GPipe's order returned for 1F1B", [["F0", "F1", "F2", "B0", "B1", "B2"]] * 3, 3, "1f1b",
     r"hold up to \[3, 3, 3\] .* at most min\(p - s, m\) = \[3, 2, 1\]"),
    ("1F1B without warm-up (one micro-batch in flight)",
     [["F0", "B0", "F1", "B1", "F2", "B2"]] * 3, 3, "1f1b",
     r"lasts 18 slots .* 2\(m \+ p - 1\) = 10 slots"),
]


@pytest.mark.parametrize("mistake, order, m, kind, message", WRONG_ORDERS,
                         ids=[w[0] for w in WRONG_ORDERS])
def test_the_judge_names_what_is_wrong_with_an_order(mistake, order, m, kind, message):
    p = 3 if mistake == "one list too few" else len(order)
    with pytest.raises(CheckFailed, match=message):
        checks.judge_schedule(order, p, m, kind)


def test_a_first_stage_that_runs_every_forward_first_is_caught_by_the_memory_it_holds():
    """Stage 0 runs GPipe's order, the others 1F1B's: no slot is lost, but stage 0 holds all 4
    micro-batches where 1F1B holds 3."""
    late = [["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]] + hidden.one_f_one_b(3, 4)[1:]
    assert bubble(timeline(late))["makespan"] == 2 * (4 + 3 - 1)
    with pytest.raises(CheckFailed, match=r"hold up to \[4, 2, 1\]"):
        checks.judge_schedule(late, 3, 4, "1f1b")


# --- wrong submissions, through real ranks -------------------------------------------------------

STAGE_1_REPEATS = ("        steps = forwards[:warmup]\n",
             "        steps = forwards[:warmup]\n        if stage == 1:\n"
             "            warmup = 0  # forgets its warm-up forwards when it builds the rest\n")
NO_WARMUP = ("        warmup = min(num_stages - 1 - stage, num_microbatches)",
             "        warmup = 0")
AS_GPIPE = ('    if kind == "gpipe":\n', '    if True:\n')
NO_REFUSAL = ('    if kind not in ("gpipe", "1f1b"):\n', '    if False:\n')
NONDETERMINISTIC = ('    if kind == "gpipe":\n        return [forwards + backwards',
                    '    import torch.distributed as dist\n    if kind == "gpipe":\n'
                    '        return [forwards[::-1] + backwards if dist.get_rank() == 1 else '
                    'forwards + backwards')


@pytest.mark.parametrize("mistake, replacement, check, message", [
    ("stage 1 runs a step twice", STAGE_1_REPEATS, checks.check_1f1b, "runs F0 more than once"),
    ("1F1B without warm-up", NO_WARMUP, checks.check_1f1b, r"lasts 30 slots .* = 14 slots"),
    ("GPipe's order for 1F1B", AS_GPIPE, checks.check_1f1b, r"hold up to \[5, 5, 5\]"),
    ("an unknown kind answered", NO_REFUSAL, checks.check_refuses_unknown_kind,
     "returned a schedule; it must raise ValueError"),
])
def test_the_checks_catch(mistake, replacement, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(build(replacement))


def test_a_deadlocking_order_is_reported_and_the_ranks_do_not_hang():
    """Stage 1 runs F1 before F0 while stage 0 waits for stage 1's B0: the ranks agree not to
    run it (its timeline deadlocks) and the verdict names what each stage waits for."""
    def pipeline_schedule(num_stages, num_microbatches, kind):
        if kind not in ("gpipe", "1f1b") or num_stages < 1 or num_microbatches < 1:
            raise ValueError(kind)
        return [["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]]

    from ddpcourse.grading.checks import run_student

    with pytest.raises(CheckFailed, match="deadlock: stage 0 at B0 waits for stage 1's B0"):
        run_student(checks.SCHEDULES, 2, pipeline_schedule, ((2, 2, "1f1b"),))


def test_an_answer_that_differs_between_ranks_is_named():
    with pytest.raises(CheckFailed, match="the ranks got different answers"):
        checks.check_gpipe(build(NONDETERMINISTIC))


# --- judged by the trusted grader: the ranks run in autograder's observation host --------------


def test_the_trusted_grader_catches_a_wrong_order(host):
    with pytest.raises(CheckFailed, match=r"hold up to \[5, 5, 5\]"):
        checks.check_1f1b(submitted(build(AS_GPIPE), host))


# --- the judge reads the ranks' reports as untrusted data ---------------------------------------

CASES = ((2, 3, "1f1b"),)


def honest_report(rank: int) -> dict:
    """What rank ``rank`` of 2 reports for CASES with the reference order, made here."""
    import torch

    order = hidden.reference_schedule(2, 3, "1f1b")
    unsplit_loss, grads = checks.unsplit_gradients(2, 3)
    loss = unsplit_loss if rank == 1 else 0.0
    return {"cases": [{"schedule": order,
                       "run": {"ran": order[rank], "peak_held": held_at_once(order[rank]),
                               "loss": loss,
                               "grads": [torch.as_tensor(g).clone() for g in grads[rank]]}}]}


DAMAGE = [
    ((), None), ((), {}), (("cases",), "x"), (("cases",), []), (("cases", 0), None),
    (("cases", 0, "schedule"), "a str"), (("cases", 0, "run"), None),
    (("cases", 0, "run", "ran"), ["F0"]), (("cases", 0, "run", "peak_held"), 7),
    (("cases", 0, "run", "grads"), [1, 2]), (("cases", 0, "run", "grads"), "x" * 1_000_000),
    (("cases", 0, "run", "loss"), "nan"),
]


def test_honest_reports_pass_the_judge():
    checks.judge_schedules([honest_report(0), honest_report(1)], 2, CASES)


def test_a_wrong_gradient_is_named_with_its_rank():
    import torch

    report = honest_report(1)
    report["cases"][0]["run"]["grads"][0] = torch.zeros(4, 4, dtype=torch.float64)
    with pytest.raises(CheckFailed, match="rank 1: its stage's weight gradient") as failed:
        checks.judge_schedules([honest_report(0), report], 2, CASES)
    assert names_ranks_first(str(failed.value).split("\n", 1)[1])


@pytest.mark.parametrize("path, value", DAMAGE, ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_instead_of_crashing_the_judge(path, value):
    """Rank 1's report is damaged (what a hostile rank may send): a CheckFailed of bounded size."""
    with pytest.raises(CheckFailed) as failed:
        checks.judge_schedules([honest_report(0), altered(honest_report(1), path, value)], 2,
                               CASES)
    assert len(str(failed.value)) < 5000
