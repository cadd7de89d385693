"""The checks of exercise $slug (chapter $number, $topic) pass its solution and catch FILL IN,
in the student's kernel and judged by the trusted grader (autograder/trusted.py, where only the
ranks' observations come back), and read the ranks' reports as untrusted data.
The exercise: solutions/$assignment/$slug.nb.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autograder.hidden import $slug as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import $slug as checks
from rank_lines import names_ranks_first
from trusted_path import altered, submitted

# What the notebook's locked setup cell does before any student code (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("integrity_snapshot")


def the_solution():
    """``$slug`` as the source notebook's solution cell defines it. (autograder.sources is
    imported here, not above: the ranks import this module to rebuild its functions, and
    nbformat would cost each of them seconds.)"""
    from autograder.sources import SOLUTIONS, solution_code

    source = SOLUTIONS / "$assignment" / "$slug.ipynb"
    namespace = {"torch": torch, "dist": dist}  # what the setup cell imports that it uses
    exec(compile(solution_code(source, "$grade_id"), "<student notebook>", "exec"), namespace)
    return namespace["$slug"]


# --- wrong answers, each what a student could hand in (FILL IN the ones your checks catch) ------


def returns_its_own_tensor(tensor):
    """Forgets to communicate."""
    return tensor.clone()


def sums_in_place(tensor):
    """The right sum, written into the caller's tensor."""
    dist.all_reduce(tensor)
    return tensor


def averages(tensor):
    """The mean over the ranks, not the sum."""
    total = tensor.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def returns_a_list(tensor):
    total = tensor.clone()
    dist.all_reduce(total)
    return total.tolist()


def test_the_reference_solution_passes_every_check():
    right = the_solution()
    checks.check_${slug}_two_ranks(right)
    hidden.check_$slug(right)


@pytest.mark.parametrize("wrong, check, message", [
    (returns_its_own_tensor, checks.check_${slug}_two_ranks,
     r"^rank 0: 2 ranks, a float32 tensor of 4 elements: expected \["),
    (sums_in_place, checks.check_${slug}_two_ranks, r"the tensor passed in was changed"),
    (averages, checks.check_${slug}_two_ranks, r"2 ranks, a float32 tensor of 4 elements"),
    (returns_a_list, checks.check_${slug}_two_ranks, r"expected a tensor, got list: \["),
    (averages, hidden.check_$slug, r"3 ranks, a float64 tensor of 9 elements"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_checks_catch(wrong, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("wrong, check, message", [
    (returns_its_own_tensor, checks.check_${slug}_two_ranks, r"^rank 0: 2 ranks"),
    (averages, hidden.check_$slug, r"3 ranks, a float64 tensor of 9 elements"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(wrong, host))
    assert names_ranks_first(str(failed.value))  # each failed rank is named


# --- written-out values: none yet ------------------------------------------------------------
# A visible judge that compares with values written out in the visible module (literals, or
# digests: ddpcourse/grading/written_out.py) gets a test here holding each of them to the hidden
# reference (regenerate a value from the reference when an input changes; never edit it by hand).


def test_the_hidden_reference_is_the_visible_invariant():
    """The hidden reference and the visible judge's invariant agree on honest inputs."""
    for length, dtype, seed in checks.VISIBLE_CASES:
        held = [checks.make_tensor(rank, length, dtype, seed) for rank in range(2)]
        assert torch.equal(hidden.reference_sum(2, length, dtype, seed), torch.stack(held).sum(0))


# --- the judges read the ranks' reports as untrusted data ----------------------------------


def honest_reports(world_size=2, cases=checks.VISIBLE_CASES):
    """What the ranks of a right answer report (built here: the observation needs a group)."""
    held = [[checks.make_tensor(rank, *case) for case in cases] for rank in range(world_size)]
    sums = [torch.stack([held[rank][number] for rank in range(world_size)]).sum(0)
            for number in range(len(cases))]
    return [{"calls": [{"held": held[rank][number], "unchanged": True,
                        "result": sums[number].clone(), "type": "Tensor", "text": ""}
                       for number in range(len(cases))]} for rank in range(world_size)]


DAMAGE = [
    ((), None), ((), [1, 2]), (("calls",), "all"), (("calls",), []), (("calls", 0), None),
    (("calls", 0, "result"), None), (("calls", 0, "result"), [1.0, 2.0, 3.0, 4.0]),
    (("calls", 0, "result"), torch.zeros(4)), (("calls", 0, "result"), torch.zeros(4, 1)),
    (("calls", 0, "result"), torch.zeros(4, dtype=torch.float64)),
    (("calls", 0, "held"), None), (("calls", 0, "held"), torch.zeros(5)),
    (("calls", 0, "unchanged"), "yes"), (("calls", 0, "unchanged"), False),
    (("calls", 1), {"held": checks.make_tensor(1, *checks.VISIBLE_CASES[1]), "unchanged": True,
                    "result": None, "type": "str", "text": "x" * 1_000_000}),
]


def test_honest_reports_pass_the_judges():
    checks.judge_$slug(honest_reports(), 2, checks.VISIBLE_CASES)
    hidden.judge_with_the_reference(honest_reports(), 2, checks.VISIBLE_CASES)


@pytest.mark.parametrize("path, value", DAMAGE, ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    reports = honest_reports()
    reports[1] = altered(reports[1], path, value)
    with pytest.raises(CheckFailed) as failed:
        checks.judge_$slug(reports, 2, checks.VISIBLE_CASES)
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
