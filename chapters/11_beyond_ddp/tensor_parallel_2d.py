"""Tensor parallelism with DTensor, and 2-D data x tensor parallelism on a device mesh.

    torchrun --standalone --nproc_per_node 4 chapters/11_beyond_ddp/tensor_parallel_2d.py

On a ``(dp, tp)`` mesh (``init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp",
"tp"))``) every rank runs the same two-layer MLP, its first Linear split by columns
(``ColwiseParallel``) and its second by rows (``RowwiseParallel``) over the ``tp`` dimension
with ``torch.distributed.tensor.parallel.parallelize_module``. Ranks of one dp group share a
batch shard; the two dp groups get different halves of the global batch. Rank 0 prints:

1. **TP alone** matches the dense MLP: output and every gradient, the input's included (largest
   difference), and one forward + backward calls exactly two all-reduces (counted with
   ``CommDebugMode``): the output's in forward, the input gradient's in backward.
2. **DDP over the dp group** refuses the TP model: ``DistributedDataParallel(model,
   process_group=mesh["dp"].get_group())`` raises ``NotImplementedError`` (DDP broadcasts the
   parameters at construction with ``c10d.broadcast_``, for which DTensor has no sharding
   strategy).
3. **FSDP2 over the dp dimension** (``fully_shard(model, mesh=mesh["dp"])``) works: one Adam step
   of the 2-D model equals one process's step on the global batch.
4. **Averaging over the wrong group**: the gradients averaged by hand over ``mesh["dp"]`` equal
   the dense global-batch gradients; averaged over ``mesh["tp"]`` (ranks that hold *different*
   shards of the same batch) they are garbage, and nothing raises.

Exit code 1 if a check fails. Needs an even number of ranks (4 for a real 2 x 2 mesh).
"""

from __future__ import annotations

import logging
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

WIDTH, HIDDEN, BATCH = 16, 32, 8  # BATCH samples per dp group


class MLP(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def data(dp_size: int):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(dp_size * BATCH, WIDTH, generator=g),
            torch.randn(dp_size * BATCH, WIDTH, generator=g))


