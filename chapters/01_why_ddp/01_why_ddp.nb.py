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
# # 01 · Why DDP, and when it is not worth it
#
# **The problem.** On one device, every sample of every batch goes through one forward and one
# backward pass on that device, one after the other. An epoch takes *steps × time per step*, and
# neither shrinks by itself: a bigger batch means fewer steps but longer ones. When an epoch takes
# hours, the device is the bottleneck.
#
# **The idea of data parallelism.** Put a replica of the model on each of *N* devices, give each
# replica 1/N of every batch, and before the optimizer step make every replica's gradient the
# *average* of all replicas' gradients (one all-reduce). Every replica then takes the same step,
# the step one device would take on the whole batch, in roughly 1/N of the compute time, plus the
# time of the all-reduce. PyTorch's `DistributedDataParallel` (DDP) does exactly that, one process
# per device, overlapping the all-reduce with the backward pass
# ([DDP design note](https://docs.pytorch.org/docs/stable/notes/ddp.html)).
#
# **In this chapter:** see that DDP really computes the single-device step; then *measure* when
# the "plus the time of the all-reduce" eats the gain.

# %%
import os, subprocess, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path.cwd().resolve().parents[1]   # the notebook runs in chapters/01_why_ddp
from ddpcourse.launcher import prestart, run_ranks, wait_until_warm
prestart()

# %% [markdown]
# ## 1. DDP on 2 ranks = one process on the global batch
#
# The course's headline demo, `ddp_equals_single_process.py`: two ranks train replicas of a
# small model with DDP, each on half of every batch, for 10 epochs over a fixed data set of 512
# samples (8 steps of a global batch of 64 per epoch); then rank 0 trains a fresh copy alone on the
# full batches and compares the loss of every epoch and the final weights. It runs under
# `torchrun`, exactly as you would launch it from a terminal at the repository root:

# %%
torchrun = Path(sys.executable).parent / "torchrun"
start = time.perf_counter()
done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2",
                       "chapters/01_why_ddp/ddp_equals_single_process.py"],
                      cwd=ROOT, capture_output=True, text=True, timeout=180)
print(done.stdout)
print(f"exit code {done.returncode}, {time.perf_counter() - start:.1f} s")

# %% [markdown]
# The loss falls epoch after epoch (the model learns), and the two columns agree to the printed
# digits: the DDP run *is* the single-process run, split over two ranks. The final weights differ
# by float32 rounding only (the all-reduce adds in another order), far below what training moved
# them by. The same two curves, drawn from the printed table:

# %%
import matplotlib.pyplot as plt

table = [line.split() for line in done.stdout.splitlines()
         if line.split() and line.split()[0].isdigit() and len(line.split()) == 3]
epochs = [int(row[0]) for row in table]
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot(epochs, [float(row[1]) for row in table], "o-", label="DDP, 2 ranks (global loss)")
ax.plot(epochs, [float(row[2]) for row in table], "x--", markersize=9, label="one process, full batches")
ax.set(xlabel="epoch", ylabel="mean training loss (MSE)", title="Same data, same steps: same curve")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Why the averaged gradient is the global-batch gradient
#
# With the usual *mean* loss over a batch of `B` samples, the gradient is the mean of per-sample
# gradients: `g = (1/B) Σᵢ ∇ℓᵢ`. Split the batch into `N` equal shards of `B/N` samples. Rank `r`
# computes the mean over its shard, `gᵣ = (N/B) Σ_{i∈shard r} ∇ℓᵢ`, and DDP all-reduces and
# divides by `N` (see the note on summed losses in the
# [DDP API docs](https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html)):
#
# `(1/N) Σᵣ gᵣ = (1/N)(N/B) Σ_all ∇ℓᵢ = g`.
#
# **The mean of equal-sized shard means is the global mean.** Two conditions hide in that line:
# the shards must be equal in size, and the loss must be a mean. Here is the same check at the
# level of one gradient, on 2 real ranks against one process, for a mean loss and for a summed
# loss:

# %%
from ddpcourse.toys import make_model, make_regression

X, Y = make_regression(64, seed=0).tensors

