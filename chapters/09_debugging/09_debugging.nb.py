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
# # 09 · Debugging DDP: make the failure speak, then read it
#
# **The problem.** A DDP job fails in three ways, and only one of them is polite. It **raises**
# (an error on one rank, and torchrun's report of the whole group), it **hangs** (one rank waits
# in a collective that another rank never calls: no output, no error, for 10 or 30 minutes), or
# it **runs to the end and is wrong** (replicas that drifted apart, an accuracy that counts some
# samples twice, an order that never changes). The bugs behind them are few and known; what
# costs the hours is finding *which rank* is *where*.
#
# **The idea.** Debug bottom-up, and turn every failure into a message that names the rank, the
# line and the collective: check the group, then the data, then the loop; shorten the timeouts
# so that a hang becomes an error in seconds; ask the ranks for their stacks; let PyTorch compare
# the collectives of all ranks; and read torchrun's report from the rank with an error of its
# own. Each section runs a real failure on 2 gloo ranks (the CPU); the GPU-only failures run
# where GPUs are, and their captured logs are here for everyone.
#
# | section | script (each checks its own claims) |
# |---|---|
# | 1. Bottom-up: the group, the shards, one step | `bottom_up.py` |
# | 2. A hang becomes an error: short timeouts, `monitored_barrier`, `TORCH_DISTRIBUTED_DEBUG=DETAIL` | `hang_to_error.py` |
# | 3. `TORCH_DISTRIBUTED_DEBUG` around DDP: INFO, and DETAIL's crash on the CPU | `detail_with_ddp.py` |
# | 4. Where is each rank? Stacks of a hung job | `stack_of_a_hung_rank.py` |
# | 5. Reading torchrun's report: the rank with an error of its own, and the exit codes | `captured_logs/` |
# | 6. On GPUs: one GPU per rank, NCCL's watchdog, the flight recorder | `gpu_failures.py`, `captured_logs/` |
# | 7. The lab: fifteen broken jobs to fix | `exercises/09_debugging/` |
#
# Launch any torchrun script with `torchrun --standalone --nproc_per_node 2
# chapters/09_debugging/NAME.py` (the first line of each docstring has its exact command).

# %%
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from ddpcourse.launcher import prestart, run_ranks

sys.path.insert(0, str(Path.cwd()))  # the notebook runs in chapters/09_debugging
prestart()

# %% [markdown]
# ## 1. Debug bottom-up
#
# A training loop is three layers on top of each other, and a bug in a lower one looks like a
# bug in the loop. So check them from the bottom, each in seconds:
#
# 1. **The group.** Every rank all-reduces `rank + 1` and must get exactly `N(N+1)/2`; a
#    broadcast from the last rank must reach everyone. A wrong `MASTER_ADDR`, a firewall or a
#    rank that never started fails *here*, on a group with a 10-second timeout, not after 30
#    minutes inside the first backward.
# 2. **The data.** Gather every rank's sample indices: they must cover the data set, the shards
#    must have **equal lengths** (otherwise the ranks run different numbers of steps and the
#    longer one hangs at the end, lab `collectives_that_hang`), and overlap only by the
#    sampler's padding (101 samples on 2 ranks: 51 each, one index twice).
# 3. **One step.** After one DDP step on different batches, the parameters must be identical
#    on every rank, compared exactly.
#
# `bottom_up.py` is written to be copied: replace its `make_dataset` and `make_model` with your
# job's.

# %%
import bottom_up

checked = run_ranks(bottom_up.run_all, 2, timeout=120)
for name, result in checked[0].items():
    print(f"{name:14s} {'ok' if result['ok'] else 'FAILED':6s}",
          {key: value for key, value in result.items() if key != "ok"})
assert all(result["ok"] for rank in checked for result in rank.values())

