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
# # 07 · The DDP training loop: wrapping, unused parameters, buffers, accumulation, precision, compile
#
# **The problem.** Chapters 01–06 built the pieces: processes and process groups, the all-reduce,
# the sampler. A training loop puts them together, and most DDP bugs people report live there. Very
# few of them raise an error where the mistake is. A parameter that takes no part in the loss
# fails one iteration *later*, at an innocent-looking line. A `no_sync()` in the wrong place, or a
# head outside the wrapper, raises nothing: the replicas drift apart. A buffer that rank 0
# overwrites changes what your model learns. A loss printed on rank 0 is not the model's loss.
#
# **The idea.** Read what `DistributedDataParallel` does at each moment of a training step, in
# torch's own source (`torch/nn/parallel/distributed.py`: the constructor, `_pre_forward`,
# `_post_forward`, `no_sync`, `_sync_buffers`), and check each claim on real process groups (gloo
# on the CPU; the same cells use NCCL on GPUs). Every section ends in a fact you can count:
# collectives, bytes, parameters named in an error, the largest difference between replicas.
#
# | section | script (each checks its own claims under `torchrun`) |
# |---|---|
# | 1. Wrapping: placement, `device_ids`, what the constructor does, buckets, `model.module` | `wrapping.py` |
# | 2. Unused parameters: the error, `TORCH_DISTRIBUTED_DEBUG`, the fixes in order, their cost | `unused_parameters.py` |
# | 3. Buffers: rank 0's, in the forwards that sync them; `broadcast_buffers`, SyncBatchNorm | `buffers.py` |
# | 4. Seeds: what must be equal, what must differ, what drifts | `seeds_and_replicas.py` |
# | 5. Loss and logging: gradients are averaged, never the loss; global metrics | `loss_and_logging.py` |
# | 6. Gradient accumulation: `no_sync()`, the off-by-one, loss scaling | `accumulation.py` |
# | 7. Mixed precision: autocast, GradScaler, what the all-reduce carries | `mixed_precision.py` |
# | 8. `torch.compile` with DDP | `compile_with_ddp.py` |
# | 9. A complete training script | `train.py` |
#
# Launch any of them with `torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/NAME.py`.
# The exercises of this chapter (`exercises/07_training_loop/`) are listed at the end.
#
# **Article claims checked here.** The source article has advice on each of these topics. Where
# it is wrong or out of date, the section says so and shows the experiment: `find_unused_parameters`
# and its "workarounds" (section 2), buffers and seeds (3, 4), "the loss must be a scalar or DDP
# won't know what to sync" (5), `torch.cuda.amp` (7).

# %%
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from ddpcourse.launcher import prestart, run_ranks

sys.path.insert(0, str(Path.cwd()))  # the notebook runs in chapters/07_training_loop
prestart()


# %% [markdown]
# ## Wrapping the model: where it must live, what `DDP(...)` does, and `model.module`
#
# **The problem.** `model = DDP(model, ...)` is one line, and most training scripts copy it from
# somewhere with `device_ids=[local_rank], output_device=local_rank`. But the constructor is not
# a thin wrapper: it *talks to the other ranks* (it compares the models, then overwrites yours
# with rank 0's), it hooks itself onto your parameters' gradients, and it groups the parameters
# into **buckets** whose layout decides whether communication overlaps the backward pass. Each
# of those explains a rule of the training loop: place the model before wrapping, build the same
# model on every rank, save and evaluate through `model.module`.
#
# **The idea.** Read what `DistributedDataParallel.__init__` does, in order, and check each step
# on two ranks:
#
# 1. it checks where the parameters are and decides what `device_ids` / `output_device` mean;
# 2. `_verify_param_shape_across_processes`: every rank's parameters must match rank 0's;
# 3. `_sync_module_states`: rank 0's parameters and buffers are broadcast to everyone;
# 4. `_ddp_init_helper` assigns parameters to buckets and builds the C++ `Reducer`, which hooks
#    every parameter's gradient accumulator.
#
# Script: `wrapping.py` (`torchrun --standalone --nproc_per_node 2
# chapters/07_training_loop/wrapping.py` runs every experiment below and exits non-zero if one of
# them contradicts this section; its docstring links each of the four steps to its lines in
# torch 2.13's source).

# %%
import wrapping as wr

# %% [markdown]
# ### 1. Place the model first, then wrap it
#
# `device_ids` is for a module that lives on **one GPU**: `device_ids=[local_rank]` tells DDP
# which one, and DDP then moves each forward's inputs there (`_pre_forward`,
# [L1788-L1795](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1788-L1795));
# without it, the inputs must already be on the module's GPU. `output_device` (default
# `device_ids[0]`) is stored and logged
# ([L948-L955](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L948-L955)),
# but in torch 2.13 `forward` never reads it (it never calls `gather`): the output is where the
# module computed it, so the common `output_device=local_rank` is harmless and redundant.
# For a **CPU** module, and for a module that **spans several GPUs** (model parallel inside each
# rank), both must be `None`: the module decides where its outputs are. DDP refuses anything else:

# %%
print(run_ranks(wr.device_ids_on_cpu, 2)[0])
print(run_ranks(wr.gpu_placement, 2)[0] if torch.cuda.device_count() >= 2
      else "GPU part skipped: needs one CUDA GPU per rank (wrapping.gpu_placement)")

# %% [markdown]
# Why place (and convert) the model **before** wrapping? The constructor allocates the buckets
# with the parameters' device and dtype, and the Reducer hooks the gradient accumulator of each
# parameter *as it is at that moment*. The docstring says it plainly: "You should never try to
# change your model's parameters after wrapping up your model"
# ([L662](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L662-L670)).
# What happens if you do? Convert to float64 before and after wrapping, and train two steps on
# different data per rank:

# %%
for when in ("before", "after"):
    r = run_ranks(wr.changed_after_wrapping, 2, when)[0]
    print(f"float64 {when:>6} wrapping: error={r['error']}, "
          f"gradients equal on every rank per step: {r['grads equal on every rank']}")

# %% [markdown]
# **No error, and no averaging.** `Module.to` replaces the parameters' data in place
# (`param.data = ...`, `Module._apply`), and `set_data` drops a parameter's gradient accumulator
# when the dtype or the device changes (`VariableHooks::set_data` in
# [torch/csrc/autograd/variable.cpp](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/autograd/variable.cpp)):
# backward creates a new one, without DDP's hook, and never tells the Reducer anything. Each rank
# steps with its own gradient and the replicas drift apart silently. `DDP(model).to(device)` on a
# GPU takes the same path (a device change); `wr.gpu_placement` checks it where each rank has a
# GPU. The source article's rule "move the model to the GPU before DDP" (section 4.3,
# 初始化DDP前必须先将模型移到GPU) is right, and this is why.

# %% [markdown]
# ### 2. The constructor compares the models... and only some ranks find out
#
# `_verify_param_shape_across_processes` first all-gathers the number of parameters, then
# **broadcasts rank 0's shapes and strides** and lets each rank compare its own
# (`verify_params_across_processes` in
# [reducer.cpp](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp)).
# So a different *count* is seen by every rank, but a different *shape* only by the rank that
# differs: rank 0 compares itself with itself, passes, and goes on into `_sync_module_states`'
# broadcast, where it waits for a rank that has already raised. Here DDP runs on a group whose
# timeout is 2 s (`short_timeout_group(2.0, "gloo")`), so the wait ends:

# %%
for difference in ("count", "shape"):
    for rank, r in enumerate(run_ranks(wr.shape_check, 2, difference, timeout=60)):
        print(f"{difference} differs, rank {rank}, after {r['seconds']:.1f} s in "
              f"{r['raised in'][-1]}: {r['error'][:110]}")

# %% [markdown]
# With the default timeout (`torch.distributed.constants.default_pg_timeout`: 30 minutes in torch
# 2.13), rank 0 would sit in that broadcast for half an hour; under `torchrun`
# the failing rank's exit makes the agent stop the others, so the job ends, but the *first*
# error in the log is the one to read: the differing rank's "appears not to match sizes of the
# same param in process 0". (The tests run it at 3 ranks: a rank that matches rank 0 gets through
# the broadcast, only rank 0 waits.)
#
# ### 3. ...and overwrites every rank with rank 0's state
#
# Each rank seeds its model with its own rank and shifts a BatchNorm buffer by it:

# %%
for init_sync in (True, False):
    per_rank = run_ranks(wr.initial_sync, 2, init_sync)
    for rank, r in enumerate(per_rank):
        print(f"init_sync={init_sync!s:<5} rank {rank}: before {r['before']}  after {r['after']}")

# %% [markdown]
# After `DDP(...)` both ranks hold rank 0's parameters *and* buffers: different seeds are not a
# bug for the parameters' initial values (they are for data order and dropout, see the seeds
# section). `init_sync=False` (torch 2.13) skips both the check and the broadcast; then making
# the replicas equal is your job.

# %% [markdown]
# ### 4. Buckets: reverse registration order, then the order gradients became ready
#
# DDP all-reduces gradients in **buckets** (`bucket_cap_mb`, 25 MiB by default), each launched as
# soon as all its gradients are ready, in bucket order, so that communication overlaps the rest of
# the backward. Which parameters go together? The constructor can only guess: it assumes the
# forward uses parameters in the order they were registered, so backward produces their gradients
# in *reverse* registration order, and builds the buckets that way (`list(reversed(bucket_indices))`,
# [L1439](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1430-L1445)).
# After the first backward it knows the real order and **rebuilds** the buckets once
# (`Reducer::rebuild_buckets`, called from `_pre_forward`,
# [L1775](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1768-L1777)).
#
# To see it, `wr.bucket_layouts` registers a **comm hook** (public: `register_comm_hook`,
# `GradBucket.index()`, `.parameters()`, `.buffer()`) that records each bucket before doing the
# default all-reduce, and a post-accumulate-grad hook on each parameter that records when its
# gradient is ready. The model, `wr.RegisteredBackwards`, uses `layer1 → layer4` but registers
# them as `layer4, layer3, layer2, layer1`; `bucket_cap_mb=0.03` makes buckets of about two layers.

# %%
configs = {"default": (0.03, False), "find_unused_parameters=True": (0.03, True)}
layouts = {name: run_ranks(wr.bucket_layouts, 2, *args)[0] for name, args in configs.items()}
for name, iterations in layouts.items():
    for i, it in enumerate(iterations, 1):
        print(f"{name}, iteration {i}:")
        for b in it["buckets"]:
            print(f"   bucket {b['index']}: {b['params']}  ({b['bytes']} bytes, launched with "
                  f"{b['gradients outstanding']} gradients still to compute)")

# %%
def draw(ax, iteration, title):
    order = iteration["ready order"]
    bucket_of = {p: b["index"] for b in iteration["buckets"] for p in b["params"]}
    colors = plt.get_cmap("tab10")
    for x, name in enumerate(order):
        ax.barh(0, 1, left=x, color=colors(bucket_of[name]), edgecolor="white")
        ax.text(x + 0.5, 0, name.replace(".", "\n"), ha="center", va="center", fontsize=7)
    sent = {}  # position in the gradient order -> buckets handed to the all-reduce there
    for b in iteration["buckets"]:
        sent.setdefault(len(order) - b["gradients outstanding"], []).append(str(b["index"]))
    for k, (x, buckets) in enumerate(sorted(sent.items())):
        ax.plot([x], [-0.5], marker="^", color="black")
        ax.text(x - 0.1, -0.62 - 0.2 * (k % 2), f"all-reduce of bucket {', '.join(buckets)}",
                ha="right", fontsize=7)
    ax.set_xlim(0, len(order)); ax.set_ylim(-0.95, 0.45); ax.set_yticks([])
    ax.set_title(title, fontsize=9)

fig, axes = plt.subplots(3, 1, figsize=(9, 5), sharex=True)
draw(axes[0], layouts["default"][0], "iteration 1 (torch 2.13 default): one bucket")
draw(axes[1], layouts["default"][1], "iteration 2: rebuilt in gradient-ready order")
draw(axes[2], layouts["find_unused_parameters=True"][1],
     "find_unused_parameters=True: reverse registration order, never rebuilt")
axes[-1].set_xlabel("gradients in the order backward produced them (colour: bucket)")
plt.tight_layout(); plt.show()

# %% [markdown]
# What torch 2.13 really does (it differs from most descriptions, including older docs):
#
# * **The first iteration uses one bucket.** With `find_unused_parameters=False` (the default)
#   or `static_graph=True`, the initial bucket limit is `sys.maxsize`
#   (`_BucketCapacityConfig.compute_bucket_size_limits`,
#   [L128-L163](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L128-L163)):
#   everything is all-reduced at the end of the first backward, in one message. The source's
#   comment says why: a guessed order could put an all-reduce too early on one rank and pair it
#   with a different collective on another.
# * **From iteration 2, buckets follow the real gradient order**: bucket 0 holds the gradients
#   ready first (`layer4`, used last) and is sent while `layer2`/`layer1`'s are still being
#   computed: overlap.
# * **With `find_unused_parameters=True` the guessed layout is kept forever**: the Reducer
#   rebuilds only when `static_graph` is on or `find_unused_parameters` is off
#   (`Reducer::should_rebuild_buckets` in reducer.hpp). Reverse registration order is
#   the wrong guess for this model: bucket 0 holds `layer1.bias`, whose gradient comes next to
#   last, and buckets are launched *in order*, so every all-reduce waits for the end of the
#   backward. One more cost of that flag (the next section counts the others).
#
# **The first bucket's size after the rebuild.** The Reducer caps the first rebuilt bucket
# separately, so that the last gradients of the backward are not stuck in a big bucket. In torch
# 2.13 that cap is 1 MiB (`dist._DEFAULT_FIRST_BUCKET_BYTES`) **only if you leave
# `bucket_cap_mb` at its default**; set `bucket_cap_mb` and the first bucket gets the same cap as
# the others (`first_bucket_bytes_cap`,
# [L106-L110](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L106-L110)).
# Six 256×256 layers (1.5 MiB), bytes per bucket in iterations 1 and 2:

# %%
for cap in (None, 2, 0.5):
    print(f"bucket_cap_mb={cap!s:<5}", run_ranks(wr.first_bucket_sizes, 2, cap)[0])

# %% [markdown]
# Default: one 1.5 MiB bucket, then 1 MiB (just over: a bucket closes once it reaches its cap)
# plus the rest. `bucket_cap_mb=2`: one bucket in both iterations, no 1 MiB first bucket.
# `bucket_cap_mb=0.5`: the first bucket is 0.5 MiB like the others.

