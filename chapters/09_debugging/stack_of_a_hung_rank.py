"""Where is each rank stuck? Ask the processes for their Python stacks.

    torchrun --standalone --nproc_per_node 2 chapters/09_debugging/stack_of_a_hung_rank.py

A hung job prints nothing. Its stacks say where each rank waits, and a hang is almost always
one rank in a collective that another rank is not in. Two ways with the standard library's
``faulthandler``, both shown here on a rank 0 that waits in ``all_reduce`` while rank 1 is
still in ``load_next_batch`` (a slow step of its own, which here lasts until rank 0's stack
has been written, so the run is the same on a busy machine):

* a watchdog set before a step that must not take long:
  ``faulthandler.dump_traceback_later(seconds, exit=False)`` prints every thread's stack if the
  step has not finished by then (and ``cancel_dump_traceback_later()`` after it);
* a signal handler installed at start-up, ``faulthandler.register(signal.SIGUSR1)``, so that
  ``kill -USR1 <pid>`` prints a live rank's stack at any time (rank 0 does that to rank 1 here).

Without either, ``py-spy dump --pid <pid>`` (a separate tool, ``pip install py-spy``; it needs
permission to ptrace the process) reads the stack of any running Python process, on every rank:
``for pid in $(pgrep -f train.py); do py-spy dump --pid $pid; done``. The rank launcher of this
course does the same for its own ranks: a call that runs past its deadline shows every rank's
stack. Exit code 1 if a stack does not name the function the rank was in.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpcourse.dist_env import process_group
from ddpcourse.report import report_checks

WATCHDOG_S = 1.0  # rank 0's patience before it dumps its own stack
GIVE_UP_S = 60.0


def wait_for_file(path: Path, text: str = "") -> None:
    give_up = time.monotonic() + GIVE_UP_S
    while not (path.exists() and text in path.read_text()):
        if time.monotonic() > give_up:
            raise TimeoutError(f"{path} did not get {text!r} in {GIVE_UP_S:.0f} s")
        time.sleep(0.05)


def load_next_batch(folder: Path) -> torch.Tensor:
    """Rank 1's slow step: it says it is here, then lasts until rank 0's watchdog has fired."""
    (folder / "rank1_is_loading").touch()
    wait_for_file(folder / "rank0.txt", "Thread")
    return torch.ones(4)


def wait_for_gradients(batch: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(batch)
    return batch


def run_all(rank: int, world_size: int, folder: str) -> dict:
    """Rank 0 dumps its own stack while it waits in ``all_reduce`` and asks rank 1 for its stack
    with SIGUSR1; returns the stack text each rank wrote (its first frames)."""
    folder = Path(folder)
    mine = folder / f"rank{rank}.txt"
    with open(mine, "w") as out:
        faulthandler.register(signal.SIGUSR1, file=out, all_threads=False)
        pids: list = [None] * world_size
        dist.all_gather_object(pids, os.getpid())
        if rank == 0:
            if world_size > 1:
                wait_for_file(folder / "rank1_is_loading")
                os.kill(pids[1], signal.SIGUSR1)
            faulthandler.dump_traceback_later(WATCHDOG_S, exit=False, file=out)
            wait_for_gradients(torch.ones(4))
            faulthandler.cancel_dump_traceback_later()
        else:
            wait_for_gradients(load_next_batch(folder))
        faulthandler.unregister(signal.SIGUSR1)
    dist.barrier()
    return {"stack": mine.read_text()}


def problems(results: list[dict]) -> list[str]:
    found = []
    if "in wait_for_gradients" not in results[0]["stack"]:
        found.append("rank 0's watchdog dump does not show it waiting in wait_for_gradients")
    if len(results) > 1 and "in load_next_batch" not in results[1]["stack"]:
        found.append("rank 1's SIGUSR1 dump does not show it in load_next_batch")
    return found


def main() -> int:
    with process_group(timeout_s=120) as ctx, tempfile.TemporaryDirectory() as folder:
        holder = [folder]
        dist.broadcast_object_list(holder, src=0)  # one folder for both (one machine)
        mine = run_all(ctx.rank, ctx.world_size, holder[0])
        results: list = [None] * ctx.world_size
        dist.all_gather_object(results, mine)
        if not ctx.is_main:
            return 0
        for rank, seen in enumerate(results):
            print(f"--- rank {rank}'s stack ---")
            print(seen["stack"].strip())
        found = problems(results)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
