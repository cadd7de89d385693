"""Chapter 11: the recorded 4-rank table (benchmarks/results/ch11_memory_traffic_ws4.json) is
complete, and today's calculator still predicts what was recorded beside the measurement."""

from __future__ import annotations

import sys
from pathlib import Path

from ddpcourse.timing import load_reference

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "chapters" / "11_beyond_ddp"))

import memory_and_traffic as mt  # noqa: E402


def test_the_recorded_table_matches_todays_calculator_and_its_exact_rows():
    record = load_reference("ch11_memory_traffic_ws4.json")
    rows = record["rows"]
    n = record["world_size"]
    assert sorted({(r["scheme"], r["rank"]) for r in rows}) == sorted(
        (s, rank) for s in mt.SCHEMES for rank in range(n))
    for r in rows:
        p = mt.prediction(r["scheme"], n, record["width"], record["depth"], record["batch"])
        assert (r["params_pred"], r["grads_pred"], r["optimizer_pred"], r["wire_pred"]) == (
            p["params"], p["grads"], p["optimizer"], p["wire_dp"])
        if r["scheme"] in ("ddp", "zero3"):
            assert (r["params"], r["grads"], r["optimizer"]) == (
                p["params"], p["grads"], p["optimizer"])
            assert abs(r["wire"] - p["wire_dp"]) < 1e-6
    zero1 = [r["optimizer"] for r in rows if r["scheme"] == "zero1"]
    assert sum(zero1) == 2 * sum(r["params"] for r in rows if r["scheme"] == "zero3")
