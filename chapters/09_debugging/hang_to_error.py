"""Turn a hang into an error that names the rank and the collective.

    torchrun --standalone --nproc_per_node 2 chapters/09_debugging/hang_to_error.py

A collective that one rank never calls waits forever on the others, or rather for the process
group's timeout: by default 30 minutes, 10 for NCCL (``init_process_group``'s docstring in
torch/distributed/distributed_c10d.py; ``default_pg_timeout`` in torch/distributed/constants.py). Four ways to make the same bug (rank 1
skips a collective that rank 0 calls) speak up within seconds, each run here on a fresh group
with a short timeout (:func:`ddpcourse.dist_env.short_timeout_group`):

* :func:`short_timeout`: the bare timeout. Rank 0 gets gloo's "Timed out waiting 3000ms for recv
  operation to complete": it says *that* it waited, not for whom; rank 1 sees nothing at all.
* :func:`monitored`: ``dist.monitored_barrier(timeout=..., wait_all_ranks=True)`` on rank 0
  (gloo only; ``monitored_barrier`` in torch/distributed/distributed_c10d.py) names the ranks
  that did not arrive: "Ranks 1 failed to pass monitoredBarrier in 3000 ms". Put one before the
  step you suspect.
* :func:`detail_mismatch`: ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps every group in a checker
  (``_create_process_group_wrapper`` in distributed_c10d.py) that first compares each
  collective's fingerprint (sequence number, operation, shapes, dtypes) across ranks. Two ranks
  calling *different* collectives (here shapes [4] and [8]) both fail at once with "Detected
  mismatch between collectives on ranks", naming both ranks and the difference.
* :func:`detail_missing`: under DETAIL a *missing* collective still waits for the timeout, but
  the checker's monitored barrier then names the rank that never came.

The debug level is read when a group is made, so the functions set it, make their own group and
set it back (``dist.set_debug_level_from_env``). On a real job set the variable before
launching: ``TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun ...``, but not around DDP on the CPU in
torch 2.13 (see ``detail_with_ddp.py``). Exit code 1 if any claim above fails.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpcourse.dist_env import process_group, short_timeout_group
from ddpcourse.report import report_checks

TIMEOUT_S = 3.0


@contextmanager
def debug_level(level: str):
    """Groups made inside use ``TORCH_DISTRIBUTED_DEBUG=level``; the old level comes back after."""
    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
    dist.set_debug_level_from_env()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = before
        dist.set_debug_level_from_env()


def _outcome(call) -> dict:
    """What one rank saw: the error's text (None if the call returned) and the seconds it took."""
    start = time.monotonic()
    try:
        call()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "seconds": round(time.monotonic() - start, 1)}


def short_timeout(rank: int, world_size: int, timeout_s: float = TIMEOUT_S) -> dict:
    group = short_timeout_group(timeout_s)
    seen = _outcome(lambda: dist.all_reduce(torch.ones(4), group=group) if rank == 0 else None)
    dist.barrier()  # the default group still works: rank 1 waits here for rank 0 to give up
    return seen


def monitored(rank: int, world_size: int, timeout_s: float = TIMEOUT_S) -> dict:
    group = short_timeout_group(timeout_s)

    def rank0_checks_who_is_there():
        if rank == 0:
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s),
                                   wait_all_ranks=True)

    seen = _outcome(rank0_checks_who_is_there)
    dist.barrier()
    return seen


def detail_mismatch(rank: int, world_size: int, timeout_s: float = TIMEOUT_S) -> dict:
    with debug_level("DETAIL"):
        group = short_timeout_group(timeout_s)
        tensor = torch.ones(4 if rank == 0 else 8)
        seen = _outcome(lambda: dist.all_reduce(tensor, group=group))
    dist.barrier()
    return seen


def detail_missing(rank: int, world_size: int, timeout_s: float = TIMEOUT_S) -> dict:
    with debug_level("DETAIL"):
        group = short_timeout_group(timeout_s)
        seen = _outcome(lambda: dist.all_reduce(torch.ones(4), group=group) if rank == 0
                        else None)
    dist.barrier()
    return seen


DEMOS = {"short timeout": short_timeout, "monitored_barrier": monitored,
         "DETAIL, different collectives": detail_mismatch,
         "DETAIL, a missing collective": detail_missing}


def run_all(rank: int, world_size: int, timeout_s: float = TIMEOUT_S) -> dict:
    """Every demo in turn, on every rank; rank 1 is the one that skips or differs."""
    return {name: demo(rank, world_size, timeout_s) for name, demo in DEMOS.items()}


def problems(results: list[dict], timeout_s: float = TIMEOUT_S) -> list[str]:
    """The claims of the docstring, checked on what every rank saw."""
    ms = f"{timeout_s * 1000:.0f} ms"
    rank0 = {name: seen["error"] or "" for name, seen in results[0].items()}
    rank1 = {name: seen["error"] or "" for name, seen in results[1].items()}
    claims = {
        "short timeout: rank 0 times out waiting, without naming rank 1":
            f"Timed out waiting {ms.replace(' ', '')}" in rank0["short timeout"]
            and "Rank 1" not in rank0["short timeout"] and not rank1["short timeout"],
        "monitored_barrier names rank 1":
            f"Ranks 1 failed to pass monitoredBarrier in {ms}" in rank0["monitored_barrier"],
        "DETAIL: both ranks fail, naming the shapes":
            all("Detected mismatch between collectives on ranks" in text
                and "Tensor shapes" in text
                for text in (rank0["DETAIL, different collectives"],
                             rank1["DETAIL, different collectives"])),
        "DETAIL: a missing collective is named by the monitored barrier":
            f"Ranks 1 failed to pass monitoredBarrier in {ms}"
            in rank0["DETAIL, a missing collective"],
    }
    return [claim for claim, holds in claims.items() if not holds]


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        if ctx.world_size != 2:
            ctx.print0("this demo needs exactly 2 ranks (rank 1 is the one that skips)")
            return 2
        mine = run_all(ctx.rank, ctx.world_size)
        results: list = [None] * ctx.world_size
        dist.all_gather_object(results, mine)
        if not ctx.is_main:
            return 0
        for name in DEMOS:
            for rank, seen in enumerate(results):
                text = (seen[name]["error"] or "(no error)").splitlines()[0][:160]
                print(f"{name:32s} rank {rank} after {seen[name]['seconds']:4.1f} s: {text}")
        found = problems(results)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
