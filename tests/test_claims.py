"""The claims page (chapters/CLAIMS.md) is generated from its data and stays true.

* the page is what ``chapters/claims.yaml`` renders to, and states the torch the course pins;
* every row has an experiment or a source reference, and everything it names exists: the test
  node ids (read from the test files' syntax tree, not collected), scripts, lesson sections, the
  page's experiments and the torch source files and functions (in the installed torch);
* the page's own experiments (``ddpcourse/claims/experiments.py``) hold: each runs here, in well
  under a second, GPU ones skipped with the reason. The chapter tests a row names run in the
  suite for their own chapter; they are not run a second time here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from course_layout import TESTED_TORCH

from ddpcourse.claims import PAGE, Claims, chapters_of, load, parse, problems, render
from ddpcourse.claims.__main__ import ERROR, FAILED, HELD, SKIPPED, junit_outcomes, row_result
from ddpcourse.claims.experiments import CHECKS, NeedsHardware

ROOT = Path(__file__).resolve().parent.parent
CLAIMS = load()

# The examples issue 31 names, each of which must stay on the page.
MUST_HAVE = [
    "torchrun-cuda-visible-devices", "c10d-file-system", "max-restarts-just-the-failed-process",
    "launch-lacks-max-restarts", "two-node-command", "everyone-is-rank-0",
    "sampler-no-overlap-zero-padding", "set-epoch-every-epoch", "missing-set-epoch-duplicates",
    "find-unused-mechanism", "find-unused-workarounds", "broadcast-buffers-semantics",
    "loss-must-be-scalar-for-ddp", "all-ranks-take-part-in-save", "compile-before-ddp",
    "autocast-halves-allreduce", "ddp-memory-own-copy-only", "nccl-bandwidth-test-world-size-1",
    "sanity-allreduce-prints-4", "nccl-blocking-wait", "nccl-min-nrings", "sampler-nvlink-groups",
    "accumulation-more-communication", "taskset-numa", "empty-cache-useless",
    "reset-peak-instead-of-empty-cache", "dataloader-defaults", "persistent-workers-avoid-refork",
]


def test_the_page_is_generated_from_the_data():
    assert PAGE.read_text() == render(CLAIMS), (
        "chapters/CLAIMS.md is out of date with chapters/claims.yaml: run "
        "`python -m ddpcourse.claims --write` and commit both")


def test_the_page_states_the_torch_the_course_pins():
    assert CLAIMS.torch == TESTED_TORCH
    assert f"**torch {TESTED_TORCH}**" in PAGE.read_text()


def test_every_row_has_an_experiment_or_a_source_and_everything_it_names_exists():
    assert problems(CLAIMS) == []


def test_every_chapter_has_its_list_and_its_lesson_links_to_it():
    """Each lesson ends with a link to its own chapter's list on the page, which exists and
    names the rows whose experiment the chapter holds."""
    page = PAGE.read_text()
    for folder in sorted(p for p in (ROOT / "chapters").iterdir() if p.name[:2].isdigit()):
        number = folder.name[:2]
        assert f"\n### Chapter {number}\n" in page, folder.name  # the anchor chapter-NN
        lesson = (folder / f"{folder.name}.nb.py").read_text()
        assert f"(../CLAIMS.md#chapter-{number})" in lesson, (
            f"{folder.name}'s lesson does not link to its list on the claims page")
    rows_of_ch10 = [c.id for c in CLAIMS.claims if "10" in chapters_of(c)]
    assert "autocast-halves-allreduce" in rows_of_ch10 and "taskset-numa" in rows_of_ch10


def test_the_article_is_covered_section_by_section():
    sections = {c.section for c in CLAIMS.claims}
    assert set(CLAIMS.sections) == sections, set(CLAIMS.sections) ^ sections
    assert len(CLAIMS.claims) >= 45
    assert [i for i in MUST_HAVE if i not in {c.id for c in CLAIMS.claims}] == []


@pytest.mark.parametrize("name", sorted({c.check for c in CLAIMS.claims if c.check}))
def test_the_pages_experiment_holds(name):
    try:
        outcome = CHECKS[name]()
    except NeedsHardware as why:
        pytest.skip(str(why))
    assert outcome.holds, outcome.observed


def test_every_experiment_is_named_by_a_row():
    assert set(CHECKS) == {c.check for c in CLAIMS.claims if c.check}


# --- the checks can fail ------------------------------------------------------------------------

GOOD_ROW = {"id": "x", "section": "1", "claim": "c", "verdict": "false", "correct": "k",
            "evidence": ["torch/distributed/run.py::get_args_parser"],
            "experiment": {"tests": [
                "tests/test_claims.py::test_the_page_is_generated_from_the_data"]}}
BAD_ROWS = {
    "neither experiment nor source": {"evidence": [], "experiment": {"needs": "GPU"}},
    "a test that does not exist": {"experiment": {"tests": ["tests/test_claims.py::test_nothing"]}},
    "a test file that does not exist": {"experiment": {"tests": ["tests/test_none.py::test_x"]}},
    "a parameter naming a missing script": {"experiment": {"tests": [
        "tests/test_chapter_scripts.py::test_script_runs_under_torchrun_as_documented"
        "[chapters/07_training_loop/none.py]"]}},
    "a missing script": {"experiment": {"script": "chapters/03_torchrun/none.py"}},
    "a missing lesson heading": {"experiment": {
        "cell": "chapters/03_torchrun/03_torchrun.nb.py#No such heading"}},
    "an unknown experiment": {"experiment": {"check": "no_such_check"}},
    "a torch file that does not exist": {"evidence": ["torch/none.py::f"]},
    "a torch function that does not exist": {"evidence": ["torch/distributed/run.py::no_such"]},
    "evidence that is no reference": {"evidence": ["the docs say so"]},
    "an unknown verdict": {"verdict": "wrong"},
    "an unknown section": {"section": "9.9"},
    "an unknown field": {"experiment": {"test": ["tests/test_claims.py::test_x"]}},
    "an unknown pending chapter": {"pending": "chapter 12"},
}


def claims_of(*rows) -> Claims:
    return parse({"torch": TESTED_TORCH, "sections": {"1": "s"}, "claims": list(rows)})


def test_a_good_row_has_no_problem():
    assert problems(claims_of(GOOD_ROW)) == []


@pytest.mark.parametrize("name", BAD_ROWS)
def test_a_bad_row_is_reported(name):
    assert problems(claims_of({**GOOD_ROW, **BAD_ROWS[name]})) != []


def test_the_students_copy_without_tests_checks_everything_else(tmp_path):
    """The students' copy of the course has chapters/ and ddpcourse/ but no tests/: the page's
    data then has no problem, and a missing script is still one."""
    (tmp_path / "chapters").symlink_to(ROOT / "chapters")
    assert problems(CLAIMS, root=tmp_path) == []
    assert problems(claims_of({**GOOD_ROW, **BAD_ROWS["a missing script"]}), root=tmp_path) != []


def test_a_duplicate_id_is_reported():
    assert problems(claims_of(GOOD_ROW, GOOD_ROW)) == ["claim 'x': the id is used twice"]


# --- the student command ------------------------------------------------------------------------

REPORT = textwrap.dedent("""\
    <testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_p[1]"/>
      <testcase classname="tests.test_a" name="test_p[2]"><failure message="boom"/></testcase>
      <testcase classname="tests.test_a" name="test_q"><skipped message="needs a GPU"/></testcase>
      <testcase classname="tests.test_a" name="test_r"/>
      <testcase classname="tests.test_a" name="test_s"><error message="fixture broke"/></testcase>
      <testcase classname="tests.test_a" name="test_t">
        <failure message="RankTimeoutError: rank(s) [1] did not finish within 60 s"/></testcase>
    </testsuite></testsuites>""")


def test_a_pytest_report_gives_each_named_test_its_outcome():
    outcomes = junit_outcomes(REPORT)
    assert outcomes["tests/test_a.py::test_p"] == [(HELD, ""), (FAILED, "boom")]
    assert outcomes["tests/test_a.py::test_p[1]"] == [(HELD, "")]
    assert outcomes["tests/test_a.py::test_q"] == [(SKIPPED, "needs a GPU")]
    assert outcomes["tests/test_a.py::test_s"] == [(ERROR, "fixture broke")]
    assert outcomes["tests/test_a.py::test_t"][0][0] == ERROR  # a deadline is no verdict
    row = parse({"torch": "x", "sections": {"1": "s"}, "claims": [
        {**GOOD_ROW, "experiment": {"tests": ["tests/test_a.py::test_q", "tests/test_a.py::test_r"],
                                    "check": "c"}}]}).claims[0]
    tests = {"tests/test_a.py::test_q": (SKIPPED, "needs a GPU"),
             "tests/test_a.py::test_r": (HELD, "")}
    assert row_result(row, {"c": (HELD, "seen")}, tests)[0] == HELD
    assert row_result(row, {"c": (FAILED, "not seen")}, tests) == (FAILED, "not seen")
    deadline = {**tests, "tests/test_a.py::test_r": (ERROR, "deadline")}
    assert row_result(row, {"c": (HELD, "seen")}, deadline) == (ERROR, "deadline")
    gpu_only = {"tests/test_a.py::test_q": (SKIPPED, "needs a GPU")}
    assert row_result(row, {"c": (SKIPPED, "needs a GPU")}, gpu_only) == (SKIPPED, "needs a GPU")


def test_the_student_command_runs_from_the_repository_root_without_the_tests():
    done = subprocess.run([sys.executable, "-m", "ddpcourse.claims", "--no-tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"checked against torch {TESTED_TORCH}" in done.stdout
    for c in CLAIMS.claims:
        assert f" {c.id} " in done.stdout
    assert "0 contradicted" in done.stdout
