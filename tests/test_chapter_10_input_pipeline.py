"""Chapter 10 (performance): ``input_pipeline.py``, workers, prefetch, persistence and pinning
counted. Launched once as its docstring says; its counts are read back (never its timings) and
``claims`` is shown to catch wrong ones."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
from chapter_launch import launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "chapters" / "10_performance" / "input_pipeline.py"
sys.path.insert(0, str(SCRIPT.parent))

import input_pipeline as ip  # noqa: E402


@pytest.fixture(scope="module")
def printed() -> str:
    return launch([SCRIPT], torchrun_ranks=2).stdout


def test_the_counts_and_the_timing_report(printed):
    assert "claims of the docstring: passed" in printed
    pids = eval(re.search(r"worker pids (\[\[.*?\]\])\n", printed).group(1))
    assert [len(p) for p in pids] == [2, 2] and len({q for p in pids for q in p}) == 4
    assert "prefetch_factor=3): [6, 6]" in printed
    assert "pin_memory=True: batch pinned False (accelerator present: False)" in printed
    assert len(re.findall(r"num_workers=[02]: min [\d.]+ ms, median [\d.]+ ms", printed)) == 2
    assert re.search(r"^timings: (conclusive|TOO (LOADED|NOISY) TO CONCLUDE)", printed, re.M)
    assert "pin_memory +18 %, persistent_workers +12 % (not measured here)" in printed


def fake():
    return [{"worker_pids": [10 + 2 * r, 11 + 2 * r], "requested_before_first": 6,
             "persistent=False": [[1, 2], [3, 4]], "persistent=True": [[5, 6], [5, 6]],
             "pinned": False, "accelerator": False} for r in range(2)]


def test_claims_catch_wrong_counts():
    assert ip.claims(fake()) == []
    for change in ("shared workers", "prefetch", "persistent", "pinned"):
        ranks = copy.deepcopy(fake())
        if change == "shared workers":
            ranks[1]["worker_pids"] = ranks[0]["worker_pids"]
        elif change == "prefetch":
            ranks[0]["requested_before_first"] = 2
        elif change == "persistent":
            ranks[1]["persistent=True"] = [[5, 6], [7, 8]]
        else:
            ranks[0]["pinned"] = True
        assert len(ip.claims(ranks)) == 1, change
