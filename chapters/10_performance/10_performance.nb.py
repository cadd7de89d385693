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
# # 10 · Performance: measured, modelled, tuned, and a network you can turn down
#
# **The problem.** "DDP is slow" is not a diagnosis. A step is forward, backward, waiting for
# gradients to be summed, and the optimizer; whether the waiting shows depends on bytes, calls,
# the link and how well the all-reduces hide behind backward. Tuning advice found online (the
# source article lists twelve knobs with speed-ups from its own A100 cluster) mixes what holds
# everywhere with what held on one machine, and a few things that are simply wrong.
#
# **The idea.** Count what can be counted (buckets, calls, bytes: the same on every machine),
# measure the rest against recorded reference runs (`benchmarks/results/ch10_*.json`: machine,
# date, torch, the command), and put both into a model that predicts a step before it runs: the
# α–β model of `ddpcourse/cost_model.py`.
#
# | section | script / record |
# |---|---|
# | 1. All-reduce bandwidth, nccl-tests style | `allreduce_bandwidth.py`, `benchmarks/ch10_allreduce.py` |
# | 2. Buckets step by step, the `bucket_cap_mb` sweep; `gradient_as_bucket_view`, `no_sync`, `static_graph` | `buckets_and_hooks.py`, `ddp_knobs.py` |
# | 3. Communication hooks: bytes per step | `buckets_and_hooks.py` |
# | 4. Anatomy of a step: phases, bucket timeline, trace; the input pipeline | `step_anatomy.py`, `input_pipeline.py` |
# | 5. The cost model: prediction beside measurement | `benchmarks/ch10_step_prediction.py` |
# | 6. A network you can turn down (root) | `throttled_network.py` |
# | 7. The article's knobs, one row each | this notebook |
#
# Launch any script with `torchrun --standalone --nproc_per_node 2 chapters/10_performance/NAME.py`
# (`throttled_network.py`: `sudo python ...`, it starts its own torchruns). The chapter's two
# graded exercises (`exercises/10_performance/`) are described at the end.

# %%
import sys
from pathlib import Path

import matplotlib.pyplot as plt

from ddpcourse import cost_model as cm
from ddpcourse.launcher import prestart, run_ranks
from ddpcourse.timing import Timing, describe, judge, load_reference, machine_load

sys.path.insert(0, str(Path.cwd()))  # the notebook runs in chapters/10_performance
import allreduce_bandwidth as ab  # noqa: E402
import buckets_and_hooks as bh  # noqa: E402

prestart()

# %% [markdown]
# ## 1. All-reduce bandwidth against message size
#
# NVIDIA's nccl-tests report two bandwidths (doc/PERFORMANCE.md in that repository):
# `algbw = bytes / time`, and `busbw = algbw · 2(N−1)/N`, what each rank's link carries in a
# ring all-reduce — comparable across rank counts and with the link's rated speed. The timing
# protocol matters as much as the formula: warm-up calls first (the first call sets up
# connections), a barrier before each timing (else a rank's lateness is timed as the
# collective's), the slowest rank's time, several repeats. Below: the recorded sweep (1 KiB to
# 256 MiB, 2 and 4 ranks) and, on top, a short live run on this machine.

# %%
record = load_reference("ch10_allreduce.json")
load = machine_load(1.0)
live = run_ranks(ab.measure, 2, [ab.parse_size(s) for s in ("1K", "64K", "1M", "4M")], 5,
                 backend="gloo", timeout=300)[0]
print(ab.format_table(live))
verdict = judge({ab.human(r["bytes"]): Timing.of(r["timings_s"]) for r in live}, load)
print(verdict)

fig, ax = plt.subplots(figsize=(7, 4))
for ws, marker in ((2, "o"), (4, "s")):
    rows = [r for r in record["rows"] if r["world_size"] == ws]
    ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker + "-",
            label=f"recorded, {ws} ranks")
ax.plot([r["bytes"] for r in live], [r["busbw_GBps"] for r in live], "k^--",
        label="live, 2 ranks" + ("" if verdict.conclusive else " (not conclusive)"))
ax.set(xscale="log", xlabel="message size (bytes)", ylabel="busbw (GB/s, from the best time)",
       title=describe(record))
ax.title.set_fontsize(8)
ax.legend()
plt.show()

