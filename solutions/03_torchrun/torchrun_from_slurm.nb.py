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

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise 03: two nodes that meet - torchrun's command from Slurm's variables
#
# The source article launches two machines with `--nnodes 2 --node_rank 0` on the first and
# `--nnodes 2 --node_rank 1` on the second, and nothing else. Chapter 03 shows why those nodes never
# meet: without `--master-addr` and `--master-port` torchrun uses 127.0.0.1:29500, so node 1 looks
# for the rendezvous store **on itself**, where nobody hosts it, until it times out. (On one machine
# the two commands meet by accident, which is how the mistake survives a rehearsal.)
#
# `chapters/03_torchrun/slurm_torchrun.sbatch` builds the command from Slurm's variables instead, so
# nothing is typed by hand. Here you write its static form as a Python function; the tests read your
# command back with **torchrun's own argument parser**, then launch it for real as two "nodes" on
# this machine.
#
# **Self-check** from the repository root: `pytest exercises/03_torchrun`.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
from typing import Mapping

from torch.distributed.run import parse_args as torchrun_parse_args

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import torchrun_from_slurm as checks

setup_notebook("torchrun_from_slurm")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-torchrun-argv", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `torchrun_argv_from_slurm(env, script, port=29500) -> list[str]` (8 points)
#
# The command of `slurm_torchrun.sbatch`, as a function: implement `torchrun_argv_from_slurm` as its
# docstring below says. It spells out the command, which Slurm variable gives each value, how to
# find the head node in Slurm's compressed hostlist, and what raises `ValueError`.
#
# How it is tested:
#
# 1. Your list is read back by torchrun's own parser, `torch.distributed.run.parse_args(argv[1:])`.
#    The setup cell imports it as `torchrun_parse_args`: try it on your command.
# 2. A **real launch**: your function builds the commands of two fake nodes (`SLURM_NODEID` 0 and 1,
#    a `SLURM_JOB_NODELIST` that names this machine first, a free port chosen by the test); both run
#    at once with `python -m torch.distributed.run` in place of `torchrun`, on a tiny worker of the
#    test's own that all-reduces the ranks. A command whose nodes would not dial the head node's
#    `HEAD:port` is not launched as a pair: its node 1 is launched alone, as on its own machine, and
#    the test reports how it waited for a store nobody hosts (a short rendezvous timeout ends that
#    wait after a few seconds). Every launch has a hard deadline that kills all its processes.
#
# Source (PyTorch v2.13.0): torchrun's parser defaults to
# [`--master-addr 127.0.0.1` and no port](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/run.py#L628-L647),
# which [`run` turns into 29500](https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/run.py#L1015-L1016);
# chapter 03 prints those lines.

