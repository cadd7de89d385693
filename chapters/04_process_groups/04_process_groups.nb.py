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
# # 04 · Process groups: backends, init methods, collectives, and "everyone is rank 0"
#
# **The problem.** N processes have started (chapter 03). Before they can add up gradients they must
# form a *process group*: agree on who is who, on a transport (the backend), and on a place to
# exchange addresses (the store). Every DDP bug of the kind "it hangs at start-up" or "the numbers
# are wrong" lives here.
#
# **The idea.** `torch.distributed.init_process_group(backend, init_method, rank, world_size,
# timeout)` joins the default group; `new_group(ranks)` makes subgroups; collectives (`all_reduce`
# and friends) move tensors inside a group; `destroy_process_group()` leaves. All cells below run
# in real process groups of 2 or 4 processes (`run_ranks`, gloo on the CPU).
#
# **Article claims checked here:** the sanity check's printed value (it says 4 on 4 ranks: it is 6),
# and the "all 8 processes connected as rank 0, gradients summed to zero" story (it fails loudly at
# start-up instead; the quiet variant is a different bug).

# %%
import inspect, os, re, sys, tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from ddpcourse.launcher import prestart, run_ranks

ROOT = Path.cwd().resolve().parents[1]   # the notebook runs in chapters/04_process_groups
sys.path.insert(0, str(Path.cwd()))     # the ranks import the chapter's modules too
sys.path.insert(0, str(ROOT / "chapters" / "03_torchrun"))
prestart()
import _demos
import collectives_tour as tour
from ddpcourse.launcher import run_bounded  # a deadline, and no process left behind

def show(fn):
    print(inspect.getsource(fn))


# %% [markdown]
# ## 1. Backends: who moves the bytes
#
# | backend | devices | when |
# |---|---|---|
# | `gloo` | CPU tensors (and some GPU collectives) | CPU training, laptops, this course's CPU runs, fallback |
# | `nccl` | CUDA tensors only, one GPU per rank | GPU training: the fastest, NVLink/InfiniBand aware |
# | `mpi` | as the MPI library allows | only in PyTorch built from source against MPI |
#
# Which collective each backend supports on which device is tabulated in the
# [torch.distributed docs, "Backends"](https://docs.pytorch.org/docs/stable/distributed.html#backends).
# Two rows matter below: `reduce_scatter` is ✓ on gloo CPU, and `all_to_all` is marked ✘ for gloo.
# On torch 2.13's CPU build gloo's `all_to_all` *does* run and gives the right values (section 4
# checks it), so the table is out of date there; NCCL supports all of them on GPUs. The article's
# "NCCL needs identical GPU models and CUDA versions" and "3-5x faster than gloo" are its own
# experience, not checked here. What this build has:

# %%
_demos.backend_of_environment()

