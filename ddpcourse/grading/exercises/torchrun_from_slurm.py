"""Chapter 03, torchrun: visible checks for ``torchrun_argv_from_slurm``.

The contract is the docstring of ``torchrun_argv_from_slurm`` in
solutions/03_torchrun/torchrun_from_slurm.nb.py (students:
exercises/03_torchrun/torchrun_from_slurm.ipynb): the static multi-node torchrun command of one
Slurm task per node, as chapters/03_torchrun/slurm_torchrun.sbatch builds it.

Two kinds of check. (a) The command is parsed with torchrun's own argument parser
(``torch.distributed.run.parse_args``, the function torchrun itself calls), so any spelling that
torchrun reads the same way passes, and each parsed value is compared with what Slurm's variables
say. (b) A real launch: the student's function builds the commands of two fake "nodes" on this
machine; both run at once (``python -m torch.distributed.run`` for ``torchrun``) on a tiny worker
of the grader's own, under a hard deadline that kills each command's whole process group, and
every worker must report the full world size. A command whose store endpoint is not the head
node's (the source article's command has no --master-addr / --master-port) is not launched as a
pair: its node 1 is launched alone, as on its own machine, with a short rendezvous timeout, to
show it never meets anyone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddpcourse.dist_env import free_port
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.launcher import run_bounded

REQUIRED = ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")
DEFAULT_MASTER = ("127.0.0.1", 29500)  # torchrun's defaults (torch/distributed/run.py)
LAUNCH_TIMEOUT_S = float(os.environ.get("DDPCOURSE_LAUNCH_TIMEOUT_S", "60"))
RDZV_TIMEOUT_S = 30  # a node waiting for a store that nobody hosts gives up after this
LONELY_RDZV_TIMEOUT_S = 3


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist such as ``node-[003-004],login1`` (one bracket group
    per item at most); the grader's reference."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    item = nodelist[:end]
    match = re.fullmatch(r"([^\[\]]*)\[([^\]]*)\](.*)", item)
    if not match:
        return item
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def expected_args(env: Mapping[str, str], script: str, port: int) -> dict:
    """What torchrun's parser must read from a correct command for ``env``."""
    return {"nnodes": env["SLURM_NNODES"], "node_rank": int(env["SLURM_NODEID"]),
            "nproc_per_node": env.get("SLURM_GPUS_ON_NODE", "1"),
            "master_addr": first_host(env["SLURM_JOB_NODELIST"]), "master_port": port,
            "training_script": script, "training_script_args": [], "rdzv_backend": "static",
            "rdzv_endpoint": "", "standalone": False, "module": False, "no_python": False}


FLAGS = {"nnodes": "--nnodes", "node_rank": "--node-rank", "nproc_per_node": "--nproc-per-node",
         "master_addr": "--master-addr", "master_port": "--master-port",
         "training_script": "the script", "training_script_args": "the script's arguments",
         "rdzv_backend": "--rdzv-backend", "rdzv_endpoint": "--rdzv-endpoint",
         "standalone": "--standalone", "module": "--module", "no_python": "--no-python"}


def parse_torchrun(argv, what: str):
    """``argv[1:]`` parsed by torchrun's own parser; CheckFailed if it is not a torchrun command
    torchrun accepts. ``PET_*`` variables (torchrun reads its defaults from them) are ignored."""
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise CheckFailed(f"{what}: expected a list of str, got {argv!r}")
    if not argv or argv[0] != "torchrun":
        raise CheckFailed(f"{what}: the command must start with 'torchrun', got {argv!r}")
    from torch.distributed.run import parse_args

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PET_")}
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parse_args(argv[1:])
    except SystemExit:
        raise CheckFailed(f"{what}: torchrun does not accept {argv!r}:\n"
                          f"{errors.getvalue().strip()}") from None
    finally:
        os.environ.update(saved)


def compare_args(parsed, expected: dict, argv, what: str) -> None:
    actual = {key: getattr(parsed, key) for key in expected}
    if actual["master_port"] is None:
        actual["master_port"] = DEFAULT_MASTER[1]  # what torchrun's run() does
    wrong = [f"{FLAGS[k]}: expected {expected[k]!r}, torchrun reads {actual[k]!r}"
             for k in expected if actual[k] != expected[k]]
    if wrong:
        raise CheckFailed(f"{what}: your command {argv!r}\n    " + "\n    ".join(wrong))


