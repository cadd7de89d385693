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
# # 06 · Data loading: one shard per rank, and what the sampler does at the edges
#
# **The problem.** DDP runs the same training loop in N processes. If each process iterates over
# the whole dataset, an epoch costs N times the work: every sample is processed N times. If the
# ranks also iterate in the *same order* (no shuffling, or the same seed on every rank), every step
# computes N gradients of the same batch and averages N copies of one gradient; if their orders
# differ, a step averages different batches, but the epoch still goes over the data N times
# (section 1 shows both). Each rank must read a different **shard**, all shards together must
# cover the dataset, and every rank must run the same number of steps, because every step ends in
# collectives that need everybody.
#
# **The idea.** `torch.utils.data.distributed.DistributedSampler` gives rank r a strided slice of
# one shared (optionally shuffled) order, and makes all slices equally long
# ([docs](https://docs.pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler), [source](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/distributed.py)). This chapter looks at
# what it returns, how it makes lengths equal (by *repeating* samples), what that does to an
# evaluation metric (and why rank 0 must not evaluate through the DDP wrapper alone), why
# `set_epoch` matters, what DataLoader workers add (start methods, pinned memory, random seeds per
# rank, sharding an `IterableDataset`), and what happens when ranks do not get the same number of
# batches.
#
# Scripts: `sampler_shards.py` (shards, padding, `set_epoch`), `eval_without_duplicates.py`
# (biased vs correct distributed evaluation; evaluation on rank 0), `workers_and_ranks.py`
# (an `IterableDataset` sharded by rank and worker; augmentation seeds per rank), `uneven_inputs.py`
# (a hang turned into an error, and two fixes). Everything runs on CPU/gloo in real process groups
# (`run_ranks`).
#
# **Article claims checked here** (section 4.2 of the source article). The article says that
# `DistributedSampler` guarantees the cards' data "does not overlap" in an epoch and that when the
# sample count is not divisible by the world size it is "automatically padded with zeros" (自动补零).
# **Both are wrong**: the sampler pads by *repeating real samples* from the start of its order, so
# those samples do appear on two ranks (sections 2-3). Its advice that `set_epoch` must be called
# every epoch, or every epoch sees the same order, is right (section 4).

# %%
import os, sys, warnings
from collections import Counter
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info

from ddpcourse.launcher import prestart, run_ranks
from ddpcourse.toys import make_regression

sys.path.insert(0, str(Path.cwd()))     # the notebook runs in chapters/06_data_loading
prestart()
import eval_without_duplicates as ev
import sampler_shards as ss
import uneven_inputs as ui
import workers_and_ranks as wr

# %% [markdown]
# ## 1. What each rank gets
#
# **Without a sampler** every rank's DataLoader walks the whole dataset. With `shuffle=True` the
# order comes from the rank's own global RNG (`RandomSampler.__iter__` draws its seed from it;
# [sampler.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/sampler.py)). Two
# ranks, 8 samples, batches of 4, first with the same `torch.manual_seed(0)` on both ranks, then with
# each rank's own seed (`run_ranks(seed=1)` seeds rank r with 1 + r, as unseeded processes under
# torchrun would differ too):

# %%
for same_seed in (True, False):
    per_rank = run_ranks(ss.whole_dataset_batches, 2, same_seed=same_seed, seed=1)
    print(f"same seed: {same_seed!s:<5}", "  ".join(f"rank {r}: {b}" for r, b in enumerate(per_rank)),
          f"\n{'':17}same batch at every step: {per_rank[0] == per_rank[1]}")

# %% [markdown]
# With the same seed both ranks hold the same batch at every step: DDP averages two copies of one
# gradient, and the step is exactly a single process's step on that batch, at twice the cost. With
# different seeds each step does average two different batches, but each rank still goes through
# all 8 samples: one epoch processes the data twice. Neither is what we want; a sampler is.
#
# `DistributedSampler(dataset, num_replicas=W, rank=r)` is an ordinary sampler: iterating it
# yields dataset indices. Inside a process group you leave out `num_replicas` and `rank` and it
# reads them from the group; outside one (as here, for a table) you pass them. `ss.Indices(n)` is
# a dataset whose sample `i` is the number `i`, so indices and samples are the same thing.
# 10 samples on 3 ranks:

# %%
for shuffle in (False, True):
    per_rank = ss.shards(10, 3, shuffle=shuffle)
    print(f"shuffle={shuffle!s:<5}", "  ".join(f"rank {r}: {s}" for r, s in enumerate(per_rank)),
          f"  lengths {[len(s) for s in per_rank]}")


# %% [markdown]
# The same thing from inside a real 3-rank group, where each rank builds its sampler
# without telling it who it is:

# %%
def my_shard(rank, world_size, n, shuffle):
    return list(DistributedSampler(ss.Indices(n), shuffle=shuffle))

live = run_ranks(my_shard, 3, 10, True)
print(live, "== table above:", live == ss.shards(10, 3, shuffle=True))


