"""How often chapter 03's racy variants fail, counted over repeated runs and written as JSON.

    python benchmarks/ch03_restart_races.py       # all counts; 5-10 minutes on 2 cores
    python benchmarks/ch03_restart_races.py --runs 1 --root-cause-runs 1 --trials 4 --out /tmp/x.json

Chapter 03 quotes these counts; the lesson reads them from the committed record
(benchmarks/results/ch03_restart_races.json) and never reruns them live. What is counted:

* restarts (``torchrun --standalone --nproc_per_node 2 --max_restarts 1 restart_demo.py``): rank 1
  fails in attempt 0, the agent restarts the group, and attempt 1 must form a new group. Three
  ways to join: plain ``env://`` on the store torchrun shares between attempts
  (``--plain-init``), the demo's store prefix private to each attempt, and plain ``env://`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a new store per attempt). A run fails when torchrun
  exits non-zero; the first error line of the failed run is kept.
* root cause (``torchrun ... record_demo.py --no-record``): rank 1 raises, rank 0 then fails in its
  barrier. Which rank does torchrun's report name as "Root Cause"? Its timestamps have whole-second
  resolution, so the victim can be named.
* pipes (``set -o pipefail; WRITER 2000 host names | head -n1``): how often the pipeline fails
  because the writer dies of SIGPIPE (exit 141), for an external writer (``env printf``, a
  separate program, as ``scontrol`` is) and for bash's builtin ``printf``.

Every launch has a deadline and leaves no process behind (``run_bounded``); ports are chosen by
torchrun (``--standalone``). The figures depend on the machine and its load, which is why the
record starts with ``ddpcourse.timing.reference_header``: machine, date, torch, this command and
how busy the machine was with other work at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ddpcourse.launcher import run_bounded
from ddpcourse.timing import command_line, machine_load, reference_header

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "chapters/03_torchrun"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ch03_restart_races.json"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
EXCEPTION_LINE = re.compile(r"\b(\w+(?:Error|Exception)): .*")
SOURCE_LOCATION = re.compile(r"\[/\S+:\d+\] ?")  # gloo's "[/path/to/file.cc:123] " prefixes

RESTART_VARIANTS = {
    "plain env://, store shared by the attempts": (["--plain-init"], {}),
    "store prefix private to each attempt (the demo's default)": ([], {}),
    "plain env://, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1":
        ([], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}
PIPE_WRITERS = {
    "external printf (env printf)": "env printf",
    "bash builtin printf": "printf",
}
PIPE_SCRIPT = "set -o pipefail; {writer} '%s\\n' $(seq -f 'host%g' 2000) | head -n1 > /dev/null"


def environment(**extra: str) -> dict[str, str]:
    inherited = ("CUDA_VISIBLE_DEVICES", "TORCHELASTIC_", "TORCH_DISABLE_SHARE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    return env


def first_error(stderr: str) -> str:
    """The first exception a worker raised, other than the planned one and torchrun's summary."""
    for line in stderr.splitlines():
        found = EXCEPTION_LINE.search(line)
        if found and "fails on purpose" not in line and found.group(1) != "ChildFailedError":
            return SOURCE_LOCATION.sub("", found.group(0)).strip()[:300]
    return ""


def count_restarts(runs: int, timeout: float) -> list[dict]:
    results = []
    for name, (flags, extra_env) in RESTART_VARIANTS.items():
        cmd = TORCHRUN + ["--max_restarts", "1", f"{CHAPTER}/restart_demo.py", *flags]
        outcomes = []
        for i in range(runs):
            events = Path(tempfile.mkdtemp()) / "events.jsonl"
            done = run_bounded(cmd + ["--event-file", str(events)], timeout, cwd=ROOT,
                               env=environment(**extra_env))
            failed = done.returncode != 0 or done.timed_out
            outcomes.append({"exit": done.returncode, "timed_out": done.timed_out,
                             "seconds": round(done.seconds, 1),
                             "error": first_error(done.stderr) if failed else ""})
            print(f"{name}: run {i + 1}/{runs}: exit {done.returncode} in {done.seconds:.1f} s",
                  flush=True)
        env_words = [f"{k}={v}" for k, v in extra_env.items()]
        results.append({"variant": name, "command": " ".join(env_words + ["torchrun"] + cmd[3:]),
                        "runs": runs,
                        "failed": sum(o["exit"] != 0 or o["timed_out"] for o in outcomes),
                        "outcomes": outcomes})
    return results


def count_root_causes(runs: int, timeout: float) -> dict:
    cmd = TORCHRUN + [f"{CHAPTER}/record_demo.py", "--no-record"]
    named = []
    for i in range(runs):
        done = run_bounded(cmd, timeout, cwd=ROOT, env=environment())
        root = done.stderr.split("Root Cause", 1)[-1]
        found = re.search(r"rank\s*:\s*(\d+)", root)
        named.append(int(found.group(1)) if found else None)
        print(f"root cause: run {i + 1}/{runs}: rank {named[-1]}", flush=True)
    return {"command": "torchrun " + " ".join(cmd[3:]), "runs": runs,
            "named_rank_1_the_culprit": named.count(1), "named_rank_0_the_victim": named.count(0),
            "named_none": named.count(None)}


def count_pipes(trials: int) -> list[dict]:
    results = []
    for name, writer in PIPE_WRITERS.items():
        script = PIPE_SCRIPT.format(writer=writer)
        codes = [subprocess.run(["bash", "-c", script], timeout=30).returncode
                 for _ in range(trials)]
        results.append({"writer": name, "command": f"bash -c {script!r}", "trials": trials,
                        "failed": sum(c != 0 for c in codes), "exit_codes": sorted(set(codes))})
        print(f"pipes, {name}: {results[-1]['failed']} of {trials} failed", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6, help="torchrun runs per restart variant")
    parser.add_argument("--root-cause-runs", type=int, default=6)
    parser.add_argument("--trials", type=int, default=20, help="pipeline trials per writer")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="deadline of one torchrun run (s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    opts = parser.parse_args()

    record = reference_header(command_line(), machine_load(),
                              note="measured once, at the start; races depend on the load")
    record["what"] = "failure counts quoted by chapters/03_torchrun"
    record["bash"] = subprocess.run(["bash", "-c", "echo $BASH_VERSION"], capture_output=True,
                                    text=True).stdout.strip()
    record["restarts"] = count_restarts(opts.runs, opts.timeout)
    record["root_cause_without_record"] = count_root_causes(opts.root_cause_runs, opts.timeout)
    record["pipes"] = count_pipes(opts.trials)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