# %% [markdown]
# ## 2. A hang becomes an error
#
# **The default is to wait.** A collective that one rank never calls blocks the others until
# the process group's timeout: 30 minutes by default, 10 for NCCL (the docstring of
# `init_process_group` in
# [torch/distributed/distributed_c10d.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/distributed_c10d.py);
# `default_pg_timeout` in torch/distributed/constants.py). While you debug, make it short:
# `dist.init_process_group(backend, timeout=timedelta(seconds=60))`, long enough for the
# slowest *legitimate* wait (start-up on a busy machine, rank 0 writing a checkpoint while the
# others wait at a barrier), short enough to see the error today.
#
# The same bug four times: rank 1 skips a collective that rank 0 calls (each on a fresh group
# with a 3-second timeout):
#
# * **the bare timeout**: rank 0 gets gloo's `Timed out waiting 3000ms for recv operation to
#   complete`. It says *that* it waited, not for whom; rank 1, which skipped, sees nothing.
# * **`dist.monitored_barrier(timeout=..., wait_all_ranks=True)`** (gloo only) on rank 0 names
#   the ranks that did not arrive. Put one before the step you suspect.
# * **`TORCH_DISTRIBUTED_DEBUG=DETAIL`** wraps every group in a checker that first compares each
#   collective's *fingerprint* across ranks (sequence number, operation, shapes, dtypes;
#   `_create_process_group_wrapper` in distributed_c10d.py). Two ranks calling *different*
#   collectives both fail at once, and the message names both ranks and the difference.
# * Under DETAIL a **missing** collective still waits for the timeout, but then the checker's
#   monitored barrier names the missing rank.

# %%
import hang_to_error

seen = run_ranks(hang_to_error.run_all, 2, timeout=120, relay_output=False)
for name in hang_to_error.DEMOS:
    for rank in (0, 1):
        outcome = seen[rank][name]
        first_line = (outcome["error"] or "(no error)").splitlines()[0]
        print(f"{name:30s} rank {rank} after {outcome['seconds']:4.1f} s: {first_line[:140]}")
assert hang_to_error.problems(seen) == [], hang_to_error.problems(seen)

# %% [markdown]
# The fingerprint check spells out the difference at the end of its message:

# %%
print(seen[0]["DETAIL, different collectives"]["error"].split(".Collectives differ")[-1].strip())

# %% [markdown]
# How long each rank waited before it knew, in this run, beside the default timeout (the
# seconds are this machine's, live; what does not change from run to run is *which* rank each
# message names):

# %%
names = list(hang_to_error.DEMOS)
waited = [max(seen[rank][name]["seconds"] for rank in (0, 1)) for name in names]
fig, ax = plt.subplots(figsize=(8, 2.8))
ax.barh(names + ["default timeout (gloo)"], waited + [1800.0], color=["C0"] * 4 + ["C3"])
ax.set_xscale("log")
ax.set_xlabel("seconds until an error (log scale)")
ax.set_title("rank 1 skips a collective: how long until the job says so")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. `TORCH_DISTRIBUTED_DEBUG` around DDP
#
# `TORCH_DISTRIBUTED_DEBUG=INFO` (with `TORCH_CPP_LOG_LEVEL=INFO`, without which PyTorch's C++
# log lines stay hidden) makes DDP report its construction: "DDP Initialized with:" and the
# bucket sizes, `find_unused_parameters`, `broadcast_buffers` (`set_construction_data_and_log`,
# called from `_ddp_init_helper` in
# [torch/nn/parallel/distributed.py](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py)).
# Under `DETAIL` it also checks the unused parameters of every iteration, but on the CPU build
# of torch 2.13 **constructing DDP under DETAIL crashes**: both ranks die of a segmentation
# fault inside that same call, with no Python traceback; torchrun reports exit code −11. The
# script launches the same two-rank job twice:

# %%
import detail_with_ddp

outcomes = detail_with_ddp.run_all()
for level, outcome in outcomes.items():
    print(f"TORCH_DISTRIBUTED_DEBUG={level}: exit code {outcome['returncode']}, ranks that "
          f"finished {outcome['ranks that finished']}, torchrun's exit codes "
          f"{outcome['exit codes torchrun reports'] or 'none'}")
    for line in outcome["DDP's own log"]:
        print("    ", line[:120])
