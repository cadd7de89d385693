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

Each check is a :class:`~ddpcourse.grading.checks.Case`. The rank calls the student's function
and reports, as plain data, each command it returned (a list of str; anything else by its type
name and a cut repr) or the exception's type and message. For the launch, the rank also writes
the worker script to its own temporary folder, picks a free port, runs the nodes (or the lonely
node) with :func:`~ddpcourse.launcher.run_bounded`, and reports every run's exit code, whether it
was killed at the deadline, the tails of its output and the workers' ``WORKER {...}`` lines as
text. The judge parses every command with torchrun's parser itself, compares it with what the
Slurm variables (its own tables) require, decides what had to be launched, parses the workers'
lines and writes every message. What the launched processes printed is reported by the rank,
where the student's code ran: a determined student could forge it, but only for commands the
judge has already found right.
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
from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, Case, CheckFailed, cut_text,
                                      judge_each_rank, observed, reported_calls, run_student,
                                      safe_text, type_name)

from ddpcourse.launcher import run_bounded

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
REQUIRED = ("SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST")
DEFAULT_MASTER = ("127.0.0.1", 29500)  # torchrun's defaults (torch/distributed/run.py)
LAUNCH_TIMEOUT_S = float(os.environ.get("DDPCOURSE_LAUNCH_TIMEOUT_S", "60"))
RDZV_TIMEOUT_S = 30  # a node waiting for a store that nobody hosts gives up after this
LONELY_RDZV_TIMEOUT_S = 3
LONELY_DEADLINE_S = 30
MAX_TEXT = 2000  # characters of a message, a repr or a line of output a rank reports
MAX_ARGV = 200  # elements of a command the rank reports as a command
MAX_TAIL = 4000  # characters of a run's output tail
MAX_WORKER_LINES = 64
WORKER_LINE = re.compile(r"WORKER (\{[^{}]*\})")


def expected_args(env: Mapping[str, str], head: str, script: str, port: int) -> dict:
    """What torchrun's parser must read from a correct command for ``env``, whose hostlist's
    first host is ``head`` (each case states it: these checks hold no hostlist parser, which is
    the exercise's to write)."""
    return {"nnodes": env["SLURM_NNODES"], "node_rank": int(env["SLURM_NODEID"]),
            "nproc_per_node": env.get("SLURM_GPUS_ON_NODE", "1"),
            "master_addr": head, "master_port": port,
            "training_script": script, "training_script_args": [], "rdzv_backend": "static",
            "rdzv_endpoint": "", "standalone": False, "module": False, "no_python": False}


FLAGS = {"nnodes": "--nnodes", "node_rank": "--node-rank", "nproc_per_node": "--nproc-per-node",
         "master_addr": "--master-addr", "master_port": "--master-port",
         "training_script": "the script", "training_script_args": "the script's arguments",
         "rdzv_backend": "--rdzv-backend", "rdzv_endpoint": "--rdzv-endpoint",
         "standalone": "--standalone", "module": "--module", "no_python": "--no-python"}


def _cut(text, limit: int = MAX_TEXT) -> str:
    return cut_text(text, limit)


