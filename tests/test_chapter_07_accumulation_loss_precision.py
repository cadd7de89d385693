"""Chapter 07 (the training loop): gradient accumulation, the loss and logging, mixed precision.

The three scripts check their own claims on 2 ranks when tests/test_chapter_scripts.py launches
them; here the same functions run in 3 and 4 ranks (``run_ranks``: deadlines, no ports), each
script's ``problems`` is shown to catch wrong data, and the GPU part (fp16 autocast + GradScaler
with NCCL) runs where there are GPUs.
"""

import sys
from pathlib import Path

import pytest
import torch

from ddpcourse.launcher import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "07_training_loop"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too

import accumulation as acc  # noqa: E402
import loss_and_logging as ll  # noqa: E402
import mixed_precision as mp  # noqa: E402

TWO_GPUS = torch.cuda.device_count() >= 2
NEEDS_GPUS = "fp16 autocast + GradScaler with NCCL needs one CUDA GPU per rank (2)"


def accumulation_measurements(rank, world_size):
    return ({p: acc.syncs_by_placement(rank, world_size, p) for p in acc.PLACEMENTS},
            acc.all_variants(rank, world_size), acc.one_process_vs_ranks(rank, world_size))


def loss_measurements(rank, world_size):
    return (ll.own_loss_shared_gradient(rank, world_size), ll.non_scalar_backward(rank, world_size),
            ll.summed_loss(rank, world_size), ll.global_metrics(rank, world_size))


@pytest.mark.parametrize("world_size", [3, 4])
def test_accumulation_claims_hold_on_more_ranks(world_size, no_orphans):
    placements, variants, versus = run_ranks(accumulation_measurements, world_size, timeout=90)[0]
    assert acc.problems(world_size, placements, variants, versus) == []
    # measured: 1 unit in the last place (2.98e-8 at |p| = 0.35); the check allows 4
    assert 0 < versus["max |DDP - 1 process accumulating W micro-batches|"] \
        <= acc.ulp_tolerance(versus["max |parameter|"])


def test_one_process_times_two_micro_batches_is_two_ranks_bit_for_bit(no_orphans):
    versus = run_ranks(acc.one_process_vs_ranks, 2, steps=5, timeout=60)
    for result in versus:
        assert result["max |DDP - 1 process accumulating W micro-batches|"] == 0.0, result
        assert result["gradient ratio without / W (min, max)"] == (2.0, 2.0), result


def test_off_by_one_accumulation_drifts_from_its_first_step_and_raises_nothing(no_orphans):
    k = 3
    for sync_on, step_on in (("first", "last"), ("last", "first")):
        results = run_ranks(acc.accumulate, 2, sync_on, step_on, k=k, groups=2, timeout=60)
        spread = results[0]["parameter spread after each micro-batch"]
        first_step = k - 1 if step_on == "last" else 0
        assert spread[:first_step] == [0.0] * first_step and spread[first_step] > 0, spread
        assert results[1]["parameter spread after each micro-batch"] == spread  # a collective


def clipping_and_views(rank, world_size):
    return ({where: acc.clipping(rank, world_size, where) for where in acc.CLIPPINGS},
            {set_to_none: acc.bucket_views(rank, world_size, set_to_none)
             for set_to_none in (True, False)})


def test_clip_after_the_sync_and_bucket_views_inside_a_window_on_three_ranks(no_orphans):
    per_rank = run_ranks(clipping_and_views, 3, timeout=180)
    clipped = {where: [r[0][where] for r in per_rank] for where in acc.CLIPPINGS}
    assert acc.check_clipping(clipped) == []
    early = [r["first norm clipped, this rank"] for r in clipped[acc.CLIPPINGS[1]]]
    assert len(set(early)) == 3  # each rank clipped its own partial gradient
    for views in (r[1] for r in per_rank):
        assert acc.check_bucket_views(views) == []
        assert views[True]["grads in the bucket after each micro-batch"] == [False] * 3 + [True] \
            + [False] * 3 + [True] + [False] * 3 + [True]
    wrong = {where: [dict(r) for r in results] for where, results in clipped.items()}
    wrong[acc.CLIPPINGS[0]][1]["first norm clipped, this rank"] = early[1]  # a local norm
    assert acc.check_clipping(wrong) != []
    right, early_runs = (clipped[where] for where in acc.CLIPPINGS)
    swapped = {acc.CLIPPINGS[0]: early_runs, acc.CLIPPINGS[1]: right}
    assert acc.check_clipping(swapped) != []
    always_views = {True: dict(per_rank[0][1][True]), False: per_rank[0][1][False]}
    always_views[True]["grads in the bucket after each micro-batch"] = [True] * 12
    assert acc.check_bucket_views(always_views) != []


