"""Chapter 01: the headline demo learns, and learns what one process learns; the scaling
measurement returns well-formed rows and tables (never its timings: wall-clock time on a shared
2-core machine is noise for a test), in both launch modes; the recorded reference run the lesson
plots is complete."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpcourse import timing
from ddpcourse.launcher import RankError, run_ranks
from ddpcourse.toys import flat_parameters, make_model

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "01_why_ddp"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too, so they can import scaling

import ddp_equals_single_process as demo  # noqa: E402
import scaling  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_orphans")
ROW_KEYS = {"workload", "mode", "world_size", "batch_per_rank", "data_ms", "compute_ms",
            "comm_ms", "step_ms", "allreduce_ms", "gradient_bytes", "samples_per_s",
            "comm_share", "epoch_s", "oversubscribed", "speedup", "step_ms_rounds"}
QUICK = dict(steps=2, warmup=1)


def test_headline_demo_loss_falls_and_equals_the_single_process_run():
    ddp = run_ranks(demo.ddp_run, 2, timeout=60)
    single = demo.single_run()
    losses = ddp[0]["losses"]
    assert len(losses) == demo.DEFAULTS["epochs"]
    # it learns: every epoch lower than the one before, and the last well under a third of the
    # first (about 0.52 -> 0.085 with the defaults)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] / 3, losses
    # and what it learns is the single process's: same loss every epoch, same final weights
    assert losses == pytest.approx(single["losses"], rel=1e-5)
    assert ddp[1]["losses"] == losses  # the global loss, all-reduced: the same on every rank
    assert torch.equal(ddp[0]["weights"], ddp[1]["weights"])
    assert (ddp[0]["weights"] - single["weights"]).abs().max() <= demo.TOLERANCE
    assert (single["weights"] - flat_parameters(make_model(0))).abs().max() > 0.1  # it moved


@pytest.fixture(scope="module")
def tiny_rows():
    return scaling.measure_scaling("tiny", world_sizes=(1, 2, 4), **QUICK)


def test_strong_scaling_rows_have_the_right_keys_and_world_sizes(tiny_rows):
    assert [row["world_size"] for row in tiny_rows] == [1, 2, 4]
    for row in tiny_rows:
        assert set(row) == ROW_KEYS
        assert row["workload"] == "tiny" and row["mode"] == "strong"
    # strong scaling: the global batch (64) is split
    assert [row["batch_per_rank"] for row in tiny_rows] == [64, 32, 16]


def test_speedups_are_positive_finite_and_relative_to_one_rank(tiny_rows):
    assert tiny_rows[0]["speedup"] == 1.0
    for row in tiny_rows:
        assert math.isfinite(row["speedup"]) and row["speedup"] > 0
        assert row["speedup"] == pytest.approx(row["samples_per_s"] / tiny_rows[0]["samples_per_s"])


def test_times_are_consistent(tiny_rows):
    for row in tiny_rows:
        for key in ("data_ms", "compute_ms", "step_ms", "allreduce_ms", "epoch_s"):
            assert math.isfinite(row[key]) and row[key] > 0, key
        assert row["comm_ms"] >= 0 and 0 <= row["comm_share"] < 1
        assert row["step_ms"] >= row["data_ms"]
        # samples/s is the global batch over the step time
        global_batch = row["batch_per_rank"] * row["world_size"]
        assert row["samples_per_s"] == pytest.approx(global_batch / (row["step_ms"] / 1e3))
        assert row["gradient_bytes"] == 4 * 1377  # TinyMLP's float32 parameters


def test_oversubscription_is_flagged_by_core_count(tiny_rows):
    cores = scaling.usable_cores()
    assert [row["oversubscribed"] for row in tiny_rows] == [n > cores for n in (1, 2, 4)]


def test_table_has_a_line_per_world_size(tiny_rows):
    lines = scaling.format_table(tiny_rows).splitlines()
    assert lines[0].startswith("tiny model, strong scaling")
    body = lines[2:]
    assert [int(line.split()[0]) for line in body] == [1, 2, 4]
    assert all(line.split()[10].endswith("x") for line in body)  # the speed-up column


def test_weak_scaling_keeps_the_per_rank_batch():
    rows = scaling.measure_scaling("tiny", world_sizes=(1, 2), mode="weak", **QUICK)
    assert [row["batch_per_rank"] for row in rows] == [64, 64]
    assert all(row["mode"] == "weak" for row in rows)


def test_rounds_keep_one_row_per_world_size():
    rows = scaling.measure_scaling("tiny", world_sizes=(2, 1), rounds=2, **QUICK)
    assert [row["world_size"] for row in rows] == [2, 1]
    assert rows[0]["speedup"] == 1.0  # relative to the first world size given
    for row in rows:  # the fastest round is kept, every round's step time is reported
        assert len(row["step_ms_rounds"]) == 2 and row["step_ms"] == min(row["step_ms_rounds"])
    named = scaling.round_timings(rows)
    assert list(named) == ["tiny strong, 2 ranks", "tiny strong, 1 ranks"]
    assert named["tiny strong, 2 ranks"].min == rows[0]["step_ms"]


def test_work_per_step_is_counted_from_the_model():
    heavy = scaling.work_per_step("heavy", 2)
    # 256*512+512 + 512*512+512 + 512+1 parameters, float32
    assert heavy["params"] == 394_753 and heavy["gradient_bytes"] == 4 * 394_753
    assert heavy["batch_per_rank"] == 1024
    assert heavy["flops_per_rank"] == 6 * 394_753 * 1024
    assert heavy["bytes_sent_per_rank"] == 4 * 394_753  # 2(N-1)/N = 1 at N = 2
    assert round(heavy["flops_per_byte_sent"]) == 1536  # the figure the lesson quotes
    tiny = scaling.work_per_step("tiny", 2)
    assert tiny["params"] == 1377 and round(tiny["flops_per_byte_sent"]) == 48
    assert scaling.work_per_step("tiny", 1)["bytes_sent_per_rank"] == 0  # nothing to all-reduce
    weak = scaling.work_per_step("heavy", 2, "weak")
    assert weak["batch_per_rank"] == 2048 and round(weak["flops_per_byte_sent"]) == 3072
    four = scaling.work_per_step("heavy", 4)
    assert four["bytes_sent_per_rank"] == pytest.approx(1.5 * 4 * 394_753)


def test_record_reference_writes_a_complete_record(tmp_path, monkeypatch):
    calls = []

    def fake_measure(workload, world_sizes, mode, rounds):
        calls.append((workload, tuple(world_sizes), mode, rounds))
        return [{"workload": workload, "mode": mode, "world_size": n, "step_ms": 10.0,
                 "step_ms_rounds": [10.0, 10.5]} for n in world_sizes]

    monkeypatch.setattr(scaling, "measure_scaling", fake_measure)
    monkeypatch.setattr(scaling.timing, "machine_load",
                        lambda interval: scaling.timing.Load(1.5, 2, "given"))
    monkeypatch.setattr(sys, "argv", ["chapters/01_why_ddp/scaling.py", "--record", "x.json"])
    out = tmp_path / "ch01.json"
    scaling.record_reference(out, (1, 2), rounds=2, note="busy")
    assert calls == [("heavy", (1, 2), "strong", 2), ("tiny", (1, 2), "strong", 2),
                     ("heavy", (1, 2), "weak", 2)]
    record = scaling.timing.load_reference(out)
    assert record["command"] == "python chapters/01_why_ddp/scaling.py --record x.json"
    assert record["load"]["busy_cores"] == 1.5 and record["load"]["note"] == "busy"
    assert record["conclusive"] is False and "TOO LOADED" in record["verdict"]
    assert set(record["strong"]) == {"heavy", "tiny"} and set(record["weak"]) == {"heavy"}


def test_heavy_workload_is_much_more_compute_per_gradient_byte():
    heavy, tiny = scaling.WORKLOADS["heavy"], scaling.WORKLOADS["tiny"]
    # FLOPs per step ~ parameters x batch, gradient bytes ~ parameters: the ratio is the batch
    assert heavy.global_batch >= 16 * tiny.global_batch


def test_a_global_batch_that_does_not_split_is_refused():
    with pytest.raises(RankError, match="does not split over 3"):
        scaling.measure_scaling("tiny", world_sizes=(3,), **QUICK)


def test_unknown_mode_is_refused():
    with pytest.raises(RankError, match="mode must be"):
        scaling.measure_scaling("tiny", world_sizes=(1,), mode="sideways", **QUICK)


def test_sweep_command_prints_a_table_per_workload(monkeypatch, capsys):
    # `python scaling.py --world-sizes ...` without torchrun: run in-process (the rank servers
    # are warm here; a fresh interpreter would spend most of its time starting them).
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["scaling.py", "--workloads", "tiny", "--world-sizes", "1",
                                      "2"])
    assert scaling.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "tiny model, strong scaling (0.01 MiB of gradients per step)"
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"]


def test_torchrun_command_prints_one_row_per_workload_on_rank_0():
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["torchrun", "--standalone", "--nproc_per_node", "2", "chapters/01_why_ddp/scaling.py",
         "--workloads", "tiny"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("tiny model, strong scaling") == 1
    row = next(line for line in done.stdout.splitlines() if line.split()[:2] == ["2", "32"])
    assert row.split()[-1] == "-"  # one world size: no speed-up to compute


def test_compute_split_is_two_ranks_over_one_and_says_whether_cores_were_free():
    rows = [{"mode": "strong", "world_size": 1, "compute_ms": 80.0},
            {"mode": "strong", "world_size": 2, "compute_ms": 48.0},
            {"mode": "strong", "world_size": 4, "compute_ms": 50.0}]
    assert scaling.compute_split(rows) == pytest.approx(0.6)
    assert scaling.cores_were_free(rows)
    rows[1]["compute_ms"] = 56.0  # 0.7 of one rank's: a core was busy
    assert not scaling.cores_were_free(rows)
    weak = [{**row, "mode": "weak"} for row in rows]  # the same work per rank: 1.0 is ideal
    weak[1]["compute_ms"] = 100.0  # 1.25
    assert scaling.cores_were_free(weak)
    weak[1]["compute_ms"] = 110.0  # 1.375
    assert not scaling.cores_were_free(weak)


def test_the_reference_run_supports_what_the_lesson_says():
    record = timing.load_reference(scaling.REFERENCE)
    assert record["conclusive"], record["verdict"]  # quiet, and the fastest rounds reproduced
    assert record["load"]["busy_cores"] <= 0.25 * record["load"]["cores"]
    assert record["command"].startswith(
        "python chapters/01_why_ddp/scaling.py --record benchmarks/results/ch01_scaling.json")
    strong, weak = record["strong"], record["weak"]
    assert [r["world_size"] for r in strong["heavy"]] == [1, 2, 4]
    # the cores were free, and the compute fell to about 0.6 of one rank's, not 0.5
    assert 0.52 < scaling.compute_split(strong["heavy"]) and scaling.cores_were_free(strong["heavy"])
    assert scaling.cores_were_free(weak["heavy"])
    heavy, tiny = strong["heavy"], strong["tiny"]
    assert heavy[1]["speedup"] > 1.1  # heavy got faster on 2 ranks...
    assert heavy[1]["speedup"] < 1.9  # ...well short of 2x
    assert tiny[1]["speedup"] < 1.0  # tiny got slower
    assert tiny[1]["comm_ms"] > 0.5 * tiny[1]["compute_ms"]  # exposed comm ~ the compute
    assert heavy[2]["speedup"] < heavy[1]["speedup"] and tiny[2]["speedup"] < tiny[1]["speedup"]
    assert all(rows[0]["epoch_s"] < 2 for rows in strong.values())  # "a second or less"
    for n in (1, 2):  # weak above strong on 2 and 4 ranks
        assert weak["heavy"][n]["speedup"] > heavy[n]["speedup"]