# %%
def draw(per_rank, ax, title):
    seen = Counter()
    for r, shard in enumerate(per_rank):
        for j, i in enumerate(shard):
            seen[i] += 1
            repeat = seen[i] > 1
            ax.add_patch(plt.Rectangle((j, -r - 0.5), 0.95, 0.9, color="tab:red" if repeat else "tab:blue",
                                       alpha=0.8))
            ax.text(j + 0.47, -r, str(i), ha="center", va="center", color="white", fontsize=12)
    ax.set_xlim(0, max(map(len, per_rank))); ax.set_ylim(-len(per_rank) + 0.4, 0.5)
    ax.set_yticks([-r for r in range(len(per_rank))], [f"rank {r}" for r in range(len(per_rank))])
    ax.set_xticks([]); ax.set_title(title, fontsize=10)

fig, axes = plt.subplots(1, 3, figsize=(11, 2.4))
draw(ss.shards(10, 3, shuffle=False), axes[0], "shuffle=False")
draw(ss.shards(10, 3, shuffle=True), axes[1], "shuffle=True (seed 0, epoch 0)")
draw(ss.shards(10, 3, shuffle=True, drop_last=True), axes[2], "shuffle=True, drop_last=True")
fig.suptitle("DistributedSampler, 10 samples on 3 ranks (red: a sample seen a second time)")
plt.tight_layout(); plt.show()

# %% [markdown]
# Every rank gets `ceil(10 / 3) = 4` indices: ranks take turns through one common order
# (rank r gets positions r, r + W, r + 2W, ...), so equal lengths need 12 slots for 10 samples.
#
# ## 2. Padding repeats real samples; it never pads with zeros
#
# Where do the 2 extra slots come from? Count the indices over all ranks and compare them with the
# order the sampler shuffled (`ss.shards(n, 1, ...)` is that order, unsharded):

# %%
for shuffle in (False, True):
    per_rank = ss.shards(10, 3, shuffle=shuffle)
    order = ss.shards(10, 1, shuffle=shuffle)[0]
    extra = Counter(i for s in per_rank for i in s) - Counter(range(10))
    print(f"shuffle={shuffle!s:<5} order {order}\n{'':14}repeated {sorted(extra.elements())}, "
          f"first two of the order {sorted(order[:2])}, any index outside 0..9: "
          f"{any(not 0 <= i < 10 for s in per_rank for i in s)}")

# %% [markdown]
# The extra slots are filled with the **first indices of the same order** (when the
# dataset is shorter than the number of slots to fill, the order is repeated as often as needed;
# see `__iter__` in the [source](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/distributed.py)). A padded batch is made of
# real samples, loaded by the dataset like any other: there is no zero tensor anywhere. The
# article's "padded with zeros" is wrong, and so is its "no overlap": samples 0 and 1 are seen by
# two ranks in every padded epoch.
#
# `drop_last=True` goes the other way: it cuts the order to the largest multiple of W (here 9) and
# drops the rest, so nothing repeats but one sample is never seen in that epoch (with shuffling, a
# different one each epoch):

# %%
dropped = ss.shards(10, 3, shuffle=True, drop_last=True)
print(dropped, "unseen:", sorted(set(range(10)) - {i for s in dropped for i in s}),
      "repeated:", ss.repeated(dropped))

# %% [markdown]
# For training, W - 1 repeated samples out of a large dataset do not matter. For
# **evaluation** they do.
#
# ## 3. Evaluation: the padded average is biased
#
# `eval_without_duplicates.py` evaluates a fixed model (mean squared error) on a small set four
# ways: on one process (the reference); the naive distributed way (each rank averages its sampler
# shard, then the ranks average their means); de-duplicated (each rank `all_gather`s its
# (index, error) pairs, every index is kept once); and with unpadded strided shards, reducing the
# error *sum* and the sample *count*:

# %%
import inspect
print(inspect.getsource(ev.naive)); print(inspect.getsource(ev.deduplicated))

# %%
for n, world_size in ((10, 3), (7, 2), (9, 3)):
    results = run_ranks(ev.evaluate_all, world_size, n)[0]
    reference = results["single process"]
    print(f"n={n:>2}, {world_size} ranks, {-n % world_size} repeated: " + ", ".join(
        f"{name} {value:.5f}" + (f" ({(value - reference) / reference:+.1%})" if name != "single process" else "")
        for name, value in results.items()))