assert detail_with_ddp.problems(outcomes) == [], detail_with_ddp.problems(outcomes)
if not detail_with_ddp.crash_expected():
    print(f"(the crash was seen with torch {detail_with_ddp.CRASH_SEEN_WITH} on the CPU; this is "
          f"{torch.__version__}: read the exit codes above)")

# %% [markdown]
# So on the CPU: DETAIL for code with plain collectives (section 2), INFO around DDP. On GPUs,
# try DETAIL around DDP on a small run first. It is not free: before *each* collective the
# wrapper (`ProcessGroupWrapper`, torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp: "a Gloo
# process group responsible for internal coordination such as monitored barrier, sequence
# number checking, collective fingerprint collecting") runs a monitored barrier and exchanges the
# collective's fingerprint. Counted with torch.profiler for one `all_reduce` on 2 gloo ranks
# (torch 2.13): at `OFF` one `gloo:all_reduce`; at `DETAIL` also a `gloo:send` and a `gloo:recv`
# (the barrier) and two `gloo:all_gather` (the fingerprint) on each rank, four extra gloo
# operations per call, each a round trip between the ranks.

# %% [markdown]
# ## 4. Where is each rank? Ask for the stacks
#
# A hang is almost always one rank inside a collective that another rank is not in. The stacks
# of all ranks show it at once. Python's own `faulthandler` gives two ways, both run here: rank
# 0 arms a **watchdog** before a step that must not take long
# (`faulthandler.dump_traceback_later(1.0, exit=False)`, cancelled after the step) and waits in
# `all_reduce`; rank 1 installed a **signal handler** at start-up
# (`faulthandler.register(signal.SIGUSR1)`) and is still in `load_next_batch` when rank 0 sends
# it `SIGUSR1`, as you would with `kill -USR1 <pid>`.
#
# For a job that prepared nothing, `py-spy dump --pid <pid>` (a separate tool: `pip install
# py-spy`; it needs permission to trace the process) prints any Python process's stack; run it
# for every rank: `for pid in $(pgrep -f train.py); do py-spy dump --pid $pid; done`. The
# course's rank launcher does the same for its ranks when a call runs past its deadline.

# %%
import stack_of_a_hung_rank

with tempfile.TemporaryDirectory() as folder:
    stacks = run_ranks(stack_of_a_hung_rank.run_all, 2, folder, timeout=120)
for rank, seen_by in enumerate(stacks):
    print(f"--- rank {rank} ---")
    print("\n".join(line for line in seen_by["stack"].splitlines() if "stack_of_a_hung_rank" in line
                    or not line.startswith("  File")))
assert stack_of_a_hung_rank.problems(stacks) == []

# %% [markdown]
# Read the top frame of your own code on each rank: rank 0 is in `wait_for_gradients`
# (an `all_reduce`), rank 1 in `load_next_batch`. The fix is in rank 1's code path, not in the
# collective where rank 0 waits.

