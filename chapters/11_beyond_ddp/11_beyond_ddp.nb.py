# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Beyond DDP: sharding, tensor and pipeline parallelism, device meshes
#
# **The problem.** DDP keeps a whole copy of the model, its gradients and its optimizer state on
# every rank. Adding ranks makes a step faster; it never makes the model fit. When the model
# does not fit one device, or leaves no room for activations, something must be split: the
# *state* (ZeRO, FSDP), the *layers' matrices* (tensor parallelism), or the *layers* themselves
# (pipeline parallelism); large runs combine them on a **device mesh**.
#
# **The idea.** Count it. Every section measures bytes per rank and bytes handed to the
# collectives in real process groups (4 gloo ranks on the CPU; the same code uses NCCL on GPUs),
# puts the count beside a memory model, `ddpcourse.memory_calculator.estimate`, and checks every
# parallel scheme's numbers against one process on the whole batch.
#
# | section | script (each checks its own claims) |
# |---|---|
# | 1. When DDP is not enough: bytes per rank and per step, measured and predicted | `memory_and_traffic.py` |
# | 2. A memory and communication calculator; the article's "FSDP only for 32+ A100s" | `ddpcourse/memory_calculator.py` |
# | 3. ZeRO by hand: `ZeroRedundancyOptimizer`, FSDP2, a sharded checkpoint through DCP | `memory_and_traffic.py` |
# | 4. Tensor parallelism: column and row splits, then DTensor's `parallelize_module` | `tensor_parallel_2d.py` |
# | 5. Device meshes and 2-D (data x tensor) parallelism; data parallelism over the wrong group | `tensor_parallel_2d.py` |
# | 6. DDP around a module on several devices (`device_ids=None`) | `ddp_multi_device.py` |
# | 7. Pipeline parallelism: GPipe and 1F1B by hand, the bubble, `torch.distributed.pipelining` | `pipeline_by_hand.py` |
#
# Launch any script as the first line of its docstring says, e.g. `torchrun --standalone
# --nproc_per_node 4 chapters/11_beyond_ddp/memory_and_traffic.py`.
#
# **Article claims checked here.** The source article says FSDP suits "super-large models on
# very many cards (> 64)", that you should "only seriously evaluate FSDP when you have 32+ A100s
# and need to train a 100B model", and recommends, for a model that does not fit one GPU,
# "DDP of ModelParallel": layers spread over GPUs with `device_map="auto"`, each rank's copy
# wrapped in DDP. Sections 2, 6 and 7 put numbers on all three.

# %%
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from ddpcourse.launcher import prestart, run_ranks
from ddpcourse.memory_calculator import bubble_fraction, estimate, format_bytes

sys.path.insert(0, str(Path.cwd()))  # the notebook runs in chapters/11_beyond_ddp
prestart()

# %% [markdown]
# ## 1. When DDP is not enough: what each rank holds, and what it sends
#
# Four ranks train the same MLP (3 x `Linear(64, 64)` + ReLU, 49,920 B of float32 parameters)
# one Adam step under four schemes, and count what each rank holds afterwards, tensor by
# tensor, and what each scheme handed to the collectives, call by call:
#
# * **DDP** (ZeRO stage 0): everything replicated; gradients all-reduced in buckets.
# * **ZeRO-1**: DDP + `torch.distributed.optim.ZeroRedundancyOptimizer` — the Adam state sharded.
# * **ZeRO-2**: FSDP2 `fully_shard(..., reshard_after_forward=False)` — gradients and Adam state
#   sharded; parameters gathered once per step.
# * **ZeRO-3**: FSDP2 `fully_shard` — parameters sharded too, gathered for forward, freed,
#   gathered again for backward.
#
# Each cell shows *measured / predicted* bytes; the prediction is
# `estimate(parameters=..., dp=4, zero_stage=...)` (section 2). "sent/step" is what one rank
# sends with ring algorithms: `(n-1)/n` of every all-gather and reduce-scatter buffer, twice
# that for an all-reduce.

# %%
import memory_and_traffic as mt

