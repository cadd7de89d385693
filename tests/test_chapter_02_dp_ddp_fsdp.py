"""Chapter 02 (DataParallel vs DDP vs FSDP): its measurements say what the lesson says they do.

The memory numbers must satisfy exact relations (DDP: full parameters, gradients, 2 x Adam
state and a bucket copy on every rank; FSDP2: a padded half on each of 2 ranks), the by-hand
DataParallel step must compute DP's gradients and count what it copies, DDP must re-broadcast
rank 0's buffers at every forward and keep its small first bucket for the default cap only, the
wire bytes must be the nccl-tests counts, and the scripts must print their tables.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from chapter_launch import launch_once
from course_layout import TESTED_TORCH

from ddpcourse import timing
from ddpcourse.launcher import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "02_dp_ddp_fsdp"
sys.path.insert(0, str(CHAPTER))

import _ch02_helpers as ch  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_script(command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------ DataParallel by hand


@pytest.mark.skipif(GPUS > 0, reason="DataParallel only falls back to the module without GPUs")
def test_dataparallel_without_gpus_just_calls_the_module():
    model = ch.make_mlp(16, 2)
    dp = nn.DataParallel(model)
    x = torch.randn(4, 16)
    assert dp.device_ids == []
    assert torch.equal(dp(x), model(x))


@pytest.mark.parametrize("n_devices,batch", [(2, 16), (3, 16), (4, 10)])
def test_dp_by_hand_computes_the_full_batch_gradient(n_devices, batch):
    # batch 10 on 4 devices gives uneven chunks (3, 3, 3, 1), as DP's scatter would
    err = ch.dp_emulation_gradient_error(n_devices=n_devices, batch=batch)
    assert err < 1e-6, f"by-hand DP gradients differ from one process's by {err}"


def test_replicas_are_differentiable_copies_whose_gradients_reach_the_module():
    model = ch.make_mlp(8, 2)
    (replica,) = ch.replicate_on_cpu(model, 1)
    originals = list(model.parameters())
    copies = [replica[0].weight, replica[0].bias, replica[2].weight, replica[2].bias]
    for original, copy in zip(originals, copies):
        assert torch.equal(original, copy)
        assert copy.data_ptr() != original.data_ptr()  # a real copy, like a GPU replica
        assert not copy.is_leaf  # its gradient flows back to the original
    replica(torch.randn(3, 8)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in originals)


def test_dp_mechanism_cost_counts_what_one_iteration_copies_and_times_every_phase():
    r = ch.dp_mechanism_cost(64, depth=2, n_devices=3, batch=12, repeats=3)
    phases = ["scatter_s", "replicate_s", "apply_s", "gather_s", "backward_s"]
    for key in phases + ["step_s"]:
        assert 0 < r[key] <= r[key[:-2] + "_median_s"], key
    assert sum(r[p] for p in phases) <= r["step_s"] * (1 + 1e-9)  # min of sums >= sum of mins
    assert r["params"] == 2 * (64 * 64 + 64)
    assert r["param_bytes"] == 4 * r["params"]
    # counted from the replicas themselves: 2 other devices, each a full copy of 5 modules
    model = ch.make_mlp(64, 2)
    replicas = ch.replicate_on_cpu(model, 2)
    assert r["modules_replicated"] == sum(len(list(m.modules())) for m in replicas) == 2 * 5
    # a replica's parameters are plain (non-leaf) tensors set on the shells, as in replicate.py
    copied = [getattr(shell, name) for replica in replicas for shell in replica.modules()
              for name in ("weight", "bias")
              if isinstance(getattr(shell, name, None), torch.Tensor)]
    assert r["replica_bytes"] == ch.tensor_bytes(copied) == 2 * r["param_bytes"]
    # scatter sends chunks 2 and 3 of 12 rows x 64 floats; gather brings their outputs back
    assert r["scatter_bytes"] == r["gather_bytes"] == 8 * 64 * 4


def test_replicate_never_sees_the_batch():
    from torch.nn.parallel.replicate import replicate
    import inspect

    assert list(inspect.signature(replicate).parameters) == ["network", "devices", "detach"]
    small, large = (ch.dp_mechanism_cost(128, depth=2, batch=b, repeats=1) for b in (8, 256))
    assert small["replica_bytes"] == large["replica_bytes"]
    assert small["modules_replicated"] == large["modules_replicated"]
    assert large["scatter_bytes"] == 32 * small["scatter_bytes"]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_wire_bytes_are_the_nccl_tests_counts_for_both_schemes(n):
    p = 1000
    wire = ch.link_bytes_per_step(n, p)
    assert wire["dp_nccl"] == 2 * p  # broadcast + reduce, bus factor 1 each, whatever n
    assert wire["ddp"] == pytest.approx(2 * (n - 1) / n * p)
    assert wire["dp_nccl"] / wire["ddp"] == pytest.approx(n / (n - 1))  # 2x at n=2, 4/3 at n=4
    assert wire["dp_copies"] == 2 * (n - 1) * p  # the old count: only without NCCL


def test_live_timings_hand_every_repeat_to_the_shared_verdict():
    r = ch.dp_mechanism_cost(256, depth=4, repeats=3)
    assert {len(v) for v in r["samples"].values()} == {3}
    for name in ("replicate", "step"):
        assert min(r["samples"][name]) == r[f"{name}_s"]
    rows = [{"param_bytes": 2e6, "batch": 8,
             "samples": {"a": [0.010, 0.011, 0.012], "tiny": [1e-5, 2e-5, 1e-3]}}]
    timings = ch.live_timings(rows, ["a", "tiny"], "DP ")
    assert list(timings) == ["DP a (2.00 MB, batch 8)"]  # under 1 ms: left out
    assert timings["DP a (2.00 MB, batch 8)"].median == 0.011
    quiet = timing.machine_load(busy=0.0, cores=2)
    assert timing.judge(timings, quiet).conclusive
    rows[0]["samples"]["a"] = [0.010, 0.020, 0.030]  # the fastest not reproduced: 100% apart
    verdict = timing.judge(ch.live_timings(rows, ["a"]), quiet)
    assert not verdict.conclusive and not verdict.loaded
    assert str(verdict).startswith("TOO NOISY TO CONCLUDE")
    loaded = timing.machine_load(busy=1.5, cores=2)
    assert not timing.judge(timings, loaded).conclusive


def test_dp_device_accounting_puts_persistent_state_on_device_0_only():
    rows = ch.dp_device_bytes(64, depth=2, n_devices=4, batch=8)
    p = ch.param_bytes(ch.make_mlp(64, 2))
    assert rows[0]["grads"] == p and rows[0]["optimizer_state"] == 2 * p
    assert all(r["grads"] == r["optimizer_state"] == r["gathered_outputs"] == 0 for r in rows[1:])


# --------------------------------------------------------------------------------- DDP


def test_ddp_broadcasts_rank_0_parameters_at_construction(no_orphans):
    r0, r1 = run_ranks(ch.ddp_broadcast_at_construction, 2)
    assert r0["checksum_before"] != r1["checksum_before"]
    assert r0["checksum_after"] == r1["checksum_after"] == r0["checksum_before"]


def test_ddp_rebroadcasts_rank_0_buffers_at_the_next_training_forward_by_default(no_orphans):
    both = run_ranks(ch.ddp_buffer_sync_both, 2)
    r0, r1 = (r["default"] for r in both)
    off0, off1 = (r["off"] for r in both)
    assert r0["forward_sync_buffers"] is True and off0["forward_sync_buffers"] is False
    for a, b in ((r0, r1), (off0, off1)):
        assert a["params"] == b["params"]  # parameters stay equal either way
        assert a["inside"][0] == b["inside"][0]  # equal at the start (construction broadcast)
        assert a["after"][0] != b["after"][0]  # each rank's BatchNorm saw its own batch
        assert a["after"][1] != b["after"][1]  # and again after the last step
    # default: step 2's forward starts with rank 0's running mean on every rank, bit for bit
    assert r0["inside"][1] == r1["inside"][1] == r0["after"][0]
    # off: each rank keeps its own
    assert off0["inside"][1] == off0["after"][0] and off1["inside"][1] == off1["after"][0]
    assert off1["inside"][1] != off0["after"][0]


@pytest.fixture(scope="module")
def bucket_sizes():
    return run_ranks(ch.ddp_bucket_sizes_by_cap, 2, [None, 25, 2], 512, 12)[0]


def test_ddp_uses_one_bucket_in_the_first_iteration_whatever_the_cap(bucket_sizes):
    grad_bytes = ch.param_bytes(ch.make_mlp(512, 12))
    for cap, sizes in bucket_sizes.items():
        assert all(sum(it) == grad_bytes for it in sizes), (cap, sizes)
        assert sizes[0] == [grad_bytes], f"bucket_cap_mb={cap}: first iteration {sizes[0]}"


def test_the_small_first_bucket_exists_only_when_the_cap_is_left_at_its_default(bucket_sizes):
    grad_bytes = ch.param_bytes(ch.make_mlp(512, 12))
    layer_bytes = (512 * 512 + 512) * 4
    first = dist._DEFAULT_FIRST_BUCKET_BYTES
    assert first == 2**20
    # default: a first bucket of one layer (it closes once it reaches 1 MiB), then the rest
    for later in bucket_sizes[None][1:]:
        assert later == [layer_bytes, grad_bytes - layer_bytes], later
    # 25 written out, the default's own value: no small bucket, everything fits in one
    for later in bucket_sizes[25][1:]:
        assert later == [grad_bytes], later
    # 2: every bucket, the first included, fills to the cap: two layers each
    for later in bucket_sizes[2][1:]:
        assert later == [2 * layer_bytes] * 6, later
        assert later[0] > first


def _first_bucket_parameter_names(rank, world_size):
    model = ch.make_mlp(512, 12, seed=rank)
    ddp = ch._ddp(model)
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    buckets = []

    def hook(state, bucket):
        buckets.append([names[p.data_ptr()] for p in bucket.parameters()])
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
            lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    for _ in range(2):
        buckets.clear()
        ddp(torch.randn(4, 512)).sum().backward()
    return buckets[0]


def test_the_small_first_bucket_holds_the_last_layer_whose_gradients_arrive_first(no_orphans):
    assert run_ranks(_first_bucket_parameter_names, 2)[0] == ["22.bias", "22.weight"]


def test_ddp_launches_all_reduces_before_backward_is_done(no_orphans):
    events = [what for _, what in run_ranks(ch.ddp_event_log, 2)[0]]
    first_launch = next(i for i, e in enumerate(events) if e.startswith("all-reduce launched"))
    first_layer_ready = events.index("grad ready: layer 0 weight")
    assert first_launch < first_layer_ready, events
    assert events[-1] == "backward() returned"


# ------------------------------------------------------------------- memory per rank


@pytest.fixture(scope="module")
def memory_results():
    return run_ranks(ch.memory_per_rank, 2)


def test_every_ddp_rank_holds_full_params_grads_adam_state_and_buckets(memory_results):
    full = ch.param_bytes(ch._memory_model(256, 8, 5))
    for r in memory_results:
        d = r["ddp"]
        assert d["full_param_bytes"] == full
        assert (d["params"], d["grads"], d["optim_moments"]) == (full, full, 2 * full)
        assert d["buckets"] == full and not d["grads_are_bucket_views"]
        assert d["optim_steps"] == 4 * len(list(ch._memory_model(256, 8, 5).parameters()))
        total = sum(d[c] for c in ch.MEMORY_COLUMNS)
        assert total == 5 * full + d["optim_steps"]


def test_each_fsdp_rank_holds_half_of_everything_within_padding(memory_results):
    full = memory_results[0]["ddp"]["full_param_bytes"]
    shards = [r["fsdp"] for r in memory_results]
    padding = 2 * shards[0]["padded_shard_bound"] - full
    assert 0 < padding < full * 0.01  # only Linear(256, 5) splits unevenly
    assert sum(f["params"] for f in shards) == full
    for f in shards:
        assert abs(f["params"] - full / 2) <= padding
        assert f["grads"] == f["params"]
        assert f["optim_moments"] == 2 * f["params"]
        assert f["params_are_dtensors"] and f["placements"] == ["(Shard(dim=0),)"]
        assert f["buckets"] == 0


def test_fsdp_gathers_full_parameters_in_forward_and_again_in_backward(memory_results):
    f = memory_results[0]["fsdp"]
    layers = 9
    assert all(e["type"] == "Parameter" and e["shape"] == e["local_shape"]
               for e in f["inside_forward"])  # unsharded plain tensors during forward
    assert len(f["inside_forward"]) == layers
    assert f["all_gather_calls"] == 2 * layers and f["reduce_scatter_calls"] == layers
    assert f["all_gather_bytes"] == 2 * f["reduce_scatter_bytes"]
    assert f["reduce_scatter_bytes"] == 2 * f["padded_shard_bound"]


def test_every_memory_relation_the_lesson_prints_holds(memory_results):
    failed = [s for s, holds in ch.check_memory_relations(memory_results) if not holds]
    assert not failed, failed


def test_gradient_as_bucket_view_removes_the_bucket_copy(no_orphans):
    for r in run_ranks(ch.ddp_memory, 2, gradient_as_bucket_view=True):
        assert r["grads_are_bucket_views"] and r["buckets"] == 0
        assert r["bucket_buffer_bytes"] == r["grads"] == r["full_param_bytes"]


# ----------------------------------------------------------------------------- scripts


def test_memory_script_prints_the_table_and_its_checks():
    # the launch its docstring documents: tests/test_chapter_scripts.py reads the same one
    done = launch_once("torchrun --standalone --nproc_per_node 2 "
                       "chapters/02_dp_ddp_fsdp/memory_per_rank.py", timeout=240)
    assert not done.timed_out and done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "RESULT: all memory relations hold" in out and "CHECK FAIL" not in out
    assert out.count("RESULT:") == 1  # rank 0 only
    full = int(re.search(r"model parameters: ([\d,]+) bytes", out).group(1).replace(",", ""))
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(DDP|FSDP2)\s+(\d)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)"
                     r"\s+([\d,]+)$", line)
        if m:
            rows[m.group(1), int(m.group(2))] = [int(v.replace(",", "")) for v in m.groups()[2:]]
    assert set(rows) == {("DDP", 0), ("DDP", 1), ("FSDP2", 0), ("FSDP2", 1)}
    for rank in (0, 1):
        params, grads, moments, steps, buckets, total = rows["DDP", rank]
        assert (params, grads, moments, buckets) == (full, full, 2 * full, full)
        assert total == params + grads + moments + steps + buckets
        params, grads, moments, steps, buckets, total = rows["FSDP2", rank]
        assert grads == params and moments == 2 * params and buckets == 0
        assert abs(params - full / 2) < 0.01 * full
    assert rows["FSDP2", 0][0] + rows["FSDP2", 1][0] == full


def test_dp_mechanism_script_prints_counts_times_and_wire_bytes_per_model_size():
    done = run_script("torchrun --standalone --nproc_per_node 2 "
                      "chapters/02_dp_ddp_fsdp/dp_mechanism.py --widths 128 256")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("DataParallel by hand") == 1  # rank 0 only
    counted = [line.split() for line in out.splitlines()
               if re.match(r"\s+\d+\s+[\d.]+\s+[\d.]+\s+\d+\s+[\d.]+$", line)]
    timed = [line for line in out.splitlines() if re.match(r"\s+\d+\s+[\d.]+ \|", line)]
    assert len(counted) == len(timed) == 2, out
    for fields, line, width in zip(counted, timed, (128, 256)):
        mb = ch.param_bytes(ch.make_mlp(width, 4)) / 1e6
        assert int(fields[0]) == width and float(fields[1]) == pytest.approx(mb, abs=0.05)
        assert float(fields[2]) == pytest.approx(mb, abs=0.05)  # one replica on 2 devices
        assert int(fields[3]) == 9  # Sequential + 4 Linear + 4 Tanh
        pairs = re.findall(r"(\d+\.\d+)/(\d+\.\d+)", line.split("|", 1)[1])
        assert len(pairs) == 6, line  # fastest/median of 6 costs
        assert all(float(v) >= 0 for pair in pairs for v in pair), line
    assert "TOO LOADED TO CONCLUDE" in out or "\nconclusive" in out
    wire = re.search(r"DP with NCCL ([\d.]+) MB, DDP ring all-reduce ([\d.]+) MB, "
                     r"DP without NCCL ([\d.]+) MB", out)
    assert wire, out
    p = ch.param_bytes(ch.make_mlp(256, 4)) / 1e6
    assert [float(v) for v in wire.groups()] == pytest.approx([2 * p, p, 2 * p], abs=0.06)


def test_dataparallel_gpu_script_runs_as_documented():
    done = run_script("python chapters/02_dp_ddp_fsdp/dataparallel_on_gpus.py")
    assert done.returncode == 0, done.stdout + done.stderr
    if GPUS < 2:
        assert "skipped: the real DataParallel measurement needs >= 2 CUDA GPUs" in done.stdout
    else:
        assert "device 0 / busiest other" in done.stdout


@pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 CUDA GPUs, found {GPUS}")
def test_real_dataparallel_loads_device_0_most():
    rows, _ = ch.gpu_dataparallel_report(widths=(1024,), repeats=2)
    for r in rows:
        assert r["replicate_s"] > 0 and r["gather_s"] > 0
        assert r["peak_bytes"][0] > max(r["peak_bytes"][1:])


# ---------------------------------------------------------------- lesson bookkeeping


# What the first line of each cited range must contain, in the torch the course pins.
CITED_FIRST_LINES = {
    "dp_init_no_device": "_get_available_device_type()",
    "dp_forward": "def forward",
    "dp_forward_no_device": "if not self.device_ids",
    "scatter_function": "class Scatter(Function)",
    "ddp_faster_than_dp": "is proven to be significantly faster",
    "replicate": "def replicate(",
    "broadcast_backward": "class Broadcast(Function)",
    "parallel_apply_threads": "if len(modules) > 1",
    "scatter": "def scatter(",
    "gather": "def gather(",
    "ddp_bucket_default": "_DEFAULT_BUCKET_CAP_MB = 25",
    "ddp_first_iteration_one_bucket": "Case 2",
    "ddp_broadcast_at_init": "if init_sync",
    "sync_module_states": "def _sync_module_states(",
    "ddp_reducer": "self.reducer = dist.Reducer(",
    "ddp_gradient_as_bucket_view": "gradient_as_bucket_view (bool)",
    "fsdp_all_gather": "class DefaultAllGather",
    "fsdp_reduce_scatter": "class DefaultReduceScatter",
    "dp_replicate_every_forward": "replicas = self.replicate(self.module",
    "replicate_broadcast_params": "_broadcast_coalesced_reshape(params, devices, detach)",
    "replicate_broadcast_apply": "else:",
    "broadcast_forward_coalesced": "comm.broadcast_coalesced(inputs, ctx.target_gpus)",
    "broadcast_backward_reduce": "@staticmethod",
    "comm_broadcast_coalesced": "def broadcast_coalesced(",
    "comm_reduce_add_nccl": "if nccl.is_available(inputs)",
    "ddp_forward_sync_buffers_default": "if forward_sync_buffers is not None",
    "ddp_pre_forward_sync_buffers": "if self._check_sync_bufs_pre_fwd()",
    "ddp_forward_param_sync_flag": "if torch.is_grad_enabled() and self.require_backward_grad_sync",
    "ddp_will_sync_module_buffers": "def will_sync_module_buffers(",
    "ddp_sync_buffers_from_rank_0": "def _sync_buffers(",
    "ddp_first_bucket_only_default": "# First bucket optimization",
    "ddp_reducer_first_bucket_cap": "# First bucket can be smaller",
}

# And a line inside the range that makes the lesson's point, where the first line alone does not.
CITED_CONTENT = {
    "replicate_broadcast_apply": "Broadcast.apply(devices, *tensors)",
    "broadcast_backward_reduce": "ReduceAddCoalesced.apply(",
    "comm_broadcast_coalesced": "torch._C._broadcast_coalesced(",
    "comm_reduce_add_nccl": "nccl.reduce(",
    "ddp_forward_sync_buffers_default": "broadcast_buffers if broadcast_buffers is not None else True",
    "ddp_pre_forward_sync_buffers": "self._sync_buffers()",
    "ddp_forward_param_sync_flag": "self.require_forward_param_sync = False",
    "ddp_will_sync_module_buffers": "len(self.modules_buffers) > 0",
    "ddp_sync_buffers_from_rank_0": "authoritative_rank = 0",
    "ddp_first_bucket_only_default": "_DEFAULT_FIRST_BUCKET_BYTES if is_using_default else bucket_bytes_cap",
    "ddp_reducer_first_bucket_cap": "self._bucket_config.first_bucket_bytes_cap",
}


@pytest.mark.skipif(torch.__version__.split("+")[0] != TESTED_TORCH,
                    reason=f"line numbers are those of torch {TESTED_TORCH}, this is {torch.__version__}")
def test_cited_source_lines_are_what_the_lesson_says():
    site = Path(torch.__file__).resolve().parent.parent
    assert set(CITED_FIRST_LINES) == set(ch.SOURCE)
    for name, (path, first, last) in ch.SOURCE.items():
        lines = (site / path).read_text().splitlines()
        assert CITED_FIRST_LINES[name] in lines[first - 1], (name, lines[first - 1])
        assert last <= len(lines) and first <= last
        if name in CITED_CONTENT:
            assert any(CITED_CONTENT[name] in line for line in lines[first - 1:last]), name
        assert ch.source_link(name).endswith(f"{path}#L{first}-L{last}")