# %% [markdown]
# With 10 samples on 3 ranks the naive number is off by several percent (the two repeated
# samples carry twice the weight of the others); at 9 samples on 3 ranks nothing is repeated and
# all four agree. The bias shrinks like `(W-1)/n` on a large set, but it is a bias, not noise: two
# runs with different world sizes report different scores for the same model, and a leaderboard
# number computed this way is not the dataset's.
#
# Correct ways, both implemented and checked above: keep the sampler but gather per-sample results
# **with their indices** and de-duplicate (needs the dataset to give each sample a stable index);
# or shard without padding (`range(rank, n, W)`; shards differ in length by at most one) and reduce
# sums and counts, never means of means. Do not use `drop_last=True` for evaluation: it silently
# skips samples.
#
# ### Evaluating on rank 0 alone: not through the DDP wrapper
#
# A third way looks simplest: rank 0 evaluates the whole set while the other ranks wait. An earlier
# version of this chapter called that "also correct, only slower". **Through the DDP wrapper it is
# not: it can hang.** DDP's forward is more than a call of your model:
# `DistributedDataParallel._pre_forward`
# ([distributed.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py))
# can run collectives, which need every rank of DDP's group:
#
# * it **broadcasts the model's buffers** from rank 0 (`_sync_buffers`) when
#   `will_sync_module_buffers()` holds: the model has buffers (BatchNorm's running mean and
#   variance, for instance),
#   `forward_sync_buffers` is on (the default; torch 2.13 deprecates its old name
#   `broadcast_buffers`), and `require_forward_param_sync` is set, which it is after construction
#   and after every forward with gradients enabled outside `no_sync()` (`_post_forward`; a
#   forward under `no_grad` or inside `no_sync()` clears it): the first evaluation forward after
#   training broadcasts, which is enough to hang (chapter 07, section 3, counts the broadcasts);
# * with gradients enabled, the first forward after the first backward **rebuilds the gradient
#   buckets** and broadcasts their order from rank 0 (`self.reducer._rebuild_buckets()`; "this
#   function makes broadcast communication call", `rebuild_buckets` in
#   torch/include/torch/csrc/distributed/c10d/reducer.hpp of the installed wheel).
#
# So a model **without buffers**, evaluated under `torch.no_grad()`, runs no collective in DDP's
# forward, and rank 0 alone gets through. That is an exception resting on implementation details:
# add a BatchNorm, or evaluate with gradients enabled after a single training step, and rank 0
# waits for ranks that are sitting in a barrier. `ev.rank0_evaluates` trains two steps, then rank 0
# evaluates while the others wait at a barrier of the default group. DDP runs on a group whose 3 s
# timeout starts after a barrier (`ddpcourse.dist_env.short_timeout_group`), so slow start-up cannot trip it and the
# error is the hang:

# %%
cases = {"DDP model, BatchNorm": dict(call="ddp"),
         "model.module, BatchNorm": dict(call="module"),
         "DDP model, no buffers, no_grad": dict(call="ddp", with_buffers=False),
         "DDP model, no buffers, grad on, after 1 step": dict(call="ddp", with_buffers=False, grad=True, train_steps=1)}
outcomes = {}
for label, kwargs in cases.items():
    rank0 = outcomes[label] = run_ranks(ev.rank0_evaluates, 2, timeout=60, **kwargs)[0]
    print(f"rank 0 evaluates {label:<45}", f"MSE {rank0['mse']:.5f}" if rank0["error"] is None else
          f"{rank0['error'].split('] ')[-1]}\n{'':62}raised in DDP's {' > '.join(rank0['raised in'])}")
assert "_sync_buffers" in outcomes["DDP model, BatchNorm"]["raised in"]
assert outcomes["model.module, BatchNorm"]["error"] is None
assert outcomes["DDP model, no buffers, no_grad"]["error"] is None
assert outcomes["DDP model, no buffers, grad on, after 1 step"]["raised in"][-1] == "_pre_forward"

# %% [markdown]
# Rank 0's buffer broadcast (`forward > _pre_forward > _sync_buffers > ...`) waited 3 s for a
# receiver that never came; with the default timeout (30 min on gloo, 10 min on NCCL, per
# `init_process_group`'s docstring) the job would sit there. The bucket rebuild ends the same way
# (its broadcast runs in C++, so `_pre_forward` is the last Python frame). These runs use gloo;
# with NCCL collectives are queued on the GPU and the host moves on, so where the job stops may
# differ (not run here), but the collectives are unmatched all the same.
#
# **The fix**: rank 0 evaluates `model.module`, the wrapped model itself (the same parameters, no
# collectives), while the other ranks wait at a barrier whose timeout is longer than the
# evaluation takes (a long evaluation needs `init_process_group(timeout=...)` or a group of its
# own). Or evaluate on all ranks, as above, which is also faster.
#
# ```python
# if rank == 0:
#     model.module.eval()
#     with torch.no_grad():
#         score = evaluate(model.module, whole_eval_set)
#     model.module.train()
# dist.barrier()   # the others wait here: its group's timeout must exceed the evaluation
# ```
#
# ## 4. `set_epoch`: a new order every epoch, the same order on every rank
#
# The shuffle uses a generator seeded with `seed + epoch` (`seed` is a constructor argument,
# default 0; `epoch` is whatever `set_epoch` last set, initially 0; [source](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/distributed.py),
# [docs](https://docs.pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler)). Nothing advances the epoch by itself. Two ranks, 10 samples, three
# epochs, with and without `sampler.set_epoch(epoch)`:

