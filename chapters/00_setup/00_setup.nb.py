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
# # 00 · Check your setup before you debug DDP
#
# **The problem.** The first distributed run on a new machine often fails for reasons that have
# nothing to do with your code: a torch build without CUDA, an NCCL that cannot reach the other
# GPU, a port held by a crashed run, a CPU drowned in threads. The source article tells of three
# days lost to a driver/NCCL mismatch that showed up as a hang (the article's story; we cannot
# check it). You want to know in one minute, before any training code runs.
#
# **The idea.** A *doctor*: small checks that each test one thing for real, above all two
# processes that actually exchange bytes, and say for every failure what to do.
#
# **In this chapter:** run `python -m ddpcourse.doctor`; read each line; measure how all-reduce
# bandwidth depends on message size (with the formulas NCCL's own benchmark uses); and see why the
# article's "NCCL bandwidth test" cannot measure bandwidth at all.

# %%
import os, subprocess, sys, time
from pathlib import Path

ROOT = Path.cwd().resolve().parents[1]   # the notebook runs in chapters/00_setup
from unittest import mock

from ddpcourse import doctor

# %% [markdown]
# ## 1. Run the doctor
#
# This is the command you run on every new machine, from a terminal. Here we run it the same way,
# as a separate process, and show what it prints and its exit code (0: everything available
# passed; 1: something failed).

# %%
start = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "ddpcourse.doctor"], capture_output=True, text=True,
                      timeout=180)
print(done.stdout, done.stderr)
print(f"exit code {done.returncode}, {time.perf_counter() - start:.1f} s")

from ddpcourse.launcher import prestart
prestart()   # start this notebook's rank servers now, so the multi-rank cells below are quick

# %% [markdown]
# ## 2. What each line means
#
# Every check is a plain function in `ddpcourse/doctor.py` that returns a `CheckResult` (name,
# status, detail, advice) and prints nothing; the report is formatted separately. `pass` and
# `fail` mean what they say; `skip` means *does not apply here* (NCCL on a CPU-only machine) and
# `warn` means *works, but watch out*; neither fails the doctor.
#
# | line | what is checked | how |
# |---|---|---|
# | torch | version, CPU or CUDA build, `torch.distributed` present | `torch.__version__`, `torch.version.cuda`, `dist.is_available()` |
# | CUDA | does torch see GPUs, which ones | `torch.cuda.is_available()`, `get_device_name(i)` |
# | NCCL | is NCCL built in, which version | `dist.is_nccl_available()`, [`torch.cuda.nccl.version()`](https://github.com/pytorch/pytorch/blob/main/torch/cuda/nccl.py) (only when CUDA is present) |
# | gloo | is gloo built in (the CPU backend this course runs on) | `dist.is_gloo_available()` |
# | GPU topology | how the GPUs are wired: NVLink (`NV#`), PCIe (`PIX`, `PXB`, `PHB`), across sockets (`SYS`) | `nvidia-smi topo -m`, or "no nvidia-smi" |
# | all_reduce gloo/nccl x2 | two fresh processes all-reduce a tensor with a known sum; time it | `ddpcourse.launcher.run_ranks`; NCCL only with 2+ GPUs |
# | free port | the OS can hand out a free port on loopback | bind port 0 on 127.0.0.1 |
# | port 29500 | `MASTER_PORT` (default 29500) is not held by someone else | bind it |
# | threads | `OMP_NUM_THREADS` vs usable cores | environment, `torch.get_num_threads()` |
#
# The functions can be called one by one, e.g. from a test or here:

# %%
for check in (doctor.check_torch, doctor.check_cuda, doctor.check_nccl, doctor.check_gloo,
              doctor.check_topology):
    result = check()
    print(f"{result.name:13} {result.status:5} ok={result.ok!s:5} {result.detail}")

