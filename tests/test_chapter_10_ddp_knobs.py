"""Chapter 10 (performance): ``ddp_knobs.py``, gradient_as_bucket_view, no_sync and static_graph
counted. Launched once as its docstring says; its counts are read back and ``claims`` is shown
to catch wrong ones."""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
from chapter_launch import launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "chapters" / "10_performance" / "ddp_knobs.py"
sys.path.insert(0, str(SCRIPT.parent))

import ddp_knobs as dk  # noqa: E402

GRAD = 6 * 256 * 257 * 4


@pytest.fixture(scope="module")
def printed() -> str:
    return launch([SCRIPT], torchrun_ranks=2).stdout


def test_the_counts(printed):
    assert "claims of the docstring: passed" in printed
    assert (f"gradient_as_bucket_view=False: buckets {GRAD} bytes + .grad outside them {GRAD} "
            f"bytes = {2 * GRAD} bytes") in printed
    assert f"gradient_as_bucket_view=True: buckets {GRAD} bytes + .grad outside them 0" in printed
    assert f"saved by gradient_as_bucket_view: {GRAD} bytes" in printed
    rows = {name: (eval(calls), eval(sent)) for name, calls, sent in re.findall(
        r"^  (\S.*?)\s+calls (\[[\d, ]+\]), bytes (\[[\d, ]+\])", printed, re.M)}
    # three buckets of two layers each (bucket_cap_mb=0.5) from step 1
    assert rows["without no_sync"] == ([10, 12, 12], [4 * GRAD] * 3)
    assert rows["with no_sync"] == ([1, 3, 3], [GRAD] * 3)
    assert rows["static_graph"][0][1:] == [12, 12] and rows["static_graph"][1] == [4 * GRAD] * 3
    assert rows["find_unused_parameters"][1] == [4 * GRAD] * 3


def counts():
    memory = {False: {"bucket_bytes": GRAD, "grad_bytes_outside_buckets": GRAD,
                      "grads_in_buckets": 0, "parameters": 12},
              True: {"bucket_bytes": GRAD, "grad_bytes_outside_buckets": 0,
                     "grads_in_buckets": 12, "parameters": 12}}
    acc = {"without no_sync": {"calls": [10, 12, 12], "sent_bytes": [4 * GRAD] * 3,
                               "weight_sum": 20.5},
           "with no_sync": {"calls": [1, 3, 3], "sent_bytes": [GRAD] * 3, "weight_sum": 20.5},
           "static_graph": {"calls": [8, 12, 12], "sent_bytes": [4 * GRAD] * 3},
           "find_unused_parameters": {"calls": [16, 16, 16], "sent_bytes": [4 * GRAD] * 3}}
    return memory, acc


def test_claims_catch_wrong_counts():
    assert dk.claims(*counts(), GRAD) == []
    for change in ("view copies", "no_sync sends", "no_sync changes weights", "static more",
                   "unused more"):
        memory, acc = copy.deepcopy(counts())
        if change == "view copies":
            memory[True]["grad_bytes_outside_buckets"] = GRAD
        elif change == "no_sync sends":
            acc["with no_sync"]["sent_bytes"][-1] = 2 * GRAD
        elif change == "no_sync changes weights":
            acc["with no_sync"]["weight_sum"] = 21.5
        elif change == "static more":
            acc["static_graph"]["calls"][-1] = 16
        else:
            acc["find_unused_parameters"]["sent_bytes"][-1] = 5 * GRAD
        assert len(dk.claims(memory, acc, GRAD)) == 1, change