# %%
for call_set_epoch in (True, False):
    epochs = run_ranks(lambda rank, ws: ss.gathered_epochs(10, 3, call_set_epoch), 2)[0]
    print(f"set_epoch called: {call_set_epoch}")
    for e, per_rank in enumerate(epochs):
        union = sorted(i for s in per_rank for i in s)
        print(f"  epoch {e}: rank 0 {per_rank[0]}, rank 1 {per_rank[1]}, together cover 0..9: {union == list(range(10))}")

# %% [markdown]
# Without `set_epoch`, epochs 0, 1, 2 are the same permutation: shuffling happens once, not
# per epoch. (The article's trouble table blames a missing `set_epoch` for "duplicated data"; what
# it causes is a repeated *order*, not duplicates across ranks.) With it, the order changes and the
# two shards still partition the data. That is only possible because both ranks drew the **same**
# permutation and took different strides of it. The `seed` must therefore be equal on every rank:
# seeding the sampler with the rank (a common slip when "every rank gets its own seed") breaks the
# partition:

# %%
wrong = [list(DistributedSampler(ss.Indices(10), num_replicas=2, rank=r, seed=r)) for r in range(2)]
both = set(wrong[0]) & set(wrong[1])
print(wrong, f"-> {len(both)} samples on both ranks, {10 - len(set(wrong[0]) | set(wrong[1]))} on neither")


# %% [markdown]
# ## 5. Per-rank batch size and global batch size
#
# `DataLoader(batch_size=B, sampler=DistributedSampler(...))` gives each rank batches of B
# samples. One optimizer step of DDP averages the gradients of all ranks, i.e. it takes one step
# on **W x B** samples (chapter 01 shows DDP matches a single process on the full batch). Counted
# in a 2-rank group:

# %%
def samples_per_step(rank, world_size, per_rank_batch):
    data = make_regression(64, seed=0)
    loader = DataLoader(data, batch_size=per_rank_batch, sampler=DistributedSampler(data))
    x, _ = next(iter(loader))
    count = torch.tensor([x.shape[0]])
    dist.all_reduce(count)
    return {"per-rank batch": x.shape[0], "global batch": count.item(), "steps per epoch": len(loader)}

print(run_ranks(samples_per_step, 2, 8)[0])
try:  # shuffling belongs to the sampler: DataLoader refuses both
    DataLoader(ss.Indices(10), shuffle=True, sampler=DistributedSampler(ss.Indices(10), 2, 0))
except ValueError as error:
    print("ValueError:", error)


# %% [markdown]
# Moving a single-GPU recipe (batch 8, learning rate lr) to W ranks with the same
# per-rank batch therefore multiplies the batch by W, and halves (for W = 2) the steps per epoch.
# A common heuristic is the **linear scaling rule**: multiply the learning rate by the same factor,
# with a gradual warm-up over the first epochs ([Goyal et al. 2017, "Accurate, Large Minibatch SGD"](https://arxiv.org/abs/1706.02677),
# SGD on ImageNet; the authors report it holds there up to batch ~8k and breaks down beyond). It is
# a heuristic for SGD, not a law: other optimizers and models need their own tuning. The
# alternative is to divide the per-rank batch by W and keep the recipe unchanged.
#
# ## 6. DataLoader workers: every rank starts its own
#
# `num_workers=k` makes *each rank's* DataLoader start k worker processes. Each sample of
# `wr.WhoLoads` (in `workers_and_ranks.py`) reports the pid of the process that loaded it, that
# process's parent and its `torch.get_num_threads()`. (The `multiprocessing_context` argument is
# the subject of the end of this section.)

# %%
from ddpcourse.dist_env import loader_workers_context

def loader_processes(rank, world_size, num_workers):
    loader = DataLoader(wr.WhoLoads(), batch_size=2, num_workers=num_workers,
                        sampler=DistributedSampler(wr.WhoLoads(), shuffle=False),
                        multiprocessing_context=loader_workers_context(num_workers))
    rows = torch.cat(list(loader))
    return {"rank pid": os.getpid(), "rank threads": torch.get_num_threads(),
            "worker pids": sorted(set(rows[:, 0].tolist())), "their parents": sorted(set(rows[:, 1].tolist())),
            "worker threads": sorted(set(rows[:, 2].tolist()))}

per_rank = run_ranks(loader_processes, 2, 2)
for r, info in enumerate(per_rank):
    print(f"rank {r}: {info}")
print("distinct worker processes:", len({p for info in per_rank for p in info["worker pids"]}), "= 2 ranks x 2 workers")

