"""Verdicts computed where no student code ran (autograder/trusted.py): the pieces, one by one.

The whole pipeline, with hostile submissions, is graded in tests/test_hostile_submissions.py.
"""

from __future__ import annotations

import os
import pickle


import nbformat
import pytest
import torch
import torch.distributed as dist

from autograder import trusted
from autograder.cell_grammar import CellGrammarError, parse_graded_cell
from autograder.hidden import allreduce_by_hand as hidden
from autograder.sources import SOLUTIONS
from ddpcourse.grading import frames
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import allreduce_by_hand as checks
from ddpcourse.launcher import RankTimeoutError
from rank_lines import ranks_named
from trusted_path import submitted

SOURCE = SOLUTIONS / "05_allreduce" / "allreduce_by_hand.ipynb"


def average_gradients(model):
    world_size = dist.get_world_size()
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            parameter.grad /= world_size


def rebinds_the_check(model):
    """Attack: rebind the comparison inside the rank, through an alias of the module."""
    from ddpcourse.grading import checks as grading
    alias = grading
    alias.expect_close = lambda *args, **kwargs: None
    import torch as t
    t.allclose = lambda *args, **kwargs: True
    t.equal = lambda *args, **kwargs: True


def fakes_the_report(model):
    """Attack: replace the observation function the rank is running, so the report claims the
    right gradients without computing them."""
    import ddpcourse.grading.exercises.allreduce_by_hand as case_module
    case_module.type_name = lambda value: "None"
    for parameter in model.parameters():
        parameter.grad = None


def test_a_correct_function_passes_visible_and_hidden_checks_run_here(host):
    fn = submitted(average_gradients, host)
    checks.check_average_gradients_two_ranks(fn)
    checks.check_average_gradients_skips_missing(fn)
    hidden.check_average_gradients(fn)


@pytest.mark.parametrize("attack", [rebinds_the_check, fakes_the_report])
def test_what_the_student_changes_inside_the_ranks_cannot_change_the_verdict(host, attack):
    with pytest.raises(CheckFailed) as failed:
        checks.check_average_gradients_two_ranks(submitted(attack, host))
    assert {0, 1} <= set(ranks_named(str(failed.value)))


def test_a_deadlock_in_the_sandboxed_ranks_is_reported_with_where_it_was(host):
    def waits_forever(model):
        import time
        time.sleep(120)

    with pytest.raises(CheckFailed, match="did not finish within") as failed:
        run_student(checks.AVERAGE_GRADIENTS, 2, submitted(waits_forever, host), timeout=5.0)
    assert "waits_forever" in str(failed.value)


def test_the_source_notebook_says_which_checks_each_cell_runs():
    cells = {cell.grade_id: cell for cell in trusted.graded_cells(SOURCE)}
    hidden_cell = cells["test-ring-allreduce-hidden"]
    assert [(c.module, c.check, c.arguments) for c in hidden_cell.calls] == [
        ("autograder.hidden.allreduce_by_hand", "check_ring_allreduce", (("ring_allreduce",),))]
    assert cells["test-average-gradients-two-ranks"].calls[0].check == \
        "check_average_gradients_two_ranks"
    assert sum(cell.points for cell in cells.values()) == 13
    assert trusted.graded_names(list(cells.values())) == ["average_gradients", "ring_allreduce"]


def test_no_check_reaches_the_kernel_only_the_test_cells_comments(tmp_path):
    copy = tmp_path / SOURCE.name
    copy.write_bytes(SOURCE.read_bytes())
    trusted.stand_in_test_cells(copy)
    text = copy.read_text()
    assert "autograder.hidden" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "checks.check_" not in text and "assert_untampered" not in text
    assert text.count("graded outside this notebook") == 7  # one per test cell
    assert "# Test (2 points): two ranks, every parameter has a gradient." in text
    assert "def ring_allreduce" in text  # solution and other cells untouched


VISIBLE = """# Test (2 points): something.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import demo as checks
integrity.assert_untampered()
{call}
print("passed")"""


@pytest.mark.parametrize("call, arguments", [
    ("checks.check_a(f)", (("f",),)),
    ("checks.check_a(f, g)", (("f",), ("g",))),
    ("checks.check_a(together(f, g))", (("f", "g"),)),
    ("checks.check_a(h, together(f, g))", (("h",), ("f", "g"))),
])
def test_the_grammar_reads_names_and_functions_given_together(call, arguments):
    [read] = parse_graded_cell(VISIBLE.format(call=call), "demo")
    assert (read.module, read.check, read.arguments) == (
        "ddpcourse.grading.exercises.demo", "check_a", arguments)


@pytest.mark.parametrize("call, why", [
    ("checks.check_a(f, strict=True)", "by position"),
    ("checks.check_a()", "by position"),
    ("checks.check_a(f())", "neither a function's name"),
    ("checks.check_a(together(f))", "neither a function's name"),
    ("checks.check_a(together(f, g=g))", "neither a function's name"),
    ("checks.check_a(lambda: f)", "neither a function's name"),
    ("checks.check_a([f, g])", "neither a function's name"),
    ("hidden.check_a(f)", "only calls of checks.check_"),
    ("checks.helper(f)", "only calls of checks.check_"),
    ("x = checks.check_a(f)", "only calls of checks.check_"),
    ("import os", "only calls of checks.check_"),
])
def test_the_grammar_refuses_what_the_grader_cannot_read(call, why):
    with pytest.raises(CellGrammarError, match=why) as refused:
        parse_graded_cell(VISIBLE.format(call=call), "demo", "demo.ipynb, cell test-a")
    assert str(refused.value).startswith("demo.ipynb, cell test-a: ")