# %% [markdown]
# The shape is the α–β model's: small messages cost a fixed α per call (the bandwidth climbs
# with size), large ones approach β. `benchmarks/ch10_allreduce.py` fits
# `t = α + 2(N−1)/N · n / β` to the recorded best times, one fit per world size, weighing each
# point by its relative error (the times span four orders of magnitude). Read the recorded
# verdict before the numbers: the reference run says whether its machine was quiet.

# %%
print(record["verdict"])
for ws in (2, 4):
    fit = record["fit"][str(ws)]
    print(f"{ws} ranks: alpha = {fit['alpha_s'] * 1e6:.0f} us, "
          f"beta = {fit['beta_bytes_per_s'] / 1e9:.2f} GB/s")
fig, ax = plt.subplots(figsize=(7, 3.5))
for ws, marker in ((2, "o"), (4, "s")):
    rows = [r for r in record["rows"] if r["world_size"] == ws]
    ax.plot([r["bytes"] for r in rows], [100 * r["prediction_error"] for r in rows], marker,
            label=f"{ws} ranks")
ax.axhline(0, color="k", lw=0.5)
ax.set(xscale="log", xlabel="message size (bytes)", ylabel="fit error (%)",
       title="α–β fit: predicted / measured − 1")
ax.legend()
plt.show()

# %% [markdown]
# Four ranks on two cores show where the model is wrong: with more ranks than cores, every call
# waits for the scheduler, so α is no longer the network's latency but the time slice of the
# operating system — one α per world size, not one per network.
#
# ## 2. Buckets, step by step, and the `bucket_cap_mb` sweep
#
# What `torch/nn/parallel/distributed.py` (torch 2.13) says, and what the comm hook sees
# (`bucket.index()`, `bucket.buffer()`):
#
# * step 0 all-reduces **one bucket** of every gradient (`_BucketCapacityConfig.compute_bucket_size_limits`
#   gives the cap `sys.maxsize` unless `find_unused_parameters` or `bucket_cap_mb_list` is set:
#   the registration order need not be the gradients' order);
# * before step 1's forward, `Reducer._rebuild_buckets` regroups in the order step 0's gradients
#   arrived; left at its default, the first bucket's cap is `dist._DEFAULT_FIRST_BUCKET_BYTES`
#   (1 MiB) so the last layers' gradients leave early; **an explicit `bucket_cap_mb` (even 25)
#   removes that small first bucket** (`_BucketCapacityConfig.create`);
# * a bucket never splits a tensor; `bucket_cap_mb_list` (per-bucket caps) exists in 2.13.
#
# So count from step 1. `_get_ddp_logging_data()["bucket_sizes"]` (private) holds the buckets DDP
# was *built* with, not the rebuilt ones: the hook is the place to look.

# %%
def bucket_counts(rank, world_size):
    return {cap: bh.buckets_by_step(rank, world_size, cap) for cap in (None, *bh.SWEEP_CAPS_MB)}


counted = run_ranks(bucket_counts, 2, backend="gloo", timeout=300)[0]
for cap in (None, 25.0):
    print(f"bucket_cap_mb={cap}: bytes per bucket, steps 0-2: {counted[cap]['bucket_bytes']}")
caps = list(bh.SWEEP_CAPS_MB)
calls = [counted[c]["calls"][2] for c in caps]
fit = record["fit"]["2"]
link = cm.Link(fit["alpha_s"], fit["beta_bytes_per_s"])
grad = counted[None]["gradient_bytes"]
comm = [sum(cm.allreduce_time(b, 2, link) for b in counted[c]["bucket_bytes"][2]) for c in caps]
fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
left.plot(caps, calls, "o-")
left.set(xscale="log", xlabel="bucket_cap_mb", ylabel="all-reduce calls per step (counted)")
right.plot(caps, [1e3 * t for t in comm], "o-")
right.set(xscale="log", xlabel="bucket_cap_mb", ylabel="ms of all-reduce (α–β model, 2 ranks)")
fig.suptitle(f"{grad} bytes of gradient, 6 layers: a cap below one layer = one bucket per layer")
plt.show()