# %% [markdown]
# So the machine runs `W x (1 + num_workers)` Python processes, here 6 on 2 cores. Each
# worker sets itself to one intra-op thread (`torch.set_num_threads(1)` in the worker loop,
# [worker.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/_utils/worker.py)), and `torchrun` sets `OMP_NUM_THREADS=1` for
# each rank unless you set it (it prints a warning saying so; [run.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/run.py)).
# (`run_ranks` instead gives each rank `cores // W` threads, as the output shows.) Size
# `num_workers` from the cores *per rank*: roughly `cores / W - 1` at most, less if the rank's
# own threads are busy. The article's "about physical cores / 2" is for one process; with 8 ranks
# on a 32-core machine it means 8 x 16 = 128 workers.
#
# **How the workers start depends on the platform and the Python version.** The DataLoader uses
# its `multiprocessing_context` argument if you give one, else `torch.multiprocessing`, i.e. Python's
# default start method (`_MultiProcessingDataLoaderIter.__init__` in
# [dataloader.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/dataloader.py)).
# That default is `fork` on Linux up to Python 3.13, `forkserver` on Linux from Python 3.14, and
# `spawn` on macOS (since 3.8) and Windows
# ([Python docs](https://docs.python.org/3/library/multiprocessing.html#contexts-and-start-methods)).
# This machine:

# %%
import multiprocessing
print(f"Python {sys.version.split()[0]} on {sys.platform}: DataLoader workers start by "
      f"{torch.multiprocessing.get_start_method()!r} (Python's default: {multiprocessing.get_start_method()!r})")

# %% [markdown]
# A forked worker is a copy of the rank, dataset included, ready in milliseconds. With `spawn` or
# `forkserver` the dataset, `collate_fn` and `worker_init_fn` are pickled and sent to each worker,
# so they must be importable: defined in a module, not in a notebook cell, and no lambdas
# (dataloader.py says so in the warning it adds to a pickling error: "Python 3.14+ changed the
# multiprocessing start method in non-Mac POSIX platforms to 'forkserver'..."). With `spawn` each
# worker also starts a fresh interpreter that imports torch again, every epoch unless
# `persistent_workers=True`. That is why `WhoLoads` and the datasets of sections 8 and 9 live in
# `workers_and_ranks.py`, and why they take the rank as an argument: they work with every start
# method.
#
# **Why the course's loaders do not fork the rank.** A rank is not a single-threaded process by
# the time it builds a loader. Count its threads, in a process group:

# %%
for r, threads in enumerate(run_ranks(wr.rank_threads, 2)):
    print(f"rank {r}: {threads}")

# %% [markdown]
# The threads Python did not start belong to the libraries: gloo starts its own when the group
# is created. `fork` copies only the thread that calls it, so a lock that another thread holds at
# that instant stays locked in the child, with no thread left to release it (the
# [`os.fork` documentation](https://docs.python.org/3/library/os.html#os.fork) warns of exactly
# this, and Python 3.12 issues a `DeprecationWarning` when it detects threads at a fork). The
# course ran into it: chapter 08's `resume_bit_exact.py`, on Python 3.11.7, hung now and then at
# the start of an epoch, with one DataLoader worker stuck before running a line of its own code,
# inside CPython's after-fork clean-up (`PyOS_AfterFork_Child` -> `_PyEval_ReInitThreads` ->
# `_PyThreadState_DeleteExcept`), waiting for the interpreter's lock on its list of thread
# states. A native thread that enters Python takes that lock without holding the GIL; CPython 3.8
# to 3.11 take it in the child before re-creating it
# ([CPython issue gh-112275](https://github.com/python/cpython/issues/112275)).
# `benchmarks/fork_with_native_threads.py` reproduces it without torch: native threads that
# enter Python and leave, while the main thread forks children that exit at once. Its record
# (`benchmarks/results/fork_with_native_threads.json`, Python 3.11.7):

# %%
from ddpcourse.timing import load_reference, describe
fork_record = load_reference("fork_with_native_threads.json")
print(describe(fork_record))
for method, hung in fork_record["hung"].items():
    print(f"{method:>10}: {hung} of {fork_record['forks']} children hung (Python {fork_record['python']})")