# %% [markdown]
# ## 5. Reading torchrun's report
#
# When one rank fails, torchrun's agent stops the others and prints a report of the whole
# group. It is long, and the useful part is at two places. The logs below were captured with
# torch 2.13 on the CPU by `captured_logs/make_logs.py` (each file's header gives the machine,
# date, torch version and the exact command); the job is `captured_logs/lesson_job.py`, where
# rank 0 fails at step 2 while rank 1 waits for it in the step's all-reduce. (The exercise
# `read_the_logs` asks the same questions of other jobs' logs.)
#
# 1. **The `[rankN]:` tracebacks**. `init_process_group` installs a `sys.excepthook`
#    (`_distributed_excepthook` in torch/distributed/distributed_c10d.py) that prefixes each line
#    of an *uncaught exception's traceback* with `[rankN]:`. Nothing else is prefixed: the
#    ranks' own prints (`rank 1: step 1, mean loss 1.5` in `lesson_raise.log`), their warnings
#    and log lines reach the log as they were written, so print the rank yourself. Look for the rank with an error **of its own**: in `lesson_raise.log`, rank 0's
#    `FloatingPointError`. The other ranks' tracebacks are consequences: their next collective
#    lost its peer ("Connection closed by peer") or timed out. The last frame of *your* code in
#    that traceback is the line. A rank killed by a signal prints no traceback at all: in
#    `lesson_abort.log` the only traceback is rank 1's consequence, and the table below names the
#    rank that died.
# 2. **The table at the end** (`ChildFailedError`) gives every rank's exit code. The ranks with
#    **−15 (SIGTERM) did nothing wrong**: the agent stopped them after the first failure. Do not
#    debug them. Its "Root Cause (first observed failure)" is only torchrun's guess: the entry
#    with the smallest timestamp, in whole seconds, ties going to the first entry, and without
#    `@record` the time is when the agent noticed the exit (`ChildFailedError.get_first_failure`
#    in torch/distributed/elastic/multiprocessing/errors/__init__.py). When two ranks fail within
#    the same second it can name the wrong one; the traceback with an error of its own decides.
#
# | exit code | meaning | where to look |
# |---|---|---|
# | 1 | a Python exception | the `[rankN]:` traceback with an error of its own |
# | −9 | SIGKILL: nothing in Python ran; on a cluster most often the kernel's out-of-memory killer | `dmesg`, the node's memory; the scheduler's log |
# | −15 | SIGTERM: stopped by the agent after another rank failed (or by the scheduler) | the root cause, not this rank |
# | −6 | SIGABRT: a C++ abort, e.g. gloo's "Received data size doesn't match expected size" when ranks' collectives pair up with different sizes (lab `collectives_that_hang`), or NCCL's watchdog after a timeout | the lines before it: the abort's message |
# | −11 | SIGSEGV: a crash in native code (section 3 shows one) | the native stack, the versions |
#
# A negative exit code is the signal that ended the process (Python's `subprocess` convention,
# which torchrun's agent reports as is; the signal's name in brackets comes from
# `torch.distributed.elastic.multiprocessing.errors`, `ProcessFailure`).

# %%
LOGS = Path("captured_logs")


def excerpt(name: str, *patterns: str, limit: int = 14) -> None:
    """The header of a captured log and its lines that match any pattern."""
    text = (LOGS / name).read_text()
    header = [line for line in text.splitlines() if line.startswith("# ") and ":" in line][:4]
    hits = [line for line in text.splitlines() if any(p in line for p in patterns)]
    print(f"== {name}")
    print("\n".join(header))
    print("\n".join(line[:150] for line in hits[:limit]))
    print()


excerpt("lesson_raise.log", "[rank0]: ", "Root Cause", "exitcode", "rank      :")
excerpt("lesson_abort.log", "Error:", "Root Cause", "exitcode", "rank      :")

# %% [markdown]
# **`@record`.** Without it the report says `error_file: <N/A>` and `traceback : To enable
# traceback see: https://pytorch.org/docs/stable/elastic/errors.html`: the traceback is only in
# the `[rankN]:` lines, which a scheduler may have cut or interleaved. Decorating the script's
# entry point with `@record` (from `torch.distributed.elastic.multiprocessing.errors`) makes each
# failing rank write its traceback to an error file, and torchrun puts it into the report itself
# (and the root cause is then chosen by when each exception was recorded). `@record` also turns
# on `faulthandler`, so a crash in native code prints the Python stacks:

# %%
excerpt("lesson_raise_record.log", "error_file", "traceback :", "FloatingPointError", limit=8)

# %% [markdown]
# With `@record` even the rank stopped with −15 has an error file: rank 1 had recorded its
# "Connection closed by peer" just before the agent stopped it. It is still a consequence.
# A collective timeout and a DETAIL mismatch look in a whole job's report as they did in
# section 2, under each rank's `[rankN]:` prefix; the exercise `read_the_logs` has you find
# ranks, lines and collectives in such logs yourself.