def mesh_2d(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    if world_size % 2:
        raise ValueError(f"needs an even number of ranks, not {world_size}")
    return init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def tp_matches_dense(rank: int, world_size: int) -> dict:
    """TP over mesh["tp"] on the same batch as a dense copy: largest differences, and the
    collectives called during one forward + backward (counted with CommDebugMode)."""
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = mesh_2d(world_size)
    dense, model = MLP(), MLP()
    parallelize_module(model, mesh["tp"], tp_plan())
    x, y = data(1)
    x_tp, x_dense = x.clone().requires_grad_(), x.clone().requires_grad_()
    counter = CommDebugMode()
    with counter:
        out = model(x_tp)
        nn.functional.mse_loss(out, y).backward()
    expected = dense(x_dense)
    nn.functional.mse_loss(expected, y).backward()
    grads = {n: (full(p.grad) - q.grad).abs().max().item()
             for (n, p), q in zip(model.named_parameters(), dense.parameters())}
    grads["input"] = (x_tp.grad - x_dense.grad).abs().max().item()
    return {"output_error": (full(out) - expected).abs().max().item(), "grad_errors": grads,
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
            "placements": {n: str(p.placements) for n, p in model.named_parameters()},
            "collectives": {str(k): v for k, v in counter.get_comm_counts().items()}}


def ddp_over_dp_refuses_tp(rank: int, world_size: int) -> str:
    """The error DDP raises when wrapped around a TP model over the dp group."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_2d(world_size)
    model = parallelize_module(MLP(), mesh["tp"], tp_plan())
    try:
        DDP(model, process_group=mesh["dp"].get_group())
    except NotImplementedError as error:
        return f"NotImplementedError: {str(error).splitlines()[0][:160]}"
    return "no error"


def fsdp_over_dp_matches_one_process(rank: int, world_size: int) -> float:
    """One Adam step of TP (mesh["tp"]) + FSDP2 (mesh["dp"]), each dp group on its half of the
    global batch, against one process's step on the whole batch: largest weight difference."""
    # full_tensor() of a 2-D sharded parameter logs that it takes two all-gathers; known, quiet
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = mesh_2d(world_size)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    model = parallelize_module(MLP(), mesh["tp"], tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    x, y = data(dp_size)
    mine = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    optimizer.step()
    dense = MLP()
    reference = torch.optim.Adam(dense.parameters(), lr=1e-2)
    nn.functional.mse_loss(dense(x), y).backward()
    reference.step()
    return max((full(p) - q).abs().max().item()
               for p, q in zip(model.parameters(), dense.parameters()))


def average_over(rank: int, world_size: int) -> dict:
    """TP gradients averaged by hand over the dp group and over the tp group, against the dense
    global-batch gradient's shard (largest difference)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = mesh_2d(world_size)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    model = parallelize_module(MLP(), mesh["tp"], tp_plan())
    x, y = data(dp_size)
    mine = slice(dp_rank * BATCH, (dp_rank + 1) * BATCH)
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    dense = MLP()
    nn.functional.mse_loss(dense(x), y).backward()
    errors = {}
    for name in ("dp", "tp"):
        group = mesh[name].get_group()
        worst = 0.0
        for p, q in zip(model.parameters(), dense.parameters()):
            local = p.grad.to_local().clone()
            dist.all_reduce(local, group=group)
            local /= mesh[name].size()
            # this rank's shard of the dense gradient, where the TP placement put it
            expected = distribute_tensor(q.grad, p.grad.device_mesh,
                                         p.grad.placements).to_local()
            worst = max(worst, (local - expected).abs().max().item())
        errors[name] = worst
    return errors


def run_all(rank: int, world_size: int) -> dict:
    return {"tp": tp_matches_dense(rank, world_size),
            "ddp_error": ddp_over_dp_refuses_tp(rank, world_size),
            "fsdp_2d_error": fsdp_over_dp_matches_one_process(rank, world_size),
            "averaged": average_over(rank, world_size)}


def checks(results: list[dict]) -> list[tuple[str, bool]]:
    r = results[0]
    return [
        ("TP output equals the dense MLP's (< 1e-5)", r["tp"]["output_error"] < 1e-5),
        ("TP gradients equal the dense MLP's (< 1e-5)",
         max(r["tp"]["grad_errors"].values()) < 1e-5),
        ("one TP forward + backward calls two all-reduces (forward: the output; backward: the"
         " input's gradient) and no other collective",
         r["tp"]["collectives"] == {"c10d_functional.all_reduce": 2}),
        ("DDP over mesh['dp'] raises NotImplementedError on every rank",
         all(x["ddp_error"].startswith("NotImplementedError") for x in results)),
        ("TP + FSDP2 over mesh['dp'] equals one process on the global batch (< 1e-5)",
         max(x["fsdp_2d_error"] for x in results) < 1e-5),
        ("gradients averaged over mesh['dp'] equal the dense ones (< 1e-5)",
         max(x["averaged"]["dp"] for x in results) < 1e-5),
        ("gradients averaged over mesh['tp'] do NOT (> 1e-3)",
         max(x["averaged"]["tp"] for x in results) > 1e-3),
    ]


def main() -> int:
    from ddpcourse.dist_env import process_group

    with process_group(timeout_s=120, backend="gloo") as ctx:
        mine = run_all(ctx.rank, ctx.world_size)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        if not ctx.is_main:
            return 0
        tp = everyone[0]["tp"]
        print(f"mesh (dp, tp) = ({ctx.world_size // 2}, 2)")
        print(f"TP vs dense: output {tp['output_error']:.1e}, gradients "
              f"{max(tp['grad_errors'].values()):.1e}; local shapes {tp['local_shapes']}")
        print(f"collectives in one TP forward + backward: {tp['collectives']}")
        print(f"DDP(tp_model, process_group=mesh['dp'].get_group()): {everyone[0]['ddp_error']}")
        print(f"TP + fully_shard(mesh['dp']) vs one process: "
              f"{max(x['fsdp_2d_error'] for x in everyone):.1e}")
        print("gradients averaged over dp: {:.1e}; over tp (wrong group): {:.1e}".format(
            max(x["averaged"]["dp"] for x in everyone),
            max(x["averaged"]["tp"] for x in everyone)))
        results = checks(everyone)
        for statement, holds in results:
            print(f"CHECK {'ok  ' if holds else 'FAIL'} {statement}")
        ok = all(h for _, h in results)
        print("RESULT: all tensor-parallel checks hold" if ok else "RESULT: a check FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