def call_student(fn, env, script: str, port, what: str):
    try:
        return fn(env, script) if port is None else fn(env, script, port)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the exception is the finding
        raise CheckFailed(f"{what}: your function raised {type(exc).__name__}: {exc}") from None


def describe_env(env: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in env.items())


def argv_cases_case(rank, world_size, fn, cases):
    """Inside a clean process: each (env, script, port or None, what) case, parsed and compared."""
    for env, script, port, what in cases:
        label = f"{what} [{describe_env(env)}]"
        argv = call_student(fn, env, script, port, label)
        compare_args(parse_torchrun(argv, label), expected_args(env, script, port or 29500),
                     argv, label)


def error_cases_case(rank, world_size, fn, cases):
    """Each (env, names the ValueError must contain, what) case must raise ValueError."""
    for env, must_name, what in cases:
        label = f"{what} [{describe_env(env)}]"
        try:
            got = fn(env, "train.py", 29500)
        except ValueError as exc:
            missing = [name for name in must_name if name not in str(exc)]
            if missing:
                raise CheckFailed(f"{label}: the ValueError must name {missing}; it said: "
                                  f"{exc}") from None
            continue
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the wrong exception type is the finding
            raise CheckFailed(f"{label}: expected ValueError, got {type(exc).__name__}: "
                              f"{exc}") from None
        raise CheckFailed(f"{label}: expected ValueError, got {got!r}")


def slurm_env(nnodes: int, node: int, nodelist: str, gpus: int | None = None) -> dict:
    env = {"SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": nodelist}
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