# %% [markdown]
# ## 3. The all-reduce check: a sum you can verify, a bandwidth you can compare
#
# Two ranks each contribute a tensor: rank *r* puts `(r+1) * (1 + i % 3)` at element *i*. The
# correct result is `n(n+1)/2 * (1 + i % 3)` on every rank, so a missing rank, a doubled chunk or a
# shifted chunk all show. (A popular sanity check, the article's §5.3 among them, has every rank
# contribute `ones * rank`; then rank 0 contributes zeros, and a rank 0 that sends nothing goes
# unnoticed. The article also says that check "should print [4]" on 4 GPUs; run it and see.)

# %%
import torch, torch.distributed as dist
from ddpcourse.launcher import run_ranks

def articles_check(rank, world_size):
    t = torch.ones(1) * rank
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item()

print("4 ranks, ones * rank, summed:", run_ranks(articles_check, 4), " (0+1+2+3 = 6, not 4)")

# %% [markdown]
# **How fast?** NVIDIA's benchmark suite `nccl-tests` reports two bandwidths, defined in its
# [PERFORMANCE.md](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), and the
# doctor uses the same two:
#
# * **algorithm bandwidth** `algbw = S / t`: bytes of the message over the time of one all-reduce.
#   It is what you feel, but it falls as ranks are added even on perfect hardware.
# * **bus bandwidth** `busbw = algbw * 2(n-1)/n`. Every element of the result needs `n-1` additions
#   and `n` copies, i.e. `2(n-1)` transfers, which `n` links share; so at best
#   `t = S * 2(n-1) / (n * B)` for links of speed `B`, and `B = algbw * 2(n-1)/n`. That figure is
#   comparable to the rated speed of the link (NVLink, PCIe, network) whatever `n` is.
#
# For two ranks the factor is exactly 1; for eight it is 1.75; for one rank it is 0. By hand:

# %%
S, t = 4 * 2**20, 5e-3          # 4 MiB all-reduced in 5 ms
for n in (1, 2, 4, 8):
    print(f"n={n}: algbw {doctor.algorithm_bandwidth(S, t) / 1e9:.3f} GB/s, "
          f"busbw {doctor.all_reduce_bus_bandwidth(S, t, n) / 1e9:.3f} GB/s "
          f"(factor {2 * (n - 1) / n:.2f})")

# %% [markdown]
# ### Bandwidth against message size (gloo, 2 ranks, this machine)
#
# One number at 4 MiB hides the shape: small messages cost a fixed latency whatever their size,
# and only large ones approach the link's bandwidth. DDP feels both ends: it groups gradients into
# buckets (`bucket_cap_mb`, 25 MiB by default:
# [DDP docs](https://docs.pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html))
# precisely to send few large messages instead of many small ones.
# `doctor.measure_allreduce` runs the same probe as the doctor for a list of sizes: the median of 5
# timings, each of several back-to-back all-reduces on the slowest rank, after warm-ups. GB/s here
# is 10^9 bytes/s, as in nccl-tests.

# %%
sizes = [4 * 2**10 * 4**k for k in range(7)]     # 4 KiB ... 16 MiB
start = time.perf_counter()
sweep = doctor.measure_allreduce(sizes, world_size=2, backend="gloo")
print(f"measured in {time.perf_counter() - start:.1f} s; every sum correct: "
      f"{all(row['correct'] for row in sweep)}")