def ddp_gradient(rank, world_size, X, Y, reduction):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(make_model(0))
    shard = slice(rank * len(X) // world_size, (rank + 1) * len(X) // world_size)
    torch.nn.functional.mse_loss(model(X[shard]), Y[shard], reduction=reduction).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

def one_process_gradient(X, Y, reduction):
    model = make_model(0)
    torch.nn.functional.mse_loss(model(X), Y, reduction=reduction).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

for reduction in ("mean", "sum"):
    ddp = run_ranks(ddp_gradient, 2, X, Y, reduction)
    one = one_process_gradient(X, Y, reduction)
    print(f"loss reduction={reduction!r}: max |g_DDP - g_one| = {(ddp[0] - one).abs().max():.1e}, "
          f"|g_DDP| / |g_one| = {ddp[0].norm() / one.norm():.3f}, "
          f"both ranks hold the same gradient: {torch.equal(ddp[0], ddp[1])}")

# %% [markdown]
# With a mean loss the two agree to float32 rounding (the all-reduce adds in a different
# order). With a summed loss DDP's gradient is **half** the single-process one on 2 ranks (1/N
# on N): DDP divides by `N` whatever your loss does. And shards of unequal size break the "mean of
# means" even with a mean loss:

# %%
per_sample = torch.arange(1.0, 65.0)            # stand-in for 64 per-sample losses
big, small = per_sample[:48], per_sample[48:]     # shards of 48 and 16 samples
print(f"global mean {per_sample.mean():.2f}; mean of the two shard means "
      f"{(big.mean() + small.mean()) / 2:.2f}")

# %% [markdown]
# That is why `DistributedSampler` gives every rank the same number of samples (padding by
# repeating samples, or dropping the tail:
# [docs](https://docs.pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler);
# chapter 06), and why the demo's global batch must divide
# by the number of ranks.
#
# ## 2. When is it worth it? The article's claim
#
# The source article says (our translation): *"DDP is not a silver bullet for multi-GPU speed.
# It needs a large enough data set and a model with enough compute density. I tried DDP on a small
# data set of only 20,000 samples: 4 GPUs were actually 17% slower than one GPU, because data
# loading and communication overhead outweighed the compute gain. The criterion is simple: DDP is
# only worth it when one epoch on a single GPU takes more than 30 minutes."*
#
# We cannot rerun the article's GPUs, but we can measure the same effect in spirit on this
# CPU. `scaling.py` (next to this notebook) trains two workloads with DDP under the same loop and
# data pipeline (a DataLoader over a DistributedSampler):
#
# * **heavy**: an MLP with 0.39 M parameters on batches of 2,048 samples: much arithmetic per
#   byte of gradient;
# * **tiny**: the course's 1.4 k-parameter `TinyMLP` on batches of 64 (an epoch of the
#   article's 20,000 samples is 313 steps): almost no arithmetic, so a step is mostly fixed costs.
#
# **Strong scaling**: the *global* batch is fixed and split across the ranks, so N ranks do the
# same work per step as one. That is the article's situation (a given data set; does an epoch get
# faster?) and the one where communication can eat the gain. Each rank gets one thread, so **one
# rank stands for one device**; this machine has 2 cores, so **4 ranks oversubscribe it**: two
# ranks share each core, and we run it anyway to show what that does.
#
# How each step's time is split (medians over the measured steps, after warm-up steps; each
# step counted on the slowest rank, since a step is only done when every rank is):
#
# * **data**: fetching the batch from the DataLoader;
# * **compute**: a step inside `DDP.no_sync()`, where DDP skips the all-reduce
#   ([docs](https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync));
# * **comm**: a normal step minus a `no_sync` step: the all-reduce time backward could not hide;
# * **allreduce**: one bare `all_reduce` of a tensor as large as all gradients, for reference.
#
# Normal and `no_sync` steps alternate, so a noisy moment on a shared machine hits both; and
# each world size is measured twice (interleaved), keeping the faster run, the one least disturbed
# by other programs.

# %%
import scaling

wait_until_warm()
load = os.getloadavg()[0]
print(f"load average before measuring: {load:.1f} on {scaling.usable_cores()} cores"
      + (" (other programs are running: the timings will show it)" if load > 0.5 else ""))
start = time.perf_counter()
results = {name: scaling.measure_scaling(name, world_sizes=(1, 2, 4), rounds=2)
           for name in ("heavy", "tiny")}
print(f"measured in {time.perf_counter() - start:.1f} s\n")
for rows in results.values():
    print(scaling.format_table(rows), "\n")

# %%
cores = scaling.usable_cores()
fig, ax = plt.subplots(figsize=(9, 4.2))
ranks = [1, 2, 4]
ax.plot(ranks, [min(n, cores) for n in ranks], "k:", label=f"ideal on {cores} cores")
for name, marker in (("heavy", "o-"), ("tiny", "s-")):
    ax.plot(ranks, [row["speedup"] for row in results[name]], marker, label=f"{name} model (measured)")
ax.plot([4], [1 / 1.17], "r*", markersize=14, label="article's claim: 4 GPUs 17% slower (0.85x)")
ax.axhline(1.0, color="grey", lw=0.8)
ax.axvspan(cores + 0.05, 4.2, color="orange", alpha=0.12, label="oversubscribed (ranks > cores)")
ax.set(xlabel="ranks (global batch fixed)", ylabel="speed-up vs 1 rank (samples/s)",
       xticks=ranks, title="Strong scaling with DDP on this CPU")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
plt.tight_layout()
plt.show()

# %% [markdown]
# Where the time goes, per step, for each world size:

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for ax, name in zip(axes, ("heavy", "tiny")):
    rows = results[name]
    x = [str(row["world_size"]) for row in rows]
    bottom = [0.0] * len(rows)
    for key, label in (("data_ms", "data"), ("compute_ms", "compute (no_sync step)"),
                       ("comm_ms", "exposed communication")):
        values = [row[key] for row in rows]
        ax.bar(x, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="ranks", ylabel="ms per step", title=f"{name} model")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# What to read off. Your numbers differ from run to run on a shared machine, so first
# check that the measurement had the machine to itself: with both cores free, the **compute**
# column of the heavy model halves from 1 rank to 2 (each rank does half the work on its own
# core). If it does not, another program was using a core and no speed-up could show; rerun.
# The cell after this one prints that check and this run's figures.

# %%
heavy, tiny = results["heavy"], results["tiny"]
ratio = heavy[1]["compute_ms"] / heavy[0]["compute_ms"]
print(f"heavy compute, 2 ranks vs 1: {ratio:.2f} (0.5 = both cores were free"
      + ("" if ratio < 0.65 else "; NOT the case in this run: another program used a core") + ")")
for name, rows in results.items():
    two = rows[1]
    print(f"{name:5}: 2 ranks {two['speedup']:.2f}x  (compute {rows[0]['compute_ms']:.2f} -> "
          f"{two['compute_ms']:.2f} ms, exposed comm {two['comm_ms']:.2f} ms, bare all_reduce "
          f"{two['allreduce_ms']:.2f} ms, comm share {100 * two['comm_share']:.0f}%); "
          f"epoch of 20k samples on 1 rank {rows[0]['epoch_s']:.2f} s")

# %% [markdown]
# On this 2-core machine, with nothing else running, we measured 1.57x to 1.68x for the
# heavy model on 2 ranks and 0.2x to 0.45x for the tiny one, over several runs. Why:
#
# * **heavy** gets faster with 2 ranks: compute halves, and the all-reduce of 1.5 MiB of
#   gradients costs much less than the compute it saves. It does not reach 2x: communication and
#   the data pipeline still cost something, and the communication thread competes with compute
#   for the same 2 cores.
# * **tiny** gets *slower* with 2 ranks, in the article's spirit and more so: its compute is
#   well under a millisecond, so there is almost nothing to split, while every step now pays an
#   all-reduce and DDP's per-step machinery. The exposed communication comes out larger than the
#   bare all-reduce: DDP's bucketing, copies and hand-off to the communication thread cost time on
#   every step too (we measured the total, not each part).
# * **4 ranks on 2 cores** help neither: more ranks than cores cannot compute faster, but they
#   still add communication, and oversubscribed processes wait for each other.
#
# The article saw 17% slower on GPUs; on a CPU the all-reduce goes through loopback TCP, whose
# latency is large next to a sub-millisecond step, so our tiny model loses more. The mechanism is
# the same: **fixed per-step costs that do not shrink with N, against compute that does.**

# %% [markdown]
# ### The "30-minute epoch" rule is a heuristic, not a law
#
# The article's rule of thumb (DDP pays off when a single-GPU epoch exceeds 30 minutes) is a
# practitioner's heuristic. Look at the last column above: on this machine an epoch of 20,000
# samples takes well under a second for *both* workloads, far below 30 minutes, yet one speeds up and
# the other slows down. What decides is not the length of the epoch but, **per step**, the compute
# that DDP divides by N against the costs it adds (the all-reduce of all gradient bytes, its
# latency, DDP's bookkeeping) and the costs it does not divide (a data pipeline that cannot keep
# up). A long epoch made of tiny steps scales no better than a short one. Estimate both sides for
# your model: compute from one step on one device; communication from the gradient size and the
# bus bandwidth the doctor measures in chapter 00 (time ≈ bytes × 2(n-1)/n / busbw).
#
# ### Weak scaling: the other question
#
# Keep the **per-rank** batch fixed instead (here 2,048 samples per rank), so the global batch
# grows with N. Ideal weak scaling keeps the step time constant and multiplies samples/s by N. It
# answers a different question (can I train on N× more data per step in the same time?) and
# tends to look better, because the compute per rank does not shrink while the communication
# stays the same (compare the two curves below; like every timing here, they need a quiet
# machine);
# and it changes the optimisation (a larger global batch usually wants a different learning
# rate). Report which one you measured.

# %%
weak = scaling.measure_scaling("heavy", world_sizes=(1, 2, 4), mode="weak")
print(scaling.format_table(weak))

# %%
fig, ax = plt.subplots(figsize=(6, 3.8))
ax.plot(ranks, [min(n, cores) for n in ranks], "k:", label=f"ideal on {cores} cores")
ax.plot(ranks, [row["speedup"] for row in results["heavy"]], "o-", label="heavy, strong scaling")
ax.plot(ranks, [row["speedup"] for row in weak], "^-", label="heavy, weak scaling")
ax.set(xlabel="ranks", ylabel="samples/s vs 1 rank", xticks=ranks,
       title="Same model, two definitions of speed-up")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Pitfalls
#
# * **Expecting N× from N devices.** The all-reduce, the data pipeline and DDP's per-step costs do
#   not shrink with N; measure the communication share before buying more GPUs.
# * **Small steps.** A model whose step takes well under a millisecond has nothing to split:
#   data parallelism makes it slower. Bigger per-rank batches (if the optimisation allows),
#   gradient accumulation with `no_sync` (chapter 07) or simply one device are the fixes.
# * **More ranks than devices (or cores).** Oversubscription adds communication without adding
#   compute.
# * **Summed losses and unequal shards.** DDP averages over ranks; a summed loss gives 1/N of the
#   single-process gradient, and unequal shards break the mean of means.
# * **Timing without warm-up, or from one step.** The first steps allocate memory and warm caches;
#   take medians over several steps, and count each step on the slowest rank.
# * **Comparing strong and weak scaling numbers.** They answer different questions.
# * **Rules of thumb as laws.** "Epoch > 30 minutes" is the article's heuristic; per-step compute
#   against per-step communication is the quantity to measure.
#
# ## Summary
#
# * DDP runs one replica per device on 1/N of each batch and averages gradients with an
#   all-reduce; with a mean loss and equal shards the step equals one device's step on the global
#   batch (demo above, to float32 rounding).
# * Speed-up is a measurement: with the global batch fixed, the compute-heavy model sped up on 2
#   ranks, the tiny one slowed down, as the article says of its 20k-sample run, and 4 ranks on 2
#   cores helped neither.
# * `python chapters/01_why_ddp/scaling.py --world-sizes 1 2 4` reproduces the tables; under
#   `torchrun --standalone --nproc_per_node 2 chapters/01_why_ddp/scaling.py` it measures the world
#   size torchrun gives it (NCCL on GPUs).
