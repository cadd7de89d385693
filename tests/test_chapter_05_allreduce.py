"""Chapter 05 (AllReduce by hand): the hand-written collectives against ``dist.all_reduce``, the
benchmark script's JSON, the three gradient-averaging designs, and the broadcast demo.

Multi-rank checks go through ``run_ranks`` (deadlines, no ports); the benchmark runs under
torchrun (``--standalone``: the OS picks the port), killed as a group at its deadline. Nothing
here depends on how fast the machine is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpcourse import timing
from ddpcourse.launcher import RankTimeoutError, run_bounded, run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "05_allreduce"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too

import broadcast_parameters  # noqa: E402
import hand_collectives  # noqa: E402
import ring_vs_gloo  # noqa: E402
import three_ddp_designs  # noqa: E402

@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_hand_all_reduces_equal_dist_all_reduce(world_size, no_orphans):
    results = run_ranks(hand_collectives.check_against_all_reduce, world_size, timeout=60)
    assert results == [[]] * world_size


def traffic(rank, world_size, numel=1200):
    sent = {}
    for name, algorithm in hand_collectives.ALGORITHMS.items():
        tensor = torch.ones(numel)
        with hand_collectives.count_traffic() as counted:
            algorithm(tensor)
        sent[name] = dict(counted)
    return sent


def test_ring_sends_2_n_minus_1_over_n_and_naive_loads_rank_0(no_orphans):
    nbytes = 1200 * 4
    for world_size in (2, 3, 4):
        results = run_ranks(traffic, world_size, timeout=30)
        for rank, sent in enumerate(results):
            assert sent["ring"]["messages"] == 2 * (world_size - 1)
            assert sent["ring"]["bytes"] == 2 * (world_size - 1) * nbytes // world_size
        assert results[0]["naive"]["bytes"] == (world_size - 1) * nbytes
        assert all(r["naive"]["bytes"] == nbytes for r in results[1:])
        if world_size == 2:  # the same two exchanges: any gap in their timings is noise
            assert all(sent["halving_doubling"] == sent["ring"] for sent in results)
    hd = run_ranks(traffic, 4, timeout=30)
    assert all(s["halving_doubling"]["messages"] == 4 for s in hd)  # 2 log2(4) steps, not 6
    assert all(s["halving_doubling"]["bytes"] == 2 * 3 * nbytes // 4 for s in hd)


def record_steps(rank, world_size, algorithm):
    snapshots = []
    tensor = torch.full((world_size,), float(2**rank))
    getattr(hand_collectives, algorithm)(
        tensor, on_step=lambda phase, step, t: snapshots.append((phase, step, t.tolist())))
    return snapshots


def test_ring_steps_are_reduce_scatter_then_all_gather(no_orphans):
    results = run_ranks(record_steps, 4, "ring_allreduce", timeout=30)
    phases = [(phase, step) for phase, step, _ in results[0]]
    assert phases == [("reduce-scatter", s) for s in range(3)] + [("all-gather", s)
                                                                   for s in range(3)]
    for rank, snapshots in enumerate(results):
        after_reduce_scatter = snapshots[2][2]
        assert after_reduce_scatter[(rank + 1) % 4] == 15.0  # 1+2+4+8: the finished chunk
        assert snapshots[-1][2] == [15.0] * 4


def test_blocking_send_first_on_both_ranks_hangs_on_gloo(no_orphans):
    def both_send_first(rank, world_size):
        dist.send(torch.ones(1000), 1 - rank)
        dist.recv(torch.empty(1000), 1 - rank)

    with pytest.raises(RankTimeoutError):
        run_ranks(both_send_first, 2, timeout=4, relay_output=False)


def test_benchmark_script_writes_json_with_every_field(tmp_path, no_orphans):
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(CHAPTER / "ring_vs_gloo.py"), "--sizes", "4K", "100K", "--repeats", "2",
           "--out", str(out)]
    done = run_bounded(cmd, 60, cwd=ROOT)
    assert not done.timed_out and done.returncode == 0, done.stdout + done.stderr
    assert "ring/gloo" in done.stdout and "100 KiB" in done.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["repeats"] == 2
    rows = report["rows"]
    assert {(r["bytes"], r["algorithm"]) for r in rows} == {
        (b, a) for b in (4096, 102400) for a in ("ring", "halving_doubling", "gloo")}
    for r in rows:
        assert r["correct"] is True and len(r["timings_s"]) == 2
        assert r["best_s"] == min(r["timings_s"]) and r["time_s"] >= r["best_s"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["best_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(N-1)/N = 1 at N = 2
    assert set(report["ring_over_gloo_busbw"]) == {"4096", "102400"}
    # a complete reference record: machine, date, torch, the command that reproduces it, load
    record = timing.load_reference(out)
    assert record["command"] == (
        "torchrun --standalone --nproc_per_node 2 chapters/05_allreduce/ring_vs_gloo.py "
        f"--sizes 4K 100K --repeats 2 --out {out}")
    assert record["torch"] == torch.__version__ and record["load"]["cores"] >= 1
    assert isinstance(report["conclusive"], bool) and report["verdict"]
    assert report["verdict"] in done.stdout


def test_ring_and_halving_doubling_gap_is_the_ratio_of_their_times():
    rows = [{"bytes": 8, "algorithm": "ring", "best_s": 3.0},
            {"bytes": 8, "algorithm": "halving_doubling", "best_s": 2.0},
            {"bytes": 8, "algorithm": "gloo", "best_s": 1.0},
            {"bytes": 16, "algorithm": "ring", "best_s": 1.0},
            {"bytes": 16, "algorithm": "halving_doubling", "best_s": 2.5}]
    assert ring_vs_gloo.same_algorithm_gap(rows) == {8: 1.5, 16: 0.4}
    assert ring_vs_gloo.worst_gap(rows) == (16, 0.4)  # 1/0.4 = 2.5 is further from 1 than 1.5


def test_bus_bandwidth_factor_and_size_parsing():
    assert ring_vs_gloo.bus_factor(4) == 1.5 and ring_vs_gloo.bus_factor(2) == 1.0
    # nccl-tests' in-network reduction factor, (n-1)/(n+1)
    assert ring_vs_gloo.bus_factor(8, in_network=True) == pytest.approx(7 / 9)
    assert ring_vs_gloo.bus_factor(2, in_network=True) == pytest.approx(1 / 3)
    for n in (2, 4, 8, 72):  # the switch's additions: algbw 2(N+1)/N higher at the same busbw
        assert ring_vs_gloo.bus_factor(n) / ring_vs_gloo.bus_factor(n, in_network=True) == \
            pytest.approx(2 * (n + 1) / n)
    assert [ring_vs_gloo.parse_size(s) for s in ("4K", "16M", "64MiB", "100")] == [
        4096, 16 * 2**20, 64 * 2**20, 100]
    rows = [{"bytes": 8, "algorithm": "ring", "busbw_GBps": 0.9},
            {"bytes": 8, "algorithm": "gloo", "busbw_GBps": 1.0}]
    assert ring_vs_gloo.busbw_ratios(rows) == {8: pytest.approx(0.9)}


def test_three_designs_count_calls_and_end_with_the_same_weights(no_orphans):
    results = run_ranks(three_ddp_designs.run_designs, 2, steps=4, width=64, depth=4, batch=16,
                        bucket_cap_mb=0.02, timeout=60)
    for per_rank in results:
        with_grad = per_rank["naive"]["params_with_grad"]
        assert with_grad == 2 * 5  # 5 Linear layers, weight and bias each
        assert per_rank["naive"]["calls_per_step"] == [with_grad] * 4
        assert per_rank["hooks"]["calls_per_step"] == [with_grad] * 4
        ddp = per_rank["ddp"]["calls_per_step"]
        assert ddp[0] == 1 and all(1 < c < with_grad for c in ddp[1:])  # rebuilt after step 1
        total = sum(p.numel() for p in three_ddp_designs.make_mlp(64, 4).parameters())
        assert all(sum(sizes) == total for sizes in per_rank["ddp"]["elements_per_call"])
        assert per_rank["compute_only"]["calls_per_step"] == [0] * 4
        assert three_ddp_designs.same_weights(per_rank)
        assert per_rank["compute_only"]["max_diff_across_ranks"] > 1e-4  # no sync: drift


def test_same_weights_rejects_a_design_that_drifted():
    fake = {d: {"max_diff_vs_naive": 0.0, "max_diff_across_ranks": 0.0}
            for d in ("naive", "hooks", "ddp")}
    assert three_ddp_designs.same_weights(fake)
    fake["hooks"]["max_diff_vs_naive"] = 1e-3
    assert not three_ddp_designs.same_weights(fake)


MODES_INDEX = {mode: i for i, mode in enumerate(broadcast_parameters.MODES)}


def test_replicas_diverge_without_broadcast_and_agree_with_it(no_orphans):
    results = run_ranks(broadcast_parameters.run_modes, 2, steps=5, timeout=60)
    by_mode = {r["mode"]: r for r in results[0]}
    apart = by_mode["averaging only"]
    assert apart["spread_before"] > 0.1
    assert apart["spread_after"] == pytest.approx(apart["spread_before"], rel=1e-4)  # SGD: kept
    assert results[0][0]["held_out_loss"] != results[1][0]["held_out_loss"]
    for mode in ("broadcast first", "DDP"):
        assert by_mode[mode]["spread_before"] == 0.0 and by_mode[mode]["spread_after"] == 0.0
        assert results[0][MODES_INDEX[mode]]["held_out_loss"] == results[1][MODES_INDEX[mode]][
            "held_out_loss"]
    assert broadcast_parameters.verdict(results)



def test_hand_collectives_warns_about_the_exercise_and_checks_itself(no_orphans):
    doc = hand_collectives.__doc__
    assert "SPOILER" in doc and "exercise 05" in doc and "Launch test: custom" in doc
    done = run_bounded([sys.executable, str(CHAPTER / "hand_collectives.py")], 90, cwd=ROOT)
    assert not done.timed_out and done.returncode == 0, done.stdout + done.stderr
    assert [line for line in done.stdout.splitlines() if "ranks:" in line] == [
        f"{n} ranks: all equal dist.all_reduce" for n in (1, 2, 3, 4)]


def reference_rows(world_size):
    record = timing.load_reference(f"ch05_ring_vs_gloo_ws{world_size}.json")
    assert record["conclusive"], record["verdict"]
    assert record["command"].startswith(
        f"torchrun --standalone --nproc_per_node {world_size} chapters/05_allreduce/ring_vs_gloo.py"
        f" --full --out benchmarks/results/ch05_ring_vs_gloo_ws{world_size}.json")
    assert record["world_size"] == world_size and record["repeats"] == 20
    return {(r["bytes"], r["algorithm"]): r for r in record["rows"]}


def test_the_reference_runs_support_what_the_lesson_says():
    two, four = reference_rows(2), reference_rows(4)
    small = [4 * 2**10, 16 * 2**10, 64 * 2**10, 256 * 2**10]
    large = [2**20, 4 * 2**20, 16 * 2**20]
    # small messages are latency: "about half a millisecond" on 2 ranks whatever the size
    best = [two[(b, a)]["best_s"] for b in small for a in ("ring", "halving_doubling", "gloo")]
    assert max(best) < 1e-3 and max(best) / min(best) < 1.8
    # on 4 ranks, halving-doubling (4 steps) beats the ring (6 steps) up to 256 KiB, by about 4/6
    for b in small:
        assert 0.5 < four[(b, "halving_doubling")]["best_s"] / four[(b, "ring")]["best_s"] < 0.85
    # on 2 ranks they are the same exchanges: the noise gauge
    _, gap = ring_vs_gloo.worst_gap(list(two.values()))
    assert 1 / 1.2 < gap < 1.2
    # large messages: the ring reaches 0.78-0.90 of gloo's busbw, and gloo is far ahead at 64 MiB
    for rows in (two, four):
        for b in large:
            ratio = rows[(b, "ring")]["busbw_GBps"] / rows[(b, "gloo")]["busbw_GBps"]
            assert 0.77 < ratio < 0.91, (b, ratio)
    assert two[(64 * 2**20, "ring")]["busbw_GBps"] < 0.7 * two[(64 * 2**20, "gloo")]["busbw_GBps"]
    # the plateau: about 1 to 1.4 GB/s for gloo on 2 ranks
    assert all(1.0 <= two[(b, "gloo")]["busbw_GBps"] <= 1.45 for b in large + [64 * 2**20])