print(f"{'size':>9} {'time us':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
for row in sweep:
    print(f"{doctor.human_bytes(row['bytes']):>9} {row['seconds'] * 1e6:>9.1f} "
          f"{row['algbw'] / 1e9:>11.3f} {row['busbw'] / 1e9:>11.3f}")

# %%
import matplotlib.pyplot as plt

kib = [row["bytes"] / 2**10 for row in sweep]
fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
left.loglog(kib, [row["seconds"] * 1e6 for row in sweep], "o-")
left.set(xlabel="message size (KiB)", ylabel="time per all_reduce (us)", title="time")
right.semilogx(kib, [row["busbw"] / 1e9 for row in sweep], "o-", label="busbw")
right.semilogx(kib, [row["algbw"] / 1e9 for row in sweep], "x--", label="algbw (= busbw for n=2)")
right.set(xlabel="message size (KiB)", ylabel="GB/s", title="bandwidth")
right.legend()
for ax in (left, right):
    ax.grid(True, which="both", alpha=0.3)
fig.suptitle("gloo all_reduce on 2 CPU ranks of this machine (loopback TCP)")
plt.tight_layout()
plt.show()

# %% [markdown]
# Read it like an nccl-tests table: the left end is latency, the right end the bandwidth
# your link really gives. Gloo between two processes on one machine goes over loopback TCP, so
# these are CPU/memory figures; on GPUs run the same probe under torchrun
# (`torchrun --standalone --nproc_per_node 2 chapters/00_setup/allreduce_bandwidth.py` picks NCCL
# when each rank has a GPU) and compare busbw with your link's rated speed, which
# `nvidia-smi topo -m` tells you the type of. On a shared machine the numbers move from run to
# run; the shape is what to look at.
#
# ## 4. The article's "NCCL bandwidth test" measures nothing
#
# The article's environment check (§4.1) has the comment *"test NCCL bandwidth (should be
# [above] 12 GB/s)"* on top of a one-liner that calls
# `init_process_group("nccl", init_method="tcp://127.0.0.1:29500", rank=0, world_size=1)` and
# prints `OK`. With `world_size=1` the group has a single member: there is no one to send bytes
# to. Worse, NCCL creates its communicator lazily, on the first collective, unless
# `init_process_group` gets a `device_id`
# ([docs](https://docs.pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group));
# the one-liner runs no collective, so NCCL is not even initialised. "OK" proves that torch
# imports and that port 29500 was free.
#
# The same test with gloo, plus an all-reduce of 16 MiB, so you can see it move nothing
# (`chapters/00_setup/one_rank_all_reduce.py`; `--backend nccl` runs it with the article's
# backend on a GPU machine):

# %%
done = subprocess.run([sys.executable, "chapters/00_setup/one_rank_all_reduce.py"], cwd=ROOT,
                      capture_output=True, text=True, timeout=120)
print(done.stdout, done.stderr)
two_ranks = next(row for row in sweep if row["bytes"] == 16 * 2**20)
print(f"for comparison, 16 MiB between 2 real ranks (above): {two_ranks['seconds'] * 1e6:.0f} us, "
      f"busbw {two_ranks['busbw'] / 1e9:.2f} GB/s")

# %% [markdown]
# The one-rank "all-reduce" finishes faster than a single memory copy of the tensor and
# returns its input: nothing was summed and nothing was sent, and the bus-bandwidth formula says
# so too (factor `2(n-1)/n = 0`). A bandwidth test needs at least two ranks, and on GPUs at least
# two GPUs: the doctor skips its NCCL all-reduce on machines with fewer.
#
# ## 5. Ports: who picks them, and what a busy one looks like
#
# Processes of a group meet at a rendezvous address. `torchrun --standalone`, and in torch 2.13
# also a single-node `torchrun` without `--master-port`, rendezvous at `localhost:0`: the OS picks
# a free port (see `run()` in
# [torch/distributed/run.py](https://github.com/pytorch/pytorch/blob/main/torch/distributed/run.py)).
# Port 29500 is torchrun's `--master-port` default, used by multi-node static rendezvous and by
# scripts that set `MASTER_PORT=29500` by hand, like the article's. A rank left over from a crashed
# run keeps holding it, and the next launch fails with `EADDRINUSE`. Here is torchrun choosing its
# own port, and setting `OMP_NUM_THREADS` (next section):

# %%
import tempfile
with tempfile.TemporaryDirectory() as tmp:
    probe = Path(tmp, "show_env.py")
    probe.write_text("import os\nprint(os.environ['RANK'], 'MASTER_PORT =', os.environ['MASTER_PORT'], "
                     "'OMP_NUM_THREADS =', os.environ.get('OMP_NUM_THREADS'), flush=True)\n")
    torchrun = Path(sys.executable).parent / "torchrun"
    done = subprocess.run([str(torchrun), "--nproc_per_node", "2", str(probe)],
                          capture_output=True, text=True, timeout=120)
print(done.stdout)

# %% [markdown]
# The doctor's two port checks: can the OS give a free port (bind port 0), and is
# `MASTER_PORT` (29500 unless set) free. Here we hold a port ourselves, as a stuck rank would, and
# ask the check about it:

# %%
import socket
with socket.socket() as squatter:
    squatter.bind(("", 0))
    squatter.listen()
    busy = squatter.getsockname()[1]
    result = doctor.check_master_port(busy)
print(doctor.format_report([doctor.check_free_port(), result]))

# %% [markdown]
# ## 6. Threads
#
# On a CPU every rank is a process with its own pool of intra-op threads (by default one per
# core). Four ranks with four threads each on a four-core machine is sixteen busy threads fighting
# for four cores. That is why `torchrun` sets `OMP_NUM_THREADS=1` in each worker when you did not
# set it and start more than one process per node (it prints a warning saying so; the output
# above shows the value). The doctor warns when `OMP_NUM_THREADS` asks for more threads than there
# are cores. The course's rank launcher gives each rank `cores // world_size` threads.

# %%
print(doctor.check_threads())
with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "64"}):
    print(doctor.check_threads())

