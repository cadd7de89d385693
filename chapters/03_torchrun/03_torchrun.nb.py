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
# # 03 · torchrun: what it sets, what it does not, restarts, many nodes, SLURM
#
# **The problem.** A DDP job is *N* copies of one script. Each copy must learn who it is (its rank),
# how many copies there are, and where to meet the others, and someone must start the copies, watch
# them, and say which one failed. On one machine or on forty.
#
# **The idea.** `torchrun` (the `torch.distributed.run` module) is that someone: one *elastic agent*
# per node starts the node's workers, gives each its identity in environment variables, hosts the
# store they meet in, and restarts or reports failures
# ([torchrun docs](https://docs.pytorch.org/docs/stable/elastic/run.html)).
#
# **In this chapter** every statement is a run you can repeat, or a line of the installed torch's
# source printed below it. Along the way, five claims of the source article are checked; four do
# not survive: torchrun does not set `CUDA_VISIBLE_DEVICES`, does not restart "just the failed
# process", the article's two-node command has nodes that never meet, and c10d rendezvous is not
# "based on the file system".

# %%
import inspect, json, os, re, sys, tempfile, textwrap
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from ddpcourse.launcher import run_bounded  # a deadline, and no process left behind

ROOT = Path.cwd().resolve().parents[1]   # the notebook runs in chapters/03_torchrun
BIN = Path(sys.executable).parent        # torchrun and python of this environment
BANNER = re.compile(r"run\.py:\d+\]|OMP_NUM_THREADS")   # torchrun's OMP_NUM_THREADS notice
print("torch", torch.__version__)


def run(cmd, timeout=120, **env):
    """Run a shell command at the repository root; its process group is killed at the deadline."""
    full_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env['PATH']}"
    full_env.update(env)
    done = run_bounded(cmd, timeout, cwd=ROOT, env=full_env, shell=True)
    err = "\n".join(line for line in done.stderr.splitlines() if not BANNER.search(line))
    if done.timed_out:
        err += f"\n[killed after {timeout} s]"
    return done.returncode, done.stdout, err, done.seconds


def show_source(obj, pattern, context=0):
    """Print the lines of the *installed* torch's source of obj that match pattern."""
    obj = inspect.unwrap(obj)   # past decorators such as the agent's @prof
    lines, first = inspect.getsourcelines(obj)
    path = inspect.getsourcefile(obj).split("site-packages/")[-1]
    keep = {i + d for i, l in enumerate(lines) if re.search(pattern, l)
            for d in range(-context, context + 1)}
    print(f"# {path}")
    for i in sorted(k for k in keep if 0 <= k < len(lines)):
        print(f"{first + i:5d}  {lines[i].rstrip()}")


# %% [markdown]
# ## 1. What torchrun puts in each worker's environment
#
# `print_env.py` gathers every rank's launcher variables on rank 0 and prints them side by side:

# %%
code_, out, err, took = run("torchrun --standalone --nproc_per_node 2 chapters/03_torchrun/print_env.py")
print(out, f"(exit {code_}, {took:.1f} s)")