# %% [markdown]
# ### 5. `model.module`: the model you wrapped
#
# `DDP(model).module` *is* `model`. Through the wrapper, `state_dict()` keys get a `module.`
# prefix; a plain model refuses them, and `strict=False` "succeeds" by loading nothing:

# %%
keys = run_ranks(wr.state_dict_keys, 2)[0]
for name, value in keys.items():
    print(f"{name}: {value}")

# %% [markdown]
# So **save `model.module.state_dict()`** (on rank 0); a checkpoint saved through the wrapper is
# fixed with `torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")`
# ([utils.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/modules/utils.py#L48)).
# The source article (section 4.4) says saving `model.state_dict()` "saves the DDP wrapper's
# metadata" (保存DDP wrapper的元信息) so that single-GPU loading fails: the load does fail, but
# there is no extra metadata, only the prefix on the same tensors.
#
# **Evaluate on rank 0 alone through `model.module`**, never through the wrapper: the wrapper's
# forward runs collectives (the buffer broadcast of section 3, the one-time bucket rebuild)
# that wait for ranks that are not there. After one training step, rank 0 evaluates while rank 1
# waits at a barrier (DDP on a 2-second group):

# %%
for through in ("module", "ddp"):
    print(f"through {through}:", run_ranks(wr.rank0_evaluates, 2, through, timeout=60)[0])

# %% [markdown]
# And **train through the wrapper**: a training forward through `model.module` bypasses
# `_pre_forward`/`_post_forward`, the Reducer is not told a backward is coming, and the gradients
# stay local:

# %%
print("gradients equal on every rank after a step through model.module:",
      run_ranks(wr.training_through_module, 2))

# %% [markdown]
# **Summary.** Move and convert the model, *then* wrap it; `device_ids=[local_rank]` only for a
# single-GPU module, `None` on CPU or for a module spread over GPUs. Build the same model on every
# rank: a different shape fails on that rank and leaves rank 0 waiting. Initial values need not
# match: rank 0's are broadcast. The first iteration is all-reduced in one bucket; from the second,
# buckets follow the gradient order (not with `find_unused_parameters=True`), and the 1 MiB first
# bucket exists only with the default `bucket_cap_mb`. Save and evaluate through `model.module`,
# train through the wrapper.

# %% [markdown]
# ## Unused parameters: an error one step late, and four fixes in the right order
#
# **The problem.** DDP's Reducer hooks every parameter's gradient accumulator and all-reduces a
# bucket when *all* its gradients are ready. A parameter that the loss does not depend on (a
# layer defined in `__init__` but skipped in `forward`, an auxiliary head whose output is
# ignored, a branch not taken this step) never gets a gradient, so its bucket is never reduced
# and the backward ends with a reduction unfinished. DDP cannot know during the backward that
# nothing more is coming; it finds out when you call the model **again**:
#
# > RuntimeError: Expected to have finished reduction in the prior iteration before starting a
# > new one. This error indicates that your module has parameters that were not used in
# > producing loss. ...
#
# **The idea.** Reproduce it, find out which parameters it means, then fix it, cheapest fix first:
# remove or freeze the parameter, make every output count in the loss, `static_graph=True`, and
# only then `find_unused_parameters=True`, whose cost we count. Every experiment trains
# `up.Net`: `body → block → head`, plus an `aux` head whose use is the experiment.
#
# Script: `unused_parameters.py` (`torchrun --standalone --nproc_per_node 2
# chapters/07_training_loop/unused_parameters.py` runs all of them and exits non-zero if one
# contradicts this section).

# %%
import json



import unused_parameters as up


def show(name, r):
    if r["ok"]:
        print(f"{name}: trains; gradients equal on every rank after each step: {r['synced']}; "
              f"no gradient at all: {r['no grad']}")
    else:
        named = f"\n    named: {r['named']}" if r["named"] else ""
        print(f"{name}: {r['error']!r}\n    at step {r['step']}, line {r['line']!r}"
              f" (in {' -> '.join(r['torch frames'])}){named}")


# %% [markdown]
# ### 1. The error, and where it is raised
#
# `aux` is defined but `forward` never calls it. Three steps, different data on each rank:

# %%
bug = run_ranks(up.train, 2, "unused")[0]
show("unused aux head", bug)
print("gradients equal on every rank after step 0:", bug["synced"])
print("indices in the message:", bug["indices"])

# %% [markdown]
# Read it carefully:
#
# * **Step 1, not step 0**, and at the line `loss = loss_of(ddp(x), ...)`, in
#   `DistributedDataParallel._pre_forward` at `self.reducer._rebuild_buckets()`
#   ([distributed.py L1775](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1768-L1777)),
#   whose C++ side first checks that the previous reduction finished
#   (`Reducer::ensure_prior_reduction_finished`,
#   [reducer.cpp](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp)).
#   The traceback points at an innocent line: the culprit is *the previous step's* forward.
# * **Step 0 was not averaged.** Torch 2.13 puts every parameter in one bucket for the first
#   iteration (see the wrapping section), and that bucket never became ready: nothing was
#   all-reduced, no error was raised, and `optimizer.step()` applied each rank's own gradient.
#   The replicas already differ when the error appears.
# * Without debugging on, the message gives only **indices** (6 and 7: `aux.weight`,
#   `aux.bias` in `named_parameters()` order of the parameters DDP manages).
#
# DDP raises this on every rank alike here (every rank skips the same layer), which is why the
# script can report it cleanly; it still runs DDP on a group with a short timeout, so a rank
# that failed alone could not leave the others waiting forever.

# %% [markdown]
# ### 2. Which parameters? `TORCH_DISTRIBUTED_DEBUG=INFO`
#
# DDP builds a name for every parameter at construction, whatever the debug level
# (`_build_debug_param_to_name_mapping`, called unconditionally in `__init__`,
# [L1593](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1593)),
# and hands the map to the C++ `Reducer`. The reducer reads the debug level when it is built
# (its `ddp_debug_level_`, in torch/csrc/distributed/c10d/reducer.hpp) and decides from it what
# the "prior iteration" error says: at `OFF` it lists the unreduced parameters' indices and
# tells you to set `TORCH_DISTRIBUTED_DEBUG`; at `INFO` (or `DETAIL`) it names them. So the
# level has to be set before `DDP(...)` builds the reducer. The level is read from the environment **when `torch.distributed` is
# imported** ([torch/distributed/\_\_init\_\_.py L170](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/__init__.py#L170)),
# so for a script set it on the command line: `TORCH_DISTRIBUTED_DEBUG=INFO torchrun ...`. In a
# process that has already imported torch (a notebook, a rank forked from a warm server),
# setting `os.environ` is too late; call `dist.set_debug_level_from_env()` or
# `dist.set_debug_level(dist.DebugLevel.INFO)` before `DDP(...)`:

# %%
ways = ["debug: environ only", "debug: environ + set_debug_level_from_env",
        "debug: set_debug_level", "anomaly detection"]
for name, r in run_ranks(up.run_experiments, 2, ways)[0].items():
    print(f"{name:<42} -> named: {r['named']}")
r = run_ranks(up.train, 2, "unused", env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})[0]
print(f"{'run_ranks(env={TORCH_DISTRIBUTED_DEBUG: INFO})':<42} -> named: {r['named']}")

# %% [markdown]
# `run_ranks(env=...)` works because the course's launcher calls `dist.set_debug_level_from_env()`
# in each rank (the test `tests/test_chapter_07_unused_parameters.py` also checks the variable
# set before a fresh process starts). Use **INFO** on CPU: with torch 2.13 on gloo, `DETAIL` makes
# DDP's constructor crash the process (a segmentation fault in `_ddp_init_helper`, seen when this
# section was written: try `run_ranks(up.train, 2, "unused", env={"TORCH_DISTRIBUTED_DEBUG":
# "DETAIL"})` and read the rank's stack). The source
# article's table (section 5) suggests `torch.autograd.set_detect_anomaly(True)` to diagnose
# unused branches: anomaly mode looks for NaN-producing backward functions and says nothing about
# parameters that got no gradient, as the `anomaly detection` line shows.

# %% [markdown]
# ### 3. What counts as "unused"
#
# A parameter is unused if no gradient reaches it in the backward, whatever the reason:

# %%
unused = ["aux returned, loss uses main only", "aux under torch.no_grad()",
          "frozen after wrapping", "static_graph=True, aux every other step"]
for name, r in run_ranks(up.run_experiments, 2, unused)[0].items():
    show(name, r)

# %% [markdown]
# * an output that the loss ignores: `aux` ran, but nothing flows back into it;
# * a layer called under `torch.no_grad()`. The source article (section 3.3) says parameters of
#   "layers with `requires_grad=False` or under `torch.no_grad()` in forward" simply "do not
#   enter the AllReduce queue" (这些参数的梯度根本不会进AllReduce队列). True for
#   `requires_grad=False` *set before wrapping* (DDP then leaves them out), **wrong for
#   `no_grad`**: the parameter is still in a bucket, gets no gradient, and training fails;
# * `requires_grad_(False)` *after* wrapping: DDP still expects it;
# * `static_graph=True` with a branch taken on alternate steps: that flag promises the set of
#   used parameters never changes. Step 0 used `aux`, step 1 did not, and the error comes at step
#   2 with its own wording ("your training graph has changed in this iteration").

# %% [markdown]
# ### 4. The fixes, in the order to try them
#
# 1. **Remove the layer, or freeze it before wrapping** (`requires_grad_(False)`): DDP never
#    waits for it, and no flag costs anything.
# 2. **Use every output in the loss** (here: `aux` returned *and* in the loss, an auxiliary
#    loss); if an output must not train, do not compute it.
# 3. **`static_graph=True`** when the *same* parameters are unused at every step: DDP learns
#    the set in the first iteration and never searches again.
# 4. **`find_unused_parameters=True`** only when the set changes from step to step (control
#    flow).

# %%
fixed = [*up.FIXES, "find_unused_parameters=True, aux every other step"]
for name, r in run_ranks(up.run_experiments, 2, fixed)[0].items():
    show(name, r)

# %% [markdown]
# All five train with averaged gradients; with `static_graph` and `find_unused_parameters` a
# parameter unused on *every* rank keeps `grad=None` (the Reducer leaves a globally unused
# parameter's gradient untouched, `Reducer::copy_bucket_to_grad`), so an optimizer skips it.
#
# **What `find_unused_parameters=True` costs**, counted per iteration after warm-up (the
# profiler's `c10d::allreduce_` and `search_unused_parameters` events; whether the buckets were
# rebuilt is DDP's private `_has_rebuilt_buckets`, nothing public tells it):

# %%
for fix, w in run_ranks(up.costs, 2)[0].items():
    print(f"{fix:<30} {w}")

# %% [markdown]
# Three costs, all deterministic:
#
# * **a search of the autograd graph at every training forward** (gradients enabled, outside
#   `no_sync()`): `_post_forward` passes the outputs to
#   `Reducer::prepare_for_backward`, which walks every node reachable from them
#   (`search_unused_parameters`) to find the gradient accumulators not in the graph
#   ([L1830-L1840](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1830-L1840));
# * **one more all-reduce per iteration**: the bitmap of locally used parameters, so that a
#   parameter used on some ranks only is averaged correctly;
# * **buckets never rebuilt**: they stay in reverse registration order (wrapping section).
#
# How big is the search? `up.nodes_searched` does the same walk; for MLPs of growing depth, at
# two batch sizes:

# %%
sizes = up.search_sizes()
for row in sizes:
    print(row)
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot([r["depth"] for r in sizes], [r["nodes, batch 1"] for r in sizes], "o-",
        label="batch 1")
ax.plot([r["depth"] for r in sizes], [r["nodes, batch 64"] for r in sizes], "x--",
        label="batch 64")
ax.set(xlabel="layers (Linear + Tanh)", ylabel="nodes visited per iteration",
       title="find_unused_parameters: graph search size")
ax.legend(); plt.tight_layout(); plt.show()

# %% [markdown]
# Five nodes per `Linear`+`Tanh` (the two backward functions, the transpose of the weight, two
# gradient accumulators), **independent of the batch size**: the search is a fixed cost per
# iteration that grows with the number of operations in `forward`, so it weighs most in models
# of many small operations and small batches. What it costs in milliseconds depends on the
# machine; a recorded reference run (2 ranks, gloo, `benchmarks/ch07_find_unused.py`):

# %%
from ddpcourse.timing import describe, load_reference

try:
    record = load_reference("ch07_find_unused.json")
except FileNotFoundError:
    record = None
    print("no recorded run: python benchmarks/ch07_find_unused.py writes one")
if record:
    print(describe(record)); print(record["verdict"])
    fig, axes = plt.subplots(1, len(record["workloads"]), figsize=(9, 3.2))
    for ax, (name, workload) in zip(axes, record["workloads"].items()):
        variants = list(workload["attempts"][0])
        for i, variant in enumerate(variants):
            mins = [attempt[variant]["min_ms"] for attempt in workload["attempts"]]
            ax.plot([i] * len(mins), mins, "o", color=f"C{i}", alpha=0.7)
        ax.set_xticks(range(len(variants)),
                      [v.replace("_parameters", "").replace("=", "=\n") for v in variants])
        ax.set_ylim(bottom=0)
        ax.set_title(f"{name}: {workload['nodes searched per step']} nodes per search",
                     fontsize=9)
        ax.set_ylabel("ms per step (min of rounds)")
        for variant, (low, high) in workload[
                "min_vs_find_unused_false, range over attempts"].items():
            print(f"{name:<13} {variant:<29} {100 * low:+4.0f}% .. {100 * high:+4.0f}% vs False")
    fig.suptitle(describe(record) + "; one dot per attempt", fontsize=8)
    plt.tight_layout(); plt.show()