WIDTH, DEPTH, BATCH = 64, 3, 4
measured = run_ranks(mt.measure_all, 4, WIDTH, DEPTH, BATCH, backend="gloo", timeout=180)
lines = mt.table(measured, WIDTH, DEPTH, BATCH)
print(mt.format_table(lines))
reference = mt.one_process_weights(4, WIDTH, DEPTH, BATCH)
worst = max((row["weights"][k] - w).abs().max().item()
            for per_rank in measured for row in per_rank for k, w in reference.items())
print(f"largest weight difference of any scheme, any rank, from one process: {worst:.1e}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
kinds = [("params", "parameters"), ("grads", "gradients"), ("optimizer", "Adam m+v"),
         ("buckets", "DDP buckets")]
labels = [f"{r['scheme']} r{r['rank']}" for r in lines]
bottom = [0] * len(lines)
for key, name in kinds:
    values = [r[key] / 1024 for r in lines]
    axes[0].bar(labels, values, bottom=bottom, label=name)
    bottom = [b + v for b, v in zip(bottom, values)]
axes[0].plot(labels, [(r["params_pred"] + r["grads_pred"] + r["optimizer_pred"]) / 1024
                      for r in lines], "k_", markersize=14, label="predicted (no buckets)")
axes[0].set_ylabel("KiB held after the step")
axes[0].tick_params(axis="x", rotation=90)
axes[0].legend(fontsize=7)
axes[1].bar(labels, [r["wire"] / 1024 for r in lines], label="measured")
axes[1].plot(labels, [r["wire_pred"] / 1024 for r in lines], "k_", markersize=14,
             label="predicted")
axes[1].set_ylabel("KiB sent per step")
axes[1].tick_params(axis="x", rotation=90)
axes[1].legend(fontsize=7)
fig.tight_layout()

# %% [markdown]
# What the counts say (exact relations; `tests/test_chapter_11_memory_calculator.py` checks each
# of them at 1, 2 and 4 ranks):
#
# * **DDP** holds the parameters, the gradients and 2x the parameters of Adam state on every
#   rank, plus a bucket copy of the gradients (chapter 02) that the first-order model leaves
#   out. It sends `2(n-1)/n` x the gradients per step.
# * **ZeRO-1 (`ZeroRedundancyOptimizer`)** keeps the Adam state of the parameters a rank owns
#   only, and the per-rank shares add up to the whole; but they are **uneven** (section 3). It
#   sends more than the ideal ZeRO-1: DDP's full all-reduce *plus* a broadcast of every updated
#   parameter from its owner (`_broadcast_params_from_rank` in
#   torch/distributed/optim/zero_redundancy_optimizer.py), where a reduce-scatter + all-gather
#   would send the same as DDP.
# * **ZeRO-2 / ZeRO-3 (FSDP2)** hold exactly 1/n of the gradients and Adam state (64 rows split
#   evenly here; with rows that do not divide, FSDP2 pads dim 0 to equal shards). Between steps
#   both also hold 1/n of the parameters; the calculator's ZeRO-2 row says "all of them"
#   because ZeRO-2 keeps the gathered parameters from forward to the end of backward, which is
#   the peak that matters (FSDP2's `reshard_after_forward=False`), and frees them after.
#   ZeRO-2 gathers the parameters once and reduce-scatters the gradients: DDP's volume, `2(n-1)/n`.
#   ZeRO-3 gathers them again in backward: `3(n-1)/n`, 1.5x DDP — the price of holding 1/n of
#   the parameters between layers.
#
# Every scheme's weights after the step equal one process's on the global batch: sharding
# changes where the state lives, not the arithmetic.

# %% [markdown]
# ## 2. A memory and communication calculator
#
# `ddpcourse.memory_calculator.estimate` is the first-order model above as a plain function:
# parameters, batch, sequence, layers, hidden width, DP/TP/PP degrees and ZeRO stage in; bytes
# per rank for parameters, gradients, optimizer state and activations, and bytes sent per step
# out. Its docstring lists every formula; section 1 and the chapter's tests check them against
# counted bytes. What it leaves out is what a run adds: DDP's bucket copy, allocator caching,
# temporary buffers, shard padding, 16-bit copies.

# %%
help(estimate)

# %% [markdown]
# **The article's threshold, with numbers.** The article says FSDP is worth evaluating only
# "with 32+ A100s and a 100B model". Take float32 Adam training (16 bytes per parameter: 4 each
# for the parameter and its gradient, 8 for Adam's two moments — the same 16 B/parameter as
# mixed-precision Adam with fp32 master weights, the ZeRO paper's count) and an 80 GB A100:

# %%
A100 = 80e9
for billions in (1, 7, 13, 70, 100):
    for dp, stage in ((8, 0), (8, 3), (32, 3)):
        e = estimate(parameters=billions * 1e9, batch=1, sequence=2048, layers=32,
                     hidden=4096, dp=dp, zero_stage=stage, saved_values_per_layer=0)
        state = e["params"] + e["grads"] + e["optimizer"]
        print(f"{billions:>4}B parameters, {dp:>2} GPUs, ZeRO-{stage}: "
              f"{format_bytes(state):>11} of model state per GPU "
              f"({'fits' if state < A100 else 'does NOT fit'} in 80 GB before activations)")

# %% [markdown]
# Under DDP a rank holds all 16 B/parameter, whatever the number of GPUs: a 7B model needs
# 112 GB per GPU and does not fit an 80 GB A100 at all; a 13B model needs 208 GB. The article's
# own 13B example (in its section 7) is already far past what DDP can hold, and sharding over
# 8 GPUs brings it to 26 GB per GPU. The threshold is "the model state does not fit one device"
# (about 5B parameters for full-precision Adam on 80 GB, less once activations need room), not
# "100B parameters on 32+ A100s". PyTorch's own guidance says the same: the FSDP2 tutorial
# (`docs.pytorch.org/tutorials/intermediate/FSDP_tutorial.html`) presents FSDP for models that
# do not fit one GPU, and the communication price is the 1.5x of section 1 (ZeRO-3), or none
# at all (ZeRO-2's volume equals DDP's), not a reason to wait for 32 GPUs.
#
# **Try it.** A plain call works everywhere; with `ipywidgets` installed (it is not part of the
# course's `[dev]` extra), the next cell draws sliders over the same function.

# %%
print(estimate(parameters=1.3e9, batch=8, sequence=1024, layers=24, hidden=2048,
               dp=4, tp=2, pp=1, zero_stage=1, saved_values_per_layer=17))

# %%
try:
    import ipywidgets as widgets
except ImportError:
    widgets = None
    print("ipywidgets is not installed: call estimate(...) as in the cell above")

if widgets is not None:
    def show(billions, dp, tp, pp, zero_stage, microbatches):
        e = estimate(parameters=billions * 1e9, batch=8, sequence=2048, layers=32,
                     hidden=4096, dp=dp, tp=tp, pp=pp, zero_stage=zero_stage,
                     microbatches=microbatches, saved_values_per_layer=17)
        for key, value in e.items():
            print(f"{key:>12}: {format_bytes(value)}")

    widgets.interact(show, billions=(0.1, 200.0, 0.1), dp=(1, 64), tp=(1, 8), pp=(1, 8),
                     zero_stage=(0, 3), microbatches=(1, 32))

# %% [markdown]
# ## 3. ZeRO by hand: `ZeroRedundancyOptimizer`, FSDP2, and a sharded checkpoint
#
# **Why `ZeroRedundancyOptimizer`'s shards are uneven.** It assigns **whole parameter tensors**
# to ranks, each to the rank with the smallest total so far, largest tensors first
# (`ZeroRedundancyOptimizer._partition_parameters` in
# torch/distributed/optim/zero_redundancy_optimizer.py). Three 64x64 weight matrices and three
# biases over four ranks: ranks 0-2 get one matrix each and rank 3 gets the three biases.

# %%
for per_rank in measured:
    zero1 = next(r for r in per_rank if r["scheme"] == "zero1")
    print(f"rank {zero1['rank']}: owns {zero1['owned_param_bytes']:>6,} B of parameters, "
          f"holds {zero1['optimizer']:>6,} B of Adam state (an even share: "
          f"{2 * zero1['full_param_bytes'] // 4:,} B)")

# %% [markdown]
# FSDP2 splits *every* tensor by rows instead, so its shares are equal (the zero2 and zero3 rows
# of section 1: the same Adam bytes on every rank).
#
# **FSDP2 and its checkpoint.** FSDP2 turns every parameter into a `DTensor` sharded on dim 0
# (`Shard(0)` on the mesh), so a checkpoint is a set of shards. `torch.distributed.checkpoint`
# (chapter 08) writes each rank's own shards, in parallel, and loads them back, here into a
# model built from another seed; parameters and Adam state come back exactly:

# %%
import tempfile

with tempfile.TemporaryDirectory() as scratch:
    roundtrip = run_ranks(mt.fsdp_checkpoint_roundtrip, 2, scratch + "/dcp", backend="gloo",
                          timeout=180)
print("files:", roundtrip[0]["files"])
for rank, r in enumerate(roundtrip):
    print(f"rank {rank}: parameters exact {r['params_equal']}, Adam state exact "
          f"{r['optimizer_equal']}")

# %% [markdown]
# ## 4. Tensor parallelism: split the matrices (Megatron-LM style)
#
# A linear layer `y = x W^T + b` can be split two ways over `t` ranks:
#
# * **by columns of the output** (`W` split by rows): each rank computes a slice of `y`;
# * **by rows of the input** (`W` split by columns): each rank computes a *partial sum* of `y`.
#
# Megatron-LM puts a column split first and a row split second, so the MLP's middle activation
# never has to be assembled. The arithmetic in one process, with the shards as plain tensors:

# %%
torch.manual_seed(0)
up, down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
x = torch.randn(4, 8)
dense = down(torch.relu(up(x)))
t = 2
partial = []
for r in range(t):
    rows = slice(r * 16 // t, (r + 1) * 16 // t)
    hidden = torch.relu(x @ up.weight[rows].T + up.bias[rows])    # column split of `up`
    partial.append(hidden @ down.weight[:, rows].T)               # row split of `down`
split = sum(partial) + down.bias
print(f"sum of the {t} ranks' partial outputs vs dense: {(split - dense).abs().max():.1e}")

# %% [markdown]
# The sum over ranks in forward is an **all-reduce**; in backward the same structure runs the
# other way: every rank's shard contributes to the gradient of the shared input `x`, so that
# gradient is a sum over ranks too (another all-reduce). One forward + backward of this MLP
# costs two all-reduces, whatever `t`: the output in forward, the input's gradient in backward.
#
# DTensor does the same from a plan: `parallelize_module(model, mesh, {"up": ColwiseParallel(),
# "down": RowwiseParallel()})`. The script runs it on the `tp` dimension of a 2 x 2 mesh and
# compares with the dense model; `CommDebugMode` counts the collectives of one forward + backward:

# %%
import tensor_parallel_2d as tp2d

two_d = run_ranks(tp2d.run_all, 4, backend="gloo", timeout=240)
tp = two_d[0]["tp"]
print(f"TP vs dense: output {tp['output_error']:.1e}, gradients (weights, biases, input) "
      f"{max(tp['grad_errors'].values()):.1e}")
print("placements:", tp["placements"])
print("local shapes on one rank:", tp["local_shapes"])
print("collectives in one forward + backward:", tp["collectives"])

# %% [markdown]
# ## 5. Device meshes and 2-D parallelism
#
# `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))` arranges 4 ranks as a 2 x 2
# grid: ranks {0, 1} and {2, 3} are tensor-parallel groups (contiguous ranks: on GPUs, the ones
# that share a fast NVLink), {0, 2} and {1, 3} the data-parallel groups. Each dp group gets its
# own half of the batch; the two ranks of a tp group see the *same* samples and hold different
# shards. Data parallelism must average over `mesh["dp"]` only.

# %%
for rank, r in enumerate(two_d):
    print(f"rank {rank}: DDP(tp_model, process_group=mesh['dp'].get_group()) -> {r['ddp_error']}")
print(f"TP over mesh['tp'] + fully_shard over mesh['dp'] vs one process: "
      f"{max(r['fsdp_2d_error'] for r in two_d):.1e}")
print(f"gradients averaged over mesh['dp']: {max(r['averaged']['dp'] for r in two_d):.1e} "
      f"from the dense global-batch gradient; over mesh['tp'] (the wrong group): "
      f"{max(r['averaged']['tp'] for r in two_d):.1e}")

# %% [markdown]
# * **DDP does not wrap a DTensor model.** It broadcasts rank 0's parameters at construction
#   (`_sync_module_states` in torch/distributed/utils.py), and DTensor has no sharding rule
#   for that broadcast: `NotImplementedError`. The recipe PyTorch documents is FSDP2 over the dp
#   dimension: `fully_shard(tp_model, mesh=mesh["dp"])` (the "2-D parallelism" section of the
#   TP tutorial, `docs.pytorch.org/tutorials/intermediate/TP_tutorial.html`). It trains exactly
#   like one process on the global batch.
# * **Averaging over the wrong group raises nothing.** Summing the local gradient shards over
#   `mesh["tp"]` adds *different* slices of the weight's gradient (rows 0-31 and rows 32-63 of
#   the first layer's): the shapes match, the all-reduce succeeds, the values are garbage.
#   Only a comparison with a reference run catches it.

# %% [markdown]
# ## 6. DDP around a module on several devices
#
# The article's "DDP of ModelParallel" (layers spread with `device_map="auto"`, each copy in
# DDP) is legal: DDP accepts a module whose parameters live on several devices if
# `device_ids=None` (and `output_device=None`); the module moves activations between its own
# devices (`DistributedDataParallel.__init__`, torch/nn/parallel/distributed.py, its
# `device_ids` check). `ddp_multi_device.py` runs it with 2 GPUs per rank and checks the weights
# against one process; here, without GPUs, only the rule itself runs: `device_ids` with a
# module that is not on one GPU is refused.

# %%
import ddp_multi_device as md


def device_ids_rule(rank, world_size):
    return md.refused(lambda: torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(4, 4), device_ids=[0]))


print("DDP(cpu_module, device_ids=[0]):", run_ranks(device_ids_rule, 1, backend="gloo")[0])
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"GPUs here: {gpus}; the two-device run needs 2 per rank: "
      f"torchrun --standalone --nproc_per_node {max(gpus // 2, 1)} "
      f"chapters/11_beyond_ddp/ddp_multi_device.py")