# %% [markdown]
# What each one is for:
#
# | variable | meaning | use it for |
# |---|---|---|
# | `RANK` | global rank, 0 … WORLD_SIZE-1, **of this rendezvous round**: it can change at a restart (section 3) | `init_process_group` (read by `env://`), who logs and saves |
# | `LOCAL_RANK` | rank on this node, 0 … LOCAL_WORLD_SIZE-1 | which GPU: `cuda:{LOCAL_RANK}` |
# | `WORLD_SIZE`, `LOCAL_WORLD_SIZE` | workers in the job / on this node | sharding data, scaling the LR |
# | `GROUP_RANK`, `GROUP_WORLD_SIZE` | this node's (agent's) index, number of nodes | per-node work (e.g. one download per node) |
# | `ROLE_RANK`, `ROLE_NAME` | rank among workers of the same role (`--role`, default `default`) | equal to `RANK` unless you mix roles |
# | `MASTER_ADDR`, `MASTER_PORT` | the store every worker meets in (hosted by the agent) | read by `env://`; you rarely touch them |
# | `TORCHELASTIC_RESTART_COUNT`, `_MAX_RESTARTS` | this attempt's number, the limit | resuming after a restart (section 3) |
# | `TORCHELASTIC_ERROR_FILE` | where `@record` writes a traceback | section 4 |
# | `TORCHELASTIC_RUN_ID`, `_USE_AGENT_STORE` | job id, "the store is the agent's" | section 3's pitfall |
# | `OMP_NUM_THREADS` | set to 1 unless you set it (the warning torchrun prints) | set it to cores ÷ workers |
# | `TORCH_NCCL_ASYNC_ERROR_HANDLING` | `1` unless you set it: on a NCCL error or timeout, abort the communicators and tear the process down | nothing on gloo; on NCCL a failed or stuck collective ends the worker, so the agent sees a failure, not a hang |
#
# The last row is the one variable the agent sets for NCCL: every worker gets
# `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` unless torchrun itself was started with a value, which is then
# passed on (`LocalElasticAgent._start_workers`, below; `tests/test_chapter_03_torchrun.py` checks
# both). `1` is `TearDown` in the `ErrorHandlingMode` enum of the installed header
# `torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp`: "tear down process upon
# error". Outside torchrun (`mp.spawn`, a plain `srun` per GPU) nobody sets it, and
# ProcessGroupNCCL's own default applies, which a comment in the same header calls "the default
# value (3 - SkipCleanUp)": tear the process down without aborting the communicators first.

# %%
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
show_source(LocalElasticAgent._start_workers, r'"RANK"|TORCH_NCCL_ASYNC_ERROR_HANDLING|str\(1\)')

# %% [markdown]
# ### Does torchrun set `CUDA_VISIBLE_DEVICES`? No.
#
# The article says torchrun "sets CUDA_VISIBLE_DEVICES for each process", which is why you should
# use `cuda:{local_rank}`. The table above says otherwise: `(unset)` on every rank. The agent only
# *copies* the variable if you set it yourself, the same value to every worker; only the opt-in flag
# `--virtual-local-rank` ([pytorch#166680](https://github.com/pytorch/pytorch/pull/166680)) gives each worker its own device
# and then sets `LOCAL_RANK=0` everywhere. Measured, then the source:

# %%
def visible_devices(flags="", **env):
    _, out, err, _ = run(f"torchrun --standalone --nproc_per_node 2 {flags} "
                         "chapters/03_torchrun/print_env.py --json", **env)
    views = json.loads(out.strip().splitlines()[-1])
    return [(v["CUDA_VISIBLE_DEVICES"], v["LOCAL_RANK"]) for v in views.values()]

print(f"{'launch':<46} (CUDA_VISIBLE_DEVICES, LOCAL_RANK) of rank 0, rank 1")
print(f"{'CUDA_VISIBLE_DEVICES=0,1 torchrun ...':<46}", visible_devices(CUDA_VISIBLE_DEVICES="0,1"))
print(f"{'torchrun --virtual-local-rank ...':<46}", visible_devices("--virtual-local-rank"))

# %%
show_source(LocalElasticAgent._set_local_rank_env, r"CUDA_VISIBLE_DEVICES|LOCAL_RANK|virtual")

# %% [markdown]
# So the article's advice is right for the wrong reason: use `cuda:{LOCAL_RANK}` (or
# `torch.cuda.set_device(local_rank)`) *because* every worker sees all of the node's GPUs. A
# worker that just uses `cuda` or `cuda:0` puts all the node's replicas on GPU 0.
#
# ## 2. Three ways to start the ranks
#
# | | `torchrun` | `torch.multiprocessing.spawn` | `python -m torch.distributed.launch` |
# |---|---|---|---|
# | identity | RANK, LOCAL_RANK, WORLD_SIZE, … in the environment | only the index passed to `fn(i)` | the same variables **plus** `--local-rank=N` on the command line |
# | rendezvous | the agent hosts the store (free port with `--standalone`) | you choose MASTER_ADDR/PORT | as torchrun |
# | restarts, failure report | `--max-restarts`, `@record`, ChildFailedError | no restarts; the parent stops the others and re-raises the first failure (`ProcessRaisedException`) | as torchrun (same code) |
# | status in torch 2.13 | the supported launcher | fine for one machine | deprecated, prints a FutureWarning |
#
# `spawn_demo.py` does torchrun's chores by hand (free port, variables, join):