# %% [markdown]
# In the recorded run (2 ranks on a 2-core CPU, gloo; each variant's best block per attempt,
# three attempts with fresh ranks), `static_graph=True` landed between a few percent below and
# about 15% above `find_unused_parameters=False`: it does no extra work after its first
# iteration, so that band is the noise of this machine. `find_unused_parameters=True` cost the
# deep narrow model roughly 40-50% in every attempt, well outside the band; for the shallow wide
# model it stayed inside the band (+4% to +14%). In milliseconds the extra was of the same order
# for both (about 1.6-1.9 ms per step for the deep model, 0.4-1.4 ms for the wide one), although
# one graph is 16 times the other: on this machine much of the cost comes once per step whatever
# the graph (the extra all-reduce has the latency of loopback TCP under gloo), and the record does
# not separate it from the search. On GPUs with NCCL the proportions will differ: time your own
# model.
#
# The source article says `find_unused_parameters=True` "slows training by 20%" (拖慢20%速度,
# introduction and section 5) and that the search is "CPU-intensive, measured at +15 ms on an
# A100" (section 3.3). No single figure can hold: the search grows with the number of autograd
# nodes, not with the model's bytes or FLOPs; the extra all-reduce is a latency, 4 bytes per
# parameter tensor; the lost bucket overlap depends on how wrong the registration order is. So
# its share of a step ranges from lost in the noise (large layers, large batches) to large (many
# small operations, a short step), as the two models above show. Measure your own model, and
# prefer a fix that needs no flag. The article also says DDP scans "after backward" and "marks
# unused gradients as 0" (只能在backward后扫描所有参数标记未使用的梯度为0再同步): the search runs at the
# **end of forward**, and a parameter unused on every rank keeps `grad=None` (above), it is not
# zero-filled.

# %% [markdown]
# ### 5. The "did not find any unused parameters" warning
#
# With the flag on, DDP prints (from C++, `reducer.cpp`, so Python's `warnings` never sees it)
# "find_unused_parameters=True was specified in DDP constructor, but did not find any unused
# parameters in the forward pass...". When? `up.unused_warning` builds three models one after
# the other in one process and captures what each step writes to stderr:

# %%
print(run_ranks(up.unused_warning, 2)[0])

# %% [markdown]
# It is printed at the **first step whose search finds nothing unused**, and only **once per
# process** (`TORCH_WARN_ONCE`): never for a model that always has an unused parameter; at step
# 0 for a model whose branch is taken on even steps, although that model *needs* the flag (the
# warning's "may be a false positive if your model has flow control"); and not at all for a
# second model that never has an unused parameter, because the process already printed it. So
# its absence proves nothing, and its presence means "one step had none unused", not "you never
# need the flag".

# %% [markdown]
# ### 6. The source article's workarounds do not work
#
# Section 3.3 of the article: 解决方案是用torch.utils.checkpoint替代条件分支或手动在forward末尾调用
# torch.distributed.all_reduce(torch.zeros(1).cuda())做dummy同步, i.e. instead of the flag,
# "replace the conditional branch with `torch.utils.checkpoint`, or call a dummy
# `all_reduce(torch.zeros(1))` at the end of forward"; its table in section 5 repeats "use
# `torch.utils.checkpoint` or restructure forward". Both, on the unused `aux` head:

# %%
article = ["article 1: reentrant checkpoint around aux", "article 2: dummy all_reduce in forward"]
for name, r in run_ranks(up.run_experiments, 2, article)[0].items():
    show(name, r)

# %% [markdown]
# The same error. Checkpointing changes *when* activations are computed, not whether a gradient
# reaches `aux`; a collective in the forward produces no gradient for anything.
#
# Worse, **reentrant** checkpointing (`use_reentrant=True`) *combined with*
# `find_unused_parameters=True` breaks a model that trains without checkpointing. The reentrant
# version runs the checkpointed forward under `no_grad`, so its parameters are not in the graph
# that DDP searches at the end of forward: DDP marks them unused (ready) at once, and then the
# recomputation in backward produces their gradients and marks them ready a second time. Here
# `block` is checkpointed (it *is* used) and `aux` is unused, so the flag is on:

# %%
checkpointed = ["reentrant checkpoint + find_unused_parameters=True",
                "non-reentrant checkpoint + find_unused_parameters=True",
                "reentrant checkpoint + static_graph=True"]
for name, r in run_ranks(up.run_experiments, 2, checkpointed)[0].items():
    show(name, r)

# %% [markdown]
# "Expected to mark a variable ready only once", raised in the **first** backward (the line
# `loss.backward()`); this message names the parameter that "has been marked as ready twice"
# even without `TORCH_DISTRIBUTED_DEBUG` (torch 2.13). Two fixes: the
# non-reentrant checkpoint (`use_reentrant=False`, the recommended one, which keeps the
# parameters visible to the graph search), or `static_graph=True`, which the DDP docstring lists
# as supporting "activation checkpointing when model has unused parameters"
# ([L743-L770](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L743-L770)).
#
# **Summary.** An unused parameter fails one step late, at the line that calls the model, after a
# first step whose gradients were silently not averaged. `TORCH_DISTRIBUTED_DEBUG=INFO` (set
# before torch is imported, or `dist.set_debug_level`) names it. Remove or freeze it before
# wrapping; make every output count; `static_graph=True` if the unused set never changes;
# `find_unused_parameters=True` only for real control flow, at the price of a graph search and
# an extra all-reduce per step and buckets that never follow the gradient order. Checkpointing
# and dummy collectives do not fix it, and reentrant checkpointing with the flag breaks.

# %% [markdown]
# ## Buffers: rank 0's copy wins, at construction and in the forwards that sync them
#
# **The problem.** A model holds two kinds of state. *Parameters* get gradients, and DDP keeps
# them equal by averaging the gradients. *Buffers* (tensors registered with `register_buffer`:
# BatchNorm's `running_mean`, `running_var` and `num_batches_tracked`, counters, EMA statistics)
# get no gradient; most are updated *in the forward*, from the rank's own batch. So after a
# forward every rank holds different buffers. What does DDP do about them?
#
# **The idea.** It never averages them. With the default settings it **broadcasts rank 0's
# buffers** to every rank, twice over:
#
# * in the constructor, together with the parameters: `DistributedDataParallel.__init__` calls
#   `_sync_module_states`, guarded by `init_sync`;
# * at the start of a forward, **when the previous forward through the wrapper ran with gradients
#   enabled and outside `no_sync()`** (or when it is the first forward): `_pre_forward` calls
#   `_sync_buffers`, which broadcasts from rank 0 (`authoritative_rank = 0`, or a rank still
#   running under `Join`) through `_sync_module_buffers` and `_default_broadcast_coalesced`,
#   if `will_sync_module_buffers()` holds: buffers present, `forward_sync_buffers` on, and
#   `require_forward_param_sync` set. The constructor sets that flag; `_post_forward` sets it
#   after a forward with gradients enabled outside `no_sync()` and clears it after any other.
#
# Script: `buffers.py` (`torchrun --standalone --nproc_per_node 2
# chapters/07_training_loop/buffers.py`; it checks every claim of this section and exits non-zero
# if one fails; its docstring links each function named here to its lines in torch 2.13's
# source).

# %%
import buffers as bf

# %% [markdown]
# ### A rank's own buffer is overwritten by rank 0's at the next forward
#
# `bf.Shifted` computes `weight * x + offset`, with `offset` a buffer; it remembers the offset its
# forward used. Each rank sets the buffer (and the weight) to `rank + 1` *before* `DDP(...)`,
# then sets the buffer to `10 * (rank + 1)` before the first forward. Three ways to build the
# wrapper:

# %%
for mode in bf.SYNC_MODES:
    per_rank = run_ranks(bf.buffer_at_forward, 2, mode)
    print(f"{mode:<27}",
          "after DDP():", [r["offset after DDP()"] for r in per_rank],
          " weight:", [r["weight after DDP()"] for r in per_rank],
          " own before forward:", [r["own offset set"] for r in per_rank],
          " forward used:", [r["offset the forward used"] for r in per_rank])
    print(" " * 28, "constructor warnings:", per_rank[0]["warnings"] or "none")

# %% [markdown]
# * **default**: rank 1's buffer is rank 0's `1.0` right after the constructor, and its own
#   `20.0` is replaced by rank 0's `10.0` *before its forward uses it*: rank 1 computes with rank
#   0's buffer. The forward reads the synced value, not the rank's own.
# * **`broadcast_buffers=False`** skips the forward's broadcast **and the constructor's**: rank 1
#   keeps its own `2.0` after `DDP(...)`. The parameters are broadcast all the same (`weight` is
#   `1.0` everywhere). So if the ranks' buffers differ before wrapping (a checkpoint loaded on one
#   rank, a rank-dependent initialisation), they keep differing.
# * **`forward_sync_buffers=False`**, new in torch 2.13, skips only the forward's broadcast: the
#   buffers are still broadcast in the constructor.
#
# That is torch 2.13's source, `DistributedDataParallel.__init__`: `broadcast_buffers` is
# **deprecated** (a `FutureWarning`, even for `broadcast_buffers=True`) in favour of
# `forward_sync_buffers`; the old flag sets both `forward_sync_buffers` and `init_sync_buffers`, the
# new one only the first
# ([distributed.py L961-L990](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L961-L990),
# and the docstrings of both arguments). The warning itself says: keep using
# `broadcast_buffers=False` if you rely on buffers *not* being synced at construction.
#
# With `forward_sync_buffers=False` nothing ever makes the buffers equal again after
# construction.
#
# ### Which forwards broadcast: counted
#
# "DDP broadcasts the buffers at every forward" is how most write-ups put it (the source article
# too, section 3.3: `broadcast_buffers=True` broadcasts them "to keep BN statistics consistent").
# The rule in torch 2.13 is the flag above: a forward broadcasts when the *previous* forward
# through the wrapper ran with gradients enabled and outside `no_sync()`. Counted, not timed:
# `bf.broadcasts_per_forward` runs a DDP `Linear` + `BatchNorm1d` through two training steps
# (the second also broadcasts the rebuilt buckets' order, once per run), then the forwards below,
# and counts the `gloo:broadcast` events torch.profiler records in each:

# %%
broadcasts = run_ranks(bf.broadcasts_per_forward, 2)
for (label, count), (_, r1_count) in zip(*broadcasts):
    print(f"{label:<46} rank 0: {count}  rank 1: {r1_count}")
print("checks:", bf.check_broadcasts_per_forward(broadcasts) or "all passed")

# %% [markdown]
# A forward that syncs runs **two** broadcasts, the same on every rank: the buffers are
# coalesced into one broadcast per dtype, BatchNorm's float32 `running_mean`/`running_var` and
# its int64 `num_batches_tracked`. And:
#
# * **evaluation**: the *first* `no_grad` forward after training broadcasts (the previous
#   forward was a training one); the second and third do not. `eval()` mode decides nothing: the
#   last row, an `eval()` forward with gradients enabled, broadcasts.
# * **the first training forward after an evaluation does not broadcast**: the forward before it
#   ran under `no_grad`. Evaluation does not change BatchNorm's buffers (in `eval()` it reads
#   them), so nothing is lost; the training step after it broadcasts again.
# * **accumulation** (section 6): only the first micro-batch of each window broadcasts, the one
#   after the synced micro-batch that closed the previous window. Inside a window each rank's
#   BatchNorm updates its own statistics, and rank 0's overwrite them at the next window.
#
# Two consequences to remember. Evaluating through the wrapper on rank 0 alone hangs at its
# first forward after training (a broadcast the other ranks never join: chapter 06, "evaluation
# on rank 0"); evaluate through `model.module`. And a rule of thumb like "one broadcast per
# forward" overcounts: to know what a loop communicates, count it, as here.
#
# ### What DDP holds on to: names of buffers, objects of parameters
#
# After wrapping, each rank changes a tensor to its own value `rank + 1` in one of several ways,
# then runs one forward (then, for the last row, a second one):

# %%
per_rank = run_ranks(bf.reassignment, 2)
for way in per_rank[0]:
    values = [r[way] for r in per_rank]
    print(f"{way:<50}", values if way != "next forward raises" else values[0])

# %% [markdown]
# * **A buffer changed in place** (`copy_`, `add_`, BatchNorm's own update) is synced: rank 0's
#   value everywhere.
# * **A buffer reassigned** (`module.offset = new_tensor`) **is synced too**. A common warning
#   says it is "never synced, because DDP holds the old tensor". That was true of old releases; in
#   torch 2.13 `_sync_buffers` calls `_assign_modules_buffers()` before every broadcast, which reads
#   `module.named_buffers()` again, by name, "because buffers can be reassigned by user module"
#   ([distributed.py L1569-L1591](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1569-L1591),
#   [pytorch#63916](https://github.com/pytorch/pytorch/issues/63916)). Assigning a tensor to
#   the name of a registered buffer keeps it a buffer (`nn.Module.__setattr__`).
# * **A tensor attribute that was never registered** (`self.scale = torch.ones(1)` in
#   `__init__`) is never synced: it is not in `named_buffers()`. It is not moved by `.to(device)`
#   or saved by `state_dict()` either. Use `register_buffer`.
# * **A buffer registered after wrapping a model that had none** is never synced: whether to sync
#   at all is decided from the buffers present at construction (`will_sync_module_buffers`
#   checks `len(self.modules_buffers) > 0`, and that list is refreshed only inside the sync,
#   [L2382-L2387](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L2382-L2387)).
# * **A parameter replaced after wrapping** (`module.weight = nn.Parameter(...)`) is the real
#   "holds the old object" trap: the reducer was built from the parameter *objects* present at
#   construction. The new weight's gradient is never all-reduced (rank 0 has `1.0`, rank 1
#   `2.0`: each its own), and since the old weight got no gradient, the next forward raises
#   `Expected to have finished reduction in the prior iteration...`. Build the model completely,
#   then wrap it.
#
# ### BatchNorm under DDP: whose running statistics?
#
# In training mode BatchNorm normalises with the *batch's* mean and variance, and updates
# `running_mean`/`running_var` (used in `eval()`) from them, in place, in the forward. Under DDP
# each rank does that with its own batch. Here every rank's batches come from a different
# distribution (mean `3 * rank`: non-shuffled shards, one domain per rank), 10 steps, and we
# compare with one process's `nn.BatchNorm1d` fed rank 0's batches only, or the whole global
# batch at every step:

# %%
stats = {mode: run_ranks(bf.running_stats, 2, mode)
         for mode in ("default", "forward_sync_buffers=False")}