def _cut_tail(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def _safe_text(make) -> str:
    return safe_text(make, MAX_TEXT)


def parse_torchrun(argv: list[str], what: str):
    """``argv[1:]`` parsed by torchrun's own parser; CheckFailed if it is not a torchrun command
    torchrun accepts. ``PET_*`` variables (torchrun reads its defaults from them) are ignored;
    what the parser prints (its errors, ``--help``) is caught."""
    if not argv or argv[0] != "torchrun":
        raise CheckFailed(f"{what}: the command must start with 'torchrun', got {_cut(argv)}")
    from torch.distributed.run import parse_args

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PET_")}
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            return parse_args(argv[1:])
    except SystemExit:
        raise CheckFailed(f"{what}: torchrun does not accept {_cut(argv)}:\n"
                          f"{_cut_tail(said.getvalue().strip())}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the parser cannot read is refused
        raise CheckFailed(f"{what}: torchrun's parser cannot read {_cut(argv)}: "
                          f"{type(exc).__name__}: {_cut(exc, 300)}") from None
    finally:
        os.environ.update(saved)


def compare_args(parsed, expected: dict, argv, what: str) -> None:
    actual = {key: getattr(parsed, key) for key in expected}
    if actual["master_port"] is None:
        actual["master_port"] = DEFAULT_MASTER[1]  # what torchrun's run() does
    wrong = [f"{FLAGS[k]}: expected {expected[k]!r}, torchrun reads {_cut(repr(actual[k]))}"
             for k in expected if actual[k] != expected[k]]
    if wrong:
        raise CheckFailed(f"{what}: your command {_cut(argv)}\n    " + "\n    ".join(wrong))


def describe_env(env: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in env.items())


def slurm_env(nnodes: int, node: int, nodelist: str, gpus: int | None = None) -> dict:
    env = {"SLURM_NNODES": str(nnodes), "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": nodelist}
    if gpus is not None:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


# --- in the rank: what each call gave, as data --------------------------------------------------


def _described(exc: BaseException) -> dict:
    return {"raised": _cut(type(exc).__name__, 200), "message": _safe_text(lambda: exc),
            "is_value_error": isinstance(exc, ValueError)}


def _as_argv(got) -> list[str] | None:
    """A copy of ``got`` as plain strings when it is a list of at most MAX_ARGV str, else None."""
    if not isinstance(got, list):
        return None
    try:
        items = list.copy(got)
        if len(items) > MAX_ARGV or not all(isinstance(a, str) for a in items):
            return None
        return [str.__str__(a) for a in items]
    except Exception:  # noqa: BLE001 - something that only looks like a list of str
        return None


def observe_call(fn, env: Mapping, script: str, port: int | None) -> dict:
    """One call, ``fn(env, script)`` or ``fn(env, script, port)``: the command it returned, or
    what else it returned (type name, cut repr), or the exception it raised. NotImplementedError
    (the stub's) ends the rank: the student reads it with its traceback."""
    try:
        got = fn(env, script) if port is None else fn(env, script, port)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the exception is the finding
        return {"argv": None, "type": "", "repr": "", "raised": _described(exc)}
    argv = _as_argv(got)
    if argv is not None:
        return {"argv": argv, "type": "list", "repr": "", "raised": None}
    return {"argv": None, "type": type_name(got), "repr": _safe_text(lambda: repr(got)),
            "raised": None}


def _given(env: dict, marker: list) -> Mapping:
    """A fresh dict, or a read-only Mapping that is not a dict when the case is marked "frozen"."""
    if marker == ["frozen"]:
        from ddpcourse.grading.exercises.ranks_from_env import FrozenEnv

        return FrozenEnv(env)
    return dict(env)


def observe_argvs(rank, world_size, fn, cases):
    """Every case ``(env, script, port or None, what, head[, "frozen"])`` in a clean process."""
    return {"calls": [observe_call(fn, _given(env, marker), script, port)
                      for env, script, port, _, _, *marker in cases]}


def observe_errors(rank, world_size, fn, cases):
    """Every case ``(env, names the ValueError must contain, what)``, called with ``train.py``
    and port 29500."""
    return {"calls": [observe_call(fn, dict(env), "train.py", 29500) for env, _, _ in cases]}


# --- in the judge ------------------------------------------------------------------------------


def _reported_exception(call) -> dict | None:
    raised = observed(call, "raised", (dict, type(None)))
    if raised is None:
        return None
    return {"type": _cut(observed(raised, "raised", str), 200),
            "message": _cut(observed(raised, "message", str)),
            "is_value_error": observed(raised, "is_value_error", bool)}


def _reported_argv(call) -> list[str] | None:
    argv = observed(call, "argv", (list, type(None)))
    if argv is not None and (len(argv) > MAX_ARGV or not all(type(a) is str for a in argv)):
        raise CheckFailed("the rank's report has an 'argv' that is not a short list of str")
    return argv


def returned_argv(call, what: str) -> list[str]:
    """The command a call returned; CheckFailed saying what came back instead."""
    raised = _reported_exception(call)
    if raised is not None:
        raise CheckFailed(f"{what}: your function raised {raised['type']}: {raised['message']}")
    argv = _reported_argv(call)
    if argv is None:
        raise CheckFailed(f"{what}: expected a list of str, got "
                          f"{_cut(observed(call, 'repr', str))} "
                          f"({_cut(observed(call, 'type', str), 200)})")
    return argv


def judge_argvs(observations, world_size, cases):
    def judge_rank(rank, observation):
        calls = reported_calls(observation, len(cases))
        for call, (env, script, port, what, head, *_) in zip(calls, cases):
            label = f"{what} [{describe_env(env)}]"
            argv = returned_argv(call, label)
            compare_args(parse_torchrun(argv, label),
                         expected_args(env, head, script, port or 29500), argv, label)

    judge_each_rank(observations, judge_rank)


def judge_errors(observations, world_size, cases):
    def judge_rank(rank, observation):
        for call, (env, must_name, what) in zip(reported_calls(observation, len(cases)), cases):
            label = f"{what} [{describe_env(env)}]"
            raised = _reported_exception(call)
            if raised is None:
                argv = _reported_argv(call)
                got = _cut(argv) if argv is not None else _cut(observed(call, "repr", str))
                raise CheckFailed(f"{label}: expected ValueError, got {got}")
            if not raised["is_value_error"]:
                raise CheckFailed(f"{label}: expected ValueError, got {raised['type']}: "
                                  f"{raised['message']}")
            missing = [name for name in must_name if name not in raised["message"]]
            if missing:
                raise CheckFailed(f"{label}: the ValueError must name {missing}; it said: "
                                  f"{raised['message']}")

    judge_each_rank(observations, judge_rank)


ARGVS = Case(observe_argvs, judge_argvs)
ERRORS = Case(observe_errors, judge_errors)

VISIBLE_CASES = [  # (env, script, port, what, the first host of its SLURM_JOB_NODELIST)
    (slurm_env(2, 1, "gpu[07-08]", 4), "train.py", 31000, "node 1 of 2, 4 GPUs per node", "gpu07"),
    (slurm_env(2, 0, "gpu[07-08]", 4), "train.py", 31000, "node 0 of 2, 4 GPUs per node", "gpu07"),
    (slurm_env(1, 0, "gpu07"), "train.py", None, "one node, no GPUs, the default port", "gpu07"),
    (slurm_env(2, 1, "n1,n2"), "/home/me/train.py", 29400, "a plain list of two hosts", "n1"),
    (slurm_env(4, 2, "gpu[07-09,12]", 8), "train.py", 29501, "ranges and single numbers",
     "gpu07"),
]
VISIBLE_ERRORS = [
    ({}, REQUIRED, "no Slurm variables at all"),
    ({"SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]"}, ("SLURM_NODEID",),
     "SLURM_NODEID missing"),
]


def check_torchrun_argv_parses(fn) -> None:
    """Commands for several Slurm environments, read back by torchrun's own parser."""
    run_student(ARGVS, 1, fn, VISIBLE_CASES, init_process_group=False)


def check_torchrun_argv_rejects_missing_variables(fn) -> None:
    run_student(ERRORS, 1, fn, VISIBLE_ERRORS, init_process_group=False)


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


def node_envs(nnodes: int, nodelist: str, gpus: int | None) -> list[dict]:
    """The Slurm variables of every fake node (one task per node)."""
    return [dict(slurm_env(nnodes, i, nodelist, gpus), SLURM_PROCID=str(i),
                 SLURM_NTASKS=str(nnodes), SLURM_JOB_ID="4242") for i in range(nnodes)]


def launch_env(rdzv_timeout_s: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "LOCAL_WORLD_SIZE")}
    env["PET_RDZV_CONF"] = f"timeout={rdzv_timeout_s}"  # the parser's env default
    env["OMP_NUM_THREADS"] = "1"
    return env


def runnable(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]


def tail(text: str, lines: int = 15) -> str:
    """The last lines of a command's output, before torchrun's own failure summary."""
    text = text.split("ChildFailedError:")[0]
    return _cut_tail("\n".join(text.strip().splitlines()[-lines:]))


def launch_plan(argvs: list, envs: list[dict], head: str, script: str, port: int
                ) -> str | None:
    """What the commands call for: "pair" (all right: run every node at once), "lonely" (they
    do not all point at the head node's store: run the last node alone) or None (a command is
    missing or wrong: nothing to run). The rank decides with it what to run; the judge decides
    again, from the commands, what it must have run."""
    if any(argv is None for argv in argvs):
        return None
    try:
        parsed = [parse_torchrun(argv, f"node {i}") for i, argv in enumerate(argvs)]
        if any((ns.master_addr, ns.master_port) != (head, port) for ns in parsed):
            return "lonely"
        for i, (ns, argv) in enumerate(zip(parsed, argvs)):
            compare_args(ns, expected_args(envs[i], head, script, port), argv, f"node {i}")
    except CheckFailed:
        return None
    return "pair"


def _output_tail(text: str, lines: int = 40) -> str:
    text = text.split("ChildFailedError:")[0]
    return _cut_tail("\n".join(text.strip().splitlines()[-lines:]), MAX_TAIL)


def run_report(done) -> dict:
    """A finished command as data: exit code, deadline, the tails of its output (before
    torchrun's failure summary) and its workers' report lines."""
    return {"returncode": done.returncode, "timed_out": bool(done.timed_out),
            "seconds": float(done.seconds), "stdout_tail": _output_tail(done.stdout),
            "stderr_tail": _output_tail(done.stderr),
            "workers": [_cut(found) for found in WORKER_LINE.findall(done.stdout)
                        [:MAX_WORKER_LINES]]}


def observe_launch(rank, world_size, fn, nnodes, nodelist, head, gpus, launch_timeout):
    """In a clean process: the student's command of every fake node, then the launch they call
    for, in this process's own temporary folder, on a port that is free here."""
    port = free_port()
    envs = node_envs(nnodes, nodelist, gpus)
    with tempfile.TemporaryDirectory(prefix="ddpcourse-torchrun-from-slurm-") as work:
        script = str(Path(work) / "grader_worker.py")
        Path(script).write_text(WORKER)
        calls = [observe_call(fn, env, script, port) for env in envs]
        report = {"port": port, "script": script, "calls": calls, "lonely": None, "runs": None}
        argvs = [call["argv"] for call in calls]
        plan = launch_plan(argvs, envs, head, script, port)
        if plan == "lonely":
            report["lonely"] = run_report(run_bounded(
                runnable(argvs[-1]), LONELY_DEADLINE_S, cwd=work,
                env=launch_env(LONELY_RDZV_TIMEOUT_S)))
        elif plan == "pair":
            env = launch_env(RDZV_TIMEOUT_S)
            with ThreadPoolExecutor(nnodes) as pool:
                runs = list(pool.map(lambda argv: run_bounded(runnable(argv), launch_timeout,
                                                              cwd=work, env=env), argvs))
            report["runs"] = [run_report(done) for done in runs]
    return report


def _run(report, what: str) -> dict:
    """A run's report, checked field by field."""
    returncode = observed(report, "returncode", (int, type(None)))
    seconds = observed(report, "seconds", (int, float))
    if isinstance(returncode, bool) or isinstance(seconds, bool):
        raise CheckFailed(f"the rank's report of {what} has a bool for a number")
    workers = observed(report, "workers", list)
    if len(workers) > MAX_WORKER_LINES or not all(type(w) is str for w in workers):
        raise CheckFailed(f"the rank's report of {what} has 'workers' that are not a few lines")
    return {"returncode": returncode, "seconds": float(seconds),
            "timed_out": observed(report, "timed_out", bool),
            "stdout_tail": _cut_tail(observed(report, "stdout_tail", str), MAX_TAIL),
            "stderr_tail": _cut_tail(observed(report, "stderr_tail", str), MAX_TAIL),
            "workers": [_cut(w) for w in workers]}


def never_meets(argvs, parsed, head: str, port: int, lonely: dict) -> str:
    """What the last node, launched alone as on its own machine, did: the judge's message."""
    node = len(argvs) - 1
    addr, node_port = parsed[node].master_addr, parsed[node].master_port or DEFAULT_MASTER[1]
    lines = [f"the commands do not point every node at the head node's store {head}:{port} "
             "(first host of SLURM_JOB_NODELIST, and the port argument):"]
    for i, ns in enumerate(parsed):
        lines.append(f"    node {i} uses --master-addr {_cut(ns.master_addr, 200)} --master-port "
                     f"{ns.master_port or DEFAULT_MASTER[1]}"
                     + (" (torchrun's default)" if ns.master_port is None else ""))
    if lonely["timed_out"]:
        outcome = f"was still waiting after {lonely['seconds']:.0f} s and was killed"
    else:
        reason = next((line.strip() for line in lonely["stderr_tail"].splitlines()[::-1]
                       if "timed out" in line.lower() or "connect" in line.lower()), "")
        outcome = (f"exited with code {lonely['returncode']} after {lonely['seconds']:.1f} s: "
                   f"{_cut(reason, 500)}")
    lines.append(f"On a cluster, node {node} would look for the store at {_cut(addr, 200)}:"
                 f"{node_port} on its own machine, where nobody hosts it, and never meet node 0. "
                 f"Launched alone here (with a {LONELY_RDZV_TIMEOUT_S} s rendezvous timeout) it "
                 f"{outcome}")
    return "\n".join(lines)


def _worker(text: str) -> dict:
    """One worker's report line, parsed and checked."""
    try:
        report = json.loads(text)
    except Exception:  # noqa: BLE001 - a line that is not JSON is malformed
        report = None
    kinds = {"rank": int, "world_size": int, "sum": (int, float), "group_rank": str,
             "local_rank": str, "store": str}
    if not isinstance(report, dict) or any(
            not isinstance(report.get(key), kind) or isinstance(report.get(key), bool)
            for key, kind in kinds.items()):
        raise CheckFailed(f"a worker's report is malformed: {_cut(text, 300)}")
    return {key: report[key] for key in kinds}


def worker_reports(observation, nnodes: int, nodelist: str, head: str, gpus: int | None,
                   launch_timeout: float) -> list[dict]:
    """Judge one rank's launch report; the workers' reports when every node met."""
    port = observed(observation, "port", int)
    if isinstance(port, bool) or not 0 < port < 65536:
        raise CheckFailed("the rank's report has a 'port' that is not a port")
    script = observed(observation, "script", str)
    if not 0 < len(script) <= MAX_TEXT:
        raise CheckFailed("the rank's report has a 'script' that is not a path")
    envs = node_envs(nnodes, nodelist, gpus)
    calls = reported_calls(observation, nnodes)
    argvs = [returned_argv(call, f"node {i} [{describe_env(env)}]")
             for i, (call, env) in enumerate(zip(calls, envs))]
    parsed = [parse_torchrun(argv, f"node {i}") for i, argv in enumerate(argvs)]
    if any((ns.master_addr, ns.master_port) != (head, port) for ns in parsed):
        lonely = _run(observed(observation, "lonely", dict), "the lonely node's launch")
        raise CheckFailed(never_meets(argvs, parsed, head, port, lonely))
    for i, (ns, argv) in enumerate(zip(parsed, argvs)):
        compare_args(ns, expected_args(envs[i], head, script, port), argv, f"node {i}")
    runs = observed(observation, "runs", list)
    if len(runs) != nnodes:
        raise CheckFailed(f"the rank's report has {len(runs)} runs instead of {nnodes}")
    runs = [_run(run, f"node {i}'s launch") for i, run in enumerate(runs)]
    world = nnodes * (gpus or 1)
    problems = []
    for i, done in enumerate(runs):
        if done["timed_out"]:
            problems.append(f"node {i} was still running after {launch_timeout:g} s and was "
                            f"killed:\n{tail(done['stdout_tail'] + chr(10) + done['stderr_tail'])}")
        elif done["returncode"] != 0:
            problems.append(f"node {i} exited with code {done['returncode']}:\n"
                            f"{tail(done['stderr_tail'])}")
    if problems:
        raise CheckFailed("\n".join(problems))
    reports = [_worker(text) for done in runs for text in done["workers"]]
    ranks = sorted(r["rank"] for r in reports)
    if ranks != list(range(world)):
        raise CheckFailed(f"{nnodes} nodes x {gpus or 1} processes should start workers with "
                          f"ranks 0..{world - 1}; the workers reported ranks {_cut(ranks, 300)}")
    for r in reports:
        if r["world_size"] != world or r["sum"] != world * (world - 1) / 2:
            raise CheckFailed(f"worker rank {r['rank']} saw world size {r['world_size']} and a "
                              f"sum of ranks {r['sum']:g}; expected one group of {world} "
                              f"({nnodes} nodes x {gpus or 1}) and {world * (world - 1) / 2:g}")
    return reports


def judge_launch(observations, world_size, nnodes, nodelist, head, gpus, launch_timeout):
    judge_each_rank(observations, lambda rank, observation: worker_reports(
        observation, nnodes, nodelist, head, gpus, launch_timeout))


LAUNCH = Case(observe_launch, judge_launch)


def launch_nodes(fn, nnodes: int, nodelist: str, head: str, gpus: int | None = None,
                 **kwargs) -> list[dict]:
    """Run the student's commands of ``nnodes`` fake nodes at once (in a rank); return the
    workers' reports.

    ``nodelist`` must name this machine first: ``head`` (``localhost`` or ``127.0.0.1``)."""
    __tracebackhide__ = True  # noqa: F841
    timeout = max(LAUNCH_TIMEOUT_S, LONELY_DEADLINE_S) + CHECK_TIMEOUT_S + 15
    observations = run_student(LAUNCH, 1, fn, nnodes, nodelist, head, gpus, LAUNCH_TIMEOUT_S,
                               init_process_group=False, timeout=timeout, **kwargs)
    return worker_reports(observations[0], nnodes, nodelist, head, gpus, LAUNCH_TIMEOUT_S)


def check_torchrun_argv_launches_two_nodes(fn) -> None:
    """Two fake nodes on this machine, one process each, launched for real."""
    launch_nodes(fn, 2, "localhost,127.0.0.1", "localhost")