# %%
code_, out, err, took = run("python chapters/03_torchrun/spawn_demo.py --nprocs 2")
print(out, f"(exit {code_}, {took:.1f} s)")

# %% [markdown]
# The deprecated launcher is a thin wrapper around torchrun's own parser that also appends
# `--local-rank=N` to your script's arguments (unless you pass `--use-env`). A script that does not
# declare that option, such as `print_env.py`, dies in argparse on every rank:

# %%
code_, out, err, took = run("python -m torch.distributed.launch --nproc_per_node 2 chapters/03_torchrun/print_env.py")
for line in err.splitlines():
    if re.search(r"FutureWarning|unrecognized arguments|is deprecated", line):
        print(line)
print(f"(exit {code_}, {took:.1f} s)")
code_, out, err, took = run("python -m torch.distributed.launch --nproc_per_node 2 chapters/03_torchrun/legacy_local_rank.py")
print(out, f"(exit {code_}: legacy_local_rank.py declares --local-rank/--local_rank)")

# %%
import torch.distributed.launch as old_launcher
show_source(old_launcher, r"get_args_parser|--use-env|_deprecated\(|local-rank.*macros")
import torch.distributed.run as torchrun_module
show_source(torchrun_module.config_from_args, r"use_env|--local-rank")


# %% [markdown]
# The article says the old launcher "does not support `--max_restarts`". In torch 2.13 it parses
# its arguments with torchrun's `get_args_parser()` (above), so it takes every torchrun flag,
# `--max-restarts` included (`python -m torch.distributed.launch --help` lists it). The reasons to
# move are the deprecation and the `--local-rank` argument, not missing features. Fix for old
# scripts: accept both `--local-rank` and `--local_rank`, or better read `os.environ["LOCAL_RANK"]`,
# which both launchers set.
#
# ## 3. Restarts: the whole group, or nothing
#
# `--max-restarts N` (default 0) lets the agent restart the worker group up to N times. *The
# group*: when any worker fails, the agent stops all of them (SIGTERM to each worker's process
# group, SIGKILL for those still alive 30 s later) and starts a fresh set of processes, with
# `TORCHELASTIC_RESTART_COUNT` one higher. `restart_demo.py` makes rank 1 raise on the first
# attempt. Rank 0 is healthy and, in that attempt, stays out of collectives (as a rank busy with a
# long local step would) until the agent stops it; a signal handler logs the SIGTERM, then lets it
# end the process. Every rank logs its pid and events per attempt:

# %%
def restart_run(max_restarts):
    log = Path(tempfile.mkdtemp()) / "events.jsonl"
    code_, out, err, took = run(f"torchrun --standalone --nproc_per_node 2 --max_restarts {max_restarts} "
                                f"chapters/03_torchrun/restart_demo.py --event-file {log}")
    return code_, out, err, took, [json.loads(l) for l in log.read_text().splitlines()]

code_, out, err, took, events = restart_run(1)
print(out, f"(exit {code_}, {took:.1f} s)")

# %%
outcome = {"raised": ("raised", "tab:red"), "finished": ("finished", "tab:green"),
           "SIGTERM": ("stopped by the\nagent (SIGTERM)", "tab:gray")}
fig, ax = plt.subplots(figsize=(8, 2.4))
for attempt, rank in sorted({(e["attempt"], e["rank"]) for e in events}):
    mine = [e for e in events if (e["attempt"], e["rank"]) == (attempt, rank)]
    label, color = outcome.get(mine[-1]["event"], (mine[-1]["event"], "tab:gray"))
    ax.barh(rank, 0.9, left=attempt, color=color, edgecolor="black")
    ax.text(attempt + 0.45, rank, f"pid {mine[0]['pid']}\n{label}", ha="center", va="center",
            color="white", fontsize=9)
ax.set_yticks([0, 1], ["rank 0", "rank 1"])
ax.set_xticks([0.45, 1.45], ["attempt 0", "attempt 1 (after the restart)"])
ax.set_title("--max_restarts 1: one rank failed, every rank was replaced")
plt.tight_layout()
plt.show()

