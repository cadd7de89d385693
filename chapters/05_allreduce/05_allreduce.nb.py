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
# # 05 · AllReduce by hand: from send/recv to a ring, and from a ring to DDP
#
# **The problem.** After `backward()`, every rank holds gradients computed on its own slice of the
# batch; DDP must replace each of them by the mean over all ranks, every step, for every parameter.
# How much data does that move, through whom, in how many steps, and how does DDP hide the cost?
#
# **The idea.** An all-reduce can be built from point-to-point messages alone. Sending everything
# to rank 0 works but makes rank 0's link carry `2(N-1)` copies of the tensor. A **ring** cuts the
# tensor into N chunks and does a *reduce-scatter* then an *all-gather*: every rank sends only
# `2(N-1)/N` of the tensor, the least any algorithm built from point-to-point messages can (the
# bound nccl-tests' bus bandwidth is built on; switches that do the additions themselves go
# below it, section 3). **Halving-doubling** needs `2·log2 N` steps instead of `2(N-1)`, which
# matters when messages are small and each step costs a fixed latency. DDP then adds two ideas on top: launch
# the all-reduces *during* backward (overlap), and pack small gradients into *buckets*.
#
# Everything below runs in real process groups (`run_ranks`, or `torchrun` for the benchmark; gloo
# on CPU). The algorithms live in `hand_collectives.py` (**it contains the answer to exercise 05's
# `ring_allreduce`: solve the exercise first**, see the end of this notebook).
#
# **Article claims checked here.** The article (section 3.3) describes AllReduce as "sum the four
# gradients, average, then broadcast the average to every card", and says NCCL's AllReduce is
# "atomic" with a latency under 5 µs thanks to GPUDirect RDMA. Sum-then-broadcast is the *naive*
# scheme of section 2, whose first rank carries N-1 times the traffic; NCCL uses rings and trees
# instead (sections 3 and 5). "Atomic" has no meaning for a collective: it is many point-to-point
# messages in steps, each rank waiting on its peers (section 1 shows two ranks waiting forever). The 5 µs is the article's own GPU figure; it cannot be checked on this
# CPU machine, where the latency of a small gloo all-reduce is measured in section 6.

# %%
import inspect, json, math, os, sys, tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from ddpcourse import timing
from ddpcourse.launcher import RankTimeoutError, prestart, run_bounded, run_ranks

ROOT = Path.cwd().resolve().parents[1]   # the notebook runs in chapters/05_allreduce
sys.path.insert(0, str(Path.cwd()))     # the ranks import the chapter's modules too
prestart()
import broadcast_parameters
import hand_collectives as hc
import ring_vs_gloo
import three_ddp_designs

def show(fn):
    print(inspect.getsource(fn))


# %% [markdown]
# ## 1. Point-to-point: send, recv, isend, irecv
#
# `dist.send(tensor, dst)` and `dist.recv(tensor, src)` block until the transfer is done;
# `dist.isend` / `dist.irecv` return at once with a work handle whose `.wait()` blocks
# ([docs, point-to-point communication](https://docs.pytorch.org/docs/stable/distributed.html#point-to-point-communication)).
# `recv` writes into a tensor you allocated, so both sides must agree on its size and dtype. Each
# rank passes its rank to its right neighbour; the send is posted *asynchronously* before the
# blocking receive:

# %%
def pass_right(rank, world_size):
    token, incoming = torch.tensor([float(rank)]), torch.empty(1)
    request = dist.isend(token, (rank + 1) % world_size)
    dist.recv(incoming, (rank - 1) % world_size)
    request.wait()
    return f"rank {rank} got {incoming.item():g} from rank {(rank - 1) % world_size}"

run_ranks(pass_right, 4)


# %% [markdown]
# Why asynchronous? Two ranks that both call the blocking `send` first, then `recv`, never
# finish on gloo, even with a 4 KB tensor: here a blocking gloo `send` does not return before the
# peer receives, and both peers are still sending. `run_ranks` kills them at its deadline (3 s):

# %%
def both_send_first(rank, world_size):
    dist.send(torch.ones(1000), 1 - rank)      # blocks: the peer is not receiving yet
    dist.recv(torch.empty(1000), 1 - rank)

try:
    run_ranks(both_send_first, 2, timeout=3, relay_output=False)
except RankTimeoutError as error:
    print(str(error).splitlines()[0])

# %% [markdown]
# ## 2. The naive all-reduce: everything through rank 0
#
# The article's picture: every rank sends its tensor to rank 0, rank 0 adds them up and sends the
# sum back to everyone.

# %%
show(hc.naive_allreduce)

