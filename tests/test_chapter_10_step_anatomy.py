"""Chapter 10 (performance): ``step_anatomy.py``, a DDP step cut into its phases, and its trace.

The script is launched once, as its docstring says, with the trace written under ``tmp_path``;
its counted facts and orderings are read back, and ``claims`` is shown to catch wrong ones.
Timings are never asserted (a loaded machine may print anything): only that they are reported
with min/median and a verdict.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
from chapter_launch import launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "chapters" / "10_performance" / "step_anatomy.py"
sys.path.insert(0, str(SCRIPT.parent))

import step_anatomy as sa  # noqa: E402


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[str, Path]:
    trace = tmp_path_factory.mktemp("trace") / "step_trace.json"
    done = launch([SCRIPT, "--steps", "5", "--trace", trace], torchrun_ranks=2)
    return done.stdout, trace


def test_phases_buckets_and_the_trace(launched):
    printed, trace = launched
    assert "claims of the docstring: passed" in printed
    assert "buckets per step [1, 6, 6, 6, 6]" in printed
    for phase in ("forward", "backward", "waiting", "optimizer", "communication"):
        assert re.search(rf"^  {phase}\s+[\d.]+ /\s+[\d.]+$", printed, re.M), phase
    assert re.search(r"hidden behind backward: min \d+% / median \d+%", printed)
    assert re.search(r"^timings: (conclusive|TOO (LOADED|NOISY) TO CONCLUDE)", printed, re.M)
    assert len(re.findall(r"^rank \d last step, buckets launched-done", printed, re.M)) == 2
    assert str(trace) in printed and trace.stat().st_size < sa.TRACE_LIMIT_BYTES
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert any("all_reduce" in n for n in names)


def test_union_length_and_phases():
    assert sa.union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert sa.union_length([(0, 2), (1, 3), (5, 6)], lo=1, hi=5.5) == 2.5
    step = {"forward": 0.0, "backward": 1.0, "backward_done": 6.0,
            "optimizer": 6.0, "optimizer_done": 7.0}
    buckets = [{"launched": 2.0, "done": 3.0}, {"launched": 4.0, "done": 6.0}]
    p = sa.phases(step, buckets)
    assert (p["forward"], p["backward"], p["waiting"], p["optimizer"]) == (1, 3, 2, 1)
    assert p["communication"] == 3 and p["hidden_fraction"] == pytest.approx(1 / 3)


def fake_ranks() -> list[dict]:
    def step(n):
        t = {"forward": 0.0, "backward": 1.0, "backward_done": 9.0,
             "optimizer": 9.0, "optimizer_done": 10.0}
        return {"timers": t, "buckets": [{"index": i, "launched": 2.0 + i, "done": 3.0 + i}
                                         for i in range(n)]}
    return [{"rank": r, "steps": [step(1)] + [step(6)] * 3,
             "trace": {"bytes": 1000, "all_reduce_events": 4} if r == 0 else None}
            for r in range(2)]


def test_claims_catch_wrong_counts_and_orderings():
    assert sa.claims(fake_ranks()) == []
    for change in ("order", "late", "trace"):
        ranks = copy.deepcopy(fake_ranks())
        if change == "order":
            ranks[1]["steps"][2]["buckets"].reverse()
        elif change == "late":
            ranks[0]["steps"][3]["buckets"][-1]["done"] = 9.5
        else:
            ranks[0]["trace"]["all_reduce_events"] = 0
        assert len(sa.claims(ranks)) == 1, change
