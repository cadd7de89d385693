"""Chapter 11: the pipeline timelines the lesson counts its bubble from (no process group needed).

The lesson's orders are written out (chapters/11_beyond_ddp/pipeline_schedules.json): writing
them for any size is the exercise pipeline_schedule, whose reference (grader-only) they are held
to here. The real send/recv runs of both schedules, and torch.distributed.pipelining's, are
checked against the unsplit model by chapters/11_beyond_ddp/pipeline_by_hand.py itself (launched
by tests/test_chapter_scripts.py and by the lesson).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from autograder.hidden.pipeline_schedule import reference_schedule
from ddpcourse.memory_calculator import bubble_fraction
from ddpcourse.pipeline import Deadlock, bubble, timeline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "chapters" / "11_beyond_ddp"))

import pipeline_by_hand as pp  # noqa: E402

WRITTEN_OUT = [(kind, p, m) for kind in pp.SCHEDULES for p, m in [(2, 4), (4, 4), (4, 6)]]


def test_the_written_out_orders_are_the_ones_the_lesson_runs():
    table = json.loads(pp.WRITTEN_OUT.read_text())
    assert sorted(k for k in table if k != "about") == sorted(
        f"{kind} p={p} m={m}" for kind, p, m in WRITTEN_OUT)


@pytest.mark.parametrize("kind, p, m", WRITTEN_OUT)
def test_written_out_orders_are_the_reference_and_give_the_bubble_formula(kind, p, m):
    order = pp.written_out(kind, p, m)
    assert order == reference_schedule(p, m, kind)
    b = bubble(timeline(order))
    assert b["makespan"] == 2 * (m + p - 1)
    assert b["fraction"] == pytest.approx(bubble_fraction(p, m))
    assert b["peak_held"] == ([m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)])


def test_a_size_not_written_out_says_how_to_run_your_own():
    with pytest.raises(SystemExit, match="pass --schedules FILE"):
        pp.written_out("1f1b", 3, 5)


def test_an_order_that_waits_on_itself_is_reported_as_a_deadlock():
    order = [["F0", "B0"], ["B0", "F0"]]  # stage 1 wants B0 before it has run F0
    with pytest.raises(Deadlock, match="stage 1 at B0 waits for stage 1's F0"):
        timeline(order)


def test_a_one_microbatch_pipeline_idles_p_minus_1_of_p():
    # the article's layers-on-several-GPUs recipe: one whole batch through p devices
    for p in (2, 4):
        order = [["F0", "B0"]] * p
        assert bubble(timeline(order))["fraction"] == pytest.approx((p - 1) / p)