# %% [markdown]
# The DDP paper (Li et al., VLDB 2020, §5) found the same shape on GPUs: too small a cap and a
# step pays α many times (latency-bound calls); too large and the one all-reduce can only start
# when backward has ended — nothing left to overlap. The model counts the first; sections 4 and 5 add
# the overlap.
#
# ### `gradient_as_bucket_view`, `no_sync`, `static_graph`: counted (`ddp_knobs.py`)
#
# The paper's other knobs, in bytes and calls. The reducer keeps a flat buffer per bucket
# (`Reducer::initialize_buckets`); by default each `.grad` is a tensor of its own, copied in and
# out: the gradient is held twice. With `gradient_as_bucket_view=True` each `.grad` is a view of
# its bucket (its `data_ptr` lies inside the bucket's buffer), so it is held once. Under
# accumulation, `no_sync()` around all micro-batches but the last sends the gradient once per
# optimizer step; `static_graph=True` sends the same calls and bytes (it saves the per-step search
# of `find_unused_parameters`, host work, not bytes).

# %%
import ddp_knobs as dk  # noqa: E402


def knob_counts(rank, world_size):
    return {"memory": {v: dk.gradient_memory(rank, world_size, v) for v in (False, True)},
            "without no_sync": dk.per_optimizer_step(rank, world_size),
            "with no_sync": dk.per_optimizer_step(rank, world_size, use_no_sync=True),
            "static_graph": dk.per_optimizer_step(rank, world_size, static_graph=True)}


knobs = run_ranks(knob_counts, 2, backend="gloo", timeout=300)[0]
for as_view, m in knobs["memory"].items():
    print(f"gradient_as_bucket_view={as_view}: {m['bucket_bytes']} bytes of buckets + "
          f"{m['grad_bytes_outside_buckets']} bytes of .grad outside them")
for name in ("without no_sync", "with no_sync", "static_graph"):
    print(f"{name:<16} all-reduce calls {knobs[name]['calls']}, bytes {knobs[name]['sent_bytes']}"
          f" per optimizer step ({dk.ACCUMULATE} micro-batches)")

# %% [markdown]
# ## 3. Communication hooks: bytes per step
#
# A comm hook (`model.register_comm_hook(state, hook)`) decides what a bucket's all-reduce sends.
# Counted by wrapping `torch.distributed.all_reduce`, which every hook here calls:

# %%
def hook_counts(rank, world_size):
    return {name: bh.with_hook(rank, world_size, name) for name in bh.HOOKS}


hooks = run_ranks(hook_counts, 2, backend="gloo", timeout=300)[0]
for name, found in hooks.items():
    print(f"{name:<20} bytes per step {found['sent_bytes']}, final loss {found['losses'][-1]:.5f}")
fig, ax = plt.subplots(figsize=(7, 3))
ax.bar(list(hooks), [h["sent_bytes"][-1] / h["gradient_bytes"] for h in hooks.values()])
ax.set(yscale="log", ylabel="bytes sent / gradient bytes (step 3)")
plt.show()

# %% [markdown]
# fp16 and bf16 halve the bytes; PowerSGD of rank 1 sends two thin factors per matrix (and the
# biases as they are) from `start_powerSGD_iter` on. Caveats measured with torch 2.13 on
# CPU/gloo: `bf16_compress_hook` is refused at registration by a check on its *name*
# (`DistributedDataParallel._check_comm_hook`: it wants a CUDA build with NCCL 2.10+), so the
# same code under another name (`bh.bf16_allreduce_hook`) runs; PowerSGD with several buckets
# hung or failed with a size mismatch, so it runs here on one bucket, in a process group with a
# timeout of its own, inside `run_ranks`' deadline.
#
# ## 4. Anatomy of a step: where the time goes, and what hides behind backward
#
# `step_anatomy.py` cuts each step of a six-layer model (`bucket_cap_mb=0.25`: one bucket per
# layer) with timers and with the comm hook's own timestamps: **forward**; **backward,
# computing** (until the last bucket is launched: the reducer launches buckets in index order as
# soon as their gradients are ready, `Reducer::mark_bucket_ready`); **waiting on communication**
# (from the last launch until `backward()` returns: `Reducer::finalize_backward` waits for every
# bucket); **optimizer**. The orderings are facts (the script checks them: every bucket launched
# after backward began and done before it returned); how much of the all-reduce time lies before
# the last launch — *hidden* behind backward — is a timing, printed with min/median over the
# steps and the verdict on the machine's load. On two busy cores the ranks and gloo's threads
# share the CPUs, so little may hide; on GPUs, NCCL's all-reduces run on a CUDA stream of their
# own beside the backward kernels, which is what the overlap is for.
#
# The same steps under `torch.profiler` give a Chrome trace: open it in
# <https://ui.perfetto.dev> and find the backend's all-reduces on a thread of their own beside
# autograd's.