# %% [markdown]
# What the recipe costs is section 7's subject: a model split over `p` devices that passes one
# whole batch through them is a pipeline with **one** micro-batch, and each device idles
# `(p-1)/p` of the time (`bubble_fraction(p, 1)`: half the time on 2 GPUs).

# %% [markdown]
# ## 7. Pipeline parallelism: GPipe, 1F1B and the bubble
#
# Cut the layers into `p` stages, one per rank, and the batch into `m` micro-batches. A stage
# receives a micro-batch's activations from the previous stage (`dist.recv`), runs its layers,
# sends the result on (`dist.isend`); backward runs the other way with gradients. Two classic
# orders of the same steps:
#
# * **GPipe**: all forwards, then all backwards. Every stage holds all `m` micro-batches'
#   activations at the end of forward.
# * **1F1B** (PipeDream-Flush): stage `s` runs `p-1-s` forwards to fill the pipe, then
#   alternates one forward and one backward. Same idle time, but stage `s` holds at most `p-s`
#   micro-batches.
#
# With every forward and every backward one time slot (messages free), the idle slots are
# counted from each schedule's timeline (`ddpcourse.pipeline.timeline`: a step starts when its
# rank is free and the step it needs has finished) and compared with the formula `(p-1)/(m+p-1)`.
# The orders below are written out in `pipeline_schedules.json` for the counts this lesson runs;
# writing them for any `p` and `m` is this chapter's exercise `pipeline_schedule`.

