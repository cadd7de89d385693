"""Debug bottom-up: does the group work, are the shards right, does one step keep the replicas equal?

    torchrun --standalone --nproc_per_node 2 chapters/09_debugging/bottom_up.py

When a DDP job hangs or learns the wrong thing, check the layers from the bottom, each in a few
seconds, before reading the training loop:

1. :func:`check_group`: every rank all-reduces ``rank + 1`` and must get exactly
   ``N(N+1)/2``; a broadcast from the last rank must reach all. On a fresh group with a short
   timeout, so a broken network, a wrong ``MASTER_ADDR`` or a firewall fails here in seconds.
2. :func:`check_shards`: each rank's sample indices from its ``DistributedSampler``, gathered:
   the shards must cover the data set, have equal lengths (or the ranks run different numbers of
   steps and hang at the end), and overlap only by the sampler's padding.
3. :func:`check_one_step`: one DDP step on every rank's own batch; afterwards the parameters
   must be identical on all ranks (compared exactly, by gathering a copy from every rank).

Replace :func:`make_dataset` and :func:`make_model` with your job's to check your own set-up.
Each check returns plain data and a verdict; exit code 1 if one fails.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset

from ddpcourse.dist_env import process_group, short_timeout_group

CHECK_TIMEOUT_S = 10.0


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(101, 8, generator=generator)  # 101: not a multiple of the world size
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def check_group(rank: int, world_size: int) -> dict:
    group = short_timeout_group(CHECK_TIMEOUT_S)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=group)
    sent = torch.tensor([float(rank)])
    dist.broadcast(sent, src=world_size - 1, group=group)
    expected = world_size * (world_size + 1) / 2
    ok = total.item() == expected and sent.item() == world_size - 1
    return {"ok": ok, "all_reduce": total.item(), "expected": expected,
            "broadcast from the last rank": sent.item()}


def check_shards(rank: int, world_size: int, dataset=None) -> dict:
    dataset = make_dataset() if dataset is None else dataset
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=0)
    sampler.set_epoch(0)
    shards: list = [None] * world_size
    dist.all_gather_object(shards, list(sampler))
    everything = [index for shard in shards for index in shard]
    lengths = sorted({len(shard) for shard in shards})
    padding = len(everything) - len(dataset)
    ok = (set(everything) == set(range(len(dataset))) and len(lengths) == 1
          and len(everything) - len(set(everything)) == padding)
    return {"ok": ok, "samples": len(dataset), "shard lengths": lengths,
            "indices repeated (the sampler's padding)": padding,
            "indices missing": len(set(range(len(dataset))) - set(everything))}


def check_one_step(rank: int, world_size: int, model=None, dataset=None) -> dict:
    model = DistributedDataParallel(make_model() if model is None else model)
    dataset = make_dataset() if dataset is None else dataset
    inputs, targets = dataset[rank::world_size][:2]  # a different batch on every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.functional.mse_loss(model(inputs[:8]), targets[:8])
    loss.backward()
    optimizer.step()
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    every: list = [None] * world_size
    dist.all_gather_object(every, mine)
    differ = [r for r in range(world_size) if not torch.equal(every[r], every[0])]
    return {"ok": not differ, "parameters": mine.numel(), "ranks that differ from rank 0": differ}


CHECKS = {"1. the group": check_group, "2. the shards": check_shards,
          "3. one step": check_one_step}


def run_all(rank: int, world_size: int) -> dict:
    return {name: check(rank, world_size) for name, check in CHECKS.items()}


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        results = run_all(ctx.rank, ctx.world_size)
        for name, result in results.items():
            details = {key: value for key, value in result.items() if key != "ok"}
            ctx.print0(f"{name:14s} {'ok' if result['ok'] else 'FAILED':6s} {details}")
        passed = torch.tensor([float(all(result["ok"] for result in results.values()))])
        dist.all_reduce(passed, op=dist.ReduceOp.MIN)  # every rank's verdicts count
        ctx.print0("checks:", "passed" if passed.item() == 1.0 else "FAILED")
        return 0 if passed.item() == 1.0 else 1

if __name__ == "__main__":
    sys.exit(main())