# %% [markdown]
# The gray box is measured, not assumed: the pid that logged the SIGTERM is the one the agent says
# it signalled (`Sending process ... closing signal SIGTERM`, from
# `SubprocessContext._close` in `torch/distributed/elastic/multiprocessing/api.py`):

# %%
stopped = [e for e in events if e["event"] == "SIGTERM"]
print("logged by the handler:", [(e["attempt"], e["rank"], e["pid"], f"signal {e['signal']}") for e in stopped])
print("said by the agent:    ", [l.split("] ", 1)[-1] for l in err.splitlines() if "closing signal" in l])

# %% [markdown]
# In a real job the healthy ranks are usually *inside* a collective when a peer dies, and they
# fail on their own first ("Connection closed by peer", exit code 1), before the agent's signal
# reaches them: section 4's `record_demo.py` is that case, and its report lists both ranks.
#
# And with the default `--max-restarts 0` the same failure ends the job:

# %%
code_, out, err, took, events = restart_run(0)
print("attempts seen:", sorted({e["attempt"] for e in events}), "| exit code", code_, f"| {took:.1f} s")
print("\n".join(err.splitlines()[-12:]))

# %% [markdown]
# The agent's loop, in the installed source: on a failed worker group it restarts *the group*
# while restarts are left, else it gives up:

# %%
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
show_source(SimpleElasticAgent._invoke_run, r"FAILED|remaining_restarts -= 1|_restart_workers|_stop_workers|return run_result")
show_source(SimpleElasticAgent._restart_workers, r"Restart|_stop_workers|_initialize_workers")

# %% [markdown]
# **The article:** torchrun "automatically restarts just the failed process when a card OOMs".
# **Wrong, twice.** An out-of-memory error is an exception like any other: if it kills a worker,
# the agent stops *all* workers and, only if `--max-restarts` > 0, starts all of them again, from
# the top of the script. Nothing of the failed attempt survives but what you saved: resuming needs
# a checkpoint (chapter 08), and the same OOM will probably happen again.
#
# ### A restart is a new rendezvous: RANK can change
#
# `_restart_workers` calls `_initialize_workers`, which runs a new rendezvous round
# (`SimpleElasticAgent._rendezvous`: "Assigns workers a new global rank and world size"). A
# worker's RANK is its node's base rank plus its LOCAL_RANK (`_assign_worker_ranks`), and the order
# of the nodes (GROUP_RANK) is decided in each round anew: the c10d rendezvous sorts *that round's*
# agents by (host name, agent pid, counter) and numbers them in that order
# (`_mark_rendezvous_complete`; section 5 shows the sort at work). The same agents sort the same
# way, so a restart on one node, or on nodes that all survived, gives every worker its old RANK.
# But a node that is replaced (a new agent: another pid, maybe another host) or that joins an
# elastic job (`--nnodes MIN:MAX`; the agent then restarts the group without spending a restart:
# "membership changes do not count as retries") re-sorts the nodes, and a worker on an unchanged
# node can come back with another RANK and another WORLD_SIZE. Read both afresh in every attempt,
# and do not reload per-rank state by rank number without checking that the world that wrote it is
# the one you are in.

# %%
show_source(SimpleElasticAgent._rendezvous, r"Assigns workers|group_rank = rdzv_info.rank")
show_source(SimpleElasticAgent._assign_worker_ranks, r"global_rank=base_global_rank")
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
show_source(dynamic_rendezvous._DistributedRendezvousOpExecutor._mark_rendezvous_complete,
            r"sorted\(state.participants\)|participants\[node\] = rank")
show_source(dynamic_rendezvous._NodeDesc, r"order=True|addr: str|pid: int|local_id: int")
show_source(dynamic_rendezvous._NodeDescGenerator.generate, r"return _NodeDesc")
show_source(SimpleElasticAgent._invoke_run, r"membership changes|num_nodes_waiting > 0")