# %%
import pipeline_by_hand as pp
from ddpcourse.pipeline import bubble, draw, timeline

print(pp.written_out("1f1b", 4, 6))
fig, axes = plt.subplots(2, 1, figsize=(11, 4.5))
for ax, kind in zip(axes, pp.SCHEDULES):
    slots = timeline(pp.written_out(kind, 4, 6))
    b = bubble(slots)
    draw(slots, f"{kind}: p=4, m=6; bubble {b['fraction']:.3f} counted, "
                f"{bubble_fraction(4, 6):.3f} by formula; activations held per rank "
                f"{b['peak_held']}", ax)
fig.tight_layout()

# %%
print(" p  m   GPipe counted  1F1B counted  formula   held per rank GPipe / 1F1B")
for p, m in [(2, 4), (4, 4), (4, 6)]:
    g = bubble(timeline(pp.written_out("gpipe", p, m)))
    f = bubble(timeline(pp.written_out("1f1b", p, m)))
    print(f"{p:>2} {m:>2} {g['fraction']:>14.3f} {f['fraction']:>13.3f} "
          f"{bubble_fraction(p, m):>8.3f}   {g['peak_held']} / {f['peak_held']}")

# %% [markdown]
# Both schedules leave the same share idle, exactly `(p-1)/(m+p-1)`: more micro-batches shrink
# the bubble. 1F1B's gain is memory: stage `s` holds `min(p-s, m)` micro-batches instead of `m`.
#
# The same schedules on real ranks with send/recv (2 stages, 4 micro-batches), then with
# `torch.distributed.pipelining` (`PipelineStage` and `ScheduleGPipe` / `Schedule1F1B`), against
# the unsplit model on the whole batch. (`pipeline_by_hand.py --schedules FILE` runs orders of
# your own the same way.)

