"""The lesson's worked examples of torchrun's failure report (chapter 09, section 5): a two-rank
job in which rank 0 fails at step 2, one way per run. The exercise read_the_logs reads the logs
of failing_job.py instead, so the lesson can show how to read a report without giving away what
the exercise asks. From the repository root:

    torchrun --standalone --nproc-per-node 2 chapters/09_debugging/captured_logs/lesson_job.py raise

* ``raise``: rank 0's loss check finds a non-finite loss and raises ``FloatingPointError`` (add
  ``--record`` to decorate ``main`` with torch.distributed.elastic's ``@record``);
* ``abort``: rank 0 dies in native code, as a failed C++ check does (``os.abort()``: SIGABRT).

Rank 1 meanwhile waits in the step's all-reduce for a peer that is gone. make_logs.py (beside
this file) captures both as ``lesson_*.log``.
"""

import argparse
import datetime
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

STEPS = 3
BAD_RANK, BAD_STEP = 0, 2
STEP_TIMEOUT = datetime.timedelta(seconds=5)


def step_loss(rank, step, failure):
    loss = float(step + rank)
    if rank == BAD_RANK and step == BAD_STEP:
        if failure == "abort":
            os.abort()
        loss = math.inf
    return loss


def check_finite(loss, step):
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step}")


def train(failure):
    rank = dist.get_rank()
    group = dist.new_group(timeout=STEP_TIMEOUT)
    for step in range(1, STEPS + 1):
        loss = step_loss(rank, step, failure)
        check_finite(loss, step)
        total = torch.tensor([loss])
        dist.all_reduce(total, group=group)
        print(f"rank {rank}: step {step}, mean loss {total.item() / dist.get_world_size()}",
              flush=True)


def main(failure):
    dist.init_process_group("gloo")
    train(failure)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("failure", choices=["none", "raise", "abort"])
    parser.add_argument("--record", action="store_true", help="decorate main with @record")
    args = parser.parse_args()
    if args.record:
        main = record(main)
    main(args.failure)