def test_accumulation_check_catches_wrong_data():
    placements = {"forward and backward": {"all-reduce calls": 0, "elements": 0,
                                           "gradient spread across ranks": 0.4},
                  "backward only": {"all-reduce calls": 1, "gradient spread across ranks": 0.0},
                  "no no_sync": {"all-reduce calls": 1, "gradient spread across ranks": 0.0}}
    variant = {"parameter spread after each micro-batch": [0.0], "all-reduce calls": 3,
               "optimizer steps": 3, "micro-batches": 12,
               "max |difference| from the correct run": 0}
    variants = {name: dict(variant) for name in acc.VARIANTS}
    for name in variants:
        if name.startswith("off by one"):
            variants[name]["parameter spread after each micro-batch"] = [0.0, 0.1]
    variants["no no_sync: sync every micro-batch"]["all-reduce calls"] = 12
    versus = {"max |DDP - 1 process accumulating W micro-batches|": 0.0,
              "max |parameter|": 0.35, "gradient ratio without / W (min, max)": (2.0, 2.0)}
    assert acc.problems(2, placements, variants, versus) == []
    late = {**placements, "backward only": {"all-reduce calls": 0,
                                            "gradient spread across ranks": 0.4}}
    assert acc.problems(2, late, variants, versus)
    silent = {**variants, "off by one: sync on the first, step on the last": variant}
    assert acc.problems(2, placements, silent, versus)
    assert acc.problems(2, placements, variants, {**versus, "max |DDP - 1 process accumulating "
                                                  "W micro-batches|": 3e-8})
    assert acc.problems(2, placements, variants,
                        {**versus, "gradient ratio without / W (min, max)": (1.0, 1.0)})


def test_backward_of_a_vector_fails_in_autograd_without_any_process_group():
    from ddpcourse.toys import make_model
    per_sample = make_model(0)(torch.randn(4, 8)).squeeze(1)
    with pytest.raises(RuntimeError, match=ll.AUTOGRAD_SCALAR_RULE):
        per_sample.backward()


@pytest.mark.parametrize("world_size", [3])
def test_loss_claims_hold_on_more_ranks(world_size, no_orphans):
    own, scalar, summed, metrics = run_ranks(loss_measurements, world_size, timeout=90)[0]
    assert ll.problems(world_size, own, scalar, summed, metrics) == []
    assert metrics["shard sizes"] == [9, 9, 3]
    low, high = summed["global sum / DDP sum, shard by shard"]
    assert abs(low - 3) < 1e-4 and abs(high - 3) < 1e-4  # 3, up to float32 rounding


def test_even_shards_make_the_mean_of_means_right_too(no_orphans):
    metrics = run_ranks(ll.global_metrics, 2, [6, 6], timeout=60)[0]
    assert metrics["mean of per-rank means"] == pytest.approx(metrics["single process"], rel=1e-12)


def test_loss_check_catches_wrong_data():
    own = {"loss on each rank": [0.5, 0.3], "gradient spread across ranks": 0.0}
    scalar = {"plain model: error": ll.AUTOGRAD_SCALAR_RULE, "DDP: error": ll.AUTOGRAD_SCALAR_RULE,
              "DDP, gradient=1/n: all-reduce calls": 1,
              "DDP, gradient=1/n: gradient spread across ranks": 0.0,
              "DDP, gradient=1/n: max |difference| from .mean().backward()": 0.0}
    summed = {"global sum / DDP sum, one batch": (1.99999, 2.00002),
              "global sum / DDP sum, shard by shard": (2.0, 2.0),
              "max |W x DDP sum - global sum| / max |global sum|": 9e-8,
              "max |DDP mean - global mean| / max |global mean|": 9e-8}
    metrics = {"single process": [1.07, 0.4167], "sums and counts": [1.07, 0.4167],
               "mean of per-rank means": [1.077, 0.3889]}
    assert ll.problems(2, own, scalar, summed, metrics) == []
    assert ll.problems(2, {**own, "loss on each rank": [0.5, 0.5]}, scalar, summed, metrics)
    assert ll.problems(2, own, {**scalar, "DDP: error": None}, summed, metrics)
    assert ll.problems(2, own, scalar, {**summed, "global sum / DDP sum, shard by shard":
                                        (1.0, 1.0)}, metrics)
    assert ll.problems(2, own, scalar, summed, {**metrics, "sums and counts": [1.077, 0.3889]})