# %% [markdown]
# ### One GPU per rank: the set-up, written out
#
# With NCCL every rank owns one GPU, and *you* pick it: torchrun gives each worker its
# `LOCAL_RANK` and leaves every GPU of the node visible to it (chapter 03). Three lines, in this
# order, do the job (`ddpcourse.dist_env.process_group` does exactly this; here it is in the open):
#
# ```python
# local_rank = int(os.environ["LOCAL_RANK"])
# device = torch.device("cuda", local_rank)
# torch.cuda.set_device(device)                        # 1. this process's current device
# dist.init_process_group("nccl", device_id=device)    # 2. the group is bound to that GPU
# model = DDP(model.to(device), device_ids=[local_rank])   # 3. DDP knows its single device
# ```
#
# 1. **`torch.cuda.set_device(local_rank)`** makes that GPU the *current device*: where plain
#    `"cuda"` tensors go and where this process's CUDA context is created. The DDP docstring asks
#    for it: "each process exclusively works on a single GPU from 0 to N-1 ... by either setting
#    `CUDA_VISIBLE_DEVICES` for every process or by calling `torch.cuda.set_device(i)`"
#    (`torch/nn/parallel/distributed.py`, `DistributedDataParallel`).
# 2. **`init_process_group(device_id=device)`** binds the group to that GPU. Under NCCL the
#    communicator is then formed at once instead of at the first collective (the `device_id`
#    paragraph of `init_process_group`'s docstring; `_new_process_group_helper` calls
#    `eager_connect_single_device`), and collectives that have no tensor to tell the device, such
#    as `barrier()`, use it. Without it, `barrier()` warns that it uses "the current device",
#    and the comment beside that warning spells out the failure: "If user did not set any, this
#    may use default device 0, causing issues like hang or all processes creating context on
#    device 0" (`torch/distributed/distributed_c10d.py`, `barrier`).
# 3. **`DDP(model, device_ids=[local_rank])`**: for a module on one GPU, the one device DDP works
#    on; DDP's forward moves the inputs there (`_pre_forward`: `_to_kwargs(..., torch.device(
#    self.device_type, self.device_ids[0]), ...)`) and the output stays there.
#
# **Without step 1** every process's current device is GPU 0: `torch.ones(1, device="cuda")`,
# `.cuda()` and the CUDA context of *every* rank land on GPU 0, so GPU 0 holds N contexts and N
# copies of whatever went to plain `"cuda"` while the other GPUs idle; and NCCL refuses two ranks
# of one communicator on one GPU (`ncclInvalidUsage`, "Duplicate GPU detected", in
# `initTransportsRank` of [NCCL's `src/init.cc`](https://github.com/NVIDIA/nccl/blob/master/src/init.cc)).
# `gpu_setup.py` runs the set-up above and, with `--forget-set-device`, the careless one,
# and prints where each rank's tensors are. It needs one GPU per rank; elsewhere it says so and
# exits 0 (`tests/test_chapter_04_process_groups.py` runs it both ways, and for real where there
# are GPUs).

# %%
gpus = torch.cuda.device_count()
if gpus >= 2 and dist.is_nccl_available():
    for flags in ("", "--forget-set-device"):
        done = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc_per_node", "2", "chapters/04_process_groups/gpu_setup.py",
                            *flags.split()], 120, cwd=ROOT)
        print(f"== gpu_setup.py {flags} (exit {done.returncode})\n{done.stdout}")
else:
    print(f"{gpus} GPU(s) here: gpu_setup.py would only print why it skips. The canonical set-up:")
    import gpu_setup
    show(gpu_setup.set_up)

# %% [markdown]
# ## 2. Three init methods, each running
#
# The *init method* says where ranks exchange addresses (the store):
#
# * **`env://`** (the default): read `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` from the
#   environment; rank 0 hosts a TCP store there. torchrun sets all four.
# * **`tcp://HOST:PORT`**: the same store at an address you pass, with explicit `rank` and `world_size`.
# * **`file:///path`**: a file every rank can lock (local disk, NFS); no port at all. It must not
#   exist or be empty beforehand ([docs](https://docs.pytorch.org/docs/stable/distributed.html#shared-file-system-initialization)).
#
# One rank function, three ways to join (ports chosen by the OS, the file in a fresh temp folder):

