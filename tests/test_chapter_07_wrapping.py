"""Chapter 07 (training loop), wrapping: the script's check holds on data from real ranks and
catches wrong data; what a 3-rank world adds (a rank that matches rank 0 gets through the
broadcast, rank 0 waits for the one that differs; buckets alike on every rank); the exact bucket
layouts before and after the rebuild; the first bucket obeys ``bucket_cap_mb`` when it is set.

``wrapping.py`` itself runs under torchrun in tests/test_chapter_scripts.py; here its functions
run in ranks through ``run_ranks`` (deadlines, no ports).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from ddpcourse.launcher import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "07_training_loop"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too

import wrapping as wr  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return run_ranks(wr.run_all, 2, timeout=120)


def test_the_scripts_check_passes_on_data_from_real_ranks(results, no_orphans):
    assert wr.problems(results) == []


WRONG = {  # what a broken DDP, or a wrong lesson, would have returned
    "device_ids accepted on CPU": lambda r: r[0]["device_ids on CPU"].update(error=None),
    "float64 after wrapping still averaged": lambda r: r[0]["float64 after wrapping"].update(
        {"grads equal on every rank": [True, True]}),
    "count mismatch passes on rank 0": lambda r: r[0]["count differs"].update(error=None),
    "rank 0 fails at once on a shape mismatch": lambda r: r[0]["shape differs"].update(
        seconds=0.0),
    "init_sync=False synchronises": lambda r: r[1]["init_sync=False"].update(
        after=r[0]["init_sync=False"]["after"]),
    "iteration 1 already bucketed": lambda r: r[0]["buckets, default"][0].update(
        buckets=[{}, {}]),
    "find_unused buckets rebuilt": lambda r: r[0]["buckets, find_unused_parameters=True"][1]
        .update(buckets=[]),
    "first bucket capped at 1 MiB with bucket_cap_mb=2": lambda r: r[0].update(
        {"first bucket, bucket_cap_mb=2": [[3 * 2**19], [2**20, 2**19]]}),
    "state_dict without prefix": lambda r: r[0]["state_dict keys"].update(
        {"through the wrapper": ["weight", "bias"]}),
    "rank 0 evaluates through the wrapper": lambda r: r[0]["rank 0 evaluates the wrapper"]
        .update(error=None),
    "training through model.module averages": lambda r: r[0].update(
        {"training through model.module": True}),
}


@pytest.mark.parametrize("name", WRONG)
def test_the_check_catches_wrong_data(results, name):
    wrong = copy.deepcopy(results)
    WRONG[name](wrong)
    assert wr.problems(wrong) != []


def test_a_rank_that_matches_rank0_gets_through_and_rank0_waits_for_the_one_that_differs(
        no_orphans):
    rank0, rank1, rank2 = run_ranks(wr.shape_check, 3, "shape", timeout=60)
    assert "_verify_param_shape_across_processes" in rank2["raised in"], rank2
    assert "appears not to match sizes of the same param in process 0" in rank2["error"]
    assert rank1["error"] is None, rank1
    assert "_sync_module_states" in rank0["raised in"], rank0
    assert rank0["seconds"] >= wr.DEMO_TIMEOUT_S * 0.9


def test_bucket_layouts_before_and_after_the_rebuild_exactly(no_orphans):
    layouts = run_ranks(wr.bucket_layouts, 3, 0.03, False, timeout=60)
    assert layouts[0] == layouts[1] == layouts[2]  # every rank buckets alike
    first, second = ([b["params"] for b in it["buckets"]] for it in layouts[0])
    registered = [f"layer{i}.{p}" for i in (4, 3, 2, 1) for p in ("weight", "bias")]
    assert first == [registered]  # one bucket, in registration order
    assert second == [["layer4.bias", "layer4.weight", "layer3.bias", "layer3.weight"],
                      ["layer2.bias", "layer2.weight", "layer1.bias", "layer1.weight"]]
    assert [b["gradients outstanding"] for b in layouts[0][1]["buckets"]] == [4, 0]


def test_find_unused_parameters_keeps_reverse_registration_order(no_orphans):
    layouts = run_ranks(wr.bucket_layouts, 2, 0.03, True, timeout=60)[0]
    assert [b["params"] for b in layouts[0]["buckets"]] == [
        ["layer1.bias"], ["layer3.bias", "layer2.weight", "layer2.bias", "layer1.weight"],
        ["layer4.weight", "layer4.bias", "layer3.weight"]]
    assert layouts[1]["buckets"] == layouts[0]["buckets"]


def test_a_set_bucket_cap_applies_to_the_first_bucket_too(no_orphans):
    layer = (256 * 256 + 256) * 4
    sizes = run_ranks(wr.first_bucket_sizes, 2, 0.5, timeout=60)[0]
    assert sizes == [[6 * layer], [2 * layer] * 3]  # 0.5 MiB closes after two layers, first too
    default = run_ranks(wr.first_bucket_sizes, 2, None, timeout=60)[0]
    assert default == [[6 * layer], [4 * layer, 2 * layer]]  # 1 MiB first, then 25 MiB


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs one CUDA GPU per rank (2)")
def test_device_ids_move_the_input_and_place_the_output(no_orphans):
    for r in run_ranks(wr.gpu_placement, 2, backend="nccl", timeout=120):
        assert r["skipped"] is None
        assert r["output device with device_ids"].startswith("cuda:")
        assert r["CPU input without device_ids"] is not None  # nobody moved the input
        assert r["moved after wrapping: grads equal"] is False
