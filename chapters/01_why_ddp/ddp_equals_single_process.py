"""DDP on N ranks computes what one process computes on the whole batch: shown, not claimed.

    torchrun --standalone --nproc_per_node 2 chapters/01_why_ddp/ddp_equals_single_process.py

Every rank trains a replica of the same tiny model with DistributedDataParallel on a fixed data
set of 512 samples for 10 epochs, each rank on its own share of every global batch of 64
(DistributedSampler): 8 steps per epoch, 80 in all, SGD with momentum. DDP averages the gradients
across ranks during ``backward()``, so each optimizer step equals one step on the full global
batch. To prove it, rank 0 then trains a fresh copy of the model alone, on the full global batches
in the same order, and compares both the loss of every epoch and the final weights with the DDP
replicas'. The loss falls (from about 0.52 to under 0.1 with the defaults): the model learns, and
DDP learns exactly what one process learns.

Why they agree only "to rounding": the all-reduce adds the ranks' partial gradients in a different
order than one process adds per-sample gradients, and float32 addition is not associative. The
difference is a few float32 ulps per step (~1e-7 relative); the tolerance below (1e-5 absolute,
on weights of size ~0.1-1) leaves room for 80 such steps and would still catch a single wrong
step, which moves the weights by ~lr * grad ~ 1e-2.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpcourse.dist_env import process_group
from ddpcourse.toys import flat_parameters, make_model, make_regression

TOLERANCE = 1e-5
DEFAULTS = dict(samples=512, global_batch=64, epochs=10, lr=0.1, momentum=0.9, seed=0)


def train(model, loader, epochs: int, lr: float, momentum: float, device,
          world_size: int = 1) -> list[float]:
    """Train for ``epochs`` passes over ``loader``; return each epoch's mean loss.

    Under DDP (``world_size > 1``) each rank's loss is the mean over its shard of the batch, so
    the mean over ranks of those equal-sized shards' means is the global batch's loss: one
    all-reduce per epoch turns the local figure into the one a single process would print.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = torch.nn.MSELoss()
    losses = []
    for _ in range(epochs):
        total = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()  # under DDP, gradients are all-reduced (averaged) right here
            optimizer.step()
            total += loss.detach()
        if world_size > 1:
            dist.all_reduce(total)
            total /= world_size
        losses.append(total.item() / len(loader))
    return losses


def make_data(samples: int, seed: int) -> TensorDataset:
    """The fixed data set every epoch goes through, the same on every rank."""
    return make_regression(samples, seed=seed)


def ddp_run(rank: int, world_size: int, device=torch.device("cpu"), **settings) -> dict:
    """Train with DDP in the current process group (every rank calls this): per-epoch global
    losses and the final weights of this rank's replica."""
    opts = {**DEFAULTS, **settings}
    if opts["global_batch"] % world_size:
        raise ValueError(f"global batch {opts['global_batch']} must divide by {world_size} ranks")
    data = make_data(opts["samples"], opts["seed"])
    # shuffle=False: rank r takes samples r, r+N, r+2N, ... so that step s's global batch, the
    # union of the ranks' batches, is samples [s*B, (s+1)*B) - what one process sees. (With
    # shuffle=True, call sampler.set_epoch(epoch) before every epoch: chapter 06.)
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=opts["global_batch"] // world_size, sampler=sampler)
    model = DDP(make_model(opts["seed"]).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    losses = train(model, loader, opts["epochs"], opts["lr"], opts["momentum"], device,
                   world_size)
    return {"losses": losses, "weights": flat_parameters(model.module).cpu()}


def single_run(device=torch.device("cpu"), **settings) -> dict:
    """The same training in one process, on the full global batches in the same order."""
    opts = {**DEFAULTS, **settings}
    data = make_data(opts["samples"], opts["seed"])
    loader = DataLoader(data, batch_size=opts["global_batch"], shuffle=False)
    model = make_model(opts["seed"]).to(device)
    losses = train(model, loader, opts["epochs"], opts["lr"], opts["momentum"], device)
    return {"losses": losses, "weights": flat_parameters(model).cpu()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    opts = vars(parser.parse_args())

    with process_group(timeout_s=60) as ctx:
        if opts["global_batch"] % ctx.world_size:
            ctx.print0(f"--global-batch {opts['global_batch']} must divide by "
                       f"{ctx.world_size} ranks")
            return 2
        ctx.print0(f"{ctx.world_size} ranks, backend {ctx.backend}, device {ctx.device}; "
                   f"{opts['samples']} samples, {opts['epochs']} epochs, global batch "
                   f"{opts['global_batch']} = {ctx.world_size} x "
                   f"{opts['global_batch'] // ctx.world_size}")
        ddp = ddp_run(ctx.rank, ctx.world_size, ctx.device, **opts)

        # Every replica must hold the same weights: compare with rank 0's.
        weights = ddp["weights"].to(ctx.device)
        reference = weights.clone()
        dist.broadcast(reference, src=0)
        spread = (weights - reference).abs().max()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)

        ok = True
        if ctx.is_main:
            single = single_run(ctx.device, **opts)
            print(f"{'epoch':>5} {'DDP global loss':>16} {'single process':>15}")
            for epoch, (a, b) in enumerate(zip(ddp["losses"], single["losses"])):
                print(f"{epoch:>5} {a:>16.6f} {b:>15.6f}")
            initial = flat_parameters(make_model(opts["seed"]))
            moved = (single["weights"] - initial).abs().max().item()
            diff = (ddp["weights"] - single["weights"]).abs().max().item()
            ok = diff <= TOLERANCE and spread.item() == 0.0
            print(f"replicas identical across ranks: {spread.item() == 0.0} "
                  f"(max spread {spread.item():.1e})")
            print(f"weights moved by training:         max {moved:.3e}")
            print(f"max |w_DDP - w_single_process|:    {diff:.3e} (tolerance {TOLERANCE:g})")
            print("RESULT: DDP == single process on the global batch" if ok
                  else "RESULT: MISMATCH - DDP did not reproduce the single-process run")
        verdict = torch.tensor([1.0 if ok else 0.0], device=ctx.device)
        dist.broadcast(verdict, src=0)
        return 0 if verdict.item() == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