VISIBLE_CASES = [
    (slurm_env(2, 1, "gpu[07-08]", 4), "train.py", 31000, "node 1 of 2, 4 GPUs per node"),
    (slurm_env(2, 0, "gpu[07-08]", 4), "train.py", 31000, "node 0 of 2, 4 GPUs per node"),
    (slurm_env(1, 0, "gpu07"), "train.py", None, "one node, no GPUs, the default port"),
    (slurm_env(2, 1, "n1,n2"), "/home/me/train.py", 29400, "a plain list of two hosts"),
    (slurm_env(4, 2, "gpu[07-09,12]", 8), "train.py", 29501, "ranges and single numbers"),
]
VISIBLE_ERRORS = [
    ({}, REQUIRED, "no Slurm variables at all"),
    ({"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}, ("SLURM_NODEID",),
     "SLURM_NODEID missing"),
]


def check_torchrun_argv_parses(fn) -> None:
    """Commands for several Slurm environments, read back by torchrun's own parser."""
    run_student(argv_cases_case, 1, fn, VISIBLE_CASES, init_process_group=False)


def check_torchrun_argv_rejects_missing_variables(fn) -> None:
    run_student(error_cases_case, 1, fn, VISIBLE_ERRORS, init_process_group=False)


# --- the real launch --------------------------------------------------------------------------

WORKER = '''"""The grader's worker: join the group torchrun set up, all-reduce the ranks, report."""
import json, os, sys
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
report = json.dumps({
    "rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": total.item(),
    "group_rank": os.environ["GROUP_RANK"], "local_rank": os.environ["LOCAL_RANK"],
    "store": os.environ["MASTER_ADDR"] + ":" + os.environ["MASTER_PORT"]})
sys.stdout.write("WORKER " + report + "\\n")  # one write: workers of a node share the pipe
sys.stdout.flush()
dist.destroy_process_group()
'''


def argvs_case(rank, world_size, fn, envs, script, port):
    """Inside a clean process: the command of every fake node."""
    return [call_student(fn, env, script, port, f"node {i} [{describe_env(env)}]")
            for i, env in enumerate(envs)]


def launch_env(rdzv_timeout_s: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env["PET_RDZV_CONF"] = f"timeout={rdzv_timeout_s}"  # the parser's env default
    env["OMP_NUM_THREADS"] = "1"
    return env


def runnable(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


def tail(text: str, lines: int = 15) -> str:
    """The last lines of a command's output, before torchrun's own failure summary."""
    text = text.split("ChildFailedError:")[0]
    return "\n".join(text.strip().splitlines()[-lines:])


def never_meets(argvs, parsed, head: str, port: int, cwd: str) -> str:
    """Launch the last node alone, as on its own machine, and say what happened."""
    node = len(argvs) - 1
    addr, node_port = parsed[node].master_addr, parsed[node].master_port or DEFAULT_MASTER[1]
    lines = [f"the commands do not point every node at the head node's store {head}:{port} "
             "(first host of SLURM_JOB_NODELIST, and the port argument):"]
    for i, ns in enumerate(parsed):
        lines.append(f"    node {i} uses --master-addr {ns.master_addr} --master-port "
                     f"{ns.master_port or DEFAULT_MASTER[1]}"
                     + (" (torchrun's default)" if ns.master_port is None else ""))
    done = run_bounded(runnable(argvs[node]), 30, cwd=cwd, env=launch_env(LONELY_RDZV_TIMEOUT_S))
    if done.timed_out:
        outcome = f"was still waiting after {done.seconds:.0f} s and was killed"
    else:
        reason = next((line.strip() for line in done.stderr.splitlines()[::-1]
                       if "timed out" in line.lower() or "connect" in line.lower()), "")
        outcome = f"exited with code {done.returncode} after {done.seconds:.1f} s: {reason}"
    lines.append(f"On a cluster, node {node} would look for the store at {addr}:{node_port} on "
                 f"its own machine, where nobody hosts it, and never meet node 0. Launched alone "
                 f"here (with a {LONELY_RDZV_TIMEOUT_S} s rendezvous timeout) it {outcome}")
    return "\n".join(lines)


def launch_nodes(fn, nnodes: int, nodelist: str, gpus: int | None = None) -> list[dict]:
    """Run the student's commands of ``nnodes`` fake nodes at once; return the workers' reports.

    ``nodelist`` must name this machine first (``localhost`` or ``127.0.0.1``)."""
    __tracebackhide__ = True  # noqa: F841
    port = free_port()
    head = first_host(nodelist)
    nproc = gpus or 1
    envs = [dict(slurm_env(nnodes, i, nodelist, gpus), SLURM_PROCID=str(i), SLURM_NTASKS=str(nnodes),
                 SLURM_JOB_ID="4242") for i in range(nnodes)]
    with tempfile.TemporaryDirectory(prefix="ddpcourse-torchrun-from-slurm-") as work:
        script = str(Path(work) / "grader_worker.py")
        Path(script).write_text(WORKER)
        argvs = run_student(argvs_case, 1, fn, envs, script, port, init_process_group=False)[0]
        parsed = [parse_torchrun(argv, f"node {i}") for i, argv in enumerate(argvs)]
        if any((ns.master_addr, ns.master_port) != (head, port) for ns in parsed):
            raise CheckFailed(never_meets(argvs, parsed, head, port, work))
        for i, (ns, argv) in enumerate(zip(parsed, argvs)):
            compare_args(ns, expected_args(envs[i], script, port), argv, f"node {i}")
        env = launch_env(RDZV_TIMEOUT_S)
        with ThreadPoolExecutor(nnodes) as pool:
            runs = list(pool.map(lambda argv: run_bounded(runnable(argv), LAUNCH_TIMEOUT_S,
                                                          cwd=work, env=env), argvs))
    world = nnodes * nproc
    problems = []
    for i, done in enumerate(runs):
        if done.timed_out:
            problems.append(f"node {i} was still running after {LAUNCH_TIMEOUT_S:g} s and was "
                            f"killed:\n{tail(done.stdout + done.stderr)}")
        elif done.returncode != 0:
            problems.append(f"node {i} exited with code {done.returncode}:\n{tail(done.stderr)}")
    if problems:
        raise CheckFailed("\n".join(problems))
    reports = [json.loads(found) for done in runs
               for found in re.findall(r"WORKER (\{[^{}]*\})", done.stdout)]
    ranks = sorted(r["rank"] for r in reports)
    if ranks != list(range(world)):
        raise CheckFailed(f"{nnodes} nodes x {nproc} processes should start workers with ranks "
                          f"0..{world - 1}; the workers reported ranks {ranks}")
    for r in reports:
        if r["world_size"] != world or r["sum"] != world * (world - 1) / 2:
            raise CheckFailed(f"worker rank {r['rank']} saw world size {r['world_size']} and a "
                              f"sum of ranks {r['sum']:g}; expected one group of {world} "
                              f"({nnodes} nodes x {nproc}) and {world * (world - 1) / 2:g}")
    return reports


def check_torchrun_argv_launches_two_nodes(fn) -> None:
    """Two fake nodes on this machine, one process each, launched for real."""
    launch_nodes(fn, 2, "localhost,127.0.0.1")