def test_the_deprecated_cuda_amp_spellings_warn_even_without_cuda():
    warned = mp.deprecation_warnings()
    assert all(messages and "is deprecated" in messages[0] for messages in warned.values())


def test_fp16_small_gradients_vanish_without_a_scaler_and_bf16_needs_none():
    fp16 = mp.small_loss_gradients("float16", 1e-6, scaled=False)
    fp16_scaled = mp.small_loss_gradients("float16", 1e-6, scaled=True)
    bf16 = mp.small_loss_gradients("bfloat16", 1e-6, scaled=False)
    bf16_scaled = mp.small_loss_gradients("bfloat16", 1e-6, scaled=True)
    assert fp16["zero fraction"] > 0.5 and fp16_scaled["zero fraction"] == 0
    assert fp16_scaled["relative error"] < 1e-3 < 0.1 < fp16["relative error"]
    assert bf16 == bf16_scaled and bf16["zero fraction"] == 0  # measured error 4.6e-3


def test_mixed_precision_check_catches_wrong_data():
    warned = {"torch.cuda.amp.autocast()": ["deprecated"]}
    good = {"zero fraction": 0.0, "relative error": 5e-4}
    errors = {"float16": [{"zero fraction": 0.7, "relative error": 0.7}],
              "float16 + GradScaler": [good], "bfloat16": [{**good, "relative error": 5e-3}],
              "bfloat16 + GradScaler": [{**good, "relative error": 5e-3}]}
    row = {"output dtype": "float32", "gradient dtypes": ["float32"], "all-reduce calls": 1,
           "all-reduced dtypes": ["float32"], "all-reduced bytes": 5508,
           "gradient spread across ranks": 0.0}
    traffic = {"float32": row, "autocast bfloat16": {**row, "output dtype": "bfloat16"},
               "compressed": {**row, "output dtype": "bfloat16", "all-reduced bytes": 2754,
                              "all-reduced dtypes": ["float16"]}}
    hooks = {None: {"all-reduces": [("float", 1377)]},
             "fp16_compress_hook": {"all-reduces": [("c10::Half", 1377)]},
             "bf16_compress_hook": {"registration error": mp.BF16_REFUSED + " ...",
                                    "all-reduces": []}}
    history = [{"scale": 32768.0, "stepped": False, "parameter spread across ranks": 0.0},
               {"scale": 32768.0, "stepped": True, "parameter spread across ranks": 0.0}]
    assert mp.problems(warned, errors, traffic, hooks, history, on_gpu=False) == []
    halved = {**traffic, "autocast bfloat16": {**traffic["autocast bfloat16"],
                                               "all-reduced bytes": 2754}}
    assert mp.problems(warned, errors, halved, hooks, history, on_gpu=False)
    assert mp.problems(warned, {**errors, "float16": [good]}, traffic, hooks, history, False)
    assert mp.problems(warned, errors, traffic, hooks, history, on_gpu=True)  # bf16 refused
    drifted = [history[0], {**history[1], "parameter spread across ranks": 0.1}]
    assert mp.problems(warned, errors, traffic, hooks, drifted, on_gpu=False)


def gpu_measurements(rank, world_size):
    return mp.traffic_cases(rank, world_size), mp.scaled_fp16_training(rank, world_size)


@pytest.mark.skipif(not TWO_GPUS, reason=NEEDS_GPUS)
def test_fp16_autocast_and_grad_scaler_on_cuda_with_nccl(no_orphans):
    traffic, history = run_ranks(gpu_measurements, 2, backend="nccl", timeout=120)[0]
    full, autocast, compressed = traffic.values()
    assert autocast["output dtype"] == "float16" and autocast["gradient dtypes"] == ["float32"]
    assert autocast["all-reduced bytes"] == full["all-reduced bytes"]
    assert 2 * compressed["all-reduced bytes"] == full["all-reduced bytes"]
    assert not history[0]["stepped"] and all(h["stepped"] for h in history[1:])
    assert all(h["parameter spread across ranks"] == 0 for h in history)