# %% [markdown]
# **A pitfall the demo works around.** In torch 2.13 the agent keeps one TCP store for the whole
# job and hands it to every attempt (`_bootstrap_store_info` is cached below). Keys that the dead
# attempt's ranks wrote there, such as their network addresses for gloo, are still there. A fresh
# rank can read one and dial a dead process: `init_process_group` then fails in gloo's connect
# ("Gloo connectFullMesh failed", a refused connection or a connect timeout), and the restart is
# spent. `restart_demo.py --plain-init` joins with plain `env://` and runs into it. The demo joins
# under a prefix private to the attempt (`PrefixStore(f"restart_{TORCHELASTIC_RESTART_COUNT}",
# store)`). On several nodes, where each agent keeps its own restart count
# ([pytorch#108158](https://github.com/pytorch/pytorch/issues/108158)), launch with
# `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` instead: every attempt then gets a new store on a new port,
# and plain `env://` is fine. Background:
# [pytorch#135712](https://github.com/pytorch/pytorch/issues/135712).

# %%
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
show_source(DynamicRendezvousHandler.next_rendezvous, r"TORCH_DISABLE_SHARE|_bootstrap_store_info is None|_create_tcp_store_server")

# %% [markdown]
# How often each way fails is a race, which one live run cannot measure and this notebook does not
# attempt: `benchmarks/ch03_restart_races.py` repeats the runs and writes the counts, with the
# machine, date, torch version, load and command, to `benchmarks/results/ch03_restart_races.json`.
# In that recorded run plain `env://` failed in 5 of 6 runs; the private prefix in 0 of
# 6, the fresh store in 0 of 6. These are counts of one recorded machine: a race's odds move
# with the load and the core count, so read them as "it happens, often", not as a rate.

# %%
from ddpcourse.timing import describe, load_reference
races = load_reference("ch03_restart_races.json")
print(describe(races), "\nreproduce with:", races["command"])
for variant in races["restarts"]:
    print(f"  {variant['failed']} of {variant['runs']} failed  {variant['variant']}")
    for error in sorted({o["error"].split(", remote=")[0] for o in variant["outcomes"] if o["error"]}):
        print(f"      {error[:100]}")

# %% [markdown]
# ## 4. Reading a failure: `@record` and ChildFailedError
#
# When a worker fails, torchrun raises `ChildFailedError` and prints one entry per failed rank.
# The traceback appears in it only if the worker's entry point is decorated with
# `torch.distributed.elastic.multiprocessing.errors.record`
# ([docs](https://docs.pytorch.org/docs/stable/elastic/errors.html)): it catches the exception and
# writes it as JSON to `TORCHELASTIC_ERROR_FILE`. `record_demo.py`: rank 1 raises, rank 0 is the
# victim (its next collective finds rank 1 gone).

# %%
logs = Path(tempfile.mkdtemp())
code_, out, err, took = run(f"torchrun --standalone --nproc_per_node 2 --log-dir {logs} chapters/03_torchrun/record_demo.py")
report = err.split("ChildFailedError:", 1)[1]
print(report.strip())
print(f"(exit {code_}, {took:.1f} s)")

# %%
for path in sorted(logs.glob("*/attempt_0/*/error.json")):
    data = json.loads(path.read_text())
    print(f"--- {path.relative_to(logs)}")
    print("message:  ", data["message"]["message"])
    print("timestamp:", data["message"]["extraInfo"]["timestamp"], "(whole seconds)")
    print("traceback, last line:", data["message"]["extraInfo"]["py_callstack"].strip().splitlines()[-1][:110])

# %% [markdown]
# How to read it:
# * Each failure shows rank, exit code, pid, error file and (with `@record`) the traceback.
#   Without it, the entry says `traceback : To enable traceback see ...`, as in the
#   `--max_restarts 0` report of section 3 (`restart_demo.py` has no `@record`; `record_demo.py
#   --no-record` shows the same, checked in `tests/test_chapter_03_torchrun.py`).
# * **"Root Cause (first observed failure)"** is the failure with the smallest timestamp, and the
#   timestamps have **whole-second** resolution (the `int(time.time())` below). When the culprit
#   and its victims fail within the same second, any of them can be named: in the recorded runs of
#   `record_demo.py --no-record` (printed below), the report named rank 0, the victim, in 2 of
#   6. Read every entry, and look for the first error that is *not* "Connection closed/reset by
#   peer".
# * Set `TORCHELASTIC_ERROR_FILE` for torchrun itself and the agent copies the root cause's error
#   file there, for a scheduler to collect.