RANK0_ONLY = "rank 0's batches only"
for mode, per_rank in stats.items():
    for name in ("running_mean", "running_var"):
        print(f"{mode:<27} {name:<12} rank 0: {per_rank[0]['this rank'][name][0]:7.4f}  "
              f"rank 1: {per_rank[1]['this rank'][name][0]:7.4f}  "
              f"average: {bf.average_over_ranks(per_rank, name)[0]:7.4f}  | one process on "
              f"rank 0's batches: {per_rank[0][RANK0_ONLY][name][0]:7.4f}, "
              f"global batch: {per_rank[0]['global batch'][name][0]:7.4f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
for ax, name in zip(axes, ("running_mean", "running_var")):
    default, own = stats["default"], stats["forward_sync_buffers=False"]
    bars = {"default\nrank 0": default[0]["this rank"][name][0],
            "default\nrank 1": default[1]["this rank"][name][0],
            "no fwd sync\nrank 0": own[0]["this rank"][name][0],
            "no fwd sync\nrank 1": own[1]["this rank"][name][0],
            "no fwd sync\naverage": bf.average_over_ranks(own, name)[0]}
    ax.bar(list(bars), list(bars.values()), color=["C0", "C0", "C1", "C1", "C2"])
    for value, label, style in ((default[0][RANK0_ONLY][name][0],
                                 "one process, rank 0's batches", ":"),
                                (default[0]["global batch"][name][0],
                                 "one process, global batch", "--")):
        ax.axhline(value, color="k", linestyle=style, label=label)
    ax.set_title(f"{name}[0] after 10 steps")
    ax.tick_params(axis="x", labelsize=8)
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# * **default**: rank 0's statistics are *exactly* those of a BatchNorm that saw only rank 0's
#   batches. At every training forward (each one syncs here: every step runs with gradients,
#   no `no_sync`) the others' updates are overwritten by rank 0's buffers; what rank 0 saves in
#   a checkpoint knows nothing of the other ranks' data. Right after a forward the ranks differ
#   again (rank 1 holds rank 0's old statistics updated with its own batch), so "the buffers are
#   equal" holds only at the start of a forward that syncs.
# * **`forward_sync_buffers=False`**: each rank's statistics are those of its own batches.
#   Averaging them over the ranks (an `all_reduce` and a division) gives the **global running
#   mean exactly**: the running mean is a linear average of batch means, and with equal batch
#   sizes the mean of the ranks' batch means is the global batch's mean. The **running variance
#   does not average**: the global variance also contains the spread *between* the ranks' means,
#   which no rank's variance sees.
# * Neither mode changes what the layer does **in training**: each rank normalises with its own
#   batch's statistics. With small per-GPU batches (detection, segmentation) that is where
#   BatchNorm suffers, and only SyncBatchNorm (below) fixes it.
#
# **Where the source article is wrong or incomplete** (section 3.3 and the skeleton in 4.3).
# It says `broadcast_buffers=True` (the default) broadcasts BN's running_mean/running_var from
# rank 0 "to keep BN statistics consistent" (保证BN统计量一致): the broadcast is real, but what is
# consistent is rank 0's running statistics, at the start of the forwards that sync (after a
# training forward, not inside an accumulation window); the other ranks' updates are discarded,
# and the statistics used in training are per rank. For domain-adaptation
# fine-tuning it suggests `broadcast_buffers=False` and then to "sync manually in forward with
# `torch.distributed.all_gather`, collect every card's buffers and average them": an `all_reduce`
# (sum, then divide by the world size) does that averaging without gathering, and as shown it
# recovers the global running mean but not the global running variance. In torch 2.13 its
# skeleton's `broadcast_buffers=True` (the default anyway) emits a `FutureWarning`. It never
# mentions `SyncBatchNorm`, the one thing that makes BatchNorm use the global batch.
#
# ### SyncBatchNorm: statistics over the global batch (GPU only)
#
# `nn.SyncBatchNorm` computes the batch mean and variance over *all* ranks' samples: in the
# forward it all-gathers every rank's per-channel mean, inverse std and count, in the backward it
# all-reduces the gradient sums (`SyncBatchNorm` in
# [torch/nn/modules/_functions.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/modules/_functions.py)):
# extra collectives in every BatchNorm layer, in both passes. The recipe, from the
# [SyncBatchNorm docs](https://docs.pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html):
#
# ```python
# model = Net().to(device)                                    # 1. on this rank's GPU
# model = nn.SyncBatchNorm.convert_sync_batchnorm(model)      # 2. convert (use the return value)
# model = DDP(model, device_ids=[local_rank])                 # 3. then wrap
# ```
#
# `convert_sync_batchnorm` replaces every `BatchNorm*D` by a `SyncBatchNorm` that reuses its
# weight, bias and running buffers, and returns the new model (a bare BatchNorm is itself
# replaced, so keep the return value). The docs say to convert "before wrapping Network with
# DDP", and that SyncBatchNorm "only supports DDP with single GPU per process"; the CPU is
# refused. Where exactly, on CPU with gloo:

# %%
cpu = run_ranks(bf.syncbatchnorm_on_cpu, 2)[0]
print("convert_sync_batchnorm on CPU works:", cpu["converted to"])
for call in ("DDP(model)", "model(x), training mode", "model(x), eval mode"):
    print(f"{call:<24}", bf.describe_error(cpu[call]) if cpu[call] else "ok")

# %% [markdown]
# Two separate refusals: the **DDP constructor** raises
# `ValueError: SyncBatchNorm layers only work with GPU modules`
# (`_ddp_init_helper` > `_passing_sync_batchnorm_handle`,
# [L2453](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L2453-L2460)),
# and even without DDP a **training-mode forward** raises
# `ValueError: SyncBatchNorm expected input tensor to be on GPU or XPU or privateuseone`
# (`SyncBatchNorm.forward`, when a process group is initialised,
# [batchnorm.py L836-L855](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/modules/batchnorm.py#L836-L855)).
# An eval-mode forward works on CPU: in `eval()` SyncBatchNorm falls back to plain `batch_norm`
# with the running statistics, no communication.
#
# What SyncBatchNorm changes, measured: one training forward of a DDP BatchNorm, each rank on its
# 4-sample slice of an 8-sample global batch, compared with one process's `nn.BatchNorm1d` on the
# whole batch (its output rows for this rank, its running statistics) and on the rank's slice
# alone. Plain BatchNorm runs here on CPU; SyncBatchNorm runs when there are two GPUs (NCCL, one
# GPU per rank), the same function with `sync=True`:

# %%
def show(per_rank, label):
    for rank, r in enumerate(per_rank):
        print(f"{label:<14} rank {rank}:", {ref: {k: f"{v:.2g}" for k, v in gaps.items()}
                                           for ref, gaps in r.items()})

show(run_ranks(bf.batchnorm_over_ranks, 2, False), "BatchNorm")
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
if gpus >= 2:
    synced = run_ranks(bf.batchnorm_over_ranks, 2, True, backend="nccl")
    show(synced, "SyncBatchNorm")
    print("checks:", bf.check_batchnorm_over_ranks(True, synced) or "all passed")
else:
    print(f"SyncBatchNorm: skipped: needs NCCL and one GPU per rank, {gpus} GPU(s) here")

# %% [markdown]
# Plain BatchNorm under DDP equals one process's BatchNorm *on the rank's own slice* (gap 0) and
# is far from the whole-batch result; SyncBatchNorm (on GPUs; `tests/test_chapter_07_buffers_and_seeds.py`
# checks it there) equals one process's BatchNorm on the whole global batch: output, running mean
# and running variance. Its running statistics are therefore also the same on every rank after
# every training forward, so the default buffer broadcast has nothing left to correct.
#
# **Buffers, in short.**
# * DDP broadcasts rank 0's buffers in the constructor and at the start of each forward whose
#   previous forward ran with gradients enabled outside `no_sync()` (counted: the first of an
#   evaluation does, the next ones and the first training forward after it do not; in an
#   accumulation window only the first micro-batch). It never averages them. Rank 0's BatchNorm
#   statistics come from rank 0's data alone.
# * `broadcast_buffers=False` (deprecated in 2.13) also skips the constructor's broadcast;
#   `forward_sync_buffers=False` skips only the forward's.
# * Reassigning a registered buffer is fine in torch 2.13; a plain tensor attribute, a buffer
#   added to a buffer-less model after wrapping, and a parameter replaced after wrapping are not.
# * For BatchNorm statistics over the global batch: `SyncBatchNorm`, GPU only, converted before
#   `DDP(...)`. Averaging per-rank running statistics gives the global mean, not the variance.

# %% [markdown]
# ## Seeds: equal where DDP does not equalise, different where randomness should differ
#
# **The problem.** Every rank is its own Python process with its own random number generators.
# Should they be seeded alike or differently? "Seed everything with the same seed" is a common
# recipe; the source article says that for a reproducible, stable run "the random seeds across
# nodes, the data sharding and the gradient reduction must be strictly identical"
# (跨节点的随机种子、数据分片、梯度归约必须严格一致, section 1). For the seeds that is half right.
#
# **The idea.** DDP makes exactly one thing equal: the module it wraps (parameters and buffers
# broadcast from rank 0 in the constructor; gradients averaged at every backward). So:
#
# * **must be equal**: whatever random state *outside* the wrapper has to be the same on every
#   rank: a copy of the model taken before `DDP(...)`, a fixed random tensor that is not part of
#   the wrapped module, the `seed` of `DistributedSampler`; and the model's own initialisation
#   only if you turn the constructor's broadcast off (`init_sync=False`);
# * **should differ**: per-sample randomness (dropout masks, data augmentation), or the ranks
#   draw the same random numbers for different samples;
# * **drifts apart silently**: learnable state outside the wrapper updated from the rank's data.
#
# Unseeded, the ranks already differ: torchrun seeds nothing, and each fresh process starts
# `torch`'s generator from a different `torch.initial_seed()` (the script prints them; `run_ranks`
# gives every rank a fresh random seed too, unless you pass `seed=`). It is the "same seed
# everywhere" line that makes them equal.
#
# Script: `seeds_and_replicas.py` (`torchrun --standalone --nproc_per_node 2
# chapters/07_training_loop/seeds_and_replicas.py`; it checks every claim of this section).

# %%
import seeds_and_replicas as sr

# %% [markdown]
# ### What DDP makes equal, and what it leaves alone
#
# Each rank seeds (`0` everywhere, or `0 + rank`), builds a small model, copies it as a
# "teacher" *before* wrapping, draws a random `4 x 4` projection kept as a plain tensor, then calls
# `DDP(model)`. The numbers are the largest difference between any rank and rank 0 (0: equal
# everywhere):

# %%
for seeding, init_sync in (("same seed", True), ("seed + rank", True), ("seed + rank", False)):
    spread = run_ranks(sr.made_before_ddp, 2, seeding, init_sync)[0]
    print(f"{seeding:<12} init_sync={init_sync!s:<5}",
          "  ".join(f"{name}: {value:.3g}" for name, value in spread.items()))

# %% [markdown]
# With different seeds the wrapped model is equal anyway: the constructor broadcast rank 0's
# parameters and buffers (`_sync_module_states`, see the buffers section). Seeding the model's
# initialisation alike is needed only with `DDP(..., init_sync=False)`, whose docstring warns
# that "the user is required to ensure themselves that the weights are the same on all ranks".
# Everything made beside the wrapper keeps its rank's values: a teacher deep-copied before
# `DDP(...)` starts different on every rank, and so does any random tensor that is not in the
# wrapped module. Copy a teacher *after* wrapping (`copy.deepcopy(ddp_model.module)`), or seed
# alike.
#
# ### The sampler's seed must be equal
#
# `DistributedSampler` shuffles the whole index list with `seed + epoch` on every rank, then rank
# r takes every W-th index from position r (chapter 06). That gives disjoint shards only if every
# rank shuffled *the same way*. Passing a rank-dependent seed (`seed=args.seed + rank`, a
# "seed everything per rank" helper's value) breaks it:

# %%
for seeds in ([0, 0], [0, 1]):
    small = sr.sampler_shards(12, seeds)
    big = sr.sampler_shards(100, seeds)
    print(f"seeds {seeds}: shards of 12 samples {small['shards']}")
    print(f"{'':14}of 100 samples: {big['on two ranks or more']} on both ranks, "
          f"{big['on no rank']} on none")

# %% [markdown]
# With seeds `[0, 1]` about a quarter of the samples is trained on twice per epoch and another
# quarter never (for two ranks: each rank takes half of its own permutation, so a sample is in
# both halves, or in neither, with probability about 1/4 each). Keep the sampler's `seed` the same on every rank
# (its default is 0) and vary `set_epoch(epoch)` instead.
#
# ### Dropout and augmentation should differ between ranks
#
# Each rank seeds, then trains four steps of a DDP model whose last layer is `Dropout(0.5)`
# (the identity before it, so an output of zero is a dropped unit), drawing a crop offset and a
# flip per step as a random augmentation would. Dropout draws from the rank's global `torch`
# generator, like any other code in the rank.

# %%
draws = {seeding: run_ranks(sr.random_draws, 2, seeding) for seeding in sr.SEEDINGS}
fig, axes = plt.subplots(1, 4, figsize=(11, 2.2))
for column, (seeding, rank) in enumerate((s, r) for s in sr.SEEDINGS for r in range(2)):
    axes[column].imshow(draws[seeding][rank]["dropout masks"], cmap="Greys", vmin=0, vmax=1)
    axes[column].set_title(f"{seeding}, rank {rank}", fontsize=9)
    axes[column].set_xlabel("unit (black: kept)", fontsize=8)
    axes[column].set_ylabel("step", fontsize=8)
plt.tight_layout()
plt.show()
for seeding in sr.SEEDINGS:
    print(f"{seeding:<12} augmentation (crop, flip) per step:",
          "  ".join(f"rank {r}: {d['augmentation']}" for r, d in enumerate(draws[seeding])))

# %% [markdown]
# With the same seed, both ranks drop **the same units at every step** and draw the same crops
# and flips, for different samples. Nothing crashes and nothing is wrong per rank, but the W
# ranks' noise is one noise repeated: the averaged gradient is not averaged over W independent
# masks or augmentations, so the randomness of a bigger batch is wasted. `seed + rank` gives each
# rank its own stream, and it is still reproducible: the script runs every seeding twice and
# checks the draws repeat. For DataLoader workers the same holds one level down: each worker is
# seeded from the rank's generator (chapter 06, `workers_and_ranks.py`).
#
# The recipe: one seed for what must be equal, `seed + rank` for the rest.
#
# ```python
# torch.manual_seed(seed)                 # model init (and anything made before DDP) alike
# model = DDP(Net().to(device), device_ids=[local_rank])
# teacher = copy.deepcopy(model.module)   # after wrapping: a copy of rank 0's weights
# sampler = DistributedSampler(dataset, seed=seed)  # same seed on every rank
# torch.manual_seed(seed + rank)          # from here on: dropout, augmentation differ per rank
# ```
#
# ### A learnable module outside the wrapper drifts apart, silently
#
# Two trainings, 30 steps, every rank on its own batches, the same seed everywhere. In the first,
# only the backbone is wrapped and a projection head sits beside it, trained by the same
# optimizer:
#
# ```python
# model = DDP(backbone)
# optimizer = SGD([*model.parameters(), *head.parameters()], lr=0.1)
# loss = cross_entropy(head(model(x)), y)      # head's gradient: this rank's only
# ```
#
# In the second, backbone and head are one DDP model, and three EMA "teachers" follow the student
# after every step: an EMA of the student's parameters only; an EMA over its whole `state_dict()`
# (parameters *and* BatchNorm buffers, as many EMA helpers do); and the latter with the teacher's
# buffers averaged over the ranks after each update. After every step: the largest difference of
# each from rank 0's copy.

# %%
curves = run_ranks(sr.drift_curves, 2, 30)[0]
fig, ax = plt.subplots(figsize=(8, 3.4))
for name, curve in curves.items():
    ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=2 if max(curve) else 1,
            linestyle="-" if max(curve) else "--")
