"""A tiny data-parallel job that fails on purpose, one way per run, so that what torchrun prints
can be read (chapter 09, exercise read_the_logs). From the repository root:

    torchrun --standalone --nproc-per-node 2 chapters/09_debugging/captured_logs/failing_job.py raise

The failures (the first argument), each made by rank 1 at step 3 of 4:

* ``raise``: rank 1 raises while loading its batch (add ``--record`` to decorate ``main`` with
  torch.distributed.elastic's ``@record``, which writes the exception to torchrun's error file);
* ``sigkill``: rank 1 is SIGKILLed while loading its batch, as the kernel's OOM killer would;
* ``timeout``: only rank 0 joins the all-reduce of the logged loss; rank 1 goes on to the
  evaluation's all-gather (the loop's collectives give up after ``LOOP_TIMEOUT``);
* ``mismatch``: rank 1's evaluation shard is smaller, and every rank all-gathers its
  predictions; run it with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` to get the fingerprint report.

make_logs.py (beside this file) runs each of them and writes the ``.log`` files of this folder.
"""

import argparse
import datetime
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

STEPS = 4
BAD_RANK, BAD_STEP = 1, 3
LOOP_TIMEOUT = datetime.timedelta(seconds=5)


def load_batch(rank, step, failure):
    if rank == BAD_RANK and step == BAD_STEP:
        if failure == "raise":
            raise ValueError(f"corrupt record in rank {rank}'s shard at step {step}")
        if failure == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
    generator = torch.Generator().manual_seed(100 * step + rank)
    inputs = torch.randn(8, 4, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True)


def average_gradients(model, group):
    for parameter in model.parameters():
        dist.all_reduce(parameter.grad, group=group)
        parameter.grad /= dist.get_world_size()


def evaluate(model, rank, failure, group):
    rows = 5 if failure == "mismatch" and rank == BAD_RANK else 8
    with torch.no_grad():
        predictions = model(torch.ones(rows, 4))
    gathered = [torch.empty_like(predictions) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, predictions, group=group)
    return torch.cat(gathered)


def train(failure):
    rank = dist.get_rank()
    # Start-up keeps the default timeout (a busy machine may start one rank seconds after the
    # other); the loop's collectives run in a group that gives up after LOOP_TIMEOUT.
    group = dist.new_group(timeout=LOOP_TIMEOUT)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    total = torch.zeros(1)
    for step in range(1, STEPS + 1):
        inputs, targets = load_batch(rank, step, failure)
        loss = F.mse_loss(model(inputs), targets)
        model.zero_grad()
        loss.backward()
        average_gradients(model, group)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter -= 0.1 * parameter.grad
        total += loss.detach()
    if failure != "timeout" or rank == 0:  # timeout: only rank 0, which logs it, all-reduces
        dist.all_reduce(total, group=group)
        print(f"rank {rank}: mean loss {total.item() / STEPS / dist.get_world_size():.4f}",
              flush=True)
    predictions = evaluate(model, rank, failure, group)
    dist.barrier(group=group)
    return predictions


def main(failure):
    dist.init_process_group("gloo")
    train(failure)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("failure", choices=["none", "raise", "sigkill", "timeout", "mismatch"])
    parser.add_argument("--record", action="store_true", help="decorate main with @record")
    args = parser.parse_args()
    if args.record:
        main = record(main)
    main(args.failure)