# %% [markdown]
# ## 7. A failure, and what the doctor says about it
#
# Every check that does not pass gets a *what to do* line, and any failure makes the exit code
# 1, so a lab can put `python -m ddpcourse.doctor` in front of a job script. Here we make the gloo
# all-reduce fail the way it fails when two processes cannot connect:

# %%
refused = RuntimeError("[gloo] Connection refused (while connecting rank 1 to rank 0)")
with mock.patch.object(doctor, "measure_allreduce", side_effect=refused):
    results = [doctor.check_gloo(), doctor.check_gloo_all_reduce()]
print(doctor.format_report(results))
print("exit code:", doctor.exit_code(results))

# %% [markdown]
# ## Pitfalls
#
# * **A one-rank test proves nothing about communication.** `world_size=1` (the article's
#   check) moves zero bytes; with NCCL it does not even create a communicator.
# * **`nvidia-smi` shows GPUs but torch does not.** A CPU-only torch wheel (`torch.version.cuda`
#   is `None`), a driver older than the CUDA torch was built for, or `CUDA_VISIBLE_DEVICES`
#   hiding them. The CUDA line tells which.
# * **NCCL on a single GPU.** NCCL wants one GPU per rank; two ranks on one GPU are refused. The
#   doctor only runs the NCCL all-reduce with 2+ GPUs.
# * **Bandwidth from one message size.** Small messages measure latency; look at the whole
#   curve, and compare *bus* bandwidth with the link's rated speed.
# * **Sanity checks that cannot fail.** `ones * rank` lets rank 0 contribute nothing unnoticed;
#   use values that differ per rank and per element, and know the exact expected sum.
# * **A fixed port held by a stuck rank.** Prefer `torchrun --standalone`; find the holder with
#   `ss -ltnp 'sport = :29500'`.
# * **Thread oversubscription on CPU.** ranks × threads per rank should not exceed the cores.
#
# ## Summary
#
# * `python -m ddpcourse.doctor` checks torch, CUDA, NCCL, gloo, the GPU topology, a real 2-rank
#   all-reduce per backend, ports and threads, and says what to do about each failure; exit code
#   1 on failure.
# * `busbw = algbw * 2(n-1)/n` (nccl-tests) is the all-reduce figure to compare across rank counts
#   and against hardware; it is 0 for one rank.
# * Bandwidth depends on message size: latency dominates small messages, which is why DDP sends
#   gradients in large buckets.
# * The article's `world_size=1` "bandwidth test" only shows that the library loads.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 00](../CLAIMS.md#chapter-00).