ax.set_xlabel("step")
ax.set_ylabel("max |rank r - rank 0|")
ax.set_title("state that DDP does not keep equal drifts apart")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for name, curve in curves.items():
    print(f"{name:<48} after step 1: {curve[0]:.3g}   largest: {max(curve):.3g}")

# %% [markdown]
# * **Head outside DDP**: its gradients are never all-reduced, so every rank steps its own head
#   with its own data's gradient; the heads differ from the first step and grow apart. No error,
#   no warning. The backbone stays bitwise equal (its
#   gradients *are* averaged), but it is trained through W different heads. **Fix**: put
#   everything that learns into the one module you wrap
#   (`DDP(nn.Sequential(backbone, head))`, or a model class that owns both): 0.0 at every step.
#   The same goes for a loss with learnable parameters, a discriminator, a learned temperature:
#   wrap them (a separate `DDP(...)` of their own is fine) or all-reduce their gradients
#   yourself.
# * **EMA of the parameters**: exactly 0.0 at every step, with no communication. The teacher is
#   computed from replicated weights (equal after every step) by the same operations on every
#   rank, so it stays equal, provided it *starts* equal: copied after `DDP(...)`, as here.
# * **EMA over the `state_dict()`**: it drifts. The student's BatchNorm buffers are equal only
#   at the start of a forward; right after it each rank holds its own batch's update (the buffers
#   section), and that is when the EMA reads them. **Fix**: average (or broadcast) the teacher's
#   buffers after each update, as in the third teacher: 0.0; or keep an EMA of the parameters only.
#   A teacher that runs its own forwards in training mode on the rank's data (updating its own
#   BatchNorm statistics, or a "center" as in DINO, whose `DINOLoss.update_center` in
#   facebookresearch/dino's `main_dino.py` all-reduces the batch center for this reason) needs the
#   same treatment.
#
# **Where the source article is wrong.** "The random seeds across nodes must be strictly
# identical" is not a rule of DDP: identical seeds are needed only for what DDP does not
# synchronise and must be equal (copies made before wrapping, state outside the wrapper, the
# sampler's seed, the init with `init_sync=False`), and harmful for per-sample randomness,
# which should differ per rank. Its one true seed remark, that `set_epoch(epoch)` must be called
# every epoch or the shuffle repeats, is checked in chapter 06.
#
# **Seeds, in short.**
# * DDP equalises the wrapped module at construction; different init seeds are harmless there.
# * Equal on every rank: copies and tensors made outside the wrapper, `DistributedSampler`'s seed
#   (different seeds: overlapping and missing samples).
# * Different per rank (`seed + rank`): dropout, augmentation.
# * Everything that learns goes inside the DDP module; an EMA of DDP parameters stays equal, an
#   EMA of buffers does not unless you average them.

# %% [markdown]
# ## The loss: what DDP averages, what it never touches, and how to log it
#
# **The problem.** In a DDP loop every rank computes `loss = loss_fn(model(x), y)` on its own
# batch and calls `loss.backward()`. Which loss is that, what does DDP do with it, and what should
# rank 0 write to the log?
#
# **The idea.** DDP never sees the loss. Its reducer hooks into the *parameters*: when a
# parameter's gradient is ready its autograd hook divides it by the world size W while copying
# it into its bucket, and each full bucket is all-reduced with SUM: the average
# (`Reducer::mark_variable_ready_dense`, chapter 04;
# [DDP notes](https://docs.pytorch.org/docs/stable/notes/ddp.html)). The loss tensor stays on
# its rank, unchanged. Everything in this section follows from that.
#
# Script: `loss_and_logging.py` (`torchrun --standalone --nproc_per_node 2
# chapters/07_training_loop/loss_and_logging.py`; it checks each claim below).

# %%
from ddpcourse.toys import make_model

import loss_and_logging as ll

# %% [markdown]
# ### Each rank's loss is its own; the gradients are shared
#
# One DDP forward and backward, each rank on its own 4 samples:

# %%
result = run_ranks(ll.own_loss_shared_gradient, 2)[0]
print("loss on each rank:           ", result["loss on each rank"])
print("gradient spread across ranks:", result["gradient spread across ranks"])

# %% [markdown]
# The gradients are identical on both ranks (spread 0.0: the all-reduce), the losses are not. So
# `print(loss.item())` on rank 0 prints the loss of rank 0's batch, a 1/W sample of the step. With
# equal batch sizes and a mean loss, the step's gradient is the gradient of the *mean of the
# ranks' losses*; to log that number you have to all-reduce the losses yourself (below).
#
# ### "The loss must be a scalar, or DDP won't know what to sync": wrong
#
# The source article (section 4.3, its "iron rule two") says:
# "loss必须是标量。model(batch)返回的是tensor.mean()或.sum()必不可少。否则DDP不知道同步哪个值。"
# (the loss must be a scalar; model(batch) returns a tensor, `.mean()` or `.sum()` is
# indispensable, otherwise DDP does not know which value to synchronise). The rule exists, but it
# is autograd's, and it has nothing to do with DDP. No process group, no DDP:

# %%
per_sample = make_model(0)(torch.randn(4, 8)).squeeze(1)  # 4 values, one per sample
try:
    per_sample.backward()
except RuntimeError as error:
    print("RuntimeError:", error)

# %% [markdown]
# `backward()` without arguments needs a starting gradient d(output)/d(output); autograd can only
# make one up (the number 1.0) for a single number. The error comes from `_make_grads` in
# [torch/autograd/\_\_init\_\_.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/autograd/__init__.py#L209),
# before any gradient exists. Give autograd that starting gradient and a vector loss trains under
# DDP like any other. `ll.non_scalar_backward` does the backward of a per-sample loss vector on a
# plain model, on DDP, and on DDP with `gradient=` 1/n for each sample (the gradient of `.mean()`):

# %%
for name, value in run_ranks(ll.non_scalar_backward, 2)[0].items():
    print(f"{name}: {value}")

# %% [markdown]
# Same error with and without DDP; with an explicit gradient, DDP all-reduces once, the ranks'
# gradients are equal, and they equal those of `.mean().backward()` exactly. DDP never
# synchronises a "value" of the loss; it synchronises parameter gradients, however the backward
# was started.
#
# ### `reduction="sum"` and DDP's average: gradients W times too small
#
# The article treats `.mean()` and `.sum()` as interchangeable. Under DDP they are not
# interchangeable with a single process either way. DDP divides by W (without a hook the reducer
# multiplies each gradient by 1/W as it enters the bucket, then sums; the documented
# `allreduce_hook` does `tensor.div_(group_to_use.size())` before its SUM all-reduce,
# [default_hooks.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py#L18-L32)).
# Averaging per-rank *means* over equal shards gives the global mean's gradient; averaging
# per-rank *sums* gives 1/W of the global sum's. "Too small" needs a baseline, and there are
# two: against **one process summing the same global batch** the DDP gradient is **W times too
# small** (this heading, measured below); against **one process summing a single rank's
# batch** (the loss you would write on one GPU with the per-rank batch size) it is of the same
# scale, since each rank's summed gradient grows with its own rows and DDP averages those:

# %%
for world_size in (2, 3):
    print(f"W = {world_size}")
    for name, value in run_ranks(ll.summed_loss, world_size)[0].items():
        print(f"    {name}: {value}")

# %% [markdown]
# Two kinds of figure. The first two lines are **per-element ratios** (min, max over the nonzero
# gradient entries): exactly W when the single process adds the shards' sums in DDP's order on 2
# ranks (2.0, 2.0: halving is exact), and otherwise W to within a few parts in 1e5 (3.4e-5 at
# most here, on 3 ranks), because a small entry is the difference of larger terms and its
# rounding is large against it. The third
# line compares **whole vectors**: the largest error of W x DDP's sum, relative to the largest
# gradient entry, about 1e-7, which is float32 rounding (machine epsilon 1.2e-7). If you mean a global sum, multiply each rank's loss by W (or
# raise the learning rate by W). A summed loss is also proportional to the batch size, so it
# changes with the number of ranks and with uneven last batches; a mean loss does not.
#
# ### Logging a global metric: sums and counts, not the mean of means
#
# The last batch of an epoch, an unpadded evaluation split, `Join` with uneven inputs (chapter
# 06): shards often have different sizes. `ll.global_metrics` evaluates a fixed 3-class model on
# 12 samples split 9 / 3, four ways: rank 0's own numbers, the all-reduced mean of the ranks'
# means, all-reduced sums and counts divided at the end, and one process reading the same batches.

# %%
metrics = run_ranks(ll.global_metrics, 2)[0]
ways = [k for k in metrics if k != "shard sizes"]
for way in ways:
    print(f"{way:<30} loss {metrics[way][0]:.10f}  accuracy {metrics[way][1]:.6f}")

fig, axes = plt.subplots(1, 2, figsize=(10, 3))
for i, (ax, what) in enumerate(zip(axes, ("mean loss", "accuracy"))):
    values = [metrics[way][i] for way in ways]
    ax.barh(ways, values, color=["tab:gray", "tab:red", "tab:green", "tab:blue"])
    ax.set_xlim(min(values) * 0.97, max(values) * 1.01)
    ax.set_title(f"{what}, shards of {metrics['shard sizes']}")
    ax.invert_yaxis()
axes[1].set_yticks([])
plt.tight_layout()
plt.show()

# %% [markdown]
# The mean of means gives each of rank 1's 3 samples three times the weight of one of rank 0's 9:
# its accuracy is off (0.389 instead of 0.417 here). Sums and counts give the accuracy *exactly*
# (integer counts; all-reduce them in float64 or int64 so nothing rounds) and the loss to the last
# float64 bit here. The reference reads the same batches: a float32 forward of 12 rows and one of
# 9 + 3 rows differ in their last bits (measured about 1e-8 relative), which is the model's
# arithmetic, not the logging's. With equal shards the mean of means is right too:

# %%
even = run_ranks(ll.global_metrics, 2, [6, 6])[0]
print("mean of per-rank means:", even["mean of per-rank means"])
print("single process:        ", even["single process"])

# %% [markdown]
# The rule behind it, the one chapter 06's evaluation follows: a mean over shards of different
# sizes is a ratio of global totals, so all-reduce the totals (what is summed and what is
# counted), never the ratios, and divide afterwards; keep counts in float64 or int64 so that
# nothing rounds. Every rank must call the all-reduce, so log on rank 0 after it. Reducing with
# `ReduceOp.AVG` instead of `SUM` does not help: it averages the ranks' means the same way.

# %% [markdown]
# ## Gradient accumulation: `no_sync()` around the forward *and* the backward
#
# **The problem.** The batch you want does not fit in memory; you can afford micro-batches of a
# quarter of it. Gradient accumulation runs k micro-batches forward and backward, lets their
# gradients add up in `.grad`, and steps the optimizer once. Under DDP every backward ends in an
# all-reduce of the gradients, so a naive loop communicates k times per optimizer step, although
# only the sum of the k gradients is ever used.
#
# **The idea.** `DistributedDataParallel.no_sync()` is a context manager in which backwards do
# not all-reduce; the gradients accumulate locally, and the next synchronised backward all-reduces
# everything accumulated so far ([docs](https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync)).
# So: k - 1 micro-batches under `no_sync()`, the k-th without it, then the step. Three details
# decide whether that is right: what `no_sync()` must wrap, on which micro-batch to sync and step,
# and how to scale the loss.
#
# Script: `accumulation.py` (run it with
# `torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/accumulation.py`; it checks
# every claim of this section and exits non-zero if one fails). Every all-reduce below is counted
# by a communication hook, `acc.counting_allreduce_hook`: registered with
# `register_comm_hook`, DDP hands it each gradient bucket; it notes the bucket's size and dtype
# and then averages it with `allreduce_hook` from
# [default_hooks.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py#L35-L55).
# The toy model has 1377 parameters, one bucket: one call is one synchronisation.

# %%
from ddpcourse.toys import flat_parameters

import accumulation as acc

print(acc.counting_allreduce_hook.__doc__)

# %% [markdown]
# ### Where `no_sync()` goes
#
# One micro-batch per rank, three placements: the forward and the backward inside `no_sync()`;
# only the backward inside (the loss was computed before entering); no `no_sync()` at all.

# %%
for placement in acc.PLACEMENTS:
    result = run_ranks(acc.syncs_by_placement, 2, placement)[0]
    print(f"{placement:<21} all-reduce calls: {result['all-reduce calls']}, "
          f"require_backward_grad_sync when the forward ran: "
          f"{result['require_backward_grad_sync at forward']!s:<5}, "
          f"gradient spread across ranks: {result['gradient spread across ranks']:.3g}")