# %%
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
show_source(ChildFailedError.get_first_failure, r"min\(")
show_source(ProcessFailure._set_no_reply_file, r"time\.time")   # no error file: when the agent noticed
from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler
show_source(ErrorHandler.record_exception, r"timestamp")           # @record's error file
print("recorded:", races["root_cause_without_record"])

# %% [markdown]
# ## 5. Many nodes: meeting at one address
#
# Each node runs its own `torchrun`; the agents must agree on one rendezvous. Two forms:
#
# * **static:** `--nnodes 2 --node_rank K --master-addr HEAD --master-port PORT`: node 0 hosts the
#   store at HEAD:PORT, the others dial it.
# * **c10d (dynamic):** `--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HEAD:PORT --rdzv-id JOB`:
#   the same command on every node, node ranks given out by the rendezvous, and `--nnodes MIN:MAX`
#   for elastic jobs ([rendezvous docs](https://docs.pytorch.org/docs/stable/elastic/rendezvous.html)).
#
# **The article's two-node command omits `--master-addr` and `--master-port`.** Their defaults are
# 127.0.0.1 and 29500, so on two machines node 1 dials *itself* and waits there until the
# rendezvous times out; the nodes never meet (on one machine they meet by accident, on the fixed
# port 29500). `two_nodes_on_one_machine.sh` rehearses both forms on one machine with a free port:

# %%
show_source(torchrun_module.get_args_parser, r'default="127.0.0.1"|"--master-port"', context=0)
show_source(torchrun_module.run, r"master_port = 29500")
for form in ("static", "c10d"):
    code_, out, err, took = run(f"bash chapters/03_torchrun/two_nodes_on_one_machine.sh {form}",
                                PYTHON=sys.executable)
    print(f"\n== {form}: exit {code_}, {took:.1f} s")
    print("\n".join(l for l in out.splitlines() if "torchrun" in l or "rank" in l))

# %% [markdown]
# In the c10d run, which terminal became node 0? Not the first to arrive: c10d sorts the agents by
# (host name, agent pid) (section 3), and here both agents run on the same host, so node 0 is the
# agent with the smaller pid. Every worker printed its agent's pid (its parent process):

# %%
agent_of_node = {int(node): int(pid) for node, pid in re.findall(r"node (\d) of \d.*agent pid (\d+)", out)}
print("c10d: node -> agent pid", agent_of_node, "| node 0's agent has the smaller pid:",
      agent_of_node[0] < agent_of_node[1])

# %% [markdown]
# **The article:** c10d rendezvous "is based on the file system". **No:** by default it keeps its
# state in a `TCPStore`, hosted by the agent whose host matches the endpoint (the others connect
# to it); a `FileStore` is an opt-in (`--rdzv-conf store_type=file`). The installed source:

# %%
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
show_source(c10d_backend.create_backend, r'store_type = |_create_file_store\(|_create_tcp_store\(')
show_source(c10d_backend._create_tcp_store, r"is_host = |TCPStore\(|is_master=")

# %% [markdown]
# ## 6. SLURM: derive every flag from the allocation
#
# On a SLURM cluster, run **one torchrun per node** (`srun --ntasks-per-node=1`) and derive its
# flags from SLURM's variables: `SLURM_NNODES` for `--nnodes`, the first host of
# `SLURM_JOB_NODELIST` as rendezvous host, `SLURM_JOB_ID` as `--rdzv-id`, and, for the static form,
# `SLURM_NODEID` read *inside* each task. The example batch file:

# %%
print((ROOT / "chapters/03_torchrun/slurm_torchrun.sbatch").read_text())

# %% [markdown]
# Without a cluster we can still run it: fake `scontrol` and `srun` on `PATH` (srun runs the
# command once per "node", in parallel, with that node's `SLURM_NODEID`), and a fake `torchrun`
# that prints the command line it was given:

