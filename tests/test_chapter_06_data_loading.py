"""Chapter 06 (data loading): what ``DistributedSampler`` returns, the padded-evaluation bias and
its fixes, rank-0 evaluation through DDP (blocks) and through ``model.module`` (exact),
``set_epoch``, loading without a sampler, DataLoader workers (start method, pinned memory,
augmentation seeds per rank, an ``IterableDataset`` sharded by rank and worker), and the
uneven-inputs demo (stops where the lesson says without a fix, runs with one).

Multi-rank checks use ``run_ranks`` (deadlines, no ports); demos that must block run DDP on a group
whose short timeout starts after a barrier (``ddpcourse.dist_env.short_timeout_group``), so the
error is the hang, not start-up skew. ``uneven_inputs.py`` is launched under torchrun (``--standalone``: the OS picks the
port) with a deadline, killed as a group.
"""

from __future__ import annotations

import math
import os
import multiprocessing
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddpcourse.dist_env import loader_workers_context, short_timeout_group
from ddpcourse.launcher import run_bounded, run_ranks
from ddpcourse.timing import load_reference

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "06_data_loading"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too

import eval_without_duplicates as ev  # noqa: E402
import sampler_shards as ss  # noqa: E402
import uneven_inputs as ui  # noqa: E402
import workers_and_ranks as wr  # noqa: E402