# %% [markdown]
# ## 6. On GPUs: one GPU per rank, NCCL's watchdog, the flight recorder
#
# Three failures exist only on GPUs; `gpu_failures.py` launches each as a two-rank NCCL job
# where the GPUs allow it (below it runs the cases this machine can, and says why it skips the
# others).
#
# * **Two ranks on one GPU.** Every rank must `torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`
#   before anything touches the GPU. A hard-coded `cuda:0`, or no `set_device` at all (every
#   rank's `"cuda"` is then GPU 0), puts two ranks on one device, and NCCL refuses:
#   `ncclInvalidUsage` ... "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ...".
#   With `device_id=` in `init_process_group` the communicator is made at once and fails there;
#   without it, at the first collective.
# * **A collective timeout under NCCL.** NCCL runs collectives asynchronously: the call returns
#   at once, and ProcessGroupNCCL's *watchdog* thread notices the timeout ("Watchdog caught
#   collective operation timeout: WorkNCCL(SeqNum=..., OpType=ALLREDUCE, ...)") and, with the
#   default `TORCH_NCCL_ASYNC_ERROR_HANDLING`, ends the process from that thread (an uncaught
#   C++ exception: SIGABRT, −6). The sequence number tells which collective, counted per group.
#   (This case needs two GPUs; it has not run on the course's machines yet.)
# * **The flight recorder.** With `TORCH_FR_BUFFER_SIZE=2000` each rank keeps its last
#   collectives (operation, sizes, sequence number, state); with `TORCH_FR_DUMP_TEMP_FILE` set, a
#   timeout dumps them per rank, and `python -m torch.distributed.flight_recorder.fr_trace` reads
#   the dumps of all ranks and names the rank whose sequence stopped short.
#   `NCCL_DEBUG=INFO` (or `WARN`) prints NCCL's own view: its version, the network it chose,
#   the rings.
#
# The real log of `NCCL_DEBUG=INFO` with a flight-recorder dump, captured on one NVIDIA H200
# (torch 2.11.0+cu130, NCCL 2.28.9). The logs of two ranks on one GPU, captured there too, are
# the exercise `read_the_logs`'s last lab.

# %%
excerpt("gpu_one_rank_nccl_info.log", "NCCL version", "NET/", "nccl:all_reduce", limit=8)

# %%
import gpu_failures

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
gpu_outcomes = gpu_failures.run_all(gpus)
for case, outcome in gpu_outcomes.items():
    print(f"{case:14s}", outcome.get("skipped") or
          f"{'as described' if outcome['ok'] else 'NOT AS DESCRIBED'}: {outcome['found'][:1]}")
assert all(outcome.get("ok", True) for outcome in gpu_outcomes.values())