# %% [markdown]
# How many bytes does each rank *send*? `hc.count_traffic()` wraps `dist.isend`/`dist.send`
# inside the block and counts. A 1 MiB tensor, 2 to 6 ranks, the three algorithms of this chapter:

# %%
MiB = 2**20

def bytes_sent(rank, world_size, numel=MiB // 4):
    sent = {}
    for name, algorithm in hc.ALGORITHMS.items():
        tensor = torch.ones(numel)
        with hc.count_traffic() as counted:
            algorithm(tensor)
        assert torch.equal(tensor, torch.full_like(tensor, world_size))  # and it is the sum
        sent[name] = dict(counted)
    return sent

traffic = {n: run_ranks(bytes_sent, n) for n in range(2, 7)}
print(f"{'N':>2} {'algorithm':<17}{'rank 0 sends':>13}{'others send':>17}{'messages':>10}"
      f"{'2(N-1)/N':>10}")
for n, per_rank in traffic.items():
    for name in hc.ALGORITHMS:
        others = [r[name]["bytes"] / MiB for r in per_rank[1:]]
        spread = f"{min(others):.3f}" + (f"-{max(others):.3f}" if max(others) - min(others) > 1e-3 else "")
        print(f"{n:>2} {name:<17}{per_rank[0][name]['bytes'] / MiB:>9.3f} MiB{spread:>13} MiB"
              f"{per_rank[0][name]['messages']:>10}{2 * (n - 1) / n:>10.3f}")

# %%
ns = list(traffic)
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, style in (("naive", "o-"), ("ring", "s-"), ("halving_doubling", "^--")):
    busiest = [max(r[name]["bytes"] for r in traffic[n]) / MiB for n in ns]
    ax.plot(ns, busiest, style, label=name)
ax.plot(ns, [2 * (n - 1) / n for n in ns], "k:", label="2(N-1)/N (the bound)")
ax.set_xlabel("ranks N"); ax.set_ylabel("MiB sent by the busiest rank")
ax.set_title("All-reduce of a 1 MiB tensor: what the busiest rank sends (measured)")
ax.legend(); plt.tight_layout(); plt.show()

# %% [markdown]
# Rank 0 of the naive scheme sends `(N-1)` copies (and receives as many): its link carries
# work that grows linearly with N, while the other links sit idle most of the time. The ring keeps
# every rank at `2(N-1)/N` of the tensor, under 2 copies whatever N is. Halving-doubling hits the
# same bound when N is a power of two; at N = 3, 5, 6 the ranks beyond the power of two first
# hand their whole tensor to a partner (the fold-in), so some ranks send more.
#
# ## 3. Ring all-reduce = reduce-scatter + all-gather
#
# Cut the tensor into N chunks. In **reduce-scatter** step s, rank r sends chunk `r - s` to its
# right neighbour and adds the chunk `r - s - 1` arriving from its left one; after N-1 steps, rank
# r holds the complete sum of chunk `r + 1`. In **all-gather**, the complete chunks travel once
# more around the ring, copied instead of added. Each step moves one chunk (`1/N` of the tensor)
# per rank, `2(N-1)` steps in all, hence `2(N-1)/N`:

# %%
show(hc.ring_allreduce)


# %% [markdown]
# To *see* the steps, rank r starts with `2**r` in every element: any sum then spells which
# ranks contributed (7 = 1+2+4: ranks 0, 1, 2). `on_step` records every rank's tensor after each
# step; a cell is outlined when it changed in that step:

# %%
def record_steps(rank, world_size, algorithm):
    tensor = torch.full((world_size,), float(2**rank))       # one element per chunk
    snapshots = [("start", -1, tensor.tolist())]
    getattr(hc, algorithm)(tensor, on_step=lambda phase, step, t: snapshots.append((phase, step, t.tolist())))
    return snapshots

def contributors(value):
    return [r for r in range(8) if int(value) >> r & 1]

def draw_steps(per_rank, title, columns=4):
    n, steps = len(per_rank), len(per_rank[0])
    rows = -(-steps // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.7 * columns, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for k in range(steps):
        ax = axes.flat[k]
        phase, step, _ = per_rank[0][k]
        ax.set_title(phase if step < 0 else f"{phase} {step + 1}", fontsize=9)
        ax.set_xlim(0, n); ax.set_ylim(n, 0)
        for rank in range(n):
            ax.text(-0.1, rank + 0.5, f"rank {rank}", ha="right", va="center", fontsize=8)
            for chunk, value in enumerate(per_rank[rank][k][2]):
                who = contributors(value)
                changed = k > 0 and value != per_rank[rank][k - 1][2][chunk]
                ax.add_patch(plt.Rectangle((chunk, rank), 1, 1, facecolor=plt.cm.Blues(len(who) / n * 0.8),
                                           edgecolor="red" if changed else "white", lw=2 if changed else 1))
                ax.text(chunk + 0.5, rank + 0.5, "+".join(map(str, who)), ha="center", va="center",
                        fontsize=7, color="white" if len(who) == n else "black")
        for chunk in range(n):
            ax.text(chunk + 0.5, n + 0.3, f"chunk {chunk}", ha="center", va="center", fontsize=7)
    fig.suptitle(title, fontsize=10)
    plt.tight_layout(); plt.show()

ring_steps = run_ranks(record_steps, 4, "ring_allreduce")
draw_steps(ring_steps, "Ring all-reduce on 4 ranks, measured: which ranks' data each chunk holds "
           "(red: changed in this step)")

# %% [markdown]
# Reading the picture: after reduce-scatter 3, rank r holds the full sum `0+1+2+3` of one
# chunk only, chunk `r+1` (a diagonal): that is exactly what `dist.reduce_scatter` would leave.
# The all-gather row then copies those finished chunks around until every rank has all four.
#
# **Why `2(N-1)/N` is the floor, for point-to-point algorithms** (the argument of [nccl-tests'
# PERFORMANCE.md](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)): every
# output element is a sum of N inputs that live on N different ranks, so it takes N-1 additions
# and N assignments, `2(N-1)` transfers of that element, wherever they happen. Spread over N ranks
# each with its own link of bandwidth B, an all-reduce of S bytes takes at least
# `t = 2(N-1)/N · S / B`. The ring reaches it (the measured 1 MiB table above equals the formula
# exactly); the naive scheme's rank 0 carries `N-1` times S instead.
#
# The argument assumes that the ranks do the additions, exchanging data with sends and receives;
# PERFORMANCE.md says so in bold ("independent of the algorithm used (ring, tree, or other) as
# long as they use point-to-point operations"). **In-network reduction** drops that assumption:
# the switch adds. NVLink SHARP (NCCL's `NVLS` and `NVLSTree` algorithms) offloads the all-reduce
# to the NVLink switches, and IB SHARP does the same in InfiniBand switches (NCCL's maintainers in
# [NVIDIA/nccl#1031](https://github.com/NVIDIA/nccl/issues/1031)); NCCL reaches IB SHARP through
# its `CollNet` algorithms and the NCCL-RDMA-SHARP network plugin
# ([HPC-X docs](https://docs.nvidia.com/networking/display/hpcxv226/NCCL-RDMA-SHARP-Plugins)).
# nccl-tests' summary table gives it its own bus-bandwidth factor, `(n-1)/(n+1)` instead of
# `2(n-1)/n`, which its `AllReduceGetBw` ([src/all_reduce.cu](https://github.com/NVIDIA/nccl-tests/blob/master/src/all_reduce.cu))
# applies when `NCCL_ALGO` is `NVLS` or `NVLSTREE`. So `2(N-1)/N` is the lower bound for
# algorithms made of point-to-point messages, like every algorithm in this chapter, not for every
# all-reduce.
#
# ## 4. Two bandwidths: algbw and busbw
#
# nccl-tests ([PERFORMANCE.md](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)) reports two numbers per message size S and time t:
#
# * **algbw = S / t**, the user's view: how long it takes to all-reduce S bytes.
# * **busbw = algbw · 2(N-1)/N** for all-reduce, the hardware's view: what each rank's link
#   actually carried per second, by the bound above. It does not depend on N, so it compares
#   directly with a link's peak bandwidth and across world sizes (a perfect ring on N = 2 and on
#   N = 8 show the same busbw; their algbw differ). For reduce-scatter and all-gather the factor is
#   `(N-1)/N`, for broadcast and reduce 1; for an all-reduce by in-network reduction
#   `(N-1)/(N+1)` (section 3).
#
# `ring_vs_gloo.bus_factor` computes both all-reduce factors. Reaching the same busbw, an
# in-network all-reduce has an algbw `2(N-1)/N ÷ (N-1)/(N+1) = 2(N+1)/N` times higher, so it
# finishes that much sooner (that is what the switch's additions buy, by nccl-tests' formulas):

# %%
print(f"{'N':>4}{'point-to-point 2(N-1)/N':>25}{'in-network (N-1)/(N+1)':>24}{'algbw ratio':>13}")
for n in (2, 4, 8, 16, 72):
    p2p, inn = ring_vs_gloo.bus_factor(n), ring_vs_gloo.bus_factor(n, in_network=True)
    print(f"{n:>4}{p2p:>25.3f}{inn:>24.3f}{p2p / inn:>13.2f}")

# %% [markdown]
# GB/s below means 10^9 bytes per second, as in nccl-tests.
#
# ## 5. Fewer steps: recursive halving, then recursive doubling
#
# A ring needs `2(N-1)` steps: with N = 64 ranks, 126 rounds of messages, each paying the
# network's fixed latency. **Halving-doubling** (Rabenseifner's algorithm) pairs rank r with
# `r XOR 2^k`: in each halving step a pair splits its current range, each keeps one half and adds
# the partner's copy of it, so after `log2 N` steps rank r holds the sum of chunk r; doubling runs
# the same pairs backwards, swapping finished halves. `2·log2 N` steps, and still `2(N-1)/N` bytes
# per rank when N is a power of two (other N: the extra ranks fold in first, see above).

# %%
show(hc.halving_doubling_allreduce)

# %%
hd_steps = run_ranks(record_steps, 4, "halving_doubling_allreduce")
draw_steps(hd_steps, "Halving-doubling on 4 ranks, measured (partners: rank XOR 2, then XOR 1, "
           "then back)", columns=5)
print(f"{'N':>5}{'ring steps 2(N-1)':>19}{'halving-doubling 2 log2 N':>27}")
for n in (2, 4, 8, 16, 64, 256):
    print(f"{n:>5}{2 * (n - 1):>19}{2 * (n.bit_length() - 1):>27}")

# %% [markdown]
# A simple cost model makes the trade-off explicit: a step that moves m bytes costs about
# `α + m/B` (α: latency per message). Ring: `2(N-1)·α + 2(N-1)/N · S/B`; halving-doubling:
# `2 log2 N · α + 2(N-1)/N · S/B`. Same bandwidth term, fewer latency terms: halving-doubling
# wins on small messages and large N, and the two tie on large messages. (Real libraries pick
# per call: NCCL's tuning model switches between ring and tree by size, node count and bandwidth,
# as its maintainer explains in [NVIDIA/nccl#754](https://github.com/NVIDIA/nccl/issues/754);
# `NCCL_ALGO` forces one.) At N = 2 both algorithms do the very same two exchanges.
#
# Before timing anything: all three hand algorithms against `dist.all_reduce`, on 1 to 4 ranks,
# lengths that do not divide by N, fewer elements than ranks, integer, float64 and 2-D tensors:

# %%
show(hc.check_against_all_reduce)
for n in (1, 2, 3, 4):
    wrong = run_ranks(hc.check_against_all_reduce, n)
    print(f"{n} ranks:", "every algorithm equals dist.all_reduce" if not any(wrong) else wrong)

# %% [markdown]
# ## 6. Measured: the hand ring against gloo's own all-reduce
#
# `ring_vs_gloo.py` times the hand ring, hand halving-doubling and `dist.all_reduce` (gloo here;
# NCCL on GPUs) for each message size: correctness first (against `dist.all_reduce` on random
# data), then two warm-up calls, then `--repeats` timings of `k` back-to-back calls each after a
# barrier, the three algorithms taking turns inside each repeat (so a burst of load from other
# programs hits all three alike), each timing taken on the slowest rank. It reports the **best**
# repeat and the median, and computes bandwidths from the best: on a small VM the scheduler adds
# long, irregular delays to small messages, so the median of a quiet run can lie far above a best
# time that the quiet moments reproduce (the verdict below checks that they do).
#
# A timing on a shared machine is part signal, part noise, and this notebook cannot know how busy
# your machine is. So the conclusions of this section rest on the chapter's **recorded reference
# runs**: the full sweep (4 KiB to 64 MiB, 20 repeats) on 2 and on 4 ranks, committed under
# `benchmarks/results/` with the machine, the date, the torch version, how busy the machine was
# and the command that reproduces each (under a minute per world size on 2 cores):
#
# ```bash
# torchrun --standalone --nproc_per_node 2 chapters/05_allreduce/ring_vs_gloo.py --full --out benchmarks/results/ch05_ring_vs_gloo_ws2.json
# torchrun --standalone --nproc_per_node 4 chapters/05_allreduce/ring_vs_gloo.py --full --out benchmarks/results/ch05_ring_vs_gloo_ws4.json
# ```
#
# The notebook runs a short live version (4 sizes, 15 repeats, 2 and 4 ranks) and plots it beside
# the reference. The live run comes with a verdict from `ddpcourse.timing`: how many cores other
# programs kept busy just before the timings, and whether each point's best repeat was reproduced
# (its second-best within 20%). And it carries its own noise gauge: **on 2 ranks the ring and
# halving-doubling send the very same two messages** (one exchange of half the tensor with the other rank, then
# one more; section 2 counted them), so any gap between their two times measures the machine,
# not the algorithms.

# %%
reference = {n: timing.load_reference(f"ch05_ring_vs_gloo_ws{n}.json") for n in (2, 4)}
sweeps = {}
out_dir = Path(tempfile.mkdtemp())
for n in (2, 4):
    out = out_dir / f"ws{n}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           "chapters/05_allreduce/ring_vs_gloo.py", "--sizes", "4K", "256K", "4M", "16M",
           "--repeats", "15", "--out", str(out)]
    done = run_bounded(cmd, 120, cwd=ROOT)
    print(done.stdout if done.returncode == 0 else done.stdout + done.stderr[-3000:])
    sweeps[n] = json.loads(out.read_text())

# %% [markdown]
# The verdict on the whole live run (both world sizes), and the noise gauge:

# %%
def live_verdict(sweeps):
    """ddpcourse.timing's verdict on every live point, and the noise gauge: the 2-rank gap
    between ring and halving-doubling furthest from 1, and whether it is within MAX_SPREAD."""
    timings = {f"N={n}, {name}": t for n, report in sweeps.items()
               for name, t in ring_vs_gloo.row_timings(report["rows"]).items()}
    busiest = max((report["load"] for report in sweeps.values()), key=lambda load: load["busy_cores"])
    verdict = timing.judge(timings, timing.Load(busiest["busy_cores"], busiest["cores"], busiest["source"]))
    size, gap = ring_vs_gloo.worst_gap(sweeps[2]["rows"])
    return verdict, abs(math.log(gap)) <= math.log(1 + timing.MAX_SPREAD), (size, gap)

verdict, gauge_ok, (size, gap) = live_verdict(sweeps)
print(verdict)
print(f"noise gauge: on 2 ranks, ring / halving-doubling time = {gap:.2f} at "
      f"{ring_vs_gloo.human(size)}, the largest gap of this run (1.00: no noise)"
      + ("" if gauge_ok else f": more than {100 * timing.MAX_SPREAD:.0f}% either way, so this "
         "run is NOT conclusive whatever the verdict says"))
ref_size, ref_gap = ring_vs_gloo.worst_gap(reference[2]["rows"])
print(f"the reference run's largest gap: {ref_gap:.2f} at {ring_vs_gloo.human(ref_size)}")

# %%
colors = {"ring": "tab:blue", "halving_doubling": "tab:green", "gloo": "tab:red"}
fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
for row, n in enumerate((2, 4)):
    ax_time, ax_bus = axes[row]
    for source, report, style, alpha in (("reference", reference[n], "--", 0.45),
                                         ("this run", sweeps[n], "o-", 1.0)):
        for name, color in colors.items():
            rows = [r for r in report["rows"] if r["algorithm"] == name]
            sizes = [r["bytes"] for r in rows]
            label = f"{name} ({source})"
            ax_time.loglog(sizes, [r["best_s"] * 1e6 for r in rows], style, color=color, alpha=alpha,
                           label=label)
            ax_bus.semilogx(sizes, [r["busbw_GBps"] for r in rows], style, color=color, alpha=alpha,
                            label=label)
    ax_time.set(ylabel="time per all-reduce (µs)", title=f"N={n}: time (best repeat, slowest rank)")
    ax_bus.set(ylabel="busbw (GB/s)", title=f"N={n}: bus bandwidth = S/t · 2(N-1)/N")
for ax in axes[1]:
    ax.set_xlabel("message bytes")
axes[0][1].legend(fontsize=7)
fig.suptitle(f"dashed: {timing.describe(reference[2])}\n"
             f"solid: this run, {'conclusive' if verdict.conclusive and gauge_ok else 'not conclusive'}"
             f" ({verdict.reasons[0]})", fontsize=9)
plt.tight_layout(); plt.show()

# %% [markdown]
# The reference runs as a table (busbw in GB/s from the best of 20 repeats, each on the slowest rank):

# %%
sizes = list(dict.fromkeys(r["bytes"] for r in reference[2]["rows"]))
busbw = {(n, r["bytes"], r["algorithm"]): r["busbw_GBps"] for n in (2, 4) for r in reference[n]["rows"]}
print(f"{'':>8} |{'N = 2':^40}|{'N = 4':^40}")
print(f"{'size':>8} |" + 2 * f"{'ring':>10}{'halv.-d.':>10}{'gloo':>10}{'ring/gloo':>10}|")
for nbytes in sizes:
    line = f"{ring_vs_gloo.human(nbytes):>8} |"
    for n in (2, 4):
        ring, hd, gloo = (busbw[(n, nbytes, name)] for name in ("ring", "halving_doubling", "gloo"))
        line += f"{ring:>10.3f}{hd:>10.3f}{gloo:>10.3f}{ring / gloo:>10.2f}|"
    print(line)
for n in (2, 4):
    print(f"N={n}: {timing.describe(reference[n])}; verdict when recorded: "
          f"{reference[n]['verdict'].splitlines()[0]}")

# %% [markdown]
# **Reading the reference runs** (the dashed lines and the table; both records passed their own
# checks when recorded: a quiet machine and reproducible best times, with two isolated points of
# the 24 flagged on 4 ranks). Two regimes, as the cost model of section 5 predicts:
#
# * **Small messages are latency.** On 2 ranks every algorithm took about half a millisecond at
#   best for every size from 4 KiB to 256 KiB: 64 times the bytes, the same time. On 4 ranks (two
#   per core) halving-doubling, with 4 steps, beat the ring, with 6, at every size up to 256 KiB,
#   by roughly the ratio of their step counts; on 2 ranks, where the two are the same exchanges,
#   their best times agreed within the noise gauge at every size. This is why DDP packs small
#   gradients into buckets.
# * **Large messages are bandwidth**, and there the hand ring comes close to gloo's C++
#   all-reduce, but not all the way: from 1 to 16 MiB it reached 0.78 to 0.90 of gloo's bus
#   bandwidth on both world sizes, a gap larger than the gauge, and at 64 MiB on 2 ranks gloo was
#   far ahead. Both move `2(N-1)/N` of the bytes through gloo's loopback TCP transport; what gloo
#   does better (its own algorithm, fewer copies, overlapping the additions with the transfers) we
#   did not take apart. The plateau, about 1 to 1.4 GB/s of bus bandwidth for gloo on 2 ranks, is
#   what 2 shared CPU cores can copy, add and push through loopback TCP: it says nothing about a
#   GPU interconnect (measure that with nccl-tests).
#
# Why not simply print a table of medians from a live run, as benchmark write-ups usually do?
# Because medians of a few repeats on a busy small VM measure its scheduler: such a table can
# make the hand ring "keep up with gloo" on one run and lose by several times on the next, and
# on 2 ranks it can show ring and halving-doubling, the very same exchanges, far apart. The
# gauge in the live cell above shows that on your machine: wherever the two differ by more than
# its tolerance, the load, not the algorithm, set the times. The conclusions here rest on the
# records, which state their load and passed their own checks.

# %% [markdown]
# ## 7. From averaged gradients to DDP: three designs
#
# The DDP paper, Li et al., [*PyTorch Distributed: Experiences on Accelerating Data Parallel
# Training*, VLDB 2020](https://arxiv.org/abs/2006.15704), section 3, builds DDP in steps. Three of them, each run in
# `three_ddp_designs.py` on the same MLP (6 hidden layers of 256, 14 parameter tensors, 1.5 MiB
# of gradients), the same global batches and SGD:
#
# 1. **naive**: `loss.backward()`, then one blocking all-reduce per parameter (`average_gradients`,
#    exercise 05's first task). Communication starts only when backward is over.
# 2. **hooks**: `Tensor.register_post_accumulate_grad_hook`
#    ([docs](https://docs.pytorch.org/docs/stable/generated/torch.Tensor.register_post_accumulate_grad_hook.html))
#    calls a hook once a leaf's `.grad` is final for this backward; the hook launches an
#    *asynchronous* all-reduce of that gradient, so the last layer's gradients travel while
#    autograd still computes the first layers'. Before `optimizer.step()`, wait for all of them.
# 3. **DDP**: `DistributedDataParallel(model, bucket_cap_mb=0.3)`: the same overlap, but gradients
#    are copied into flat **buckets** and each bucket is all-reduced once it is full, so 14 small
#    messages become a few large ones (section 6 showed how poor small messages are). A comm hook
#    ([`register_comm_hook`](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L2178)) wraps the all-reduce to
#    count the buckets. Writing this bucketed, overlapping DDP yourself is exercise 05's `BucketedDDP`
#    (in `bucketed_ddp.ipynb`), so it is not written out here.

# %%
show(three_ddp_designs.HookAllReduce)
load = timing.machine_load()
designs = run_ranks(three_ddp_designs.run_designs, 2, steps=12)
print(three_ddp_designs.format_report(designs[0], 2))
print("same weights at the end (designs and ranks, within 1e-6):", three_ddp_designs.same_weights(designs[0]))
print("elements per DDP all-reduce, step 1 and step 2:", designs[0]["ddp"]["elements_per_call"][:2])
# every step after the first is a repeat: its min, median and spread, and the verdict
step_timings = {d: timing.Timing.of(r["step_times_s"][1:]) for d, r in designs[0].items()}
for d, t in step_timings.items():
    print(f"{d:<13}{t}")
design_verdict = timing.judge(step_timings, load)
print(design_verdict)

# %%
names = list(designs[0])
fig, ax = plt.subplots(figsize=(6, 3))
ax.barh(names, [step_timings[d].min * 1e3 for d in names],
        color=["lightgray", "tab:red", "tab:orange", "tab:blue"])
for i, d in enumerate(names):
    ax.text(step_timings[d].min * 1e3, i, f"  {max(designs[0][d]['calls_per_step'][1:])} all-reduces",
            va="center", fontsize=8)
ax.invert_yaxis(); ax.set_xlabel("best step time after the first (ms), slowest of 2 ranks")
ax.set_title(f"Same model, same data, 2 ranks on CPU/gloo (this run: {'conclusive' if design_verdict.conclusive else 'not conclusive'})", fontsize=10)
plt.tight_layout(); plt.show()

# %% [markdown]
# What the counts say (they do not depend on the machine): naive and hooks make one
# all-reduce per parameter tensor with a gradient (14 here); DDP makes **one** in its first step,
# because it puts every parameter in one bucket until it has seen the order in which gradients
# arrive ([distributed.py L150-L154](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L150-L154)), and from
# step 2 on a few buckets, each closed once it *reaches* the cap: a bucket can exceed
# `bucket_cap_mb` by up to one tensor (two 256×256 weights per 0.3 MiB bucket above). All three end
# with the same weights: to the last bit on 2 ranks; on 4 ranks DDP differed from the others by
# 1e-8 while writing this chapter (the buckets change the order of the float additions).
#
# What the times say depends on how busy your machine is: read the chart with the verdict printed
# above it. The counts, with the recorded reference sweep of section 6, say what to expect:
#
# * **Buckets pay on a latency-bound transport.** Every all-reduce costs a fixed time whatever its
#   size: the reference run's smallest messages (printed below) took hundreds of microseconds on
#   gloo, and naive and hooks pay that 14 times per step where DDP pays it for each of its few
#   buckets. The cell below turns the counts and the recorded latency into that fixed cost per step.
# * **Overlap cannot gain much on a CPU.** gloo's all-reduce is carried out by CPU threads (the TCP
#   transfers and the additions), and they compete for the *same cores* as the backward pass they
#   are supposed to hide behind, so "at the same time" mostly means "interleaved"; and the backward
#   of this small MLP is short, so there is little to hide behind. Hooks and naive send the same
#   14 messages; any gap between their times is what overlap won on this machine, or noise, as
#   the verdict says.
# * On GPUs the picture changes: NCCL runs its kernels on a separate CUDA stream while the
#   backward kernels keep the compute units busy, so a bucket's all-reduce really runs while the
#   backward of earlier layers is computed; the paper reports overlap and bucketing as what makes
#   DDP scale (its measurements, not repeated here).

# %%
smallest = min(r["bytes"] for r in reference[2]["rows"])
latency = next(r["best_s"] for r in reference[2]["rows"]
               if r["bytes"] == smallest and r["algorithm"] == "gloo")
print(f"reference run, 2 ranks: one gloo all-reduce of {ring_vs_gloo.human(smallest)} took "
      f"{latency * 1e6:.0f} µs at best ({timing.describe(reference[2])})")
for d in ("naive", "hooks", "ddp"):
    calls = max(designs[0][d]["calls_per_step"][1:])
    print(f"{d:<6}: {calls:>2} all-reduces per step -> at least {calls * latency * 1e3:.1f} ms of "
          "fixed cost per step, before a byte of bandwidth")

# %% [markdown]
# ## 8. Why DDP broadcasts rank 0's parameters when it is built
#
# Averaging gradients gives every rank the **same update**. That keeps identical replicas
# identical, but it does nothing for replicas that start apart: with SGD, `w_r - w_0` stays exactly
# what it was at initialisation, forever. `broadcast_parameters.py` builds each rank's model with
# seed = rank and trains it three ways: averaged gradients only; the same after `dist.broadcast`
# of every parameter and buffer from rank 0; and DDP. (**The function shown below,
# `broadcast_from_rank0`, is the answer to exercise 05's `broadcast_parameters`: solve the exercise
# first**, see the end of this notebook.)

# %%
show(broadcast_parameters.broadcast_from_rank0)
modes = run_ranks(broadcast_parameters.run_modes, 2)
print(f"{'mode':<17}{'max |w_r - w_0| before':>24}{'after 30 steps':>16}   held-out loss, rank 0 / rank 1")
for i, mode in enumerate(broadcast_parameters.MODES):
    r0, r1 = modes[0][i], modes[1][i]
    print(f"{mode:<17}{r0['spread_before']:>24.6f}{r0['spread_after']:>16.6f}   "
          f"{r0['held_out_loss']:.5f} / {r1['held_out_loss']:.5f}")

# %% [markdown]
# Two replicas that never meet: the difference after 30 steps is the difference at the
# start, and the two ranks' models give different losses on the same data (a checkpoint saved by
# rank 0 is not the model rank 1 trained). DDP's constructor prevents this. In torch 2.13 it first
# calls `_verify_param_shape_across_processes` (every rank must have the same parameter shapes, or
# it raises) and then `_sync_module_states(..., src=0)`, which collects every parameter and buffer
# and broadcasts them from rank 0 with `dist._broadcast_coalesced`
# ([distributed.py L1062-L1073](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1062-L1073),
# [utils.py L289-L328](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/utils.py#L289-L328)). The installed source:

# %%
from torch.nn.parallel import DistributedDataParallel
from torch.distributed import utils as dist_utils

def grep_source(fn, *needles):
    lines, first = inspect.getsourcelines(fn)
    path = Path(inspect.getsourcefile(fn)).relative_to(Path(torch.__file__).parent.parent)
    print(f"--- {path}")
    for i, line in enumerate(lines):
        if any(n in line for n in needles):
            print(f"{first + i:5d} {line.rstrip()}")

grep_source(DistributedDataParallel.__init__, "_verify_param_shape_across_processes(", "_sync_module_states(", "src=0")
grep_source(dist_utils._sync_params_and_buffers, "_broadcast_coalesced")

# %% [markdown]
# (`init_sync=False` in the constructor skips both; chapter 02 measured that DDP's
# construction makes differently-seeded models equal.)
#
# ## Pitfalls
#
# * **Blocking send before receive on every rank**: on gloo it hangs even for 4 KB (section 1).
#   Post `isend` first, then the blocking `recv`, then `wait()` the send.
# * **Chunks that do not divide evenly**: `tensor.view(-1).tensor_split(N)` gives N views, some
#   one element longer (or empty when there are fewer elements than ranks); size every receive
#   buffer from the chunk it receives, not from `numel // N`.
# * **A hand all-reduce on a non-contiguous tensor**: `.view(-1)` fails, and a `.reshape(-1)` copy
#   would not write back; reduce a contiguous buffer (DDP's buckets are).
# * **Reading busbw as link speed at small sizes**: there the time is latency, not bandwidth
#   (section 6's reference run); bucket small gradients.
# * **Timing on a shared machine**: warm up, barrier, take the slowest rank, keep the minimum and
#   the median of repeats, interleave the contenders, and record how busy the machine was
#   (`ddpcourse.timing` does the last two, and says when a run is too loaded or too noisy to
#   conclude). Time two contenders that do the same thing (ring and halving-doubling on 2 ranks):
#   their gap is your noise.
# * **Replicas that start apart**: gradient averaging never fixes them; broadcast from rank 0 (DDP
#   does it in its constructor) or seed every rank identically *and* check.
# * **Async all-reduces in hooks**: wait for every handle before `optimizer.step()`, and only then
#   divide the sums by N; the optimizer must never see a gradient still in flight.
#
# ## Summary
#
# * Point-to-point messages are enough to build an all-reduce. The naive "through rank 0" scheme
#   loads rank 0 with `N-1` copies in each direction.
# * Ring = reduce-scatter + all-gather: `2(N-1)` steps of `1/N` of the tensor, `2(N-1)/N` bytes
#   per rank, which is the lower bound for algorithms made of point-to-point messages; nccl-tests'
#   busbw = algbw · 2(N-1)/N is built on it. In-network reduction (NVLink SHARP, IB SHARP through
#   CollNet) lets the switches add, and nccl-tests gives it the factor (N-1)/(N+1) instead.
# * Halving-doubling: the same bytes (N a power of two) in `2 log2 N` steps, for latency-bound
#   small messages.
# * Measured on CPU/gloo (the recorded reference runs): small messages are latency-bound for
#   everyone; on large ones the Python ring reached 78-90% of the bus bandwidth of gloo's C++
#   all-reduce from 1 to 16 MiB. A live timing on a shared machine needs repeats, a load check
#   and a noise gauge before it can say more.
# * DDP = averaged gradients + overlap with backward (hooks) + buckets, plus a broadcast of rank
#   0's state at construction, without which replicas that start apart stay apart.
#
# **Exercises** (`exercises/05_allreduce/`): in `allreduce_by_hand.ipynb` write
# `average_gradients` and a bandwidth-optimal `ring_allreduce` from send/recv; in
# `bucketed_ddp.ipynb` write `broadcast_parameters` and `BucketedDDP`, your own bucketed DDP whose
# all-reduces overlap backward. Check yourself with `pytest exercises/05_allreduce` from the
# repository root (both notebooks), or name one: `pytest exercises/05_allreduce/bucketed_ddp.ipynb`.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 05](../CLAIMS.md#chapter-05).
