"""Chapter 07 (training loop), buffers and seeds: ``buffers.py`` and ``seeds_and_replicas.py``.

``tests/test_chapter_scripts.py`` launches both scripts under torchrun with 2 ranks, and each
script checks its own claims; here the same functions run in 3 ranks (``run_ranks``), the exact
values behind the lesson's sentences are pinned, and each check is shown to catch wrong data.
The SyncBatchNorm GPU path runs only with two GPUs or more (NCCL, one GPU per rank).
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

import buffers as bf  # noqa: E402
import seeds_and_replicas as sr  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def buffer_results():
    return run_ranks(bf.run_all, 3, timeout=120, relay_output=False)


@pytest.fixture(scope="module")
def seed_results():
    return run_ranks(sr.run_all, 3, timeout=120, relay_output=False)


def test_every_buffer_claim_holds_on_three_ranks(buffer_results, no_orphans):
    assert bf.check(buffer_results) == []


def test_rank0s_buffer_wins_at_construction_and_at_the_next_training_forward(buffer_results):
    def values(mode, field):
        return [r[f"forward {mode}"][field] for r in buffer_results]
    assert values("default", "offset after DDP()") == [1.0, 1.0, 1.0]
    assert values("default", "offset the forward used") == [10.0, 10.0, 10.0]
    assert values("broadcast_buffers=False", "offset after DDP()") == [1.0, 2.0, 3.0]
    assert values("broadcast_buffers=False", "weight after DDP()") == [1.0, 1.0, 1.0]
    assert values("forward_sync_buffers=False", "offset after DDP()") == [1.0, 1.0, 1.0]
    assert values("forward_sync_buffers=False", "offset the forward used") == [10.0, 20.0, 30.0]
    assert all(w.startswith("FutureWarning: `broadcast_buffers` is deprecated")
               for r in values("broadcast_buffers=False", "warnings") for w in r)


def test_a_reassigned_buffer_is_synced_a_plain_tensor_never(buffer_results):
    by_way = {way: [r["reassignment"][way] for r in buffer_results]
              for way in buffer_results[0]["reassignment"]}
    assert by_way["buffer reassigned (m.offset = tensor)"] == [1.0, 1.0, 1.0]
    assert by_way["plain attribute reassigned (m.scale = tensor)"] == [1.0, 2.0, 3.0]
    assert by_way["gradient of a parameter replaced after DDP()"] == [1.0, 2.0, 3.0]


def test_a_forward_broadcasts_only_after_a_synced_forward_with_gradients(buffer_results):
    counts = [dict(r["broadcasts per forward"]) for r in buffer_results]
    assert all(c == counts[0] for c in counts)
    by_label = counts[0]
    assert by_label["eval(), no_grad: 1st forward"] == 2  # float32 statistics + int64 counter
    assert by_label["eval(), no_grad: 2nd forward"] == 0
    assert by_label["eval(), no_grad: 3rd forward"] == 0
    assert by_label["train(): 1st training step after evaluation"] == 0
    assert by_label["eval(), gradients enabled"] == 2
    for window in (1, 2):
        assert [by_label[label] for label in by_label if label.startswith(f"window {window},")] \
            == [2, 0, 0, 0]


def test_syncbatchnorm_on_cpu_fails_in_ddp_init_and_in_a_training_forward(buffer_results):
    cpu = buffer_results[1]["SyncBatchNorm on CPU"]
    ddp = cpu["DDP(model)"]
    assert ddp["error"] == "ValueError: SyncBatchNorm layers only work with GPU modules"
    assert "nn/parallel/distributed.py:_passing_sync_batchnorm_handle" in ddp["raised in"]
    assert cpu["model(x), training mode"]["error"].startswith(
        "ValueError: SyncBatchNorm expected input tensor to be on GPU")
    assert cpu["model(x), eval mode"] is None


def test_buffer_checks_catch_wrong_data(buffer_results):
    forward = [copy.deepcopy(r["forward default"]) for r in buffer_results]
    forward[1]["offset the forward used"] = 20.0  # as if the forward had not synced
    assert bf.check_buffer_at_forward("default", forward) != []
    reassigned = [copy.deepcopy(r["reassignment"]) for r in buffer_results]
    reassigned[2]["buffer reassigned (m.offset = tensor)"] = 3.0  # the claim
    assert bf.check_reassignment(reassigned) != []
    stats = [copy.deepcopy(r["running stats forward_sync_buffers=False"]) for r in buffer_results]
    for r in stats:  # as if averaging the variances gave the global variance
        r["global batch"]["running_var"] = bf.average_over_ranks(stats, "running_var")
    assert bf.check_running_stats("forward_sync_buffers=False", stats) != []
    cpu = [copy.deepcopy(r["SyncBatchNorm on CPU"]) for r in buffer_results]
    cpu[0]["DDP(model)"] = None
    assert bf.check_syncbatchnorm_on_cpu(cpu) != []
    every_forward = [[(label, 2) for label, _ in r["broadcasts per forward"]]
                     for r in buffer_results]  # the rule "a broadcast in every forward"
    assert bf.check_broadcasts_per_forward(every_forward) != []
    unequal = [list(r["broadcasts per forward"]) for r in buffer_results]
    unequal[1][2] = (unequal[1][2][0], 2)
    assert bf.check_broadcasts_per_forward(unequal) != []
    local = [copy.deepcopy(r["BatchNorm over ranks"]) for r in buffer_results]
    assert bf.check_batchnorm_over_ranks(True, local) != []  # local statistics are not SyncBN's


@pytest.mark.skipif(GPUS < 2, reason=f"SyncBatchNorm needs NCCL, one GPU per rank: {GPUS} GPU(s)")
def test_syncbatchnorm_normalises_with_the_global_batch(no_orphans):
    results = run_ranks(bf.batchnorm_over_ranks, 2, True, timeout=120, backend="nccl")
    assert bf.check_batchnorm_over_ranks(True, results) == [], results


def test_every_seed_claim_holds_on_three_ranks(seed_results, no_orphans):
    assert sr.check(seed_results) == []


def test_ddp_equalises_the_wrapped_model_and_nothing_made_beside_it(seed_results):
    per_rank = seed_results[0]["made before DDP, seed + rank, init_sync=True"]
    assert per_rank["wrapped model"] == 0.0
    assert per_rank["teacher copied before DDP()"] > 0
    assert per_rank["random tensor outside modules"] > 0
    assert seed_results[0]["made before DDP, seed + rank, init_sync=False"]["wrapped model"] > 0


@pytest.mark.parametrize("n, world_size", [(100, 2), (100, 3), (64, 4)])
def test_different_sampler_seeds_overlap_and_miss_samples(n, world_size):
    same = sr.sampler_shards(n, [5] * world_size)
    assert same["on no rank"] == 0 and same["on two ranks or more"] == -n % world_size
    different = sr.sampler_shards(n, list(range(world_size)))
    assert different["on no rank"] > 0 and different["on two ranks or more"] > -n % world_size
    assert sr.check_sampler_shards(n, world_size) == []


def test_seed_checks_catch_wrong_data(seed_results):
    same = [r["draws, same seed"] for r in seed_results]
    assert sr.check_random_draws("seed + rank", same, same) != []
    curves = copy.deepcopy(seed_results[0]["drift"])
    curves["EMA of parameters"][-1] = 1e-7
    assert sr.check_drift_curves(curves, 3) != []
    curves = copy.deepcopy(seed_results[0]["drift"])
    curves["head outside DDP"] = [0.0] * len(curves["head outside DDP"])
    assert sr.check_drift_curves(curves, 3) != []
    assert sr.check_made_before_ddp("seed + rank", True, {"wrapped model": 0.0,
                                    "teacher copied before DDP()": 0.0,
                                    "random tensor outside modules": 0.5}) != []