# %%
fake = Path(tempfile.mkdtemp())
(fake / "scontrol").write_text('#!/usr/bin/env bash\nprintf "%s\\n" gpu07 gpu08\n')
(fake / "srun").write_text(textwrap.dedent('''\
    #!/usr/bin/env bash
    while [[ $1 == -* ]]; do shift; done
    for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & done
    wait'''))
(fake / "torchrun").write_text('#!/usr/bin/env bash\necho "node $SLURM_NODEID: torchrun $*"\n')
for f in fake.iterdir():
    f.chmod(0o755)
slurm = dict(PATH=f"{fake}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="2",
             SLURM_JOB_NODELIST="gpu[07-08]", SLURM_GPUS_ON_NODE="4")
for mode in ("c10d", "static"):
    code_, out, err, _ = run("bash chapters/03_torchrun/slurm_torchrun.sbatch train.py", RDZV_MODE=mode, **slurm)
    print(f"RDZV_MODE={mode} (exit {code_}):\n" + "\n".join(sorted(out.splitlines())) + "\n")

# %% [markdown]
# The stand-ins show the flags; `tests/test_slurm_cluster.py` runs the batch file on a real SLURM
# cluster of two nodes (the throwaway one of `slurm/start_local_cluster.sh`, which you can start
# on a laptop or VM too: `slurm/README.md`), in both forms, 2 workers per node: the four ranks
# form one group, and chapter 01's training prints the same figures as on one node.
#
# Inside the workers, read `RANK`, `LOCAL_RANK`, `WORLD_SIZE` from torchrun, never `SLURM_PROCID`:
# with one task per node, `SLURM_PROCID` is the node's index, the same for every worker on it
# (chapter 04 shows what that does to `init_process_group`).
#
# ## Pitfalls
#
# * **`CUDA_VISIBLE_DEVICES` is not set by torchrun** (section 1): select `cuda:{LOCAL_RANK}` yourself.
# * **Restarts restart everything and keep nothing**: resume from a checkpoint, and in torch 2.13
#   re-join under a fresh store prefix (or `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`), or a restart
#   can fail on stale addresses.
# * **No `@record`, no traceback** in the failure report; and the named "root cause" can be a victim.
# * **Multi-node without `--master-addr`** dials 127.0.0.1 on every node.
# * **Script arguments that look like torchrun's**: argparse abbreviations apply to everything
#   before the script name, and an option placed after it that is a prefix of a torchrun option
#   (`--log` for `--log-dir`, say) was rejected as ambiguous while this chapter was written; put
#   the script's options after the script and give them unambiguous names.
# * **`pipefail` + `| head -n1`** in a batch file: the writer can die of SIGPIPE (exit 141) and take
#   the job down. In the recorded run (`pipes` in the record above), with 2000 host names under
#   pipefail, 14 of 20 pipelines failed with an external `printf`, 11 of 20 with bash's
#   builtin one. `slurm_torchrun.sbatch` turns pipefail off for that one pipe and checks the result.
#
# ## Summary
#
# * torchrun's agent gives each worker RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
#   ROLE_RANK, MASTER_ADDR/PORT and TORCHELASTIC_* variables; CUDA_VISIBLE_DEVICES only with
#   `--virtual-local-rank`.
# * `mp.spawn` starts processes and nothing more; `torch.distributed.launch` is torchrun plus a
#   `--local-rank` argument and a deprecation warning.
# * Every worker also gets `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` (a NCCL error or timeout tears the
#   process down) unless torchrun was given another value.
# * `--max-restarts N` restarts the whole group up to N times (the agent SIGTERMs the healthy
#   workers first); 0 (default) means the first failure ends the job.
# * RANK and WORLD_SIZE belong to one rendezvous round: a restart or a membership change can give a
#   worker on the same node another RANK. Read them afresh in every attempt.
# * `@record` puts tracebacks into ChildFailedError and error files.
# * Multi-node: the same endpoint on every node (static: `--node_rank`, `--master-addr/port`;
#   c10d: `--rdzv-endpoint/--rdzv-id`, a TCPStore in an agent, node ranks by sorted (host, agent
#   pid)); on SLURM derive them from the allocation, one torchrun per node.
#
# The source article's claims that this chapter's experiments check, each with its verdict and the
# correct statement: [the claims page, chapter 03](../CLAIMS.md#chapter-03).