# %% [markdown]
# Wrapping only the backward changes nothing: one all-reduce, and the gradients are equal on both
# ranks, exactly as without `no_sync()`. The reason is in
# [torch/nn/parallel/distributed.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1659-L1685).
# `no_sync()` does nothing but flip a flag for the duration of the block:
#
# ```python
# old_require_backward_grad_sync = self.require_backward_grad_sync
# self.require_backward_grad_sync = False
# try:
#     yield
# finally:
#     self.require_backward_grad_sync = old_require_backward_grad_sync
# ```
#
# and that flag is read by the **forward**. `_pre_forward` calls
# `self.reducer.prepare_for_forward()` only
# `if torch.is_grad_enabled() and self.require_backward_grad_sync`
# ([L1754](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1754-L1758)),
# and `_post_forward`, under the same condition, calls `self.reducer.prepare_for_backward(...)`
# ([L1828-L1840](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1828-L1840)).
# `Reducer::prepare_for_backward` sets `expect_autograd_hooks_ = true`, and the reducer's
# per-parameter `autograd_hook` returns at once when it is false
# ([reducer.cpp](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp)).
# So the decision "this backward all-reduces" is taken when the forward runs; the backward only
# carries it out. `no_sync`'s own docstring says it too: "The forward pass should be included
# inside the context manager, or else gradients will still be synchronized."
#
# ### One optimizer step from two micro-batches
#
# Here is the idea in its smallest form, unrolled: one optimizer step from k = 2 micro-batches per
# rank (rank r takes every W-th of a shared list), the first kept local, the second
# synchronised:

# %%
def one_accumulated_step(rank, world_size):
    model, log = acc.counted_ddp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (x1, y1), (x2, y2) = acc.micro_batches(2 * world_size)[rank::world_size]
    with model.no_sync():                      # micro-batch 1: forward AND backward inside,
        (acc.MSE(model(x1), y1) / 2).backward()  # so its gradient stays on this rank
    (acc.MSE(model(x2), y2) / 2).backward()      # micro-batch 2: all-reduces the sum of both
    optimizer.step()
    optimizer.zero_grad()
    return {"all-reduce calls": log.calls,
            "parameter spread across ranks": acc.spread_across_ranks(flat_parameters(model.module))}

print(run_ranks(one_accumulated_step, 2)[0])

# %% [markdown]
# Two micro-batches, one optimizer step, **one** all-reduce, and replicas that are still
# identical. Three things in it matter:
#
# * `/ 2`, the number of micro-batches in the step: `.grad` *adds* the backwards. Dividing each
#   micro-batch's (mean) loss by their number makes the sum the mean gradient over them, what one
#   batch that many times larger would give.
# * `zero_grad()` once per optimizer step. Zeroing between micro-batches throws away what was
#   accumulated.
# * The step comes right after the synchronised backward, which all-reduced everything the
#   `no_sync()` backwards had accumulated.
#
# A real loop does this over a whole list of micro-batches: groups of k, the right micro-batch of
# each group synchronised, a last group that may be shorter than k, and a loss to log that is the
# same on every rank. That loop is the exercise `train_steps` (end of the chapter); the
# experiments below show what goes wrong when one of those decisions is off.
#
# ### Off by one: the replicas drift apart, and nothing says so
#
# `acc.accumulate(rank, W, sync_on, step_on)` is the same training with the sync and the step on
# a chosen micro-batch of each group of k = 4: the last (right), or the first, which is what a test
# like `if i % k == 0` gives. `acc.all_variants` runs five variants and measures, after every
# micro-batch, the largest difference between the ranks' parameters.

# %%
variants = run_ranks(acc.all_variants, 2)[0]
fig, ax = plt.subplots(figsize=(9, 3.6))
for (name, result), marker in zip(variants.items(), "os^vx"):
    ax.plot(result["parameter spread after each micro-batch"], marker=marker, label=name)
    print(f"{name:<48} all-reduces {result['all-reduce calls']:>2}, steps "
          f"{result['optimizer steps']}, off the correct run by "
          f"{result['max |difference| from the correct run']:.3g}")
ax.set_xlabel("micro-batch (k = 4: steps after 3, 7, 11 when stepping on the last)")
ax.set_ylabel("max |rank 1 - rank 0| of the parameters")
ax.set_title("Replicas after each micro-batch, 2 ranks")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# * **Sync on the first, step on the last.** The first micro-batch's backward all-reduces (only
#   its own gradient), the next three accumulate locally, and the step uses gradients that differ
#   from rank to rank. The replicas diverge at the first step and never meet again: DDP
#   all-reduces gradients; after the constructor's broadcast it never compares or re-sends
#   parameters. No error, no warning; the loss still goes down on each rank.
# * **Sync on the last, step on the first.** The step after micro-batch 0 uses its unsynchronised
#   gradient: diverged from the very first step.
# * **Sync and step on the first.** The replicas stay equal (every step follows a sync that
#   gathered everything accumulated), but the groups are {0}, {1, 2, 3, 4}, {5, ..., 8} and the
#   last three micro-batches are never used: equal replicas, wrong training.
# * **No `no_sync()`.** Same parameters as the correct loop up to rounding (it re-averages
#   already-averaged partial sums), and 12 all-reduces instead of 3.
#
# A check that catches drift in your own loop: every few hundred steps, compare a checksum of
# the parameters across ranks (`acc.spread_across_ranks(flat_parameters(model.module))` does it
# with an `all_gather`).
#
# ### 1 process × k micro-batches = k ranks × 1 micro-batch
#
# With the loss divided by k, accumulation on one process and DDP on k ranks compute the same
# thing: the mean of k micro-batch gradients. `acc.one_process_vs_ranks` trains both (and a third
# model on one batch of all k micro-batches) for three SGD steps, in every rank, on the same data:

# %%
for world_size in (2, 3):
    result = run_ranks(acc.one_process_vs_ranks, world_size)[0]
    print(f"W = k = {world_size}:")
    for name, value in result.items():
        print(f"    {name}: {value}")
    print(f"    4 units in the last place at max |parameter|: "
          f"{acc.ulp_tolerance(result['max |parameter|']):.3g}")

# %% [markdown]
# On 2 ranks the two trainings are equal **bit for bit**: dividing a loss by 2 scales every
# gradient by exactly 1/2, and a sum of two numbers is the same in any order. On 3 ranks they
# differ by one unit in the last place of float32 (3e-8 at parameters of size 0.35): dividing by
# 3 rounds, and gloo adds three numbers in its own order (the tests in
# `tests/test_chapter_07_accumulation_loss_precision.py` measure 3 and 4 ranks and allow 4 units).
# One batch of k·b samples differs by rounding too: the mean over 8 samples is computed in another
# order than the mean of two means of 4. Without the division by k the accumulated gradient is
# exactly k times DDP's (ratio 2.0 on 2 ranks): the same as multiplying the learning rate by k.
#
# ### Gradient clipping in an accumulation window
#
# `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` scales the gradients down when
# their total norm exceeds `max_norm`. Under DDP, *when* you call it decides *which* gradient it
# measures. After the synchronised backward every rank holds the averaged gradient: the same
# norm everywhere, the norm one process would compute on the global batch. Inside `no_sync()`
# each rank holds only its own partial sum. `acc.clipping` trains k = 2 micro-batches per step
# on 2 ranks with `max_norm=0.01` (so every step clips), clipping either after the synced
# backward or after every backward, and compares with one process that accumulates all the
# step's micro-batches and clips once:

# %%
clip_runs = {where: run_ranks(acc.clipping, 2, where) for where in acc.CLIPPINGS}
for where, per_rank in clip_runs.items():
    print(f"clip {where:<42} norm clipped at step 1, per rank: "
          f"{[round(r['first norm clipped, this rank'], 4) for r in per_rank]}, one process: "
          f"{per_rank[0]['first norm clipped, one process']:.4f}; replicas apart by "
          f"{per_rank[0]['parameter spread across ranks']:.3g}; off one process by "
          f"{per_rank[0]['max |DDP - one process|']:.3g}")
print("checks:", acc.check_clipping(clip_runs) or "all passed")

# %% [markdown]
# Clipped after the sync, both ranks see one process's norm and end where it ends, up to float32
# rounding. Clipped inside the window, each rank measures its own partial gradient (two
# different norms, neither the global one), scales it by its own factor, and the sync then
# averages what each rank clipped: the replicas stay equal (nothing warns), but the training is
# no longer the global batch's. Clip once per optimizer step, after the synchronised backward
# and before `optimizer.step()` (with a `GradScaler`, after `scaler.unscale_(optimizer)`).
#
# ### `gradient_as_bucket_view=True` in an accumulation window
#
# By default DDP keeps the gradients twice: in each parameter's `.grad` and in its flat
# communication buckets. `DDP(..., gradient_as_bucket_view=True)` makes every `.grad` a view into
# its bucket, saving that copy (the constructor's docstring). Does that hold inside `no_sync()`,
# where the reducer does not run? `acc.bucket_views` records, after every micro-batch's backward
# (k = 4, three steps), whether every `.grad` lives in the storage of the bucket DDP all-reduced
# (`B`) or elsewhere (`.`), for both ways of clearing the gradients, and compares the trained
# parameters with `gradient_as_bucket_view=False`:

# %%
for set_to_none in (True, False):
    r = run_ranks(acc.bucket_views, 2, set_to_none)[0]
    marks = "".join("B" if b else "." for b in r["grads in the bucket after each micro-batch"])
    print(f"zero_grad(set_to_none={set_to_none!s:<5}): {marks}   same parameters as without "
          f"bucket views: {r['same parameters as without bucket views']}")

# %% [markdown]
# The numbers are the same either way. The memory is not: after `zero_grad()` with its default
# `set_to_none=True` the gradients are gone, the first backward of the next window runs under
# `no_sync()` without the reducer and allocates fresh `.grad` tensors, and only the synchronised
# backward copies them into the bucket and makes them views again (`...B` in every window):
# inside the window the gradients exist twice, as without the option. With
# `optimizer.zero_grad(set_to_none=False)` the gradients are zeroed in place and stay bucket
# views from the first sync on. So with accumulation and `gradient_as_bucket_view=True`, zero
# the gradients with `set_to_none=False` to keep the saving.
#
# **The source article on accumulation** (section 6.3): "gradient_accumulation_steps: 当单卡batch
# 受限时用梯度累积模拟大batch，但会增加通信次数" (when the per-GPU batch is limited, accumulation
# simulates a large batch, but it increases the number of communications). It increases them only
# in a loop without `no_sync()` (or with `no_sync()` around the backward alone): 12 all-reduces
# for 3 steps above. With `no_sync()` around forward and backward there is one all-reduce per
# optimizer step, as many as the large batch would need, and k times fewer per sample than
# training on the micro-batches without accumulation.
#
# **Pitfalls, in short.** `no_sync()` must contain the forward. Sync and step on the same, last
# micro-batch of a group. Divide the loss by k. Zero the gradients after the step. Drifting
# replicas raise nothing: compare parameters across ranks when in doubt. The experiments above
# use groups of exactly k micro-batches; a list of micro-batches that does not divide into them
# leaves one more decision (the exercise `train_steps`).

# %% [markdown]
# ## Mixed precision under DDP: autocast, GradScaler, and the bytes on the wire
#
# **The problem.** Half-precision arithmetic (float16 or bfloat16) is faster on GPUs that have
# tensor cores and halves the memory of activations. Training entirely in half precision loses
# accuracy, so *mixed* precision runs selected operations (matmuls, convolutions) in the low
# dtype and keeps the rest, and the parameters, in float32. What changes when DDP is in the loop?
#
# **The idea.** Very little, and not what the source article says. Its section 6.3: "torch.cuda.
# amp.autocast()混合精度与DDP天然契合，AllReduce在FP16下通信量减半，实测提速14%，且GradScaler能自动
# 处理梯度下溢" (autocast fits DDP naturally, the all-reduce volume halves in FP16, measured 14%
# faster, and GradScaler handles gradient underflow automatically). Below: the spelling it uses is
# deprecated; GradScaler is for float16 and not needed for bfloat16; and the all-reduce volume does
# **not** halve, because gradients stay float32, unless you register a compression hook. (The 14%
# is the article's own measurement; nothing here can check it.)
#
# Script: `mixed_precision.py` (`torchrun --standalone --nproc_per_node 2
# chapters/07_training_loop/mixed_precision.py`). On CPU it uses bfloat16 autocast, and runs the
# float16 + GradScaler part on the CPU, which torch 2.13 supports; with one GPU per rank (NCCL)
# the same functions run on the GPUs with float16 autocast. Docs:
# [torch.amp](https://docs.pytorch.org/docs/stable/amp.html),
# [AMP examples](https://docs.pytorch.org/docs/stable/notes/amp_examples.html),
# [DDP communication hooks](https://docs.pytorch.org/docs/stable/ddp_comm_hooks.html).

# %%
import mixed_precision as mp

# %% [markdown]
# ### The spelling: `torch.autocast(device_type, ...)` and `torch.amp.GradScaler(device_type)`
#
# `torch.cuda.amp.autocast()` and `torch.cuda.amp.GradScaler()` still exist, as deprecated
# wrappers: constructing one raises a `FutureWarning`
# ([autocast_mode.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/cuda/amp/autocast_mode.py#L13-L18),
# [grad_scaler.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/cuda/amp/grad_scaler.py#L18)),
# on any machine:

# %%
for spelling, messages in mp.deprecation_warnings().items():
    print(f"{spelling}: FutureWarning: {messages[0]}")

# %% [markdown]
# The current forms take the device type, so one loop serves CPU and GPU:
# `with torch.autocast(device.type, dtype=torch.bfloat16): loss = loss_fn(model(x), y)` and
# `scaler = torch.amp.GradScaler(device.type)`. Autocast wraps the forward and the loss, not the
# backward: the torch.amp docs advise against backward passes under autocast, since backward ops
# run in the dtype autocast chose for the matching forward ops anyway.
#
# ### float16 needs a GradScaler; bfloat16 does not

# %%
for name, numbers in mp.number_formats().items():
    print(f"{name:<9} max {numbers['max']:.3g}   smallest normal {numbers['smallest normal']:.3g}"
          f"   eps {numbers['eps']:.3g}")

# %% [markdown]
# float16 has more mantissa bits than bfloat16 (eps 1e-3 against 8e-3) but a tiny range: below
# 6e-5 numbers lose precision, and the smallest float16 above 0 is 6e-8; anything much smaller
# becomes 0. Gradients of activations are often that small. GradScaler multiplies the loss by a large factor (65536 to start) before `backward()`, so
# the low-precision gradients stay in range, and divides the float32 parameter gradients by it
# before the step; if any is inf or NaN it skips the step and halves the factor. bfloat16 has
# float32's exponent range: nothing underflows, and scaling has nothing to fix.
#
# `mp.small_loss_gradients` makes the gradients small on purpose (the loss times a factor from 1
# down to 1e-6), runs one backward under CPU autocast and compares with float32:

# %%
table = mp.gradient_error_table("cpu")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
for (name, rows), style in zip(table.items(), ("o-", "s--", "^-", "x:")):
    axes[0].loglog(mp.LOSS_FACTORS, [r["relative error"] for r in rows], style, label=name)
    axes[1].semilogx(mp.LOSS_FACTORS, [100 * r["zero fraction"] for r in rows], style, label=name)
axes[0].set_ylabel("relative error of the gradient")
axes[1].set_ylabel("% of gradient entries exactly 0")
for ax in axes:
    ax.set_xlabel("loss multiplied by")
    ax.invert_xaxis()
axes[0].legend(fontsize=8)
fig.suptitle("One backward under CPU autocast, against float32")
plt.tight_layout()
plt.show()

# %% [markdown]
# Unscaled float16 gets worse as the loss shrinks, until most gradient entries are exactly zero;
# with GradScaler its error stays at float16's rounding (about 5e-4) everywhere. bfloat16's error
# is larger (about 5e-3: fewer mantissa bits) but flat, and GradScaler leaves it unchanged. So: a
# GradScaler with float16, none with bfloat16.
#
# ### Gradients stay float32, and so does the all-reduce
#
# Autocast casts *inputs* of selected ops to the low dtype; the parameters remain float32, so do
# their `.grad`, and DDP's buckets are built from those. `mp.traffic_cases` runs one DDP step
# without autocast, with autocast, and with autocast plus float16 compression, and counts the
# all-reduce with a comm hook (for compression, the hook is wrapped in `fp16_compress_wrapper`,
# which casts each bucket to float16 before calling it):

# %%
traffic = run_ranks(mp.traffic_cases, 2)[0]
for name, result in traffic.items():
    print(f"{name:<36} output {result['output dtype']:<9} gradients {result['gradient dtypes']}"
          f"  all-reduced {result['all-reduced bytes']} bytes as {result['all-reduced dtypes']}")

fig, ax = plt.subplots(figsize=(7, 2.2))
ax.barh(list(traffic), [r["all-reduced bytes"] for r in traffic.values()],
        color=["tab:gray", "tab:orange", "tab:green"])
ax.set_xlabel("bytes all-reduced per step (1377 gradients)")
ax.invert_yaxis()
plt.tight_layout()
plt.show()

# %% [markdown]
# 1377 gradients × 4 bytes = 5508 bytes, with or without autocast; 2754 only with compression.
# The counting hook could in principle change what it counts, so here is the same measured without
# it, from the profiler (`gloo:all_reduce` events and their input dtype), for DDP's own all-reduce
# and for the real `fp16_compress_hook` and `bf16_compress_hook` of
# [default_hooks.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py#L96-L135):

# %%
for hook in (None, "fp16_compress_hook", "bf16_compress_hook"):
    print(f"{hook!s:<19}", run_ranks(mp.real_hook_traffic, 2, hook)[0])

# %% [markdown]
# DDP's own all-reduce sends `float` (float32) under autocast; `fp16_compress_hook` sends
# `c10::Half` (float16), half the bytes: it divides the bucket by W, casts it, all-reduces and
# casts back, so what the optimizer sees carries float16 rounding. **bfloat16 compression on
# gloo**: gloo in torch 2.13 all-reduces bfloat16 tensors fine, but `register_comm_hook` refuses
# `bf16_compress_hook` (and `bf16_compress_wrapper`'s hook) by name unless CUDA with NCCL ≥ 2.10,
# or XPU with XCCL, is present: `DistributedDataParallel._check_comm_hook`,
# [distributed.py L2485](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L2485-L2505).
# On CPU/gloo, float16 compression is the one that works.
#
# ### GradScaler with DDP: the replicas skip together
#
# Nothing DDP-specific is needed: scale, backward, `scaler.step(optimizer)`, `scaler.update()`.
# One thing is worth seeing. `mp.scaled_fp16_training` makes rank 0 alone overflow at step 0 (its
# loss × 1e6). The all-reduce adds rank 0's inf into every rank's gradient, so every rank's scaler
# finds it, skips the same step and halves the same scale:

# %%
for rank, history in enumerate(run_ranks(mp.scaled_fp16_training, 2)):
    steps = [(h["scale"], "stepped" if h["stepped"] else "skipped") for h in history]
    print(f"rank {rank}:", steps, "| parameter spread:",
          max(h["parameter spread across ranks"] for h in history))

# %% [markdown]
# ### On GPUs: float16 autocast and GradScaler with NCCL
#
# The same functions on one GPU per rank, with NCCL: autocast in float16 there. The cell runs
# where there are at least 2 GPUs and says why it is skipped elsewhere.

# %%
if torch.cuda.device_count() >= 2:
    gpu_traffic = run_ranks(mp.traffic_cases, 2, backend="nccl")[0]
    for name, result in gpu_traffic.items():
        print(f"{name:<36} all-reduced {result['all-reduced bytes']} bytes "
              f"as {result['all-reduced dtypes']}, gradients {result['gradient dtypes']}")
    print(run_ranks(mp.scaled_fp16_training, 2, backend="nccl")[0])
else:
    print(f"skipped: needs 2 CUDA GPUs (one per rank, NCCL); this machine has "
          f"{torch.cuda.device_count()}. The CPU cells above ran the same functions with gloo.")

# %% [markdown]
# **Pitfalls, in short.** Write `torch.autocast(device.type, dtype=...)` and
# `torch.amp.GradScaler(device.type)`, not the `torch.cuda.amp` spellings. Use a GradScaler with
# float16, none with bfloat16 (and bfloat16 on CPU). If you clip gradients, call
# `scaler.unscale_(optimizer)` first. Autocast does not make DDP send fewer bytes: the gradients
# are float32. A compression hook does (`fp16_compress_hook`; `bf16_compress_hook` only with NCCL
# or XCCL), at the price of rounding the averaged gradients to 16 bits.

# %% [markdown]
# ## `torch.compile` with DDP: a graph cut at the bucket boundaries, and either order works
#
# **The problem.** DDP is fast because it overlaps communication with the backward: a bucket of
# gradients is all-reduced as soon as its last gradient is ready, while the backward carries on
# with earlier layers (section 1). `torch.compile` with an AOTAutograd backend (`inductor`, the
# default, or `aot_eager`) traces the forward *and the backward* into graphs and runs each
# compiled backward as **one** autograd node. If the whole model were one graph, every gradient
# would become ready at the same moment, at the end of the backward, and every all-reduce would
# start after the last backward kernel: nothing left to overlap with.
#
# **The idea.** TorchDynamo's *DDP optimizer* cuts the forward graph where it expects DDP's
# buckets to end and compiles each piece on its own, so each piece's backward is a node of its
# own, and DDP's hooks fire between them
# ([DDP notes, "TorchDynamo DDPOptimizer"](https://docs.pytorch.org/docs/stable/notes/ddp.html#torchdynamo-ddpoptimizer),
# and the long comment "Note [DDPOptimizer]" in torch/_dynamo/backends/distributed.py).
# It is on by default: `torch._dynamo.config.optimize_ddp = True` (`False` turns it off,
# `"python_reducer"` is an experimental alternative that needs compiled autograd). How does
# dynamo know DDP is there? While DDP runs the wrapped module it records itself as the active DDP
# module (`_inside_ddp_forward`), and every frame dynamo compiles asks for it and, if there is
# one, hands the graph to `DDPOptimizer.compile_fn` with that module's `bucket_cap_mb`.
#
# Script: `compile_with_ddp.py` (`torchrun --standalone --nproc_per_node 2
# chapters/07_training_loop/compile_with_ddp.py`; its docstring links each of these places to
# its lines in torch 2.13's source). Its model is four 512 × 512 tanh layers and a
# small head, so each hidden layer holds exactly 1 MiB of float32 weights, which is what the cuts
# are measured in. Its backend is `aot_eager`: AOTAutograd's forward and backward graphs, run
# without generating code. That is everything the DDP optimizer depends on, and needs no C++
# compiler; `inductor` would generate and compile C++ kernels on the CPU first
# (`--backend inductor` runs the same checks with it).
#
# **How we see the pieces.** `torch.compile(backend=...)` accepts any callable that takes a
# `torch.fx.GraphModule` and example inputs and returns something to run: the documented way to
# write a backend ([custom backends](https://docs.pytorch.org/docs/stable/torch.compiler_custom_backends.html)).
# `compile_with_ddp.RecordingBackend` counts the `F.linear` calls in each graph it is handed, then
# passes the graph on to `aot_eager`. The DDP optimizer calls the backend once per piece, so the
# list it records *is* the split. Nothing private is read: only the graphs the backend receives.

# %%
import compile_with_ddp as cw

# %% [markdown]
# ### What the DDP optimizer does to the graph, and to the backward
#
# Four runs of 3 SGD steps on 2 ranks, `bucket_cap_mb=1`: eager DDP (the reference); compile,
# then wrap; wrap, then compile; and compile, then wrap with `optimize_ddp=False`. In the last
# backward of each compiled run, a hook before each compiled backward node writes "backward", and
# a comm hook writes "all-reduce" when DDP launches a bucket.

# %%
result = run_ranks(cw.measure, 2, timeout=180)[0]
print("\n".join(cw.report(result)))
print("problems:", cw.problems(result) or "none")

# %% [markdown]
# Read the timelines: with the DDP optimizer, after the backward of the last piece (the head and
# layer 3) DDP launches that bucket's all-reduce, then the backward of the next piece runs, and
# so on; three all-reduces are under way before the last piece's backward starts. Without it,
# there is one backward node, and every all-reduce comes after it. This is an order of events,
# the same on every run, not a timing: it says when an all-reduce *can* start. The picture, with
# the number of pieces for a few bucket caps:

# %%
def caps_sweep(rank, world_size, caps=(1, 2, 25)):
    """Linear layers per compiled piece, backend "eager" (the split does not depend on it)."""
    found = {f"{cap} MiB": cw.train_steps(rank, world_size, "compile, then DDP", cap,
                                          backend="eager", steps=1)["subgraphs"] for cap in caps}
    found["off"] = cw.train_steps(rank, world_size, "compile, then DDP", 25, optimize_ddp=False,
                                  backend="eager", steps=1)["subgraphs"]
    return found


sweep = run_ranks(caps_sweep, 1, timeout=120)[0]
sizes = cw.layer_bytes(cw.make_net())
for cap, pieces in sweep.items():
    predicted = "one graph" if cap == "off" else cw.predicted_subgraphs(sizes, int(cap.split()[0]))
    print(f"bucket_cap_mb {cap:>6}: Linear layers per piece {pieces}   predicted {predicted}")

fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [2, 1]})
colours = {"backward": "tab:blue", "all-reduce": "tab:orange"}
for row, name in enumerate(["compile, then DDP; optimize_ddp=False", "compile, then DDP"]):
    for i, event in enumerate(result["runs"][name]["timeline"]):
        left.barh(row, 0.9, left=i, color=colours[event])
left.set_yticks([0, 1], ["optimize_ddp=False", "optimize_ddp=True"])
left.set_xlim(0, 15)
left.set_xlabel("order of events in the last backward (not time)")
left.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()],
            labels=["a compiled backward piece runs", "DDP launches a bucket's all-reduce"],
            loc="center right", fontsize=8)
right.bar(list(sweep), [len(pieces) for pieces in sweep.values()], color="tab:green")
right.set_xlabel("bucket_cap_mb")
right.set_ylabel("compiled pieces")
fig.tight_layout()
plt.show()

# %% [markdown]
# **Where the cuts fall.** `DDPOptimizer.compile_fn`
# ([L506-L592](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/_dynamo/backends/distributed.py#L506-L592))
# walks the graph from its last node backwards (the order in which the backward makes gradients
# ready), adds each parameter's bytes to the current bucket, and starts a new bucket once the
# first one holds 1 MiB (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`) or a later one holds
# `bucket_cap_mb`. Here: the head (8 KiB) and layer 3 (1 MiB) fill the first bucket; with a 1 MiB
# cap each further layer is a bucket of its own ([1, 1, 1, 2] in forward order), with 2 MiB two
# layers share one ([1, 2, 2]), with 25 MiB the rest is one bucket ([3, 2]).
# `cw.predicted_subgraphs` is that rule, and the test suite checks it against the backend's record.
#
# These cuts are the DDP optimizer's *estimate* of DDP's buckets, computed from the graph; DDP
# builds its real buckets itself, and after the first step rebuilds them in the order gradients
# actually arrived (section 1). The two need not coincide: the note in distributed.py says so
# ("It would be better to enforce ... that the bucket splits chosen here are used by DDP"). The
# runs above recorded DDP's buckets too (the layers whose parameters each bucket holds, in the
# order DDP launched them). In eager DDP they match the pieces; behind the compiled pieces, DDP
# rebuilt its buckets in the order the compiled backward handed out gradients, and they differ:

# %%
for name in ("eager", "compile, then DDP"):
    print(f"{name:<18} DDP's buckets in the last step: {result['runs'][name]['buckets']}")

# %% [markdown]
# ### Which order: compile, then wrap, or wrap, then compile?
#
# Both work, and give the same pieces and the same numbers: above, the largest difference
# between either compiled run and eager DDP, over all gradients and weights after 3 steps, is 0
# (the check allows float32 rounding, `cw.TOLERANCE` = 1e-6, because nothing guarantees that a
# compiled graph adds in eager's order; with `aot_eager` on torch 2.13 it does). **The docs
# differ on the order.** The DDP notes' section on TorchDynamo's DDPOptimizer shows the second
# one, `ddp_model = DDP(model, device_ids=[rank])` then `ddp_model = torch.compile(ddp_model)`
# ([DDP notes](https://docs.pytorch.org/docs/stable/notes/ddp.html)); the newer page on where to
# apply `torch.compile` shows the first: "`torch.compile` specifically doesn't handle
# distributed wrapper modules like DDP or FSDP very well, so consider applying `torch.compile`
# to the inner module passed to the wrapper", with `model.compile()` then
# `DistributedDataParallel(model, ...)`
# ([Where to apply torch.compile?](https://docs.pytorch.org/docs/stable/compile/programming_model.where_to_apply_compile.html)).
# What this lesson's run shows settles it for torch 2.13: both orders get the DDPOptimizer's
# pieces (the same subgraphs, counted above) and the same numbers. In the other order dynamo traces DDP's own `forward` first (hence the warning "Profiler record
# function ... will be ignored" above: DDP's forward opens a `record_function`) and stops at
# `_inside_ddp_forward`, which is excluded from tracing; the model inside is compiled as before.
#
# **The source article is wrong here** (its section 5.2): it says `torch.compile(model)` *must*
# come before `DDP(model)`, "otherwise the compiler compiles the DDP wrapper in as well and the
# AllReduce gets wrongly optimized". Neither happens: the all-reduces are launched by DDP's
# autograd hooks, outside any graph, and both orders give bit-identical results above. Its
# advice that `mode="reduce-overhead"` works best under DDP is not something the docs say;
# that mode means CUDA graphs, which this CPU lesson cannot test. Its order is the one the newer
# docs page shows, for that page's reason (dynamo handles the wrapper poorly), not the
# article's; the DDP notes show the other, and both work.
#
# ### Pitfalls
#
# **`bucket_cap_mb` under 1 MiB breaks compilation.** The DDP optimizer's first bucket is always
# 1 MiB and must not be larger than the others (`DDPOptimizer.__init__`,
# [L450-L470](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/_dynamo/backends/distributed.py#L450-L470)),
# so a smaller cap, fine in eager DDP, fails at the first compiled forward:

