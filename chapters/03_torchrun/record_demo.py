"""@record: how a worker's traceback reaches torchrun's failure report (ChildFailedError).

    torchrun --standalone --nproc_per_node 2 --log-dir /tmp/record_demo chapters/03_torchrun/record_demo.py

Launch test: custom (it fails on purpose; tests/test_chapter_03_torchrun.py checks the report).

Both ranks join a group and do one all-reduce; then rank 1 raises ValueError, and rank 0, waiting
in the next collective, fails too ("Connection closed by peer"): the victim of rank 1's failure.
With ``main`` wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``, each failing
rank writes its traceback as JSON to the file named by TORCHELASTIC_ERROR_FILE (under
``--log-dir``: ``<run id>/attempt_0/<local rank>/error.json``), and torchrun prints those
tracebacks in its ChildFailedError report. With ``--no-record`` the report only says "To enable
traceback see ...". Either way, read every failure: "Root Cause" is the failure with the smallest
timestamp in whole seconds, so a victim that failed in the same second can be named instead.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddpcourse.dist_env import process_group


def train() -> int:
    with process_group(timeout_s=20) as ctx:
        loss = torch.tensor([float("nan") if ctx.rank == 1 else 0.5], device=ctx.device)
        dist.all_reduce(torch.ones(1, device=ctx.device))
        if torch.isnan(loss).any():
            raise ValueError(f"rank {ctx.rank}: the loss became NaN at step 3")
        dist.barrier()  # rank 0 waits here for rank 1, which has just died
        ctx.print0("never reached: rank 1 failed")
    return 0


@record
def main_with_record() -> int:
    return train()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-record", action="store_true", help="run without @record")
    opts = parser.parse_args()
    return train() if opts.no_record else main_with_record()


if __name__ == "__main__":
    sys.exit(main())
