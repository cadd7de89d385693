"""Why DDP broadcasts rank 0's parameters when it is built: averaging gradients is not enough.

    torchrun --standalone --nproc_per_node 2 chapters/05_allreduce/broadcast_parameters.py

Each rank builds its replica with a *different* seed (as happens when nobody seeds, or seeds with
the rank), then trains with SGD on its slice of the same global batches, in three ways:

* ``averaging only``: all-reduce and average the gradients after every backward, nothing else;
* ``broadcast first``: the same, after ``dist.broadcast`` of every parameter and buffer from
  rank 0;
* ``DDP``: ``DistributedDataParallel(model)``, whose constructor does that broadcast itself
  (``_sync_module_states`` in torch/nn/parallel/distributed.py, after
  ``_verify_param_shape_across_processes`` has checked that all replicas have the same shapes).

Averaged gradients give every rank the *same* update, so the replicas' differences never shrink:
with SGD ``w_r - w_0`` stays what it was at initialisation. Rank 0 prints the largest weight
difference between ranks before and after training, and each rank's final loss on the same
held-out set. Exit code 1 unless the first way stays apart and the other two agree exactly.
"""

from __future__ import annotations

import sys
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.dist_env import process_group
from ddpcourse.toys import flat_parameters, make_model, make_regression

MODES = ("averaging only", "broadcast first", "DDP")


def broadcast_from_rank0(model: nn.Module) -> None:
    """What DDP's constructor does: every parameter and buffer takes rank 0's values."""
    for tensor in chain(model.parameters(), model.buffers()):
        dist.broadcast(tensor.detach(), src=0)


def spread_across_ranks(model: nn.Module) -> float:
    """max |w_r - w_0| over all weights and ranks."""
    mine = flat_parameters(model)
    reference = mine.clone()
    dist.broadcast(reference, src=0)
    spread = torch.tensor([(mine - reference).abs().max().item()])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def train_replicas(rank: int, world_size: int, mode: str, steps: int = 30, batch: int = 16,
                   lr: float = 0.1) -> dict:
    """Train this rank's replica (seeded with its rank) in one of ``MODES``."""
    model = make_model(seed=rank)  # a different initialisation on every rank
    data = make_regression(steps * batch * world_size + 256, seed=0)
    x_all, y_all = data.tensors
    held_out = x_all[-256:], y_all[-256:]
    trained: nn.Module = model
    if mode == "broadcast first":
        broadcast_from_rank0(model)
    elif mode == "DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        trained = DDP(model)
    spread_before = spread_across_ranks(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        rows = slice((step * world_size + rank) * batch, (step * world_size + rank + 1) * batch)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(trained(x_all[rows]), y_all[rows]).backward()
        if mode != "DDP":  # DDP averages inside backward
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world_size
        optimizer.step()
    with torch.no_grad():
        loss = nn.functional.mse_loss(model(held_out[0]), held_out[1]).item()
    return {"mode": mode, "spread_before": spread_before,
            "spread_after": spread_across_ranks(model), "held_out_loss": loss}


def run_modes(rank: int, world_size: int, **options) -> list[dict]:
    return [train_replicas(rank, world_size, mode, **options) for mode in MODES]


def verdict(results_per_rank: list[list[dict]]) -> bool:
    """Averaging alone leaves the replicas apart; a broadcast (by hand or DDP's) makes them one."""
    by_mode = {r["mode"]: r for r in results_per_rank[0]}
    return (by_mode["averaging only"]["spread_after"] > 1e-3
            and by_mode["broadcast first"]["spread_after"] == 0.0
            and by_mode["DDP"]["spread_after"] == 0.0)


def main() -> int:
    with process_group(timeout_s=60) as ctx:
        mine = run_modes(ctx.rank, ctx.world_size)
        everyone: list = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        ctx.print0(f"{ctx.world_size} replicas, each initialised with seed = its rank")
        ctx.print0(f"{'mode':<17}{'max |w_r - w_0| before':>24}{'after':>11}"
                   f"   held-out loss per rank")
        for i, mode in enumerate(MODES):
            r = mine[i]
            losses = ", ".join(f"{everyone[k][i]['held_out_loss']:.5f}"
                               for k in range(ctx.world_size))
            ctx.print0(f"{mode:<17}{r['spread_before']:>24.6f}{r['spread_after']:>11.6f}"
                       f"   {losses}")
        ok = verdict(everyone)
        ctx.print0(f"RESULT: replicas differ without a broadcast and agree with one: {ok}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