# %% nbgrader={"grade": false, "grade_id": "torchrun-argv", "locked": false, "schema_version": 3, "solution": true, "task": false}
def torchrun_argv_from_slurm(env: Mapping[str, str], script: str, port: int = 29500) -> list[str]:
    """This node's static multi-node torchrun command, from one Slurm task per node.

    Returns this node's command, every element a `str`:

        ["torchrun", "--nnodes", N, "--node-rank", NODEID, "--nproc-per-node", NPROC,
         "--master-addr", HEAD, "--master-port", str(port), script]

    * `N` = `SLURM_NNODES`; `NODEID` = `SLURM_NODEID` (the node's index; not `SLURM_PROCID`, the
      task's, which the tests may set to something else);
    * `NPROC` = `SLURM_GPUS_ON_NODE` if it is set, else `"1"`;
    * `HEAD` = the first host of `SLURM_JOB_NODELIST`, which Slurm writes compressed. Items are
      separated by commas outside brackets; an item is a host name, or a prefix, one bracket group
      of comma-separated numbers and `lo-hi` ranges, and an optional suffix. The first host is the
      first item with the first number listed in its brackets, zero padding kept:
      `gpu07` -> `gpu07`, `n1,n2` -> `n1`, `gpu[07-09,12]` -> `gpu07`,
      `node-[003-004],login1` -> `node-003`, `a[3,1-2]` -> `a3`, `gpu[01-02]-ib` -> `gpu01-ib`.
      Expand it yourself (`scontrol show hostnames` does it in the sbatch script).

    Other spellings that torchrun reads the same way (`--node_rank`, `--nnodes=2`) pass: the
    tests parse the list with torchrun's own parser, `torch.distributed.run.parse_args(argv[1:])`,
    and each value it reads (`nnodes`, `node_rank`, `nproc_per_node`, `master_addr`,
    `master_port`, `training_script`, no script arguments, static rendezvous) must equal what
    Slurm's variables say; `argv[0]` must be `"torchrun"`. Launched for real, the commands of two
    nodes must both exit with code 0, and every worker must see one group of `N x NPROC`
    processes.

    Args:
        env: any `Mapping[str, str]` holding the variables of one Slurm task per node. Use only
            `env`, not `os.environ`, and no `scontrol`.
        script: the training script, the command's last element.
        port: the head node's port, for `--master-port`.

    Raises:
        ValueError: whose message names every missing variable among `SLURM_NNODES`,
            `SLURM_NODEID`, `SLURM_JOB_NODELIST`.
        ValueError: naming `SLURM_NODEID`, when the node id is not in `[0, N)`.
    """
    ### BEGIN SOLUTION
    required = ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")
    missing = [name for name in required if name not in env]
    if missing:
        raise ValueError(f"missing Slurm variables: {', '.join(missing)}")
    nnodes, node_id = int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])
    if not 0 <= node_id < nnodes:
        raise ValueError(f"SLURM_NODEID={node_id} is not in [0, SLURM_NNODES={nnodes})")
    return ["torchrun", "--nnodes", env["SLURM_NNODES"], "--node-rank", env["SLURM_NODEID"],
            "--nproc-per-node", env.get("SLURM_GPUS_ON_NODE", "1"),
            "--master-addr", first_host(env["SLURM_JOB_NODELIST"]),
            "--master-port", str(port), script]


def first_host(nodelist: str) -> str:
    """First host of a compressed Slurm hostlist: 'node-[003-004],login1' -> 'node-003'."""
    depth = 0
    for end, char in enumerate(nodelist + ","):  # the first comma outside brackets ends item 1
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            break
    item = nodelist[:end]
    if "[" not in item:
        return item
    prefix, rest = item.split("[", 1)
    numbers, suffix = rest.split("]", 1)
    return prefix + numbers.split(",")[0].split("-")[0] + suffix  # strings keep the padding
    ### END SOLUTION


# %%
# Try it: node 1 of a 2-node job with 4 GPUs per node, read back by torchrun's parser.
env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
       "SLURM_GPUS_ON_NODE": "4"}
argv = torchrun_argv_from_slurm(env, "train.py", 31000)
print(argv)
args = torchrun_parse_args(argv[1:])
print(args.nnodes, args.node_rank, args.nproc_per_node, args.master_addr, args.master_port,
      args.training_script)

# %% nbgrader={"grade": true, "grade_id": "test-torchrun-argv-parses", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): commands for 1, 2 and 4 nodes, with and without GPUs, the default port, hostlists gpu07 / n1,n2 / gpu[07-09,12], read by torchrun's parser.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import torchrun_from_slurm as checks
integrity.assert_untampered()
checks.check_torchrun_argv_parses(torchrun_argv_from_slurm)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-torchrun-argv-missing-variables", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): missing Slurm variables raise ValueError naming them.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import torchrun_from_slurm as checks
integrity.assert_untampered()
checks.check_torchrun_argv_rejects_missing_variables(torchrun_argv_from_slurm)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-torchrun-argv-two-nodes-meet", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): a real launch: 2 fake nodes x 1 process on this machine form one group of 2.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import torchrun_from_slurm as checks
integrity.assert_untampered()
checks.check_torchrun_argv_launches_two_nodes(torchrun_argv_from_slurm)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-torchrun-argv-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) more hostlist forms, any Mapping, a stray SLURM_PROCID, node ids out of range, missing variables, and 2 nodes x 2 processes launched for real.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import torchrun_from_slurm as hidden
hidden.check_torchrun_argv(torchrun_argv_from_slurm)
print("passed")
### END HIDDEN TESTS