# %% [markdown]
# So every loader with workers in the course's scripts (here, chapter 07's and chapter 08's
# `train.py`) passes `multiprocessing_context=loader_workers_context(num_workers)`
# ([`ddpcourse/dist_env.py`](../../ddpcourse/dist_env.py)): a `forkserver` context. Its server is
# a fresh process that runs no other thread, and every worker is forked from it. The server
# imports torch once, when the first loader starts (the context preloads it; otherwise every
# worker would import torch again). On Python 3.14 and later, `forkserver` is Linux's default
# anyway.
#
# ## 7. `pin_memory` and `non_blocking`: overlapping the copy to the GPU
#
# With a GPU, each batch is copied from host memory to the device. `DataLoader(pin_memory=True)`
# copies every batch into page-locked ("pinned") host memory before handing it to you: in a
# background thread of the rank's process when there are workers (`_pin_memory_loop` in
# [_utils/pin_memory.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/_utils/pin_memory.py)),
# in the loop itself without workers (`_SingleProcessDataLoaderIter._next_data`). A copy from pinned
# memory can be done by the GPU's copy engine while the CPU goes on:
# `x.to(device, non_blocking=True)` then only *queues* the copy on the current CUDA stream and
# returns; kernels queued after it on that stream wait for it, so using `x` right away is safe, and
# the host is free to fetch the next batch in the meantime. From ordinary (pageable) memory the copy
# is staged through a pinned buffer and cannot overlap that way
# ([memory pinning](https://docs.pytorch.org/docs/stable/data.html#memory-pinning),
# [tutorial on `pin_memory` and `non_blocking`](https://docs.pytorch.org/tutorials/intermediate/pinmem_nonblock.html)).
# The other direction is not safe by default: after a `non_blocking` copy *to the CPU*, synchronize
# before reading it.
#
# Under DDP, move the batch yourself: `DDP(model, device_ids=[local_rank])` does move CPU inputs in
# its forward, but with a plain `.to(device)` (`_recursive_to` in
# [torch/distributed/utils.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/utils.py)),
# not `non_blocking`:
#
# ```python
# loader = DataLoader(data, batch_size=B, sampler=DistributedSampler(data),
#                     num_workers=k, pin_memory=True)
# for x, y in loader:
#     x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
# ```
#
# **Only the bookkeeping runs on this CPU-only machine**; pinning and asynchronous copies need an
# accelerator. Without one the DataLoader warns and pins nothing (`_BaseDataLoaderIter.__init__`:
# `self._pin_memory = loader.pin_memory and torch.accelerator.is_available()`), `Tensor.pin_memory()`
# raises, and `.to("cpu", non_blocking=True)` returns the tensor itself: there is nothing to copy.
# On a GPU machine the same cell shows a pinned batch and queues its copy:

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    batch = next(iter(DataLoader(ss.Indices(8), batch_size=4, pin_memory=True)))
accelerator = torch.accelerator.current_accelerator()
print(f"accelerator: {accelerator}; batch pinned: {batch.is_pinned()}; DataLoader warnings:",
      [str(w.message) for w in caught])
if accelerator is None:
    try:
        torch.zeros(4).pin_memory()
    except RuntimeError as error:
        print("Tensor.pin_memory():", error)
    print(".to('cpu', non_blocking=True) returns the same tensor:", batch.to("cpu", non_blocking=True) is batch)
else:  # GPU only: not run on the course's CPU machines
    on_device = batch.to(accelerator, non_blocking=True)
    print("copy queued; on", on_device.device, "->", on_device.tolist())

# %% [markdown]
# ## 8. Random augmentation: one data seed per rank
#
# Workers are where augmentation runs (random crops, flips, noise). Each worker seeds `torch` and
# `random` with `base_seed + worker_id`, and `numpy` from the same two numbers (`_worker_loop` in
# [_utils/worker.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/_utils/worker.py)),
# and `base_seed` is drawn when the loader's iterator is created (every epoch, unless
# `persistent_workers=True`), from the loader's `generator` or, without one, from the rank's global
# RNG (`_BaseDataLoaderIter.__init__` in dataloader.py). Without workers the dataset runs in the
# rank's own process and draws from its global RNG. Either way, the same seed on every rank (a
# `torch.manual_seed(0)` at the top of the script, or the recipe of PyTorch's
# [reproducibility notes](https://docs.pytorch.org/docs/stable/notes/randomness.html#dataloader),
# a `generator` seeded with 0 plus a `worker_init_fn` that seeds the other libraries) gives every
# rank the **same stream of random numbers**. The ranks load different samples, but sample 0 on
# rank 0 and sample 1 on rank 1 get the same crop and the same flip: the global batch has W times
# fewer distinct augmentations than it should.
#
# `wr.augmentation_draws` loads `wr.Augmented`, whose sample i is `[i, a torch draw, a random draw]`,
# through `DistributedSampler` with `worker_init_fn=wr.seed_worker` (the notes' recipe); the data's
# seed is `seed` on every rank, or `seed + rank`:

# %%
for num_workers in (2, 0):
    for per_rank in (False, True):
        draws = run_ranks(wr.augmentation_draws, 2, 0, per_rank, num_workers)
        first = "  ".join(f"rank {r}: {[[round(v, 3) for v in row] for row in d[0][:2]]}" for r, d in enumerate(draws))
        print(f"{num_workers} workers, seed{' + rank' if per_rank else '       '}: {first}  "
              f"same draws on both ranks: {wr.same_draws(draws)}")
        assert wr.same_draws(draws) is not per_rank

