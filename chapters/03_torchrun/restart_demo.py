"""--max_restarts restarts the whole worker group, not the one process that failed: shown with pids.

    torchrun --standalone --nproc_per_node 2 --max_restarts 1 chapters/03_torchrun/restart_demo.py

Launch test: custom. tests/test_chapter_03_torchrun.py runs it with ``--max_restarts 1`` (it
succeeds after one restart of *every* rank: new pids everywhere; the healthy rank of attempt 0 is
stopped by the agent's SIGTERM) and with the default ``--max_restarts 0`` (nothing restarts;
torchrun exits non-zero, and the healthy rank is stopped all the same).

Every rank joins the group and does one all-reduce; then rank ``--fail-rank`` raises while
``TORCHELASTIC_RESTART_COUNT`` is below ``--fail-attempts``. In such an attempt the other ranks
stay out of collectives, like a rank busy with a long local step when its peer dies: they wait
(at most ``--wait-s`` seconds) for the agent. torchrun's agent sees one failed worker and sends
SIGTERM to the others (``LocalElasticAgent._stop_workers`` -> ``SubprocessHandler.close``); a
handler, installed in those waiting ranks only, logs that signal and lets it end the process as
SIGTERM would. While
restarts are left, the agent then starts the whole group again with the count one higher. Each
rank appends one JSON line per event to ``--event-file`` (default: a file in the temp folder
named after the run id); rank 0 prints the story at the end.

(A healthy rank that is *inside* a collective when its peer dies usually fails on its own first,
"Connection closed by peer", before the agent's signal arrives: record_demo.py shows that case.)

Why this script does not join with plain ``env://``: torchrun (torch 2.13, ``--standalone`` or
c10d) keeps one TCP store for the whole job and hands it to every attempt. Keys the previous
attempt's ranks wrote there (their network addresses) are still in it, so a fresh rank can read a
dead peer's address and fail in gloo's connect ("Gloo connectFullMesh failed": refused, or timed
out; ``--plain-init`` reproduces it). Joining under a key prefix private to the attempt (``restart_N/``) avoids it. A
caveat: each node's agent keeps its own TORCHELASTIC_RESTART_COUNT, so on several nodes the
counts can differ; there, launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` instead, which
gives every attempt a new store (and a new MASTER_PORT), so that plain env:// is fine (this
script then uses it). The joining is ``process_group(restart_safe=True)`` in ddpcourse/dist_env.py. How often each variant failed is recorded, with the command that repeats
the count, in benchmarks/results/ch03_restart_races.json (benchmarks/ch03_restart_races.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ddpcourse.dist_env import process_group


def attempt() -> int:
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def log_event(path: str, event: str, **extra) -> None:
    line = json.dumps({"attempt": attempt(), "rank": int(os.environ["RANK"]),
                       "pid": os.getpid(), "event": event, **extra})
    with open(path, "a") as f:  # one short line per write: appends from many ranks stay whole
        f.write(line + "\n")


def log_sigterm_then_die(path: str) -> None:
    """On SIGTERM: log it, then let the signal end the process as it would have without us.

    Installed only where this rank waits for the agent: a Python handler runs between two
    bytecodes, so a rank inside a long C++ call (a collective, a connect) would not die on
    SIGTERM until the call returns, and the agent would wait its 30 s before SIGKILL."""
    def handler(signum, frame):
        log_event(path, "SIGTERM", signal=signum)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    signal.signal(signal.SIGTERM, handler)


def wait_for_the_agent(path: str, limit_s: float) -> None:
    """Stay out of collectives until the agent stops this process; give up after limit_s."""
    log_event(path, "waiting")
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.05)  # the SIGTERM handler runs between two sleeps
    log_event(path, "not stopped")
    raise TimeoutError(f"the agent did not stop rank {os.environ['RANK']} within {limit_s} s")


def story(path: str) -> str:
    with open(path) as f:
        events = [json.loads(line) for line in f]
    lines = [f"{'attempt':>7} {'rank':>4} {'pid':>8}  events"]
    keys = sorted({(e["attempt"], e["rank"], e["pid"]) for e in events})
    for a, r, pid in keys:
        seen = [e["event"] for e in events if (e["attempt"], e["rank"], e["pid"]) == (a, r, pid)]
        lines.append(f"{a:>7} {r:>4} {pid:>8}  {' -> '.join(seen)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-attempts", type=int, default=1,
                        help="the rank fails on attempts 0 .. N-1")
    parser.add_argument("--event-file", default=None,
                        help="JSON-lines event log (default: a temp file)")
    parser.add_argument("--plain-init", action="store_true",
                        help="join with plain env:// (reproduces the stale-store race)")
    parser.add_argument("--wait-s", type=float, default=60.0,
                        help="how long a healthy rank waits to be stopped by the agent")
    opts = parser.parse_args()
    log = opts.event_file or os.path.join(
        tempfile.gettempdir(), f"restart_demo-{os.environ['TORCHELASTIC_RUN_ID']}.jsonl")

    log_event(log, "started")
    failing_attempt = attempt() < opts.fail_attempts
    with process_group(timeout_s=20, restart_safe=not opts.plain_init) as ctx:
        if failing_attempt and ctx.rank != opts.fail_rank:
            log_sigterm_then_die(log)  # before the all-reduce that the failing rank leaves first
        total = torch.tensor([float(ctx.rank)], device=ctx.device)
        dist.all_reduce(total)
        log_event(log, "joined")
        if failing_attempt and ctx.rank == opts.fail_rank:
            log_event(log, "raised")
            raise RuntimeError(f"rank {ctx.rank} fails on purpose in attempt {attempt()}")
        if failing_attempt:
            wait_for_the_agent(log, opts.wait_s)
        dist.barrier()
        log_event(log, "finished")
        dist.barrier()
        if ctx.is_main:
            print(f"attempt {attempt()} finished on all {ctx.world_size} ranks "
                  f"(TORCHELASTIC_MAX_RESTARTS={os.environ['TORCHELASTIC_MAX_RESTARTS']})")
            print(story(log), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
