"""Chapter 10 (performance): the α–β cost model (``ddpcourse.cost_model``), its fit
(``benchmarks/ch10_allreduce.py``) and the recorded all-reduce run it was fitted to.

The model is arithmetic: every test here is exact or follows from the formulas. DDP's own bucket
rule is compared with torch's (``dist._compute_bucket_assignment_by_size``, the function
``DistributedDataParallel.__init__`` calls), so a torch that changes it fails here first.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from chapter_launch import launch
from course_layout import import_by_path

from ddpcourse import cost_model as cm
from ddpcourse.timing import load_reference

ROOT = Path(__file__).resolve().parent.parent
bench = import_by_path("ch10_allreduce_benchmark", ROOT / "benchmarks" / "ch10_allreduce.py")

LINK = cm.Link(alpha_s=50e-6, beta_bytes_per_s=1e9)


def test_one_allreduce_costs_alpha_plus_the_ring_bytes_over_beta():
    assert cm.allreduce_time(1e6, 2, LINK) == pytest.approx(50e-6 + 1e6 / 1e9)
    assert cm.allreduce_time(1e6, 4, LINK) == pytest.approx(50e-6 + 1.5 * 1e6 / 1e9)
    assert cm.allreduce_time(0, 4, LINK) == pytest.approx(50e-6)  # a call costs α even empty
    assert cm.allreduce_time(1e9, 1, LINK) == 0.0  # one rank sends nothing
    assert cm.bus_factor(8) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        cm.Link(1e-6, 0)
    with pytest.raises(ValueError):
        cm.allreduce_time(-1, 2, LINK)


@pytest.mark.parametrize("cap_mb, first_mb", [(25, 1), (25, None), (1, None), (0.01, 1), (4, 4)])
def test_bucket_sizes_follow_ddps_own_assignment(cap_mb, first_mb):
    rng = random.Random(f"{cap_mb} {first_mb}")
    shapes = [(rng.randint(1, 300), rng.randint(1, 300)) for _ in range(40)]
    params = [torch.empty(s) for s in shapes]
    cap, first = int(cap_mb * cm.MiB), int(first_mb * cm.MiB) if first_mb else None
    caps = [first if first else cap, cap]
    # DDP's call (torch/nn/parallel/distributed.py, DistributedDataParallel.__init__): the
    # parameters in reverse order, the caps [first, cap].
    indices, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), caps, [False] * len(params))
    theirs = [sum(params[len(params) - 1 - i].numel() * 4 for i in bucket) for bucket in indices]
    assert cm.bucket_sizes([p.numel() * 4 for p in params], cap, first) == theirs


def test_a_bucket_never_splits_a_tensor():
    # a 10 MiB tensor in a 1 MiB cap: a bucket of its own, or of it and what came before it
    assert cm.bucket_sizes([100, 10 * cm.MiB], cap_bytes=cm.MiB) == [10 * cm.MiB, 100]
    assert cm.bucket_sizes([10 * cm.MiB, 100], cap_bytes=cm.MiB) == [10 * cm.MiB + 100]
    assert cm.bucket_sizes([], cap_bytes=cm.MiB) == []


def test_communication_that_fits_under_backward_is_hidden():
    buckets = [1_000_000] * 4  # 4 ms of bandwidth each on 2 ranks (+ 50 us)
    hidden = cm.step_time(forward_s=0.01, backward_s=0.05, buckets=buckets, world_size=2,
                          link=LINK)
    # bucket i is ready at (i+1)/4 of backward; the last one's all-reduce sticks out
    assert hidden.bucket_starts_s == pytest.approx((0.0125, 0.025, 0.0375, 0.05))
    assert hidden.exposed_communication_s == pytest.approx(1.05e-3)
    assert hidden.step_s == pytest.approx(0.01 + 0.05 + 1.05e-3)
    slow = cm.step_time(forward_s=0.01, backward_s=0.002, buckets=buckets, world_size=2,
                        link=LINK)  # the all-reduces queue behind each other
    assert slow.bucket_ends_s[-1] == pytest.approx(0.0005 + 4 * 1.05e-3)
    assert slow.hidden_fraction < 0.5
    serial = cm.step_time(forward_s=0.01, backward_s=0.05, buckets=buckets, world_size=2,
                          link=LINK, overlap=False)
    assert serial.exposed_communication_s == pytest.approx(4 * 1.05e-3)
    one = cm.step_time(forward_s=0.01, backward_s=0.05, buckets=buckets, world_size=1, link=LINK)
    assert one.communication_s == 0 and one.hidden_fraction == 1.0


def test_input_time_is_hidden_by_enough_loader_workers():
    base = dict(forward_s=0.01, backward_s=0.02, buckets=[1000], world_size=1, link=LINK)
    assert cm.step_time(input_s=0.05, **base).input_s == pytest.approx(0.05)
    assert cm.step_time(input_s=0.05, input_workers=1, **base).input_s == pytest.approx(0.02)
    assert cm.step_time(input_s=0.05, input_workers=2, **base).input_s == 0.0


def test_the_bandwidth_at_which_ddp_stops_paying_off():
    model = dict(forward_s=0.01, backward_s=0.02, buckets=[4_000_000] * 10, world_size=4,
                 alpha_s=1e-4)
    beta = cm.bandwidth_for_efficiency(0.9, **model)
    at = cm.step_time(forward_s=0.01, backward_s=0.02, buckets=[4_000_000] * 10, world_size=4,
                      link=cm.Link(1e-4, beta)).step_s
    assert 0.03 / at == pytest.approx(0.9, rel=1e-6)
    assert cm.bandwidth_for_efficiency(0.9, **{**model, "alpha_s": 1.0}) == math.inf


def test_the_fit_recovers_known_parameters_from_noisy_points():
    rng = random.Random(0)
    alpha, beta = 80e-6, 2.5e9
    points = [(n, ws, (alpha + cm.bus_factor(ws) * n / beta) * rng.uniform(0.95, 1.05))
              for n in (2**k for k in range(10, 29, 2)) for ws in (2, 4)]
    link = bench.fit_alpha_beta(points)
    assert link.alpha_s == pytest.approx(alpha, rel=0.1)
    assert link.beta_bytes_per_s == pytest.approx(beta, rel=0.1)
    with pytest.raises(ValueError, match="two distinct"):
        bench.fit_alpha_beta([(1024, 2, 1e-4), (1024, 2, 2e-4)])


def test_the_recorded_allreduce_run_and_its_fit_agree():
    record = load_reference("ch10_allreduce.json")
    assert record["all_sums_correct"]
    assert {r["world_size"] for r in record["rows"]} == {2, 4}
    assert min(r["bytes"] for r in record["rows"]) == 1024
    assert max(r["bytes"] for r in record["rows"]) == 256 * cm.MiB
    for world_size in (2, 4):
        rows = [r for r in record["rows"] if r["world_size"] == world_size]
        link = bench.fit_alpha_beta([(r["bytes"], world_size, r["best_s"]) for r in rows])
        assert link.alpha_s == pytest.approx(record["fit"][str(world_size)]["alpha_s"])
        assert link.beta_bytes_per_s == pytest.approx(
            record["fit"][str(world_size)]["beta_bytes_per_s"])
        for r in rows:
            assert r["predicted_s"] == pytest.approx(cm.allreduce_time(r["bytes"], world_size, link))
    for r in record["rows"]:
        assert r["busbw_GBps"] == pytest.approx(
            r["bytes"] / r["best_s"] * cm.bus_factor(r["world_size"]) / 1e9)


def test_the_benchmark_runs_in_short_mode_and_writes_a_complete_record(tmp_path, no_orphans):
    out = tmp_path / "ch10_allreduce.json"
    done = launch([ROOT / "benchmarks" / "ch10_allreduce.py", "--short", "--world-sizes", "2",
                   "--out", out], timeout=300)
    record = load_reference(out)
    assert [r["bytes"] for r in record["rows"]] == [1024, 64 * 1024, 4 * cm.MiB]
    assert record["all_sums_correct"] and set(record["fit"]) == {"method", "2"}
    assert "fit, 2 ranks: alpha =" in done.stdout


def test_the_step_prediction_benchmark_runs_in_short_mode(tmp_path, no_orphans):
    out = tmp_path / "ch10_step_prediction.json"
    launch([ROOT / "benchmarks" / "ch10_step_prediction.py", "--short", "--out", out], timeout=300)
    record = load_reference(out)
    (row,) = record["rows"]
    assert row["world_size"] == 2 and row["predicted_step_s"] > 0 and row["measured_step_s"] > 0
    assert record["buckets"] == cm.bucket_sizes(
        [512 * 512 * 4, 512 * 4] * 8, 25 * cm.MiB, cm.MiB)


def test_the_recorded_step_prediction_follows_from_its_inputs():
    record = load_reference("ch10_step_prediction.json")
    one = {k: min(v) for k, v in record["one_rank_without_ddp"].items()}
    for row in record["rows"]:
        fit = record["allreduce_fit"][str(row["world_size"])]
        predicted = cm.step_time(forward_s=one["forward"], backward_s=one["backward"],
                                 optimizer_s=one["step"] - one["forward"] - one["backward"],
                                 buckets=record["buckets"], world_size=row["world_size"],
                                 link=cm.Link(fit["alpha_s"], fit["beta_bytes_per_s"]))
        assert row["predicted_step_s"] == pytest.approx(predicted.step_s)
        assert row["measured_step_s"] == min(row["samples"]["step"])