@pytest.mark.parametrize("source, why", [
    (VISIBLE.format(call="checks.check_a(f)").replace("integrity.assert_untampered()\n", ""),
     "the first thing a test cell runs"),
    (VISIBLE.format(call="checks.check_a(f)").replace('print("passed")', ""), "ends with"),
    (VISIBLE.format(call="").replace("\n\n", "\n"), "at least one check"),
    ("from os import path\n" + VISIBLE.format(call="checks.check_a(f)"), "imports only"),
    ("integrity.assert_untampered()\n### BEGIN HIDDEN TESTS\nhidden.check_a(f)\n"
     "print('passed')\n### END HIDDEN TESTS", "starts with `from autograder.hidden import demo"),
    ("integrity.assert_untampered()\n### BEGIN HIDDEN TESTS\n"
     "from autograder.hidden import demo as hidden\nhidden.check_a(f)\n### END HIDDEN TESTS",
     "ends with"),
    ("integrity.assert_untampered()\n### BEGIN HIDDEN TESTS\n"
     "from autograder.hidden import demo as hidden\nhidden.check_a(f)\nprint('passed')\n",
     "without ### END HIDDEN TESTS"),
])
def test_the_grammar_refuses_a_cell_out_of_shape(source, why):
    with pytest.raises(CellGrammarError, match=why):
        parse_graded_cell(source, "demo")


def test_a_hidden_block_is_read_as_grader_only_calls():
    source = ("# Hidden tests: they run when your notebook is graded.\n"
              "from ddpcourse.grading import integrity\nintegrity.assert_untampered()\n"
              "### BEGIN HIDDEN TESTS\nfrom autograder.hidden import demo as hidden\n"
              "hidden.check_b(together(f, g))\nprint('passed')\n### END HIDDEN TESTS")
    [read] = parse_graded_cell(source, "demo")
    assert (read.module, read.check, read.names) == ("autograder.hidden.demo", "check_b",
                                                     ("f", "g"))


def test_missing_functions_and_grader_errors_score_zero_with_a_reason(host):
    cells = trusted.graded_cells(SOURCE)[:1]
    verdict, = trusted.grade_cells(cells, {}, host)
    assert verdict.score == 0 and "average_gradients was not defined" in verdict.message


def explains_and_passes(fn):
    print("What happened: the explanation the graded feedback reveals.")


def explains_and_fails(fn):
    print("printed before the failure")
    raise CheckFailed("the field 'rank' is wrong")


def test_what_a_passing_check_prints_goes_into_the_cells_feedback(tmp_path):
    """A check may print what a lab reveals once it is graded (chapter 09's explanations): on a
    pass it follows the verdict in the cell's output; a failure shows its message only."""
    cells = [trusted.GradedCell(grade_id, 1.0, (trusted.CheckCall(__name__, check, (("f",),)),))
             for grade_id, check in (("passes", "explains_and_passes"),
                                     ("fails", "explains_and_fails"))]
    passed, failed = trusted.grade_cells(cells, {"f": b""}, host=None)
    assert (passed.score, passed.printed) == (
        1.0, "What happened: the explanation the graded feedback reveals.\n")
    assert (failed.score, failed.printed, failed.message) == (0.0, "", "the field 'rank' is wrong")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "pass", metadata={"nbgrader": {"grade_id": grade_id}}) for grade_id in ("passes", "fails")])
    path = tmp_path / "graded.ipynb"
    nbformat.write(notebook, path)
    trusted.annotate(path, [passed, failed])
    first, second = (cell.outputs[0].text for cell in nbformat.read(path, as_version=4).cells)
    assert "passed (1 of 1 points)" in first and "the explanation the graded feedback" in first
    assert "FAILED (0 of 1 points)" in second and "printed before the failure" not in second


def test_observations_must_be_plain_data():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(frames.FrameError):
        frames.tensors_from_bytes(pickle.dumps([Evil()], protocol=2))
    data = [{"result": torch.arange(3), "returned": "None", "bytes": 12}]
    assert frames.tensors_from_bytes(frames.tensors_to_bytes(data))[0]["bytes"] == 12


def test_a_frame_over_the_limit_is_refused_before_it_is_read():
    read, write = os.pipe()
    frames.write_frame(write, {"status": "ok"}, b"x" * 1000)
    with pytest.raises(frames.FrameError, match="over the limit"):
        frames.read_frame(read, max_body_bytes=100)
    os.close(read), os.close(write)


@pytest.mark.parametrize("observations", [
    [None, None], [{"returned": 3}, {}], [{"returned": "None", "grads": [], "weights": {}}] * 2,
    [{"returned": "None", "grads": {"inp.weight": "x"}, "weights": {}}] * 2,
])
def test_malformed_reports_fail_the_check_instead_of_the_grader(observations):
    with pytest.raises(CheckFailed):
        checks.judge_average_gradients(observations, 2)


def test_a_rank_report_is_rebuilt_from_checked_fields_only():
    header = {"timed_out": True, "backend": "gloo", "failures": [
        {"rank": 1, "kind": "timeout", "stack": "s" * 100_000, "exitcode": "x"},
        {"rank": 7, "kind": "raised"}, {"rank": 0, "kind": "pwned"}, "junk"]}
    error = trusted.rebuild_rank_error(header, world_size=2)
    assert isinstance(error, RankTimeoutError)
    assert [(f.rank, f.kind) for f in error.failures] == [(1, "timeout")]
    assert len(error.failures[0].stack) <= 20_000 and error.failures[0].exitcode is None