# %% [markdown]
# With the same seed the ranks' draws are identical position by position (with and without
# workers); with `seed + rank` they differ, and a rerun repeats them (the test checks it). A
# `worker_init_fn` cannot repair the same-seed case by itself: it runs in each worker "after
# seeding and before data loading" (DataLoader docstring) and sees only what that rank's
# `base_seed` gave it (`torch.initial_seed()`, `get_worker_info().seed`), the same on every rank;
# it is the place to seed other libraries from that seed, or to mix in the rank if you cannot
# change the loader's seed. Two seeds must stay **the same** on every rank: the sampler's (section 4;
# `DistributedSampler` uses its own `seed` argument, not the global RNG) and the model's initial
# weights (DDP broadcasts rank 0's parameters at construction anyway, `_sync_module_states` in
# `DistributedDataParallel.__init__`).
#
# ## 9. Iterable datasets: shard by rank *and* by worker
#
# An `IterableDataset` (lines of a file, a stream from a queue) has no indices, so there is nothing
# for a sampler to shard, and the DataLoader refuses one:

# %%
try:
    DataLoader(wr.Stream(9), sampler=DistributedSampler(ss.Indices(9), 2, 0))
except ValueError as error:
    print("ValueError:", error)

# %% [markdown]
# The dataset must shard itself, and there are `W x num_workers` copies of it: every worker of
# every rank runs its own `__iter__` over its own copy (the `IterableDataset` docstring,
# [dataset.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/utils/data/dataset.py)).
# `get_worker_info()` tells a copy which worker it runs in (`id`, `num_workers`; `None` in the
# rank's own process), and the rank is passed to the constructor. `wr.Stream` numbers the readers
# `rank + W x worker_id` and lets each keep every `(W x num_workers)`-th sample from its number on,
# so rank r's workers together read `range(r, n, W)`. Nine samples, 2 ranks x 2 workers, sharded
# three ways:

# %%
for split in wr.SPLITS:
    per_rank = run_ranks(wr.stream_samples, 2, 9, split, 2)
    counts = wr.read_counts(per_rank)
    print(f"split by {split:<13}: rank 0 reads {per_rank[0]['samples']}, rank 1 reads {per_rank[1]['samples']}\n"
          f"{'':24}times each sample is read {sorted(set(counts.values()))}, batches per rank "
          f"{[r['batches'] for r in per_rank]}")
    if split == "rank x worker":
        assert sorted(counts.elements()) == list(range(9))

# %% [markdown]
# Not sharding reads each sample `W x num_workers` = 4 times; sharding by rank alone still lets
# both workers of a rank read the same samples (twice each); sharding by rank and worker reads each
# sample exactly once. Nothing pads a stream you cannot count, so the shards differ in length (5
# and 4 samples here), and so do the batch counts: 3 and 2. That is the next section's hang; `Join`
# is made for it.
#
# ## 10. Uneven inputs: one rank runs out of batches
#
# Every DDP backward all-reduces gradients, so every rank must run the same number of steps. A
# hand-made split such as `indices[rank::W]` of 9 samples gives rank 0 five samples (3 batches of
# 2) and rank 1 four (2 batches). `ui.train` runs one epoch and ends with a `dist.barrier()` (as
# before saving a checkpoint). Rank 1 reaches the barrier while rank 0 waits in its third backward
# for gradients that never come. With the default process-group timeout (30 min on gloo, 10 min on
# NCCL) that is a hang. `ui.where_it_stops` runs DDP and the barrier on a group with a 3 s timeout
# whose clock starts after a barrier, once both ranks are up (`ddpcourse.dist_env.short_timeout_group`: on a loaded
# machine one rank can start seconds after the other, and a clock that counted start-up would stop
# a rank that is still inside `DDP(...)`). Each rank reports the line of `ui.train` where its wait
# ended, and how many batches it had finished:

# %%
stops = run_ranks(ui.where_it_stops, 2, timeout=60)
for rank, stop in enumerate(stops):
    print(f"rank {rank}: {stop['batches done']} batches done, stopped at uneven_inputs.py:{stop['line']}: "
          f"{stop['code']}\n        {stop['error'].split('] ')[-1]}")
assert stops[0]["batches done"] == 2 and stops[0]["code"].endswith(".backward()")  # in its third backward
assert stops[1]["batches done"] == 2 and stops[1]["code"].startswith("dist.barrier(")  # at the barrier

# %% [markdown]
# Rank 0 finished two batches and its error comes out of the third backward, whose gradient
# all-reduce nobody answered; rank 1 finished its two and waits in the barrier. `uneven_inputs.py
# --fix none` runs the same under torchrun: both ranks raise `RuntimeError: ... Timed out waiting
# 3000ms` and the job exits non-zero (the chapter's test checks it). Mismatched collectives can
# also end in an abort instead of a hang, depending on which collectives meet; either way the job
# is lost.
#
# **Fix 1: equal shards.** `DistributedSampler` gives every rank `ceil(n / W)` samples, so the
# same number of batches (at the price of the repeats of section 2). **Fix 2: `Join`.** When the
# uneven split is wanted (e.g. an iterable dataset you cannot pad, section 9), wrap the loop in
# `torch.distributed.algorithms.Join([model])` ([docs](https://docs.pytorch.org/docs/stable/distributed.algorithms.join.html), [tutorial](https://docs.pytorch.org/tutorials/advanced/generic_join.html)):
# a rank that runs out keeps answering the others' gradient all-reduces (with zeros) until all
# ranks are done. Checked here on gloo/CPU (torch 2.13):

