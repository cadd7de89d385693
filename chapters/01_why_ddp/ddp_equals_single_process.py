"""DDP on N ranks computes what one process computes on the whole batch: shown, not claimed.

    torchrun --standalone --nproc_per_node 2 chapters/01_why_ddp/ddp_equals_single_process.py

Every rank trains a replica of the same tiny model with DistributedDataParallel, each on its own
share of every global batch (DistributedSampler). DDP averages the gradients across ranks during
``backward()``, so each optimizer step equals one step on the full global batch. To prove it, rank 0
then trains a fresh copy of the model alone, on the full global batches in the same order, and
compares the final weights with the DDP replicas'.

Why they agree only "to rounding": the all-reduce adds the ranks' partial gradients in a different
order than one process adds per-sample gradients, and float32 addition is not associative. The
difference is a few float32 ulps per step (~1e-7 relative); the tolerance below (1e-5 absolute,
on weights of size ~0.1-1) leaves room for 20 such steps and would still catch a single wrong
step, which moves the weights by ~lr * grad ~ 1e-2.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddpcourse.dist_env import process_group
from ddpcourse.toys import flat_parameters, make_model, make_regression

TOLERANCE = 1e-5


def train(model, loader, steps: int, lr: float, device, on_step=None) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.nn.MSELoss()
    batches = iter(loader)
    for step in range(steps):
        x, y = (t.to(device) for t in next(batches))
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # under DDP, gradients are all-reduced (averaged) right here
        optimizer.step()
        if on_step:
            on_step(step, loss.detach())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()

    with process_group(timeout_s=60) as ctx:
        if opts.global_batch % ctx.world_size:
            ctx.print0(f"--global-batch {opts.global_batch} must divide by {ctx.world_size} ranks")
            return 2
        local_batch = opts.global_batch // ctx.world_size
        data = make_regression(opts.steps * opts.global_batch, seed=opts.seed)
        # shuffle=False: rank r takes samples r, r+N, r+2N, ... so that step s's global batch,
        # the union of the ranks' batches, is samples [s*B, (s+1)*B) - what one process sees.
        sampler = DistributedSampler(data, shuffle=False)
        loader = DataLoader(data, batch_size=local_batch, sampler=sampler)

        ddp_model = DDP(make_model(opts.seed).to(ctx.device))
        ctx.print0(f"{ctx.world_size} ranks, backend {ctx.backend}, device {ctx.device}; "
                   f"global batch {opts.global_batch} = {ctx.world_size} x {local_batch}")
        ctx.print0(f"{'step':>5} {'global loss':>12}")

        def report(step, local_loss):
            dist.all_reduce(local_loss)  # mean of equal-sized shards' means = global mean
            if step % 5 == 0 or step == opts.steps - 1:
                ctx.print0(f"{step:>5} {local_loss.item() / ctx.world_size:>12.6f}")

        train(ddp_model, loader, opts.steps, opts.lr, ctx.device, report)
        ddp_weights = flat_parameters(ddp_model.module)

        # Every replica must hold the same weights: compare with rank 0's.
        reference = ddp_weights.clone()
        dist.broadcast(reference, src=0)
        spread = (ddp_weights - reference).abs().max()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)

        ok = True
        if ctx.is_main:
            single = make_model(opts.seed).to(ctx.device)
            full_loader = DataLoader(data, batch_size=opts.global_batch, shuffle=False)
            train(single, full_loader, opts.steps, opts.lr, ctx.device)
            diff = (ddp_weights - flat_parameters(single)).abs().max().item()
            moved = (flat_parameters(single) - flat_parameters(make_model(opts.seed))
                     .to(ctx.device)).abs().max().item()
            ok = diff <= TOLERANCE and spread.item() == 0.0
            print(f"replicas identical across ranks: {spread.item() == 0.0} "
                  f"(max spread {spread.item():.1e})")
            print(f"weights moved by training:         max {moved:.3e}")
            print(f"max |w_DDP - w_single_process|:    {diff:.3e} (tolerance {TOLERANCE:g})")
            print("RESULT: DDP == single process on the global batch" if ok
                  else "RESULT: MISMATCH - DDP did not reproduce the single-process run")
        verdict = torch.tensor([1.0 if ok else 0.0])
        dist.broadcast(verdict, src=0)
        return 0 if verdict.item() == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