# %%
import tempfile

import step_anatomy as sa  # noqa: E402


TRACE = str(Path(tempfile.mkdtemp(prefix="ddp_step_")) / "step_trace.json")  # rank 0 writes it


def anatomy(rank, world_size):
    return sa.anatomy(rank, world_size, steps=6, trace_path=TRACE)


ranks = run_ranks(anatomy, 2, backend="gloo", timeout=300)
print("counted claims contradicted:", sa.claims(ranks) or "none")
stats, verdict = sa.summary(ranks)
for name, t in stats["table"].items():
    print(f"{name:<14} min {1e3 * t.min:7.2f} ms, median {1e3 * t.median:7.2f} ms")
print(f"hidden behind backward: min {100 * stats['hidden'].min:.0f}%, "
      f"median {100 * stats['hidden'].median:.0f}%  —  timings: {verdict}")
print(f"Chrome trace ({ranks[0]['trace']['bytes']} bytes): {ranks[0]['trace']['path']}")
fig, axes = plt.subplots(len(ranks), 1, figsize=(9, 1.6 * len(ranks)), sharex=True)
for ax, found in zip(axes, ranks):
    s = found["steps"][-1]
    t0 = s["timers"]["forward"]
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    ax.barh(-1, ms(s["timers"]["backward_done"]) - ms(s["timers"]["backward"]),
            left=ms(s["timers"]["backward"]), color="lightgray", label="backward()")
    for b in s["buckets"]:
        ax.barh(b["index"], ms(b["done"]) - ms(b["launched"]), left=ms(b["launched"]))
    ax.set(ylabel=f"rank {found['rank']}\nbucket", yticks=range(-1, len(s["buckets"])))
axes[-1].set_xlabel("ms after the step's forward began (last step; hook timestamps)")
axes[0].legend(loc="upper left")
plt.show()

# %% [markdown]
# The timeline is one live run: its bars move with the machine's load, the orderings do not.
#
# ### The input pipeline (`input_pipeline.py`)
#
# A `DataLoader` belongs to its process: each rank starts its own `num_workers` workers, so a
# job runs ranks × `num_workers` of them (size it to the cores per rank, not per machine). On
# `iter(loader)` each worker is handed `prefetch_factor` batches at once
# (`_MultiProcessingDataLoaderIter._reset`); `persistent_workers=True` keeps the workers between
# epochs; `pin_memory=True` pins batches only where an accelerator is present. Counted on a toy
# whose samples take 2 ms to "decode", then one epoch timed live (min/median and the verdict).
# The source article's pin_memory +18 % and persistent_workers +12 % are its figures on its GPU
# cluster; they are not measured here.

# %%
import input_pipeline as ip  # noqa: E402


def pipeline(rank, world_size):
    return {"counts": ip.counts(rank, world_size),
            "timed": {w: ip.epoch_times(rank, world_size, w) for w in (0, 2)}}


piped = run_ranks(pipeline, 2, backend="gloo", timeout=300)
print("counted claims contradicted:", ip.claims([r["counts"] for r in piped]) or "none")
print("worker pids per rank:", [r["counts"]["worker_pids"] for r in piped])
print("batches requested before the first (2 workers x prefetch_factor 3):",
      [r["counts"]["requested_before_first"] for r in piped])
loader_times = {f"num_workers={w}": Timing.of(t) for w, t in piped[0]["timed"].items()}
for name, t in loader_times.items():
    print(f"one epoch, {name}: {t}")
print(judge(loader_times, machine_load(0.5), statistic="median"))

# %% [markdown]
# ## 5. The cost model: a step predicted, then measured
#
# `cm.step_time` takes what one rank measures alone (forward, backward, the rest), DDP's buckets
# (`cm.bucket_sizes`, checked against torch's own assignment in the tests) and α, β; each bucket
# starts when its gradients are ready and the previous all-reduce is done; what does not fit
# under backward is exposed. The recorded comparison (`benchmarks/ch10_step_prediction.py`):

# %%
steps = load_reference("ch10_step_prediction.json")
print(steps["verdict"])
rows = steps["rows"]
for r in rows:
    print(f"{r['world_size']} ranks: predicted {1e3 * r['predicted_step_s']:.1f} ms, measured "
          f"{1e3 * r['measured_step_s']:.1f} ms ({100 * r['error']:+.0f}%), efficiency "
          f"predicted {r['predicted_efficiency']:.2f}, measured {r['measured_efficiency']:.2f}")