# %%
print("torch", torch.__version__)
for fix in ("sampler", "join"):
    print(f"--fix {fix}: batches per rank {run_ranks(ui.train, 2, fix, timeout=30)}")

# %% [markdown]
# Two things `Join` does not do. It only shadows the collectives of the objects you pass it
# (DDP's gradient all-reduce, ZeroRedundancyOptimizer's); any other collective inside the loop, for
# example an `all_reduce` of the loss for logging or `SyncBatchNorm`, still hangs; for those the
# docs tell you to pass `throw_on_early_termination=True` and handle the exception. And by default
# DDP still divides gradients by the initial world size, so in the extra steps the remaining ranks'
# gradients count as if the joined ranks had contributed zeros (`divide_by_initial_world_size`,
# [DDP.join](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py)).
#
# ## Pitfalls
#
# * **No sampler at all**: every rank reads the whole dataset; with the same seed every step
#   averages N copies of one gradient, with different seeds the epoch still reads everything N times
#   (section 1).
# * **Believing "padded with zeros" or "no overlap"**: without `drop_last`, up to W - 1 real
#   samples are seen twice per epoch (section 2).
# * **Evaluating with the training sampler and averaging means**: biased when `n % W != 0`
#   (section 3). De-duplicate by index, or reduce sums and counts over unpadded shards.
# * **Rank 0 evaluating through the DDP wrapper** while the others wait: DDP's forward broadcasts
#   buffers (or rebuilds buckets) and waits for them (section 3). Call `model.module` on rank 0.
# * **`drop_last=True` in evaluation**: skips samples silently.
# * **Forgetting `sampler.set_epoch(epoch)`**: every epoch gets the same order (section 4). Call it
#   before creating the epoch's iterator (`for batch in loader`), on every rank, with the same epoch.
# * **Different sampler `seed` per rank**: the shards overlap and miss samples (section 4).
# * **`DataLoader(shuffle=True)` together with a sampler**: refused with a `ValueError`
#   (section 5); shuffle through the sampler (`shuffle=True` is its default).
# * **Forgetting that the global batch is W x the per-rank batch** when reusing a learning rate
#   (section 5).
# * **`num_workers` sized for one process**: the machine runs W times as many (section 6).
# * **Datasets defined in a notebook or as lambdas** with `spawn`/`forkserver` workers (macOS,
#   Windows, Linux from Python 3.14): they cannot be pickled to the workers (section 6).
# * **Forking workers from a rank**: the rank runs other threads, and a fork can leave a worker
#   waiting forever for a lock one of them held; start them from a `forkserver` (section 6).
# * **`non_blocking=True` from unpinned memory**, or relying on DDP's own input move: no overlap
#   of the copy (section 7).
# * **The same data seed on every rank**: identical augmentation on every rank; seed the data
#   with `seed + rank` (section 8).
# * **An `IterableDataset` sharded by rank only**, or not at all: each worker reads the same
#   samples (section 9).
# * **Hand-made splits with unequal lengths**: a hang at the next collective (section 10).
#
# ## Summary
#
# * `DistributedSampler` gives rank r every W-th index of one order that all ranks share, padded to
#   `ceil(n / W)` indices per rank by **repeating the first indices** (or cut with `drop_last`).
# * The repeats bias evaluation metrics that average per-rank means; gather per-sample results with
#   their indices and de-duplicate, or reduce sums and counts over unpadded shards. Evaluating on
#   rank 0 alone works only through `model.module`.
# * The order is a permutation seeded by `seed + epoch`: call `set_epoch` every epoch and use the
#   same `seed` on every rank.
# * Global batch = per-rank batch x W; scaling the learning rate with it is a heuristic.
# * Each rank starts its own `num_workers` workers, by the platform's start method (`fork` only on
#   Linux before Python 3.14) unless the loader is given one: start them from a `forkserver`,
#   since a rank is multi-threaded; `pin_memory=True` plus `.to(device, non_blocking=True)` lets the copy
#   to the GPU overlap with the host's work.
# * Seed the data's randomness with `seed + rank`; keep the sampler's seed and the model's the same.
# * An `IterableDataset` shards itself over `W x num_workers` readers (`get_worker_info()` and the
#   rank), and its shards are uneven.
# * Every rank must run the same number of steps: equal shards, or `Join`.
#
# **Exercise** (`exercises/06_data_loading/`): write `shard_indices`, your own version of what
# `DistributedSampler` returns. Check yourself with `pytest exercises/06_data_loading` from the
# repository root.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 06](../CLAIMS.md#chapter-06).