# %%
orders = {kind: pp.written_out(kind, 2, 4) for kind in pp.SCHEDULES}
pipes = run_ranks(pp.run_all, 2, orders, backend="gloo", timeout=180)
reference = pp.unsplit(2)
for label in ("gpipe", "1f1b", "torch_gpipe", "torch_1f1b"):
    err = pp.compare([r[label] for r in pipes], reference)
    print(f"{label:<12} loss {err['loss_error']:.1e}, gradients {err['grad_error']:.1e}")
print("micro-batches held at once per rank (by hand):",
      {kind: [r[kind]["peak_held"] for r in pipes] for kind in pp.SCHEDULES})

# %% [markdown]
# ## Summary
#
# | claim | shown by |
# |---|---|
# | DDP: full parameters, gradients, Adam state and a bucket copy per rank, at any rank count | section 1, `memory_and_traffic.py` |
# | ZeRO-1/2/3 shard optimizer state / + gradients / + parameters: 1/n each; same weights as one process | section 1, counted at 1, 2, 4 ranks in the tests |
# | sent per step: DDP and ZeRO-2 `2(n-1)/n` P, ZeRO-3 `3(n-1)/n` P; `ZeroRedundancyOptimizer` adds a broadcast | section 1, collectives counted |
# | the calculator predicts every counted byte except what runs add (buckets, padding) | section 2, `tests/test_chapter_11_memory_calculator.py` |
# | DDP cannot hold a 7B model on an 80 GB GPU; FSDP is for "does not fit", not "100B on 32 A100s" | section 2 |
# | `ZeroRedundancyOptimizer` partitions whole tensors: uneven shares | section 3 |
# | FSDP2 state round-trips exactly through DCP | section 3 |
# | column-then-row TP equals the dense MLP with one all-reduce each way | section 4, `tensor_parallel_2d.py` |
# | DDP refuses a DTensor model; FSDP2 over `mesh["dp"]` works; averaging over `mesh["tp"]` silently corrupts | section 5 |
# | DDP around a multi-device module needs `device_ids=None` | section 6, `ddp_multi_device.py` |
# | GPipe and 1F1B: bubble `(p-1)/(m+p-1)` counted; 1F1B's stage `s` holds `min(p-s, m)` micro-batches | section 7, `pipeline_by_hand.py` |
# | hand-written pipelines and `torch.distributed.pipelining` equal the unsplit model | section 7 |
#
# **Exercises** (`exercises/11_beyond_ddp/`): in `pipeline_schedule.ipynb` write the GPipe and
# 1F1B orders for any number of stages and micro-batches (the grader runs them with send/recv on
# real ranks, counts their bubble and the activations each stage holds); in
# `build_2d_groups.ipynb` build the data- and tensor-parallel groups of a 2-D grid with
# `dist.new_group`; in `tensor_parallel_linear.ipynb` write `ColumnParallelLinear` and
# `RowParallelLinear` with their collectives (section 4's layers, without DTensor); in
# `sharded_optimizer.ipynb` write ZeRO-1 yourself, sharing out elements instead of whole tensors
# (section 3), with the same weights as the unsharded optimizer. Check yourself with
# `pytest exercises/11_beyond_ddp` from the repository root.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 11](../CLAIMS.md#chapter-11).