fig, ax = plt.subplots(figsize=(6, 3.5))
ws = [r["world_size"] for r in rows]
ax.plot(ws, [1e3 * r["predicted_step_s"] for r in rows], "o-", label="α–β model")
ax.plot(ws, [1e3 * r["measured_step_s"] for r in rows], "s-", label="measured (best)")
ax.set(xlabel="ranks", ylabel="ms per step", xticks=ws, title=describe(steps))
ax.title.set_fontsize(8)
ax.legend()
plt.show()

# %% [markdown]
# Where the model is wrong, and why it is still useful: on a CPU the all-reduce and backward
# share the same cores (gloo's reductions are CPU work), so communication slows compute instead
# of hiding behind it; ranks beyond the cores wait for the scheduler. On GPUs, where NCCL runs
# on its own stream, the overlap assumption is much closer. The model's use is the question it
# answers without a run: at which bandwidth does DDP stop paying off?

# %%
one_layer = 512 * 513 * 4
fig, ax = plt.subplots(figsize=(6, 3.5))
for layers in (8, 32, 128):
    buckets = cm.bucket_sizes([one_layer] * layers, 25 * cm.MiB, cm.MiB)
    needed = [cm.bandwidth_for_efficiency(0.9, forward_s=2e-3 * layers / 8,
                                          backward_s=4e-3 * layers / 8, buckets=buckets,
                                          world_size=n, alpha_s=50e-6) for n in (2, 4, 8, 16)]
    ax.plot((2, 4, 8, 16), [8 * b / 1e9 for b in needed], "o-", label=f"{layers} layers")
ax.set(xlabel="ranks", ylabel="Gbit/s for 90% efficiency", yscale="log",
       title="bus bandwidth needed (model: α = 50 µs, 1 MiB per layer)")
ax.legend()
plt.show()

# %% [markdown]
# Communication hides when it fits under backward: `2(N−1)/N · bytes / β` (plus α per bucket)
# below the backward time, from the first bucket on. Compute per byte of gradient is what decides
# it: a model with more arithmetic per parameter (larger batch, convolutions) tolerates a slower
# link.
#
# ## 6. A network you can turn down
#
# `throttled_network.py` (root) runs two torchrun "nodes" in two network namespaces joined by a
# veth pair, each end limited by a `tbf` qdisc. Each rank of a 2-rank all-reduce sends the whole
# buffer once, so at rate R it takes at least `bytes · 8 / R`: the recorded run, beside α + n/β:

# %%
throttled_path = Path("../../benchmarks/results/ch10_throttled_network.json")
if throttled_path.exists():
    net = load_reference(throttled_path)
    for r in net["rows"]:
        print(f"{r['rate']:>10}: all-reduce {1e3 * r['allreduce']['best_s']:.1f} ms, DDP step "
              f"{1e3 * r['ddp_step']['best_s']:.1f} ms, efficiency {r['efficiency']:.2f}")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    limited = [r for r in net["rows"] if r["bits_per_s"]]
    ax.plot([r["bits_per_s"] for r in limited], [r["allreduce"]["best_s"] for r in limited],
            "o", label="measured (best)")
    ax.plot([r["bits_per_s"] for r in limited], [r["predicted_allreduce_s"] for r in limited],
            "-", label="α + n/β, β = rate")
    ax.set(xscale="log", yscale="log", xlabel="link rate (bit/s)", ylabel="s per all-reduce",
           title=describe(net))
    ax.title.set_fontsize(8)
    ax.legend()
    plt.show()
else:
    print("no recorded throttled run yet: sudo python throttled_network.py --out ...")