# %%
def small_cap(rank, world_size):
    try:
        cw.train_steps(rank, world_size, "compile, then DDP", bucket_cap_mb=0.5, backend="eager",
                       steps=1)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"


print(run_ranks(small_cap, 1, timeout=120)[0])

# %% [markdown]
# **`.compile()` on a bare torch container does nothing, and `torch.compile(model)` renames the
# state.** The docs recommend `model.compile()` over `model = torch.compile(model)`. It compiles
# in place and keeps the model's `state_dict` keys; `torch.compile` returns an `OptimizedModule`
# whose keys start with `_orig_mod.`, and a checkpoint saved from it does not load into the plain
# model. But on torch 2.13, calling `.compile()` on a bare `nn.Sequential` captures no graph at
# all: its frames live in torch/nn, which dynamo skips ("frame is in the Dynamo skipfiles list"
# under `TORCH_LOGS=+dynamo`). A model class of your own, even one that *contains* an
# `nn.Sequential`, is compiled. Counted by the recording backend:

# %%
def compile_calls(rank, world_size):
    graphs = {how: cw.graphs_captured(how) for how in (
        "nn.Sequential .compile()", "nn.Sequential torch.compile", "own class .compile()",
        "own class torch.compile")}
    keys = {how: cw.state_dict_keys(how) for how in ("eager", ".compile()", "torch.compile")}
    return graphs, keys


graphs, keys = run_ranks(compile_calls, 1, timeout=120)[0]
for how, count in graphs.items():
    print(f"{how:<28} graphs captured: {count}")
for how, names in keys.items():
    print(f"state_dict keys, {how:<14} {names}")

# %% [markdown]
# **Summary.** Compile the inner model, then wrap it (`model.compile()`; `DDP(model)`), as the
# newer docs page shows; the DDP notes' order, wrap then compile, gets the same DDPOptimizer
# pieces and numbers. Keep `optimize_ddp` on: it is what lets DDP overlap all-reduces with a
# compiled backward, and with a `bucket_cap_mb` of at least 1. `train.py` (next section) does
# it with `--compile`.

# %% [markdown]
# ## A complete training script: `train.py`
#
# **The problem.** Each section above fixed one thing in isolation. A real script needs all of
# them at once, in the right order, and it must stay readable, because chapters 08 (checkpoints),
# 09 (debugging) and 10 (performance) build on it.
#
# **The idea.** One file, small functions, each doing one step of the chapter, and a `train()`
# that runs in any process group and returns plain data, so that torchrun, the tests and this
# notebook all run the same code. It trains a small MLP classifier on generated data (Gaussian
# clusters that overlap: it learns, but never reaches 100%).
#
# ```
# torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/train.py
# torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/train.py --accumulation-steps 4 --amp bf16
# torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/train.py --compile --save model.pt
# ```
#
# The same command runs on one GPU per rank: `process_group()` picks NCCL there, the model goes
# to `cuda:LOCAL_RANK` and is wrapped with `device_ids=[local_rank]`. Where each section of this
# chapter shows up in it:
#
# | what | where in `train.py` | section |
# |---|---|---|
# | same seed on every rank; data generated from its own seed | `seed_everything`, `build_data` | 4 |
# | `DistributedSampler`, `set_epoch(epoch)` before every epoch | `build_data`, `train` | chapter 06 |
# | model on its device, *then* (compiled, then) wrapped | `build_model`, `wrap_model` | 1, 8 |
# | `no_sync()` around forward **and** backward; loss / window length | `train_one_epoch` | 6 |
# | autocast; GradScaler for fp16 only | `autocast`, `train` | 7 |
# | global mean loss and accuracy from all-reduced sums and counts | `train_one_epoch`, `evaluate` | 5, chapter 06 |
# | evaluation through `model.module`, every sample once | `evaluate` | 1, chapter 06 |
# | rank 0 saves `model.module.state_dict()`, the others wait | `save` | 1 (chapter 08 goes further) |
# | tqdm bar on rank 0 only | `train` | |
# | replicas identical at the end (CRC32 of the weights, `all_gather`) | `gathered_checksums`, `problems` | |

# %%
import train as tr

# %% [markdown]
# `train_one_epoch` accumulates over windows of `--accumulation-steps` batches, one all-reduce
# per window (section 6), and `evaluate` computes the evaluation set's global loss and accuracy
# (section 5). The exercises `train_steps` and `global_metrics` have you write the general
# versions of these two functions, so read the script's after you have written yours. Its
# training loss is accumulated as a tensor on the device and all-reduced once per epoch, not
# turned into a Python float at every step (`.item()` would wait for the GPU at each step).
#
# ### Run it: 2 ranks learn what 1 process learns on the same global batches
#
# `train()` runs in any process group, so `run_ranks` can call it directly. Three runs with the
# same global batch of 64 samples per optimizer step: 1 rank × 64; 2 ranks × 32; 2 ranks × 16 ×
# 2 accumulated micro-batches. With `DistributedSampler` the ranks' batches at one step are,
# together, the same slice of the epoch's shuffled order that one process takes with a batch of
# 64 (the sampler gives rank r every world_size-th index of one permutation, which depends only
# on the seed and the epoch), so all three should train the same model, up to float32 rounding.

# %%
runs = {
    "1 rank x 64": run_ranks(tr.train, 1, batch_size=64, progress=False, timeout=120)[0],
    "2 ranks x 32": run_ranks(tr.train, 2, progress=False, timeout=120)[0],
    "2 ranks x 16 x 2 (accumulation)": run_ranks(tr.train, 2, batch_size=16, accumulation_steps=2,
                                                  progress=False, timeout=120)[0],
}
reference = runs["1 rank x 64"]["weights"]
for name, history in runs.items():
    gap = (history["weights"] - reference).abs().max().item()
    print(f"{name:<32} steps {history['optimizer_steps']:>3}  final accuracy "
          f"{history['epochs'][-1]['eval_accuracy']:.4f}  largest weight gap to 1 rank {gap:.1e}  "
          f"problems: {tr.problems(history) or 'none'}")

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
for (name, history), style in zip(runs.items(), ["-", "--", ":"]):
    epochs = [e["epoch"] for e in history["epochs"]]
    left.plot(epochs, [e["train_loss"] for e in history["epochs"]], style, marker="o", label=name)
    right.plot(epochs, [e["eval_accuracy"] for e in history["epochs"]], style, marker="o",
               label=name)
left.set(xlabel="epoch", ylabel="global mean training loss", xticks=epochs)
right.set(xlabel="epoch", ylabel="evaluation accuracy (509 samples)", xticks=epochs)
left.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# The three curves lie on top of each other. The weights differ by about 1e-7 (float32
# rounding: the all-reduce adds the ranks' gradients in another order than one process adds its
# samples'); the test suite requires at most 1e-5, which still catches a single wrong step.
#
# ### What the script checks itself
#
# `problems(history)` returns what contradicts the lesson, and `main()` exits with code 1 when it
# is not empty: the global training loss must fall, the final accuracy must beat chance, every
# evaluation sample must be counted exactly once, and the final weights must be identical on
# every rank. Wrong data is caught:

# %%
history = runs["2 ranks x 32"]
print("right:", tr.problems(history))
print("replicas apart:", tr.problems({**history, "checksums": [history["checksums"][0], 1234]}))
print("padded evaluation:", tr.problems(
    {**history, "epochs": [{**e, "eval_samples": 510} for e in history["epochs"]]}))

# %% [markdown]
# ### Pitfalls this script avoids
#
# * **Evaluation through the wrapper.** The 509 evaluation samples split into slices of 255 and
#   254: the ranks run different numbers of evaluation batches. For a model with buffers
#   (BatchNorm), a forward through the DDP wrapper can broadcast them (section 3: the first
#   `no_grad` forward after training does, and in an evaluation with gradients enabled every
#   forward does), a collective that waits for every rank (chapter 06 shows it blocking).
#   This model has none,
#   but it is meant to be extended: `model.module` runs no collective, and the only collective
#   of the evaluation is the one all-reduce of the sums and counts at the end.
# * **The sampler's padding in a metric.** `DistributedSampler` would pad 509 to 510 by repeating
#   a sample (chapter 06); the strided slice `range(rank, n, world_size)` does not.
# * **The mean of the ranks' means.** Unequal slices make it wrong; sums and counts are exact.
# * **Seeds.** One seed everywhere: the initial weights agree before DDP's broadcast, and the run
#   is reproducible. The sampler's seed must be the same on every rank (section 4); dropout or
#   augmentation would add the rank to their seeds.
# * **`--compile`**: compiled in place before the wrap (previous section), so `model.module`'s
#   state_dict keys are the plain model's and the checkpoint loads into an uncompiled model (the
#   test suite loads it).
# * **`--amp fp16`**: GradScaler, also on the CPU (section 7); `bf16` needs none.
#
# **The source article's skeleton** (its section 4.3) wraps and loops correctly and calls
# `set_epoch`, but logs nothing global, never evaluates, and has no way to tell whether the
# replicas stayed together. Here every number printed is a global one, and the script checks its
# replicas at the end.
#
# **What comes next.** Chapter 08 (checkpoints) starts from `save()`, chapter 09 (debugging labs)
# from this script, and chapter 10 (performance) from `train_one_epoch`: each extends these
# functions rather than rewriting the loop.

# %% [markdown]
# ## Exercises
#
# Three graded exercises in `exercises/07_training_loop/` (nbgrader assignment
# `07_training_loop`). Each runs your code in real process groups of 1 to 4 ranks and compares the
# result with one process; none is judged by the text of your code.
#
# ### `train_steps`: gradient accumulation with DDP
#
# You write `train_steps(ddp_model, micro_batches, optimizer, loss_fn, accumulation_steps)`: one
# optimizer step per group of micro-batches, including a short last group, and each step's global
# mean loss returned on every rank. The tests count the bytes your loop all-reduces. Exactly one
# gradient all-reduce per optimizer step is allowed, so `no_sync()` must wrap the right forwards
# and backwards (section 6). The trained weights must equal one process trained on the equivalent
# large batches. Self-check: `pytest exercises/07_training_loop/train_steps.ipynb`.
#
# ### `global_metrics`: exact metrics of the whole validation set
#
# Each rank evaluates only its share of the validation set, but every rank needs the loss and
# accuracy of the *whole* set, to log them, keep the best checkpoint or stop early, alike on every
# rank. You write `evaluate(model, dataset, batch_size)`: the work shared among the ranks, every
# sample counted once, exactly one process's numbers on every rank, and the model handed back as
# it came, whatever the shares' sizes (some may be empty) and whether you are handed the model or
# its DDP wrapper. The tests record every row your model sees and compare with one process.
# Self-check: `pytest exercises/07_training_loop/global_metrics.ipynb`.
#
# ### `fix_the_loop`: three silent bugs
#
# A colleague's fine-tuning loop, `buggy_train`, has three bugs, and none of them raises an error:
# a module outside the wrapper (section 4), a summed loss (section 5) and a loss logged by one rank.
# You run it on two ranks with an instrument that shows how far the replicas are apart, how far
# they are from one process, and what each rank logs. Then you write `train`, the loop it was meant
# to be. When your weights are wrong, the tests name the mistake that reproduces them. Self-check:
# `pytest exercises/07_training_loop/fix_the_loop.ipynb`.

# %% [markdown]
# ## Summary
#
# * **Wrap last, in one place.** Put the model on its device, convert BatchNorm if you want
#   SyncBatchNorm, compile it, then wrap it: `DDP(model, device_ids=[local_rank])` on a GPU, no
#   `device_ids` on the CPU or for a model that spans GPUs. The constructor compares every rank's
#   model with rank 0's, copies rank 0's state, and builds the gradient buckets. Save and evaluate
#   on one rank through `model.module`.
# * **Every parameter must get a gradient in every step**, or the *next* forward raises. Remove or
#   freeze what you do not train, use every output, or declare `static_graph=True`.
#   `find_unused_parameters=True` is the last resort: it walks the autograd graph after every
#   forward.
# * **Buffers are rank 0's** by default, broadcast at the start of each forward that follows a
#   synced training forward (not at every forward: counted in section 3), so the statistics come
#   from rank 0's data. SyncBatchNorm computes batch statistics over all ranks, on GPUs only.
# * **Seeds.** The sampler's seed must be the same on every rank. Dropout and augmentation should
#   differ between ranks. A learnable module outside the wrapper drifts apart without a word.
# * **Losses are per rank; gradients are averaged.** To log a global number, all-reduce sums and
#   counts. Under DDP a summed loss gives gradients W times smaller than one process summing the
#   global batch, and of the scale of one process summing one rank's batch: its scale follows
#   the rows per rank, not the world size.
# * **Gradient accumulation.** `no_sync()` goes around the forward *and* the backward of every
#   micro-batch but the last of a step. Divide each loss by the number of micro-batches. Sync and
#   step on the same, last micro-batch.
# * **Mixed precision** computes in bf16 or fp16 but keeps gradients in float32. The all-reduce
#   carries the same bytes unless a compression hook is registered. GradScaler is for fp16 only.
# * **`torch.compile`** cooperates with DDP: the DDP optimizer splits the graph at bucket
#   boundaries so that the all-reduces still overlap the backward.
#
# `train.py` puts all of it into one script. Chapter 08 makes it survive a crash.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 07](../CLAIMS.md#chapter-07).