# %%
show(_demos.join_and_sum)
port = _demos.free_port()
print("env:// ", run_ranks(_demos.join_and_sum, 2, "env://", init_process_group=False,
                           env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
print("tcp:// ", run_ranks(_demos.join_and_sum, 2, f"tcp://127.0.0.1:{_demos.free_port()}",
                           init_process_group=False))
store_file = Path(tempfile.mkdtemp()) / "store"
print("file://", run_ranks(_demos.join_and_sum, 2, f"file://{store_file}", init_process_group=False))

# %% [markdown]
# **Under torchrun, use `env://`.** torchrun exports `TORCHELASTIC_USE_AGENT_STORE=True`,
# and in torch 2.13 that makes *every* rank a client of the store at whatever address it is given,
# so a `tcp://` address of your own has no server and every rank waits until the timeout (measured
# while writing this chapter: `DistNetworkError: The client socket has timed out after 5000ms` on
# both ranks). The behaviour is reported upstream
# ([pytorch#192113](https://github.com/pytorch/pytorch/pull/192113)). The installed source:

# %%
import importlib
rendezvous_module = importlib.import_module("torch.distributed.rendezvous")
lines, first = inspect.getsourcelines(rendezvous_module._create_c10d_store)
for i, line in enumerate(lines):
    if re.search(r"_torchelastic_use_agent_store\(\)|is_master=", line):
        print(f"{first + i:5d} {line.rstrip()}")

# %% [markdown]
# ## 3. Timeouts: a missing peer becomes an error
#
# Collectives block until every rank of the group calls them. Whether `init_process_group`
# already waits for every rank depends on the backend:
#
# * **gloo** (by default) connects every pair of ranks while the group is created, so
#   `init_process_group` returns only when all `world_size` ranks have joined.
# * **NCCL without `device_id`** creates its communicator lazily, at the first collective (the
#   `device_id` paragraph of the `init_process_group` docstring: with it "the communicator is
#   immediately formed (calling `ncclCommInit*` immediately rather than the normal lazy call)").
#   So `init_process_group` can return with a peer missing, and the wait moves to the first
#   collective. With `device_id=torch.device("cuda", local_rank)` (section 1) the wait is back in
#   `init_process_group`. (Only the store may wait earlier: without torchrun, rank 0's `TCPStore`
#   waits for every rank to connect, `wait_for_workers=True` in the `TCPStore` docstring.)
#
# gloo can connect lazily too, when `TORCH_GLOO_LAZY_INIT=1` (declared in the installed header
# `torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp`: "whether or not connections
# are established in a full mesh or lazily as needed"), which lets this CPU build show both
# behaviours. `timeout=` bounds either wait. Here one process joins a group of two that nobody
# else joins, with a 2-second timeout, first as gloo does by default, then lazily:

# %%
show(_demos.wait_for_a_missing_peer)
[outcome] = run_ranks(_demos.wait_for_a_missing_peer, 1, str(Path(tempfile.mkdtemp()) / "store"), 2.0,
                      init_process_group=False)
print("full mesh (default):", outcome)
[outcome] = run_ranks(_demos.wait_for_a_missing_peer, 1, str(Path(tempfile.mkdtemp()) / "store"), 2.0,
                      init_process_group=False, env={"TORCH_GLOO_LAZY_INIT": "1"})
print("TORCH_GLOO_LAZY_INIT=1:", outcome)
from torch.distributed import constants
print("defaults: gloo and others", constants.default_pg_timeout, "| nccl", constants.default_pg_nccl_timeout)

# %% [markdown]
# The lazy group's `init_process_group` returned at once and its first all-reduce waited out the
# timeout instead: "the ranks joined" is only known after a collective (or an eager init). A
# sanity all-reduce right after start-up (section 6) catches a missing rank where it is cheap.
#
# Without a timeout of your own, that wait lasts **30 minutes** on gloo and 10 on NCCL (the
# `init_process_group` docstring; this CPU build has no NCCL, hence `None` above). In demos and tests, always pass a short
# `timeout=timedelta(seconds=...)`.
#
# ## 4. Subgroups with `new_group`, and leaving with `destroy_process_group`
#
# `new_group(ranks)` is itself a collective over the *default* group: **every** rank must call it,
# for every subgroup, in the same order, even ranks that are not members
# ([docs](https://docs.pytorch.org/docs/stable/distributed.html#groups)). A non-member gets a
# placeholder and `get_rank(group) == -1`.

# %%
show(_demos.subgroups)
for rank, r in enumerate(run_ranks(_demos.subgroups, 4)):
    print(f"rank {rank}: {r}")

# %% [markdown]
# ## 5. The collectives, one picture each
#
# `collectives_tour.py` runs each collective once on tensors whose values tell where they came
# from: scalars `r + 1` on rank r; for the collectives that cut a tensor into one chunk per rank,
# `10·j + r` in chunk j (tens digit: chunk, ones digit: origin rank). Two of them:

# %%
show(tour.reduce_scatter)
show(tour.all_to_all)

# %% [markdown]
# All seven on 4 ranks, compared with the values each rank must hold afterwards
# (`tour.expected`), then drawn from the measured values:

# %%
results = run_ranks(tour.tour, 4)
problems = tour.mismatches(results, 4)
for name in tour.COLLECTIVES:
    afters = [r[name][1] for r in results]
    print(f"{name:<15} after: {afters}")
print("\nmismatches:", problems or "none: every rank holds the expected values")


# %%
def origin(name, value, when):
    """The rank a value came from (None: a sum over ranks), read off the values' encoding."""
    if when == "after" and name in ("reduce", "all_reduce", "reduce_scatter"):
        return None
    return int(value) % 10 if name in ("reduce_scatter", "all_to_all") else int(value) - 1

def panel(ax, name, rows, when):
    width = max(len(r) for r in rows if r is not None)
    ax.set_xlim(0, width); ax.set_ylim(len(rows), 0); ax.set_xticks([]); ax.set_yticks([])
    ax.set_title(f"{name}: {when}", fontsize=9)
    for rank, row in enumerate(rows):
        ax.text(-0.05, rank + 0.5, f"rank {rank}", ha="right", va="center", fontsize=8)
        if row is None:
            ax.text(width / 2, rank + 0.5, "undefined", ha="center", va="center", color="gray", fontsize=8)
            continue
        for j, value in enumerate(row):
            source = origin(name, value, when)
            color = "lightgray" if source is None else plt.cm.tab10(source)
            ax.add_patch(plt.Rectangle((j, rank), 1, 1, facecolor=color, edgecolor="white", alpha=0.6))
            ax.text(j + 0.5, rank + 0.5, f"{value:g}", ha="center", va="center", fontsize=8)

names = [n for n in tour.COLLECTIVES if n != "barrier"]
fig, axes = plt.subplots(len(names) + 1, 2, figsize=(9, 2.0 * (len(names) + 1)))
for row, name in zip(axes, names):
    panel(row[0], name, [r[name][0] for r in results], "before")
    panel(row[1], name, [r[name][1] for r in results], "after")
arrive = [r["barrier"][0][0] for r in results]
leave = [r["barrier"][1][0] for r in results]
for ax, times, label in ((axes[-1][0], arrive, "barrier: arrival time (s)"), (axes[-1][1], leave, "barrier: departure time (s)")):
    ax.barh(range(4), times, color="tab:blue"); ax.set_yticks(range(4), [f"rank {r}" for r in range(4)])
    ax.invert_yaxis(); ax.set_xlim(0, max(leave) * 1.1); ax.set_title(label, fontsize=9)
fig.suptitle("4 ranks, measured. Colour: the rank a value came from; grey: a sum over ranks", fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# Reading the pictures:
# * **broadcast**: rank `src`'s tensor replaces everyone's. **reduce**: the sum lands on `dst`
#   only (other ranks' buffers are not promised anything). **all_reduce**: everyone gets the sum;
#   DDP averages gradients with it, dividing *before* the sum (below).
# * **all_gather**: everyone gets every rank's tensor, in rank order. **reduce_scatter**: chunk j
#   of all ranks is summed onto rank j (FSDP's gradient step; all_reduce = reduce_scatter + all_gather).
# * **all_to_all**: chunk j of rank i goes to slot i of rank j, a transpose across ranks.
# * **barrier**: no data; every rank leaves after the last one arrives.
#
# ### How DDP averages: divide, then all-reduce with SUM
#
# A common description (blog posts, and the DDP notes' own summary "gradients are averaged
# across processes") has DDP all-reduce the gradients and "then divide by N". The order is the
# other way round. DDP's reducer divides each gradient by N
# *while copying it into its bucket* (one pass over the data instead of two), then all-reduces the
# bucket with plain SUM:
#
# * In [`torch/csrc/distributed/c10d/reducer.cpp` at v2.13.0](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/csrc/distributed/c10d/reducer.cpp),
#   `Reducer::mark_variable_ready_dense` copies a ready gradient into its bucket with
#   `at::mul_out(bucket_view, grad, 1 / div_factor_)`: "Divides while copying into the bucket
#   view to save one scan over all the input parameters" (older releases called this step
#   `copy_grad_to_bucket`; with the opt-in batched copy, `flush_deferred_copies` divides the
#   whole bucket once instead). When the bucket is full, `all_reduce_bucket` calls
#   `run_comm_hook`, which, with no hook registered, runs `_AllReduceBySumCommHook`: a SUM.
# * The C++ source is not installed, but its headers are, under `torch/include/torch/csrc/
#   distributed/c10d/`: `reducer.hpp` declares `div_factor_`, "Division factor for reduction of
#   gradients. Equal to the process group size, with an exception of handling uneven input"
#   (chapter 06's `Join`), and `default_comm_hooks.hpp` describes `_AllReduceBySumCommHook` as
#   "without division inside the hook. This enables the optimization of fusing copy and
#   division ... when no communication hook is provided by the user".
# * The same order is in the installed Python hook that reproduces the default,
#   `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`, `_allreduce_fut`:
#   `tensor.div_(group_to_use.size())`, then `all_reduce`, with the reason: "Apply the division
#   first to avoid overflow, especially for FP16."
#
# Overflow is also how to *see* the order. In float16 (largest value 65504) let the gradient be
# 40000 on both ranks: summing first gives 80000, which is `inf`; dividing first gives
# 20000 + 20000 = 40000. DDP's result tells which one it did:

# %%
show(_demos.ddp_average_in_float16)
for rank, r in enumerate(run_ranks(_demos.ddp_average_in_float16, 2)):
    print(f"rank {rank}: {r}")

# %% [markdown]
# A communication hook takes the division with it: once you register one, the reducer copies
# the gradients into the bucket *undivided* (reducer.cpp, "Note [DDP Communication Hook]": "If
# registered, reducer also skips dividing grads by world size"), and averaging is the hook's job,
# which is why `_allreduce_fut` above divides. A hook that only sums sees each rank's own gradient
# and leaves the sum, not the mean:

# %%
show(_demos.what_a_comm_hook_sees)
for rank, r in enumerate(run_ranks(_demos.what_a_comm_hook_sees, 2)):
    print(f"rank {rank}: {r}")

# %% [markdown]
# ## 6. The article's sanity check prints 6, not 4
#
# The article's check, "all_reduce of `ones * rank` should print `[4]` on 4 cards": with the
# default `op=SUM` every rank prints 0 + 1 + 2 + 3 = **6**. (4 would be `ones` without `* rank`.)
# `sanity_all_reduce.py` is the same check as a torchrun script.

# %%
show(_demos.ones_times_rank)
print(run_ranks(_demos.ones_times_rank, 4))


# %% [markdown]
# ## 7. "All processes connected as rank 0": reproduced and diagnosed
#
# The article: the rank was read from `os.environ['SLURM_PROCID']` "without adapting to Slurm", so
# 8 processes all connected as rank 0, "gradients summed to 8 zeros is still 0", and the model
# did not learn. Where the ranks come from under each launcher:
#
# | what | torchrun sets | srun sets (per *task*) |
# |---|---|---|
# | global rank | `RANK` | `SLURM_PROCID` |
# | rank on the node | `LOCAL_RANK` | `SLURM_LOCALID` |
# | number of processes | `WORLD_SIZE` | `SLURM_NTASKS` |
# | processes on this node | `LOCAL_WORLD_SIZE` | `SLURM_NTASKS_PER_NODE` (only if requested so) |
# | node index | `GROUP_RANK` | `SLURM_NODEID` |
#
# With `srun --ntasks-per-node=1 torchrun ...` (chapter 03), each *task* is a torchrun agent, so
# every worker of node 0 inherits `SLURM_PROCID=0`: 8 workers, 8 times "rank 0". Read the
# launcher's variables for the launcher you used: torchrun's `RANK`/`LOCAL_RANK`/`WORLD_SIZE` under
# torchrun; `SLURM_*` only when srun starts one task per GPU itself, without torchrun.
#
# `everyone_is_rank0.py` passes `rank=int(os.environ[...])` explicitly, as the article's script
# did. Four launches under torchrun, with a 4-second timeout:

# %%
def torchrun(*args, timeout=60, **env):
    """2 workers of everyone_is_rank0.py; the whole process group is killed at the deadline."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | env
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "chapters/04_process_groups/everyone_is_rank0.py", "--timeout", "4", *args]
    done = run_bounded(cmd, timeout, cwd=ROOT, env=full_env)
    out, err = done.stdout, done.stderr
    errors = [l.strip() for l in err.splitlines() if re.match(r"\s*(\w+\.)*\w*(Error|Exception)\b:", l)]
    print(f"exit {done.returncode} after {done.seconds:.1f} s" + (" (killed: deadline)" if done.timed_out else ""))
    print("\n".join(sorted(out.splitlines()) + sorted(set(errors))[:3]) + "\n")

print("== SLURM_PROCID=0, as srun gives every worker of node 0 ==")
torchrun(SLURM_PROCID="0")
print("== no SLURM at all (plain torchrun) ==")
torchrun()
print("== rank AND world size from SLURM (SLURM_PROCID=0, SLURM_NTASKS=1) ==")
torchrun("--world-size-from", "SLURM_NTASKS", SLURM_PROCID="0", SLURM_NTASKS="1")
print("== the fix: rank from torchrun's RANK ==")
torchrun("--rank-from", "RANK")

# %% [markdown]
# And when the processes are started by hand with `tcp://` and all pass `rank=0`, each tries
# to *host* the store: one wins the port and waits for clients that never come, the other gets
# "address already in use" at once:

# %%
for i, outcome in enumerate(run_ranks(_demos.everyone_rank0_by_hand, 2, _demos.free_port(), 2.0,
                                     init_process_group=False)):
    print(f"process {i}: {outcome[:170]}")

# %% [markdown]
# **Diagnosis.** With the right world size and everyone claiming rank 0, torch 2.13 does not
# train at all: `init_process_group` waits for the address of rank 1 (the store key
# `/default_pg/0//cpu//0/1` in the error), which nobody writes, and fails with `DistStoreError:
# wait timeout` when the timeout expires; by default after 30 minutes, which looks like a hang,
# not like a model that does not learn. Started by hand, it is `EADDRINUSE` plus a store timeout.
# **The article's "gradients summed to zero" does not happen.**
#
# The only way to get *silently wrong* training is the third case: world size taken from SLURM
# too, so each process is rank 0 of a world of **one**. Then no collective ever crosses a process:
# `all_reduce` returns each rank's own value (0 on rank 0, 1 on rank 1 above), each DDP replica
# trains alone on its own gradient, and a `DistributedSampler` with `num_replicas=1` hands each
# one the whole data set. The model learns (N times over, no faster), it does not sit at zero.
#
# Cheap guards: log `dist.get_rank()` and `dist.get_world_size()` once per process at start-up;
# assert `dist.get_world_size() == int(os.environ["WORLD_SIZE"])` under torchrun; and run the
# sanity all-reduce above, which prints N(N-1)/2 only when the group is whole.
#
# ## Pitfalls
#
# * **Reading the wrong launcher's variables** (section 7): under torchrun, RANK/LOCAL_RANK/WORLD_SIZE.
# * **No `torch.cuda.set_device(local_rank)` on GPUs** (section 1): every rank's current device,
#   CUDA context and plain-`"cuda"` tensors are on GPU 0.
# * **Taking a returned `init_process_group` as proof that all ranks are there** (section 3): NCCL
#   without `device_id`, or gloo with `TORCH_GLOO_LAZY_INIT=1`, connects at the first collective.
# * **No timeout**: a missing peer or a duplicate rank waits 30 min (gloo) / 10 min (NCCL).
# * **`tcp://` under torchrun** (torch 2.13): every rank is a store client; use `env://`.
# * **`new_group` on some ranks only**: it is collective over the default group; call it on all.
# * **`file://` reused**: the file must be new or empty for each initialisation.
# * **Trusting a support table over a run**: check the collectives you need on your backend.
#
# ## Summary
#
# * Backends: gloo for CPU tensors, NCCL for CUDA tensors (one GPU per rank); the docs' table says
#   which collective runs where (gloo's `all_to_all` runs on CPU in 2.13 despite its ✘).
# * One GPU per rank: `torch.cuda.set_device(local_rank)`, `init_process_group(device_id=...)`,
#   `DDP(model, device_ids=[local_rank])` (`gpu_setup.py`).
# * `init_process_group` waits for every rank with gloo's default full-mesh connect, or NCCL with
#   `device_id`; NCCL without it creates its communicator at the first collective.
# * Init methods: `env://` (torchrun's), `tcp://`, `file://`; all three ran above. A short
#   `timeout=` turns a missing peer into an error in seconds.
# * `new_group` makes subgroups (called on every rank); `destroy_process_group()` leaves.
# * broadcast, reduce, all_reduce, all_gather, reduce_scatter, all_to_all, barrier: each checked
#   on 4 ranks against its expected values, and drawn.
# * DDP averages by dividing each gradient by N as it enters its bucket, then all-reducing with SUM
#   (float16 shows the order); a registered comm hook gets the bucket undivided.
# * "Everyone is rank 0" fails loudly at start-up (`DistStoreError: wait timeout`); the article's
#   sanity check prints 6 on 4 ranks.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 04](../CLAIMS.md#chapter-04).