# %% [markdown]
# ## 7. The lab: fifteen broken jobs
#
# Each lab is a piece of a real job that fails the way real jobs fail, on 2–4 gloo ranks, within
# seconds. Run it, read the failure with the tools above, fix it. The tests run your fixed code
# in real process groups with a deadline; every check also wants every rank to finish and the
# replicas to end identical. Self-check one notebook with
# `pytest exercises/09_debugging/NAME.ipynb`; hidden tests run when it is graded.
#
# | exercise (`exercises/09_debugging/`) | labs |
# |---|---|
# | `ddp_errors` | "Expected to have finished reduction..." in a model with an auxiliary head; a checkpoint that does not resume; "marked ready twice" with activation checkpointing |
# | `collectives_that_hang` | a job that logs its loss on rank 0; rank 0 evaluating after every epoch; shards of a stream; a bad batch on one rank; gathering the predictions of every rank |
# | `wrong_numbers` | an evaluation accuracy slightly off; shuffled data that looks alike every epoch; gradient clipping with gradient accumulation |
# | `replicas_that_disagree` | a job that never forms under `torchrun`; a learnable temperature in the loss; BatchNorm with `broadcast_buffers=False` |
# | `read_the_logs` | real captured logs (a ChildFailedError, a collective timeout, a DETAIL mismatch, a killed rank, two ranks on one GPU): name the failing rank, the line and the collective |
#
# Each lab gives the symptom; finding the cause is part of the exercise. In `ddp_errors`,
# `collectives_that_hang` and `replicas_that_disagree` you also hand in a diagnosis of the given
# code (`diagnose_<lab>()`: which rank, which collective, which step, which parameter), graded
# only when the notebook is graded; that graded feedback explains what happened and the fixes.
#
# ## 8. Symptom → cause → command → fix
#
# Every row is reproduced in this repository by a section above (or a captured log); the labs'
# own symptoms follow, with where to look first (their causes are the labs' to find).
#
# | symptom | cause | command that shows it | fix | reproduced by |
# |---|---|---|---|---|
# | no output, no error; GPUs idle or at 100 % | a collective one rank does not call | short `timeout=` in `init_process_group`; stacks (`faulthandler`, `py-spy dump`) of every rank | call collectives on every rank, in the same order | §2, §4; `collectives_that_hang` |
# | `Timed out waiting ...ms for recv operation` (gloo) | the same, after the group's timeout | `monitored_barrier(wait_all_ranks=True)` names the missing rank | as above | §2 |
# | `Detected mismatch between collectives on ranks` | ranks call different collectives or shapes | `TORCH_DISTRIBUTED_DEBUG=DETAIL` (plain collectives; not DDP on CPU) | same collective, same shapes everywhere | §2; `captured_logs/mismatch_detail.log` |
# | hang at the end of an epoch | shards of unequal length: one rank runs more steps | `bottom_up.py` step 2 (shard lengths) | equal numbers of steps (agree on the minimum), or `Join` | §1; `collectives_that_hang` |
# | `exitcode : -9` | SIGKILL, most often the out-of-memory killer | `dmesg`, the scheduler's log | less memory per rank | §5; `captured_logs/sigkill.log` |
# | `exitcode : -11`, no traceback | a native crash (e.g. DDP under DETAIL on CPU, torch 2.13) | `faulthandler` (`python -X faulthandler`) | avoid the trigger; report it | §3 |
# | `Duplicate GPU detected` | two ranks on one GPU: no `set_device(LOCAL_RANK)` | `nvidia-smi`; `NCCL_DEBUG=WARN` | `torch.cuda.set_device(local_rank)` first | §6; `gpu_failures.py` |
# | `Watchdog caught collective operation timeout` | a hang under NCCL | flight recorder (`TORCH_FR_BUFFER_SIZE`, `fr_trace`) | as for any hang | §6; `gpu_failures.py` (2 GPUs) |
#
# The labs' symptoms, and the first thing to measure:
#
# | symptom | command that shows it | lab |
# |---|---|---|
# | exit −6, `Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?` (gloo) | the exit code and the rank's stderr; stacks | `collectives_that_hang` |
# | hang after a bad batch or an early stop | stacks: one rank in the next step's all-reduce, one elsewhere | `collectives_that_hang` |
# | `Expected to have finished reduction in the prior iteration ...` | the error's parameter list; `TORCH_DISTRIBUTED_DEBUG=INFO` | `ddp_errors` |
# | `Expected to mark a variable ready only once` | the error text | `ddp_errors` |
# | loss jumps after a resume; `module.` keys do not load | `torch.load(...).keys()` | `ddp_errors`; chapter 08 |
# | accuracy slightly higher or lower than on one GPU | count the samples each rank saw | `wrong_numbers` |
# | the same order every epoch | print the first indices of two epochs | `wrong_numbers` |
# | replicas agree, each step's gradient within `max_norm`, yet the weights differ from one process's | print the norm the clip measures on every rank, at every micro-batch | `wrong_numbers` |
# | every process logs as rank 0; the group never forms | print `RANK`, `LOCAL_RANK`, `WORLD_SIZE` on every process | `replicas_that_disagree` |
# | replicas drift apart; evaluation differs per rank | `bottom_up.py` step 3: compare parameters and buffers across ranks | `replicas_that_disagree` |
#
# ## Summary
#
# * Debug bottom-up: the group, the shards, one step (`bottom_up.py`), then the loop.
# * Make hangs short and loud: a short group timeout while debugging, `monitored_barrier`,
#   `TORCH_DISTRIBUTED_DEBUG=DETAIL` for plain collectives, every rank's stack.
# * Read torchrun's report from the `[rankN]:` traceback with an error of its own, and the exit
#   codes; the −15s are bystanders. `@record` puts the traceback into the report.
# * On GPUs: one GPU per rank, set first; NCCL's watchdog and flight recorder for hangs.
#
# Next: chapter 10 measures where the time of a DDP step goes.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 09](../CLAIMS.md#chapter-09).
