"""Chapter 07 (training loop): ``torch.compile`` with DDP (``compile_with_ddp.py``) and the complete
training script (``train.py``).

``tests/test_chapter_scripts.py`` launches both scripts under torchrun with 2 ranks, and each
checks its own claims (bucket_cap_mb=1, the aot_eager backend; the default training run). Here
the same functions run in other configurations (``run_ranks``: deadlines, no ports): the DDP
optimizer's subgraphs for several bucket caps and both orders, both orders' gradients at another
cap, the small-cap pitfall; train.py on 2 ranks against 1 rank on the same global batches (with
and without gradient accumulation), its checkpoint; and each ``problems`` is shown to catch wrong
data. Compiling happens in the ranks, whose warm server has ``torch._dynamo`` imported already.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from course_layout import import_by_path
from ddpcourse.launcher import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "07_training_loop"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too

import compile_with_ddp as cw  # noqa: E402


def _train_module():
    """Chapter 07's train.py as ``ch07_train`` (the name chapter 08's train.py gives it): chapter
    08 has a ``train.py`` too."""
    return import_by_path("ch07_train", CHAPTER / "train.py")


tr = _train_module()


def train_in_rank(rank, world_size, **kwargs):
    """``tr.train`` for run_ranks: the ranks import this test module, which loads ch07_train."""
    return _train_module().train(rank, world_size, **kwargs)

CAPS_MB = (1, 2, 25)


# ----------------------------------------------------------------------------- compile with DDP

def test_the_prediction_follows_ddpoptimizers_rule():
    sizes = [1024 * 1024 + 2048] * 4 + [512 * 4 * 4 + 16]  # BlockNet's four layers and its head
    assert cw.layer_bytes(cw.make_net()) == sizes
    assert cw.predicted_subgraphs(sizes, 1) == [1, 1, 1, 2]  # first bucket: head + layer 3
    assert cw.predicted_subgraphs(sizes, 2) == [1, 2, 2]
    assert cw.predicted_subgraphs(sizes, 25) == [3, 2]


def subgraphs_by_cap(rank, world_size):
    """Linear layers per compiled graph, backend "eager" (the split does not depend on it)."""
    found = {(cap, "compile, then DDP", True): cw.train_steps(
        rank, world_size, "compile, then DDP", cap, backend="eager", steps=1)["subgraphs"]
        for cap in CAPS_MB}
    found[(2, "DDP, then compile", True)] = cw.train_steps(
        rank, world_size, "DDP, then compile", 2, backend="eager", steps=1)["subgraphs"]
    found[(2, "compile, then DDP", False)] = cw.train_steps(
        rank, world_size, "compile, then DDP", 2, optimize_ddp=False, backend="eager",
        steps=1)["subgraphs"]
    return found


def test_the_ddp_optimizer_splits_where_the_bucket_cap_says(no_orphans):
    found = run_ranks(subgraphs_by_cap, 1, timeout=120)[0]
    sizes = cw.layer_bytes(cw.make_net())
    for cap in CAPS_MB:
        assert found[(cap, "compile, then DDP", True)] == cw.predicted_subgraphs(sizes, cap), cap
    assert found[(2, "DDP, then compile", True)] == cw.predicted_subgraphs(sizes, 2)
    assert found[(2, "compile, then DDP", False)] == [5]  # off: one graph, whatever the cap


def orders_at_cap_2(rank, world_size):
    return {order: cw.train_steps(rank, world_size, order, bucket_cap_mb=2)
            for order in cw.ORDERS}


def test_both_orders_train_exactly_like_eager_ddp_and_overlap(no_orphans):
    """aot_eager, bucket_cap_mb=2, 3 steps, 2 ranks. The tolerance is cw.TOLERANCE (1e-6,
    justified there); on torch 2.13 the gap is exactly 0."""
    results = run_ranks(orders_at_cap_2, 2, timeout=180)
    expected = cw.predicted_subgraphs(cw.layer_bytes(cw.make_net()), 2)
    for runs in results:
        eager = runs["eager"]
        for order in ("compile, then DDP", "DDP, then compile"):
            run = runs[order]
            assert run["subgraphs"] == expected, (order, run["subgraphs"])
            assert cw.all_reduces_during_backward(run["timeline"]) >= 1, run["timeline"]
            for what in ("gradients", "weights"):
                assert cw.max_difference(run[what], eager[what]) <= cw.TOLERANCE, (order, what)
    for order in cw.ORDERS:  # and the replicas agree bit for bit
        assert torch.equal(results[0][order]["weights"], results[1][order]["weights"]), order


def small_cap_error(rank, world_size):
    try:
        cw.train_steps(rank, world_size, "compile, then DDP", bucket_cap_mb=0.5,
                       backend="eager", steps=1)
    except Exception as error:  # noqa: BLE001  (the lesson shows what is raised)
        return type(error).__name__, str(error)
    return None


def test_a_bucket_cap_under_1_mib_breaks_the_ddp_optimizer(no_orphans):
    """DDPOptimizer.__init__: its first bucket is 1 MiB and must not exceed bucket_cap_mb."""
    name, message = run_ranks(small_cap_error, 1, timeout=120)[0]
    assert "First bucket should be smaller/equal to other buckets" in message, (name, message)


def how_graphs_are_captured(rank, world_size):
    return {how: cw.graphs_captured(how) for how in (
        "nn.Sequential .compile()", "nn.Sequential torch.compile", "own class .compile()",
        "own class torch.compile")}


def keys_by_compile_call(rank, world_size):
    return {how: cw.state_dict_keys(how) for how in ("eager", ".compile()", "torch.compile")}


def test_compiling_in_place_keeps_the_state_dict_keys(no_orphans):
    keys = run_ranks(keys_by_compile_call, 1, timeout=60)[0]
    assert keys[".compile()"] == keys["eager"]
    assert keys["torch.compile"] == ["_orig_mod." + key for key in keys["eager"]]


@pytest.mark.skipif(torch.__version__.split("+")[0] != "2.13.0",
                    reason="pins torch 2.13.0's behaviour, which a later torch may change")
def test_compiling_a_bare_sequential_in_place_captures_nothing(no_orphans):
    captured = run_ranks(how_graphs_are_captured, 1, timeout=60)[0]
    assert captured == {"nn.Sequential .compile()": 0, "nn.Sequential torch.compile": 1,
                        "own class .compile()": 1, "own class torch.compile": 1}


def fake_compile_result(**changes):
    run = {"subgraphs": [1, 1, 1, 2], "buckets": [], "gradients": torch.zeros(3),
           "weights": torch.ones(3),
           "timeline": ["backward", "all-reduce", "backward", "all-reduce", "all-reduce"]}
    off = dict(run, subgraphs=[5], timeline=["backward", "all-reduce", "all-reduce"])
    runs = {"eager": dict(run, subgraphs=None, timeline=["all-reduce"]),
            "compile, then DDP": run, "DDP, then compile": dict(run),
            "compile, then DDP; optimize_ddp=False": off}
    for name, change in changes.items():
        runs[name] = dict(runs[name], **change)
    return {"expected subgraphs": [1, 1, 1, 2], "runs": runs}


def test_the_compile_check_passes_right_data_and_catches_wrong_data():
    assert cw.problems(fake_compile_result()) == []
    wrong = [
        {"compile, then DDP": {"subgraphs": [5]}},
        {"DDP, then compile": {"subgraphs": [2, 3]}},
        {"compile, then DDP; optimize_ddp=False": {"subgraphs": [1, 1, 1, 2]}},
        {"compile, then DDP": {"timeline": ["backward", "backward", "all-reduce"]}},
        {"compile, then DDP; optimize_ddp=False": {"timeline": ["backward", "all-reduce",
                                                                 "backward"]}},
        {"DDP, then compile": {"gradients": torch.tensor([0.0, 1e-4, 0.0])}},
        {"compile, then DDP": {"weights": torch.tensor([1.0, 1.0, 0.99])}},
    ]
    for change in wrong:
        assert cw.problems(fake_compile_result(**change)) != [], change
    differing = fake_compile_result(**{"eager": {"weights": torch.zeros(3)}})
    assert cw.replicas_differ([fake_compile_result(), differing]) != []


# ----------------------------------------------------------------------------------- train.py

QUIET = dict(progress=False, epochs=2)
# 1 rank vs 2 ranks: the same global batches (the union of the ranks' batches at each step is the
# same slice of the epoch's permutation), but the gradient sums are added in another order, so
# they agree to float32 rounding, not bit for bit. Measured: ~1e-7 on weights of size ~0.1-1
# after 64 steps; 1e-5 leaves room and still catches one wrong step (lr * grad ~ 1e-3).
TOLERANCE = 1e-5


def one_and_two_ranks(batch: int, accumulation: int):
    single = run_ranks(train_in_rank, 1, batch_size=batch * 2 * accumulation, timeout=60, **QUIET)[0]
    double = run_ranks(train_in_rank, 2, batch_size=batch, accumulation_steps=accumulation,
                       timeout=60, **QUIET)
    return single, double


def test_two_ranks_train_what_one_rank_trains_on_the_same_global_batch(no_orphans):
    """2 ranks x batch 16 x 2 accumulated micro-batches against 1 rank x batch 64."""
    single, (rank0, rank1) = one_and_two_ranks(batch=16, accumulation=2)
    assert single["optimizer_steps"] == rank0["optimizer_steps"] == 2 * 2048 // 64
    assert rank0["checksums"] == rank1["checksums"] and torch.equal(rank0["weights"],
                                                                    rank1["weights"])
    assert (rank0["weights"] - single["weights"]).abs().max().item() <= TOLERANCE
    for mine, theirs in zip(rank0["epochs"], single["epochs"]):
        for key in ("train_loss", "eval_loss", "eval_accuracy"):
            assert mine[key] == pytest.approx(theirs[key], abs=TOLERANCE), key
        assert mine["eval_samples"] == theirs["eval_samples"] == 509
    assert tr.problems(rank0) == [] and tr.problems(single) == []


def test_the_saved_model_is_the_plain_module_with_the_trained_weights(tmp_path, no_orphans):
    path = tmp_path / "model.pt"
    rank0 = run_ranks(train_in_rank, 2, save=str(path), timeout=60, **QUIET)[0]
    saved = torch.load(path)
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in saved["model"])
    config = tr.Config(**saved["config"])
    model = tr.build_model(config, torch.device("cpu"))
    model.load_state_dict(saved["model"])
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                       rank0["weights"])
    assert saved["epochs_done"] == QUIET["epochs"]


def test_amp_compile_and_a_short_last_window_run_and_pass_the_check(no_orphans):
    """fp16 autocast + GradScaler on the CPU, compiled before wrapping (backend "eager": the
    wiring, not the compiler, is under test here), 32 batches in windows of 3."""
    rank0 = run_ranks(train_in_rank, 2, amp="fp16", compile="eager", accumulation_steps=3,
                      timeout=120, **QUIET)[0]
    assert rank0["optimizer_steps"] == 2 * 11  # ceil(32 / 3) windows per epoch
    assert tr.problems(rank0) == []


def fake_history(**changes):
    history = {"config": {"classes": 4, "eval_samples": 509}, "checksums": [7, 7],
               "epochs": [{"train_loss": 1.0, "eval_accuracy": 0.6, "eval_samples": 509},
                          {"train_loss": 0.5, "eval_accuracy": 0.8, "eval_samples": 509}]}
    history.update(changes)
    return history


def test_the_train_check_passes_right_data_and_catches_wrong_data():
    assert tr.problems(fake_history()) == []
    rising = [{"train_loss": 0.5, "eval_accuracy": 0.6, "eval_samples": 509},
              {"train_loss": 0.6, "eval_accuracy": 0.8, "eval_samples": 509}]
    chance = [{"train_loss": 1.0, "eval_accuracy": 0.25, "eval_samples": 509},
              {"train_loss": 0.5, "eval_accuracy": 0.25, "eval_samples": 509}]
    padded = [{"train_loss": 1.0, "eval_accuracy": 0.6, "eval_samples": 510},
              {"train_loss": 0.5, "eval_accuracy": 0.8, "eval_samples": 510}]
    for wrong in (dict(epochs=rising), dict(epochs=chance), dict(epochs=padded),
                  dict(checksums=[7, 8])):
        assert tr.problems(fake_history(**wrong)) != [], wrong


def test_the_training_loaders_workers_start_from_a_fork_server():
    """The rank is multi-threaded, so its workers are not forked from it (chapter 06, section 6)."""
    loader = tr.build_data(tr.Config(workers=2), 0, 2, torch.device("cpu"))[0]
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    assert [len(batch) for batch in itertools.islice(loader, 2)] == [2, 2]  # x, y from a worker
    assert tr.build_data(tr.Config(), 0, 2, torch.device("cpu"))[0].multiprocessing_context is None


def test_the_command_line_fills_the_config():
    config = tr.parse_args(["--accumulation-steps", "4", "--amp", "bf16", "--compile",
                            "--no-progress", "--batch-size", "8"])
    assert (config.accumulation_steps, config.amp, config.compile, config.progress,
            config.batch_size) == (4, "bf16", "auto", False, 8)
    assert tr.parse_args([]) == tr.Config()
    with pytest.raises(SystemExit):
        tr.parse_args(["--accumulation-steps", "0"])
