"""The suite's own profile (tests/suite_profile.py, benchmarks/suite_profile.py): what it counts
as CPU and how it splits a test's wall time into categories."""

from __future__ import annotations

import subprocess
import sys
import time

import suite_profile
from course_layout import import_by_path
from suite_profile import ROOT, _category_of_command, _descendant_cpu_s, _Intervals

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_nested_categories_count_once_for_the_outermost():
    spans = _Intervals()
    for category, start, end in [("grading", 0, 10), ("notebook", 2, 5), ("ranks", 4, 12),
                                 ("torchrun", 20, 30)]:
        spans.spans[category].append([start, end])
    assert spans.take(0, 12) == {"grading": 10, "notebook": 0, "torchrun": 0, "ranks": 2}
    assert spans.spans == {c: [] for c in suite_profile.CATEGORIES}  # closed spans are taken


def test_a_span_still_open_counts_to_the_end_and_stays_for_the_next_test():
    spans = _Intervals()
    span = spans.begin("torchrun")
    span[0] -= 5.0
    assert spans.take(span[0], span[0] + 5.0)["torchrun"] == 5.0
    assert spans.spans["torchrun"] == [span]


def test_commands_are_told_apart():
    assert _category_of_command("torchrun --standalone --nproc_per_node 2 x.py") == "torchrun"
    assert _category_of_command([sys.executable, "-m", "torch.distributed.run", "x.py"]) == "torchrun"
    assert _category_of_command([sys.executable, "-m", "autograder", "grade", "x"]) == "grading"
    assert _category_of_command(["nbgrader", "autograde", "ps1"]) == "grading"
    assert _category_of_command([sys.executable, "-c", "print(1)"]) is None


def test_a_running_childs_cpu_counts_and_an_ended_one_moves_to_rusage_children():
    before = _descendant_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.5) + "time.sleep(600)"])
    try:
        give_up = time.monotonic() + 120  # a loaded machine gives the child its 0.5 s slowly
        while _descendant_cpu_s() - before < 0.5 and time.monotonic() < give_up:
            time.sleep(0.2)
        assert _descendant_cpu_s() - before >= 0.5
    finally:
        child.kill()
        child.wait()
    assert _descendant_cpu_s() - before < 0.5  # reaped: now in RUSAGE_CHILDREN, not in the walk


def test_the_summary_totals_files_categories_and_the_slowest():
    script = import_by_path("suite_profile_script", ROOT / "benchmarks" / "suite_profile.py")
    tests = [{"nodeid": f"tests/test_{f}.py::t{i}", "file": f"tests/test_{f}.py", "worker": "gw0",
              "start": float(i), "wall_s": float(i), "cpu_self_s": 0.5, "cpu_children_s": 1.0,
              "categories_s": {"grading": 0, "notebook": float(i), "torchrun": 0, "ranks": 0,
                               "other": 0}, "outcome": "passed"}
             for i, f in enumerate(["a", "a", "b"])]
    result = script.profile({"wall_s": 9}, tests, [])
    assert [(f["file"], f["tests"], f["wall_s"], f["cpu_s"]) for f in result["files"]] == [
        ("tests/test_b.py", 1, 2.0, 1.5), ("tests/test_a.py", 2, 1.0, 3.0)]
    assert result["categories_wall_s"]["notebook"] == 3.0
    assert [t["nodeid"] for t in result["slowest_tests"]][0] == "tests/test_b.py::t2"
    assert result["workers"]["gw0"]["last_test_done_at_s"] == 4.0
    assert "tests/test_b.py" in script.summary(result)
