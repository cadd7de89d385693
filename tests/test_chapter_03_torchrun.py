"""Chapter 03 (torchrun): the scripts whose launch is not a single torchrun command, checked.

Every launch runs in its own session with a deadline; on timeout the whole process group
(torchrun, its agent, its workers) is killed, so a hung rendezvous fails the test instead of
hanging it. Ports are chosen by the scripts at run time, never fixed here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "03_torchrun"
sys.path.insert(0, str(CHAPTER))
from ddpcourse.launcher import run_bounded  # a deadline, and no process left behind
BIN = Path(sys.executable).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
OLD_LAUNCHER = [sys.executable, "-m", "torch.distributed.launch"]


def environment(**extra: str) -> dict[str, str]:
    """This process's environment, less the variables the tests set when they want them."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.update(extra)
    return env


def launch(cmd: list[str], timeout: float = 60, **extra_env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repository root; its whole process group is killed at the deadline."""
    done = run_bounded(cmd, timeout, cwd=ROOT, env=environment(**extra_env))
    if done.timed_out:
        pytest.fail(f"still running after {timeout} s: {' '.join(cmd)}\n"
                    f"{done.stdout}\n{done.stderr}")
    return subprocess.CompletedProcess(cmd, done.returncode, done.stdout, done.stderr)


def report_of(stderr: str) -> str:
    """The ChildFailedError report torchrun prints last (empty if there is none)."""
    return stderr.split("ChildFailedError:", 1)[1] if "ChildFailedError:" in stderr else ""


# --- what torchrun sets ---------------------------------------------------------------------

def test_torchrun_sets_rank_variables_but_not_cuda_visible_devices(no_orphans):
    done = launch(TORCHRUN + ["--standalone", "--nproc_per_node", "2",
                              str(CHAPTER / "print_env.py"), "--json"])
    assert done.returncode == 0, done.stderr
    views = json.loads(done.stdout.strip().splitlines()[-1])
    assert [views[r]["RANK"] for r in "01"] == ["0", "1"]
    assert [views[r]["LOCAL_RANK"] for r in "01"] == ["0", "1"]
    for r in "01":
        v = views[r]
        assert (v["WORLD_SIZE"], v["LOCAL_WORLD_SIZE"], v["GROUP_RANK"]) == ("2", "2", "0")
        assert v["ROLE_RANK"] == r and v["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert v["CUDA_VISIBLE_DEVICES"] == "(unset)"
        assert v["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # set by the agent for every worker
    assert views["0"]["MASTER_PORT"] == views["1"]["MASTER_PORT"] != "(unset)"
    assert views["0"]["pid"] != views["1"]["pid"]


def test_only_virtual_local_rank_makes_torchrun_set_cuda_visible_devices(no_orphans):
    done = launch(TORCHRUN + ["--standalone", "--nproc_per_node", "2", "--virtual-local-rank",
                              str(CHAPTER / "print_env.py"), "--json"],
                  CUDA_VISIBLE_DEVICES="3,5", TORCH_NCCL_ASYNC_ERROR_HANDLING="3")
    assert done.returncode == 0, done.stderr
    views = json.loads(done.stdout.strip().splitlines()[-1])
    assert [views[r]["CUDA_VISIBLE_DEVICES"] for r in "01"] == ["3", "5"]
    assert [views[r]["LOCAL_RANK"] for r in "01"] == ["0", "0"]
    assert [views[r]["RANK"] for r in "01"] == ["0", "1"]
    # a value given to torchrun itself is passed on unchanged, not replaced by the agent's 1
    assert [views[r]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] for r in "01"] == ["3", "3"]


# --- restarts -------------------------------------------------------------------------------

def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_max_restarts_restarts_every_rank_not_just_the_failed_one(tmp_path, no_orphans):
    log = tmp_path / "events.jsonl"
    done = launch(TORCHRUN + ["--standalone", "--nproc_per_node", "2", "--max_restarts", "1",
                              str(CHAPTER / "restart_demo.py"), "--event-file", str(log)],
                  timeout=90)
    assert done.returncode == 0, done.stderr
    seen = events(log)
    pids = {a: {e["rank"]: e["pid"] for e in seen if e["attempt"] == a and e["event"] == "started"}
            for a in (0, 1)}
    assert sorted(pids[0]) == sorted(pids[1]) == [0, 1], seen
    assert not set(pids[0].values()) & set(pids[1].values()), "every rank got a new process"
    assert {(e["attempt"], e["rank"]) for e in seen if e["event"] == "raised"} == {(0, 1)}
    assert {(e["attempt"], e["rank"]) for e in seen if e["event"] == "finished"} == {(1, 0), (1, 1)}
    assert "attempt 1 finished on all 2 ranks" in done.stdout
    assert_the_agent_stopped_the_healthy_rank(seen, done.stderr)


def assert_the_agent_stopped_the_healthy_rank(seen: list[dict], stderr: str) -> None:
    """Attempt 0's rank 0 did not fail on its own: it logged the agent's SIGTERM, and its pid is
    the one the agent says it signalled."""
    rank0 = [e for e in seen if (e["attempt"], e["rank"]) == (0, 0)]
    assert [e["event"] for e in rank0] == ["started", "joined", "waiting", "SIGTERM"], rank0
    assert rank0[-1]["signal"] == signal.SIGTERM
    signalled = {int(pid) for pid in re.findall(r"Sending process (\d+) closing signal SIGTERM",
                                                stderr)}
    assert signalled == {rank0[0]["pid"]}, stderr


def test_with_the_default_max_restarts_0_nothing_restarts_and_the_job_fails(tmp_path, no_orphans):
    log = tmp_path / "events.jsonl"
    done = launch(TORCHRUN + ["--standalone", "--nproc_per_node", "2",
                              str(CHAPTER / "restart_demo.py"), "--event-file", str(log)])
    assert done.returncode != 0
    seen = events(log)
    assert {e["attempt"] for e in seen} == {0}
    assert not [e for e in seen if e["event"] == "finished"]
    assert "RuntimeError: rank 1 fails on purpose in attempt 0" in done.stderr
    assert_the_agent_stopped_the_healthy_rank(seen, done.stderr)


# --- failure reports ------------------------------------------------------------------------

def test_record_puts_each_failing_ranks_traceback_in_the_report(tmp_path, no_orphans):
    parent_file = tmp_path / "parent_error.json"
    done = launch(TORCHRUN + ["--standalone", "--nproc_per_node", "2", "--log-dir",
                              str(tmp_path / "logs"), str(CHAPTER / "record_demo.py")],
                  TORCHELASTIC_ERROR_FILE=str(parent_file))
    assert done.returncode != 0
    report = report_of(done.stderr)
    assert "ValueError: rank 1: the loss became NaN at step 3" in report
    assert re.search(r"Connection (closed|reset) by peer", report)  # rank 0, the victim
    child_files = sorted((tmp_path / "logs").glob("*/attempt_0/*/error.json"))
    assert [p.parent.name for p in child_files] == ["0", "1"]
    rank1 = json.loads(child_files[1].read_text())
    assert "NaN" in rank1["message"]["message"]
    assert "py_callstack" in rank1["message"]["extraInfo"]
    assert "message" in json.loads(parent_file.read_text())  # the root cause, copied for the parent


def test_without_record_the_report_has_no_traceback(tmp_path, no_orphans):
    done = launch(TORCHRUN + ["--standalone", "--nproc_per_node", "2",
                              str(CHAPTER / "record_demo.py"), "--no-record"])
    assert done.returncode != 0
    report = report_of(done.stderr)
    assert "error_file: <N/A>" in report and "To enable traceback see" in report
    assert "ValueError" not in report
    assert "ValueError: rank 1" in done.stderr  # only in the worker's own stderr


# --- two nodes on one machine ---------------------------------------------------------------

@pytest.mark.parametrize("form", ["static", "c10d"])
def test_two_nodes_on_one_machine_meet(form, no_orphans):
    done = launch(["bash", str(CHAPTER / "two_nodes_on_one_machine.sh"), form], timeout=90,
                  PYTHON=sys.executable, TORCHRUN=str(BIN / "torchrun"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all-reduce of the ranks: 1 (expected 1) -> one group of 2" in done.stdout
    nodes = {line.split("node ")[1][0] for line in done.stdout.splitlines()
             if "-> global rank" in line}
    assert nodes == {"0", "1"}
    if form == "c10d":  # node ranks come from sorting (host name, agent pid), not from arrival
        agent_of_node = {int(node): int(pid) for node, pid in
                         re.findall(r"node (\d) of \d.*agent pid (\d+)", done.stdout)}
        assert agent_of_node[0] < agent_of_node[1], done.stdout


def test_a_node_whose_master_nobody_hosts_fails_instead_of_meeting(no_orphans):
    started = time.monotonic()
    done = launch(["bash", str(CHAPTER / "two_nodes_on_one_machine.sh"), "lonely"], timeout=60,
                  PYTHON=sys.executable, TORCHRUN=str(BIN / "torchrun"))
    assert done.returncode != 0
    assert "timed out" in done.stdout and "trying to connect to (127.0.0.1" in done.stdout
    assert time.monotonic() - started < 60


# --- other launchers ------------------------------------------------------------------------

def test_the_deprecated_launcher_warns_and_passes_local_rank(no_orphans):
    old = launch(OLD_LAUNCHER + ["--nproc_per_node", "2", str(CHAPTER / "print_env.py")])
    assert old.returncode != 0
    assert "FutureWarning: The module torch.distributed.launch is deprecated" in old.stderr
    assert "unrecognized arguments: --local-rank=0" in old.stderr

    legacy = launch(OLD_LAUNCHER + ["--nproc_per_node", "2",
                                    str(CHAPTER / "legacy_local_rank.py")])
    assert legacy.returncode == 0, legacy.stderr
    assert "argv tail ['--local-rank=0']" in legacy.stdout
    assert "argv tail ['--local-rank=1']" in legacy.stdout


def test_the_deprecated_launcher_takes_torchruns_flags_including_max_restarts():
    helped = launch(OLD_LAUNCHER + ["--help"], timeout=30)
    assert helped.returncode == 0
    assert "--max-restarts" in helped.stdout and "--use-env" in helped.stdout


def test_torchrun_passes_no_local_rank_argument(no_orphans):
    done = launch(TORCHRUN + ["--standalone", "--nproc_per_node", "2",
                              str(CHAPTER / "legacy_local_rank.py")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("(from the LOCAL_RANK variable); argv tail []") == 2


def test_mp_spawn_demo_joins_a_group_without_torchrun(no_orphans):
    done = launch([sys.executable, str(CHAPTER / "spawn_demo.py"), "--nprocs", "2"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("sum of ranks 1") == 2
    assert "every process exited cleanly" in done.stdout


# --- SLURM ----------------------------------------------------------------------------------
# The batch file runs on a real SLURM cluster in tests/test_slurm_cluster.py (both forms, 2 nodes x
# 2 workers); stand-ins for scontrol, srun and torchrun remain only for what a real run cannot
# show: the refusal of an unknown form.

FAKE_SCONTROL = """#!/usr/bin/env bash
# fake scontrol: 'show hostnames LIST' prints the hosts of $FAKE_HOSTS, one per line
[[ $1 == show && $2 == hostnames ]] || exit 3
printf '%s\\n' $FAKE_HOSTS
"""
FAKE_SRUN = """#!/usr/bin/env bash
# fake srun: drop srun's options, run the command once per node in parallel, like one task per
# node, with that node's SLURM_NODEID / SLURM_PROCID; fail if any task failed
while [[ $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=$?; done
exit $status
"""
FAKE_TORCHRUN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["TORCHRUN_CALLS"], "a") as f:
    f.write(json.dumps({"node": os.environ.get("SLURM_NODEID"), "argv": sys.argv[1:]}) + "\\n")
"""


def fake_slurm(tmp_path: Path, hosts: str, fake_torchrun: bool, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"scontrol": FAKE_SCONTROL, "srun": FAKE_SRUN}
    if fake_torchrun:
        fakes["torchrun"] = FAKE_TORCHRUN
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return {"PATH": os.pathsep.join([str(bin_dir), str(BIN), os.environ.get("PATH", "")]),
            "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
            "SLURM_GPUS_ON_NODE": "4", "FAKE_HOSTS": hosts,
            "TORCHRUN_CALLS": str(tmp_path / "calls.jsonl"), **extra}


def sbatch(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return launch(["bash", str(CHAPTER / "slurm_torchrun.sbatch"), *args], timeout=timeout, **env)


def test_sbatch_rejects_an_unknown_mode(tmp_path):
    done = sbatch(fake_slurm(tmp_path, "gpu07 gpu08", fake_torchrun=True, RDZV_MODE="etcd"))
    assert done.returncode == 2 and "RDZV_MODE must be c10d or static" in done.stderr


# --- recorded counts ----------------------------------------------------------------------------

RECORD = "ch03_restart_races.json"
RECORDER = ROOT / "benchmarks" / "ch03_restart_races.py"


def test_the_recorder_writes_a_complete_record(tmp_path):
    """The pipe count only (no torchrun run): the script runs and its record is reproducible."""
    from ddpcourse.timing import load_reference

    out = tmp_path / "record.json"
    done = launch([sys.executable, str(RECORDER), "--runs", "0", "--root-cause-runs", "0",
                   "--trials", "2", "--out", str(out)], timeout=60)
    assert done.returncode == 0, done.stderr
    record = load_reference(out)  # raises if machine, date, torch, command or load is missing
    assert "benchmarks/ch03_restart_races.py" in record["command"]
    assert [p["trials"] for p in record["pipes"]] == [2, 2]
    assert all(0 <= p["failed"] <= 2 for p in record["pipes"])


def test_the_lesson_quotes_the_recorded_counts():
    """Every count chapter 03 states is the committed record's; re-recording means re-reading."""
    from ddpcourse.timing import load_reference

    record = load_reference(RECORD)
    assert record["command"].split()[:2] == ["python", "benchmarks/ch03_restart_races.py"]
    lesson = " ".join((CHAPTER / "03_torchrun.nb.py").read_text().replace("#", " ").split())
    plain, prefix, fresh = record["restarts"]
    assert f"plain `env://` failed in {plain['failed']} of {plain['runs']} runs" in lesson
    assert (f"the private prefix in {prefix['failed']} of {prefix['runs']}, the fresh store in "
            f"{fresh['failed']} of {fresh['runs']}") in lesson
    root = record["root_cause_without_record"]
    victim = root["named_rank_0_the_victim"]
    assert f"named rank 0, the victim, in {victim} of {root['runs']}" in lesson
    external, builtin = record["pipes"]
    assert (f"{external['failed']} of {external['trials']} pipelines failed with an external "
            f"`printf`, {builtin['failed']} of {builtin['trials']} with bash's builtin") in lesson
    for old in ("6 of 8 runs", "0 of 8 failed", "11 failed"):  # the old, unrecorded figures
        assert old not in lesson