# %% [markdown]
# ## 7. The article's knobs, one row each
#
# | the article's claim (its A100 cluster) | here |
# |---|---|
# | `pin_memory=True` "+18 %" | the article's figure on its hardware: pinned memory only speeds host→GPU copies (`non_blocking=True`); on CPU there is no copy to speed up. Not measured here. |
# | `persistent_workers=True` "+12 %" | the article's figure: it saves re-starting the loader workers each epoch, so the gain is start-up time / epoch time — large for short epochs, nothing within an epoch. |
# | `prefetch_factor` 2 → 3 | the article's figure; it hides input time only when workers are the bottleneck (`cm.step_time(input_workers=...)`). |
# | `num_workers` ≈ physical cores / 2 | per *process*: ranks × workers processes in all; 4 ranks × 4 workers on 8 cores oversubscribes. |
# | AMP "+14 %", "halves the all-reduce" | wrong as stated: autocast leaves gradients in the parameters' dtype (fp32), so DDP's all-reduce carries as many bytes (chapter 07, `mixed_precision.py`); halving takes a comm hook (section 3: fp16/bf16 hooks, counted 0.5×). |
# | order the `DistributedSampler` "by NVLink groups" | wrong: the sampler decides which *samples* a rank reads; every gradient byte still goes through the all-reduce, whose ring NCCL builds from the topology itself. No byte moves. |
# | `NCCL_MIN_NRINGS=4` | outdated name: NCCL now calls rings *channels* (`NCCL_MIN_NCHANNELS`, `NCCL_MAX_NCHANNELS` in NCCL's environment-variable documentation); NCCL derives the count from the topology, so set it only to test a hypothesis. |
# | `NCCL_BLOCKING_WAIT=1` | outdated name: torch reads `TORCH_NCCL_BLOCKING_WAIT` (the old name still, as a deprecated alias: `ProcessGroupNCCL.hpp`); it makes the host thread wait for each collective (so a timeout raises there), it does not make training faster or fix a network. |
# | `taskset -c 0-7 torchrun ...` "bind to the NUMA node" | wrong for a job: every rank inherits the same mask, so all ranks share cores 0–7. Bind per rank: `torchrun --numa-binding=node` (torch 2.13's `torch/distributed/run.py`) or a per-rank mask. |
# | `bucket_cap_mb`, `gradient_as_bucket_view`, `static_graph` | section 2 counts buckets; `gradient_as_bucket_view=True` makes each `.grad` a view into its bucket, so gradients are not held twice (section 2, `ddp_knobs.py`: 1.58 MB saved of 3.16 MB, counted); `static_graph` skips the per-step search for unused parameters (chapter 07). |
# | `torch.backends.cudnn.benchmark` "+15 %" | the article's figure: a GPU convolution knob, unrelated to DDP. |
#
# ## Exercises
#
# Two graded exercises in `exercises/10_performance/` (nbgrader assignment `10_performance`).
# Neither is judged by the text of your code, and neither by a clock.
#
# ### `tune_this_job`: the same training, within a communication budget
#
# A colleague's DDP training function, `slow_job`, trains the right model with the knobs of
# section 2 set wrong (tiny buckets, `find_unused_parameters` without need, no `no_sync` under
# accumulation) and a global loss all-reduced for its log on every micro-batch. You write
# `tune_this_job`, the same training (the tests compare the weights with the slow job's
# numerics) whose all-reduces fit a budget per optimizer step: the gradients' bytes once, in few
# calls. The tests run it on 1 to 4 ranks and count every
# all-reduce call and byte; when the class is graded, the grader's relay between the ranks
# counts them. Self-check: `pytest exercises/10_performance/tune_this_job.ipynb`.
#
# ### `fit_cost_model`: α and β from a sweep, and a step predicted from a profile
#
# `fit_cost_model(measurements)` fits α and β to nccl-tests-style rows (elements of a dtype,
# several timings in microseconds): the units, the best of the repeats, a fit on the relative
# error (section 1), and the data that cannot tell β. `predict_step_time(...)` predicts a step
# from α, β and a profile of backward (each gradient's size and ready time): buckets closed at the
# cap, all-reduces one at a time, what sticks out past backward (section 5; unlike
# `cm.step_time`, the gradients need not arrive at a steady rate). The tests use generated data
# with known parameters, noise included. Self-check:
# `pytest exercises/10_performance/fit_cost_model.ipynb`.
#
# ## Summary
#
# * Count first: buckets, calls and bytes per step are exact, the same on every machine, and
#   explain most of what a knob can change.
# * Time against a recorded run, with the machine, date and command, and a verdict on the
#   repeats; a live timing on a busy laptop concludes nothing on its own.
# * The α–β model predicts what communication costs and whether it hides under backward; where
#   it is wrong (shared cores, oversubscribed ranks, size-dependent protocols) it says what to
#   measure next.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 10](../CLAIMS.md#chapter-10).