SIZES = [(n, w) for n in range(1, 12) for w in range(1, 5)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_padding_repeats_the_first_indices_and_never_invents_one(shuffle):
    for n, world_size in SIZES:
        per_rank = ss.shards(n, world_size, shuffle=shuffle, epoch=2)
        assert [len(s) for s in per_rank] == [math.ceil(n / world_size)] * world_size
        flat = [i for s in per_rank for i in s]
        assert set(flat) == set(range(n)), (n, world_size, per_rank)  # covered, nothing new
        order = ss.shards(n, 1, shuffle=shuffle, epoch=2)[0]
        extra = len(flat) - n
        expected = (order * (extra // n + 1))[:extra]  # the order again, from its start
        assert Counter(flat) - Counter(range(n)) == Counter(expected), (n, world_size, per_rank)


def test_drop_last_drops_the_tail_and_repeats_nothing():
    for n, world_size in SIZES:
        if n < world_size:
            continue
        per_rank = ss.shards(n, world_size, shuffle=True, drop_last=True)
        assert [len(s) for s in per_rank] == [n // world_size] * world_size
        assert ss.repeated(per_rank) == []


def epochs_both_ways(rank, world_size, n):
    return (ss.gathered_epochs(n, 3, call_set_epoch=True),
            ss.gathered_epochs(n, 3, call_set_epoch=False))


@pytest.mark.parametrize("world_size", [2, 3])
def test_set_epoch_changes_the_order_and_every_rank_shuffles_alike(world_size, no_orphans):
    n = 10
    results = run_ranks(epochs_both_ways, world_size, n, timeout=30)
    with_epochs, without_epochs = results[0]
    for rank in range(world_size):  # what each rank's own sampler yielded, as gathered
        assert [e[rank] for e in results[rank][0]] == [e[rank] for e in with_epochs]
    assert len({tuple(e[0]) for e in with_epochs}) == 3
    assert all(e == without_epochs[0] for e in without_epochs)
    for epoch in with_epochs:  # disjoint strides of one permutation: identical on every rank
        flat = [i for s in epoch for i in s]
        assert set(flat) == set(range(n)) and len(flat) == world_size * math.ceil(n / world_size)
    assert ss.check(n, world_size, with_epochs, without_epochs) == []


def test_check_catches_a_sampler_that_ignores_set_epoch():
    stuck = [[list(range(10))[r::2] for r in range(2)]] * 3
    assert ss.check(10, 2, stuck, stuck) != []


@pytest.mark.parametrize("n, world_size", [(10, 3), (7, 2)])
def test_naive_padded_evaluation_is_biased_and_the_fixes_are_exact(n, world_size, no_orphans):
    results = run_ranks(ev.evaluate_all, world_size, n, timeout=30)
    for r in results:
        reference = r["single process"]
        assert abs(r["naive"] - reference) > 1e-3 * reference
        assert r["de-duplicated"] == pytest.approx(reference, rel=1e-6)
        assert r["sum and count"] == pytest.approx(reference, rel=1e-6)


def test_evaluations_agree_when_nothing_is_padded(no_orphans):
    r = run_ranks(ev.evaluate_all, 3, 9, timeout=30)[0]
    assert r["naive"] == pytest.approx(r["single process"], rel=1e-6)


def test_uneven_batches_stop_rank0_in_its_third_backward_and_rank1_at_the_barrier(no_orphans):
    rank0, rank1 = run_ranks(ui.where_it_stops, 2, timeout=60)
    assert rank0["batches done"] == 2 and rank0["code"].endswith(".backward()"), rank0
    assert rank1["batches done"] == 2 and rank1["code"].startswith("dist.barrier("), rank1
    # the message varies: the first rank to time out closes the pair ("Timed out waiting 3000ms",
    # then "Connection closed by peer" or "Application timeout caused pair closure" for the other)


def test_the_fixes_of_uneven_batches_run(no_orphans):
    assert run_ranks(ui.train, 2, "sampler", timeout=30) == [3, 3]
    assert run_ranks(ui.train, 2, "join", timeout=30) == [3, 2]


def test_the_short_timeout_clock_starts_after_a_barrier(no_orphans):
    """A rank that starts 5 s late (a loaded machine) does not trip a 3 s group timeout."""
    def late_start(rank, world_size):
        if rank == 1:
            import time
            time.sleep(5)
        group = short_timeout_group(3.0)
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        return t.item()
    assert run_ranks(late_start, 2, timeout=60) == [2.0, 2.0]


def test_rank0_evaluating_through_ddp_blocks_in_the_buffer_broadcast(no_orphans):
    rank0, rank1 = run_ranks(ev.rank0_evaluates, 2, "ddp", timeout=60)
    assert rank0["mse"] is None and rank0["error"], rank0  # gloo's words vary; where it waited does not
    assert rank0["raised in"][:3] == ["forward", "_pre_forward", "_sync_buffers"], rank0
    assert rank1 == {"mse": None, "error": None, "raised in": None}


@pytest.mark.parametrize("with_buffers", [True, False])
def test_rank0_evaluating_model_module_is_exact(with_buffers, no_orphans):
    rank0 = run_ranks(ev.rank0_evaluates, 2, "module", with_buffers, timeout=60)[0]
    every_rank = run_ranks(ev.rank0_evaluates, 2, "ddp, every rank", with_buffers, timeout=60)
    assert rank0["error"] is None and isinstance(rank0["mse"], float)
    assert [r["mse"] for r in every_rank] == [rank0["mse"]] * 2


def test_without_buffers_rank0_gets_through_ddp_under_no_grad(no_orphans):
    plain = run_ranks(ev.rank0_evaluates, 2, "module", with_buffers=False, timeout=60)[0]
    wrapped = run_ranks(ev.rank0_evaluates, 2, "ddp", with_buffers=False, timeout=60)[0]
    assert wrapped["error"] is None and wrapped["mse"] == plain["mse"]


def test_without_buffers_only_the_bucket_rebuild_blocks_rank0(no_orphans):
    """Grad on, after one step: the first forward after the first backward rebuilds the buckets (a
    broadcast); after two steps it has happened, and rank 0 alone gets through."""
    once = run_ranks(ev.rank0_evaluates, 2, "ddp", with_buffers=False, grad=True, train_steps=1,
                     timeout=60)[0]
    assert once["raised in"] == ["forward", "_pre_forward"], once
    twice = run_ranks(ev.rank0_evaluates, 2, "ddp", with_buffers=False, grad=True, train_steps=2,
                      timeout=60)[0]
    assert twice["error"] is None, twice


def buffers_broadcast_once_after_training(rank, world_size):
    model = DDP(ev.small_net(with_buffers=True), process_group=short_timeout_group(3.0))
    x = torch.ones(4, 8)
    model(x).sum().backward()
    with torch.no_grad():
        model(x)  # every rank: the broadcast that follows a forward with gradients enabled
        if rank == 0:
            model(x)  # rank 0 alone: the no_grad forward before cleared require_forward_param_sync
    dist.barrier(group=model.process_group)
    return model.require_forward_param_sync


def test_a_no_grad_forward_stops_the_next_buffer_broadcast(no_orphans):
    assert run_ranks(buffers_broadcast_once_after_training, 2, timeout=60) == [False, False]


def test_without_a_sampler_the_same_seed_gives_every_rank_the_same_batches(no_orphans):
    same = run_ranks(ss.whole_dataset_batches, 2, same_seed=True, seed=1, timeout=30)
    assert same[0] == same[1]
    own = run_ranks(ss.whole_dataset_batches, 2, same_seed=False, seed=1, timeout=30)
    assert own[0] != own[1]
    for batches in same + own:  # every rank reads the whole dataset either way
        assert sorted(i for b in batches for i in b) == list(range(8))


def test_the_workers_start_method_is_pythons_default_for_this_platform_and_version():
    assert torch.multiprocessing.get_start_method() == multiprocessing.get_start_method()
    if sys.platform in ("darwin", "win32"):
        expected = "spawn"
    else:
        expected = "fork" if sys.version_info < (3, 14) else "forkserver"
    assert multiprocessing.get_start_method() == expected


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the CPU-only behaviour")
def test_pin_memory_without_an_accelerator_warns_and_pins_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = next(iter(DataLoader(ss.Indices(8), batch_size=4, pin_memory=True)))
    assert not batch.is_pinned()
    assert any("no accelerator is found" in str(w.message) for w in caught)
    with pytest.raises(RuntimeError):
        torch.zeros(2).pin_memory()
    assert batch.to("cpu", non_blocking=True) is batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_same_data_seed_gives_every_rank_the_same_augmentation(num_workers, no_orphans):
    same = run_ranks(wr.augmentation_draws, 2, 0, False, num_workers, timeout=60)
    assert wr.same_draws(same)
    assert [row[0] for row in same[0][0]] != [row[0] for row in same[1][0]]  # different samples
    per_rank = run_ranks(wr.augmentation_draws, 2, 0, True, num_workers, timeout=60)
    assert not wr.same_draws(per_rank)
    assert run_ranks(wr.augmentation_draws, 2, 0, True, num_workers, timeout=60) == per_rank
    epochs = per_rank[0]
    assert [row[1:] for row in epochs[0]] != [row[1:] for row in epochs[1]]  # a new base seed per epoch


def _who_loads(rank: int, world_size: int) -> dict:
    loader = DataLoader(wr.WhoLoads(), batch_size=4, num_workers=2,
                        multiprocessing_context=loader_workers_context(2))
    rows = torch.cat(list(loader))
    return {"rank": os.getpid(), "workers": set(rows[:, 0].tolist()),
            "parents": set(rows[:, 1].tolist()), "threads": wr.rank_threads(rank, world_size)}


def test_a_ranks_loader_workers_start_from_a_fork_server_not_from_the_rank(no_orphans):
    """The rank runs threads besides its own (gloo's), so the course never forks it: the workers'
    parent is one fork server per rank, a process of its own."""
    per_rank = run_ranks(_who_loads, 2, timeout=60)
    for result in per_rank:
        assert len(result["workers"]) == 2 and result["rank"] not in result["parents"]
        assert len(result["parents"]) == 1
        if result["threads"]["threads"] is not None:
            assert result["threads"]["threads"] > result["threads"]["started by Python"]
    assert per_rank[0]["parents"] != per_rank[1]["parents"]
    assert loader_workers_context(0) is None  # the DataLoader refuses a context without workers
    with pytest.raises(ValueError, match="multiprocessing_context"):
        DataLoader(wr.WhoLoads(), multiprocessing_context=multiprocessing.get_context("forkserver"))


def test_the_fork_record_shows_the_hang_and_the_fork_server_without_it():
    """benchmarks/fork_with_native_threads.py's record, quoted by the lesson: on its Python
    (3.11: CPython issue gh-112275) some forked children hung, none started from the fork server."""
    record = load_reference("fork_with_native_threads.json")
    assert record["python"].startswith("3.11.")
    assert record["hung"]["fork"] > 0 and record["hung"]["forkserver"] == 0
    assert record["forks"] >= 10_000


def test_an_iterable_dataset_refuses_a_sampler():
    with pytest.raises(ValueError, match="IterableDataset"):
        DataLoader(wr.Stream(9), sampler=DistributedSampler(ss.Indices(9), 2, 0))


@pytest.mark.parametrize("world_size, num_workers", [(2, 2), (3, 2), (2, 3)])
def test_an_iterable_dataset_sharded_by_rank_and_worker_reads_each_sample_once(
        world_size, num_workers, no_orphans):
    n = 11
    results = {split: run_ranks(wr.stream_samples, world_size, n, split, num_workers, timeout=60)
               for split in wr.SPLITS}
    once = results["rank x worker"]
    assert sorted(wr.read_counts(once).elements()) == list(range(n))
    for rank, result in enumerate(once):  # a rank's workers together read range(rank, n, W)
        assert result["samples"] == list(range(rank, n, world_size))
    assert set(wr.read_counts(results["rank"]).values()) == {num_workers}
    assert set(wr.read_counts(results["none"]).values()) == {num_workers * world_size}
    if (world_size, num_workers) == (2, 2):
        assert [r["batches"] for r in results["rank x worker"]] == [4, 3]  # uneven


def test_the_workers_script_check_catches_wrong_sharding():
    one = {"rank x worker": [{"samples": [0, 1, 2]}, {"samples": [3]}],
           "rank": [{"samples": [0, 0, 2, 2]}, {"samples": [1, 1, 3, 3]}],
           "none": [{"samples": sorted([0, 1, 2, 3] * 2)}] * 2}
    draws = {"same seed": [[[[0, 0.5, 0.5]]]] * 2, "seed + rank": [[[[0, 0.5, 0.5]]], [[[1, 0.1, 0.2]]]]}
    assert wr.check(4, 2, 2, one, draws, draws["seed + rank"]) == []
    assert wr.check(4, 2, 2, {**one, "rank x worker": one["rank"]}, draws, draws["seed + rank"]) != []
    assert wr.check(4, 2, 2, one, {**draws, "seed + rank": draws["same seed"]}, draws["same seed"]) != []


@pytest.mark.parametrize("fix", ui.FIXES)
def test_uneven_inputs_script_fails_without_a_fix_and_runs_with_one(fix, no_orphans):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(CHAPTER / "uneven_inputs.py"), "--fix", fix]
    done = run_bounded(cmd, 60, cwd=ROOT)
    assert not done.timed_out, "the process-group timeout should have turned the hang into an error"
    if fix == "none":
        assert done.returncode != 0
        assert "Timed out" in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 0, done.stdout + done.stderr[-2000:]
        assert f"--fix {fix}: batches per rank" in done.stdout
        assert "terminate called" not in done.stderr
