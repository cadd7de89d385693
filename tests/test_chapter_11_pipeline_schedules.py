"""Chapter 11: the pipeline timelines the lesson counts its bubble from (no process group needed).

The real send/recv runs of both schedules, and torch.distributed.pipelining's, are checked
against the unsplit model by chapters/11_beyond_ddp/pipeline_by_hand.py itself (launched by
tests/test_chapter_scripts.py and by the lesson).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpcourse.memory_calculator import bubble_fraction

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "chapters" / "11_beyond_ddp"))

import pipeline_by_hand as pp  # noqa: E402


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_counted_idle_slots_give_the_bubble_formula(kind, p, m):
    order = pp.SCHEDULES[kind](p, m)
    assert all(sorted(steps) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
               for steps in order)
    b = pp.bubble(pp.timeline(order))
    assert b["makespan"] == 2 * (m + p - 1)
    assert b["fraction"] == pytest.approx(bubble_fraction(p, m))
    expected_held = [m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)]
    assert b["peak_held"] == expected_held


def test_an_order_that_waits_on_itself_is_reported_as_a_deadlock():
    order = [["F0", "B0"], ["B0", "F0"]]  # stage 1 wants B0 before it has run F0
    with pytest.raises(RuntimeError, match="deadlock"):
        pp.timeline(order)


def test_a_one_microbatch_pipeline_idles_p_minus_1_of_p():
    # the article's layers-on-several-GPUs recipe: one whole batch through p devices
    for p in (2, 4, 8):
        assert pp.bubble(pp.timeline(pp.gpipe(p, 1)))["fraction"] == pytest.approx((p - 1) / p)
