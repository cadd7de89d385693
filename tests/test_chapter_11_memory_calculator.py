"""Chapter 11: ddpcourse.memory_calculator's formulas, against bytes counted in real process groups.

The measured side is chapters/11_beyond_ddp/memory_and_traffic.py's ``measure_all`` (one Adam
step of DDP, ZeroRedundancyOptimizer, FSDP2 without and with resharding after forward), run at
1, 2 and 4 gloo ranks. What the calculator leaves out is checked to be exactly what the run adds
(DDP's bucket copies, ZeroRedundancyOptimizer's whole-tensor partition, FSDP2's dim-0 padding).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpcourse.launcher import run_ranks
from ddpcourse.memory_calculator import bubble_fraction, estimate, format_bytes, ring_factor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "chapters" / "11_beyond_ddp"))

import memory_and_traffic as mt  # noqa: E402

WIDTH, DEPTH, BATCH = 64, 3, 4
PARAMS = DEPTH * (WIDTH * WIDTH + WIDTH)


# ------------------------------------------------------------------ the formulas, by hand


def test_ddp_replicates_everything_and_all_reduces_the_gradients():
    e = estimate(parameters=1000, batch=2, sequence=3, layers=4, hidden=5, dp=4)
    assert e["params"] == e["grads"] == 4000
    assert e["optimizer"] == 8000  # Adam: two values per parameter
    assert e["wire_dp"] == pytest.approx(2 * 3 / 4 * 4000)
    assert e["activations"] == 1 * 5 * 3 * 2 * 4 * 4
    assert e["total"] == e["params"] + e["grads"] + e["optimizer"] + e["activations"]


@pytest.mark.parametrize("stage,shares", [(0, (1, 1, 1)), (1, (1, 1, 1 / 8)),
                                          (2, (1, 1 / 8, 1 / 8)), (3, (1 / 8, 1 / 8, 1 / 8))])
def test_each_zero_stage_shards_one_more_kind_of_state(stage, shares):
    e = estimate(parameters=800, batch=1, sequence=1, layers=1, hidden=1, dp=8,
                 zero_stage=stage)
    assert (e["params"], e["grads"], e["optimizer"] / 2) == tuple(3200 * s for s in shares)
    assert e["wire_dp"] == pytest.approx((3 if stage == 3 else 2) * 7 / 8 * 3200)


def test_tensor_and_pipeline_degrees_split_the_model_and_add_their_traffic():
    base = dict(parameters=8e6, batch=8, sequence=16, layers=8, hidden=32)
    e = estimate(**base, tp=2, pp=2, microbatches=4, schedule="gpipe")
    assert e["params"] == 8e6 * 4 / 4
    assert e["activations"] == 1 * 32 * 16 * 2 * 4 / 2 * 4 * 4  # 4 layers, half width, 4 in flight
    assert e["wire_tp"] == pytest.approx(2 * 4 * 4 * 2 * 0.5 * 2 * 16 * 32 * 4)
    assert e["wire_pp"] == 2 * 8 * 16 * 32 * 4
    one_f_one_b = estimate(**base, tp=2, pp=2, microbatches=4, schedule="1f1b")
    assert one_f_one_b["activations"] == e["activations"] / 2  # 2 in flight instead of 4
    assert estimate(**base)["wire_tp"] == estimate(**base)["wire_pp"] == 0


def test_one_rank_sends_nothing_and_bad_inputs_are_refused():
    assert estimate(parameters=10, batch=1, sequence=1, layers=1, hidden=1)["wire_total"] == 0
    assert ring_factor(1) == 0 and ring_factor(4) == 0.75
    for bad in ({"dp": 0}, {"zero_stage": 4}, {"schedule": "zb"}, {"tp": 1.5},
                {"parameters": -1}):
        with pytest.raises(ValueError):
            estimate(**{**dict(parameters=10, batch=1, sequence=1, layers=1, hidden=1), **bad})
    assert bubble_fraction(4, 8) == 3 / 11
    assert format_bytes(1536) == "1.50 KiB" and format_bytes(12) == "12 B"


# ------------------------------------------------ the formulas against counted bytes


@pytest.fixture(scope="module")
def measured():
    """measure_all at 1, 2 and 4 ranks: {world_size: [per rank: [per scheme: row]]}."""
    return {n: run_ranks(mt.measure_all, n, WIDTH, DEPTH, BATCH, backend="gloo", timeout=180)
            for n in (1, 2, 4)}


def rows(measured, n, scheme):
    return [next(r for r in per_rank if r["scheme"] == scheme) for per_rank in measured[n]]


def predicted(scheme, n):
    return mt.prediction(scheme, n, WIDTH, DEPTH, BATCH)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ddp_and_zero_rows_equal_the_prediction_where_it_is_exact(measured, n, no_orphans):
    full = PARAMS * 4
    for r in rows(measured, n, "ddp"):
        p = predicted("ddp", n)
        assert r["params"] == p["params"] == full
        assert r["grads"] == p["grads"] == full
        assert r["optimizer"] == p["optimizer"] == 2 * full
        assert r["buckets"] == full  # what the calculator leaves out: DDP's bucket copy
        assert mt.wire_bytes(r, n) == pytest.approx(p["wire_dp"])
    zero1 = rows(measured, n, "zero1")
    # ZeroRedundancyOptimizer: Adam state of the parameters the rank owns, whole tensors
    assert sum(r["optimizer"] for r in zero1) == 2 * full
    for r in zero1:
        assert r["optimizer"] == 2 * r["owned_param_bytes"]
        assert r["params"] == r["grads"] == full
        assert r["allreduce_payload"] == full and r["broadcast_payload"] == full
    # the shards are uneven: whole tensors, and there are fewer weight matrices than ranks at 4
    if n == 4:
        assert max(r["optimizer"] for r in zero1) > 10 * min(r["optimizer"] for r in zero1)


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("scheme", ["zero2", "zero3"])
def test_fsdp2_rows_equal_the_prediction(measured, n, scheme):
    p = predicted(scheme, n)
    for r in rows(measured, n, scheme):
        # 64 rows split evenly over 1, 2, 4 ranks: no padding here
        assert r["params"] == r["grads"] == p["grads"] == PARAMS * 4 / n
        assert r["optimizer"] == p["optimizer"]
        assert r["buckets"] == 0
        # counted: one all-gather of every parameter per step (zero2) or two (zero3, as
        # forward and backward), one reduce-scatter of every gradient
        gathers = 2 if scheme == "zero3" else 1
        if n > 1:
            assert r["all_gather_payload"] == gathers * PARAMS * 4
            assert r["reduce_scatter_payload"] == PARAMS * 4
        else:  # a one-rank mesh: FSDP2 calls no collective at all
            assert r["all_gather_payload"] == r["reduce_scatter_payload"] == 0
        assert mt.wire_bytes(r, n) == pytest.approx(p["wire_dp"])


def test_every_scheme_trains_like_one_process(measured):
    for n, per_rank in measured.items():
        reference = mt.one_process_weights(n, WIDTH, DEPTH, BATCH)
        for row in (r for rank_rows in per_rank for r in rank_rows):
            err = max((row["weights"][k] - w).abs().max().item() for k, w in reference.items())
            assert err < 1e-5, (n, row["rank"], row["scheme"], err)


@pytest.mark.parametrize("batch,depth", [(4, 3), (16, 2)])
def test_activation_bytes_are_the_tensors_autograd_saves(batch, depth):
    """Counted with saved_tensors_hooks: every tensor autograd keeps for backward, less the
    parameters (held anyway), each storage once. A Linear + ReLU layer adds one storage: the
    ReLU's output, which is also the next Linear's saved input (saved_values_per_layer=1); the
    first Linear's saved input, the batch itself, is the one tensor more."""
    import torch

    model = mt.make_mlp(WIDTH, depth)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.randn(batch, WIDTH))
    e = estimate(parameters=PARAMS, batch=batch, sequence=1, layers=depth, hidden=WIDTH)
    assert sum(saved.values()) == e["activations"] + batch * WIDTH * 4
    out.sum().backward()
