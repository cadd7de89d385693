"""DDP around a module that spans several devices: ``device_ids=None``, and what that costs.

    torchrun --standalone --nproc_per_node 2 chapters/11_beyond_ddp/ddp_multi_device.py

The source article's recipe for a model too big for one GPU ("DDP of ModelParallel": place the
layers on several GPUs with ``device_map="auto"`` and wrap each rank's copy in DDP) is a
module whose parameters live on more than one device. DDP accepts such a module only with
``device_ids=None`` and ``output_device=None``: it then leaves the input where it is and each
layer's parameters on their own device (``DistributedDataParallel.__init__`` in
torch/nn/parallel/distributed.py: ``is_multi_device_module``, and its ``device_ids`` check).

With ``2 x WORLD`` GPUs (each rank takes GPUs ``2 * local_rank`` and ``2 * local_rank + 1``)
the script splits an MLP over the rank's two GPUs, wraps it in DDP, trains one step and checks
the weights against one process on the global batch; it also shows that the same module with
``device_ids=[...]`` is refused. With fewer GPUs it runs what a CPU can show: a CPU module with
``device_ids=[0]`` is refused too (the rule is the same: ``device_ids`` only for a module on
one GPU), and prints why the two-device run was skipped. Exit code 1 if a check fails.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, BATCH = 32, 8


class TwoDeviceMLP(nn.Module):
    """First half on ``first``, second half on ``second``; the activation moves in between."""

    def __init__(self, first: torch.device, second: torch.device, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.second = first, second
        self.front = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()).to(first)
        self.back = nn.Linear(WIDTH, WIDTH).to(second)

    def forward(self, x):
        return self.back(self.front(x.to(self.first)).to(self.second))


def refused(make) -> str:
    try:
        make()
    except ValueError as error:
        return f"ValueError: {str(error).splitlines()[0][:200]}"
    return "accepted"


def gpu_run(rank: int, world_size: int, local_rank: int) -> dict:
    devices = torch.device(f"cuda:{2 * local_rank}"), torch.device(f"cuda:{2 * local_rank + 1}")
    model = TwoDeviceMLP(*devices)
    error = refused(lambda: DDP(TwoDeviceMLP(*devices), device_ids=[devices[0].index]))
    ddp = DDP(model)  # device_ids=None: the only accepted form for a multi-device module
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world_size * BATCH, WIDTH, generator=g)
    y = torch.randn(world_size * BATCH, WIDTH, generator=g)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    nn.functional.mse_loss(ddp(x[mine]), y[mine].to(devices[1])).backward()
    optimizer.step()
    reference = TwoDeviceMLP(torch.device("cpu"), torch.device("cpu"))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    err = max((p.detach().cpu() - q.detach()).abs().max().item()
              for p, q in zip(model.parameters(), reference.parameters()))
    return {"devices": sorted({str(p.device) for p in model.parameters()}),
            "refused_with_device_ids": error, "weight_error": err}


def main() -> int:
    from ddpcourse.dist_env import process_group

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # gloo also on GPUs: it all-reduces CUDA tensors, and a rank's GPUs here are not
    # cuda:LOCAL_RANK, the one device NCCL's group would be bound to by process_group()
    with process_group(timeout_s=120, backend="gloo") as ctx:
        cpu_rule = refused(lambda: DDP(nn.Linear(4, 4), device_ids=[0]))
        ctx.print0(f"DDP(cpu_module, device_ids=[0]): {cpu_rule}")
        ok = cpu_rule.startswith("ValueError")
        if gpus >= 2 * local_world:
            result = gpu_run(ctx.rank, ctx.world_size, ctx.local_rank)
            everyone = [None] * ctx.world_size
            dist.all_gather_object(everyone, result)
            if ctx.is_main:
                for r, res in enumerate(everyone):
                    print(f"rank {r}: parameters on {res['devices']}; with device_ids: "
                          f"{res['refused_with_device_ids']}; weights vs one process: "
                          f"{res['weight_error']:.1e}")
            ok &= all(res["refused_with_device_ids"].startswith("ValueError")
                      and res["weight_error"] < 1e-5 and len(res["devices"]) == 2
                      for res in everyone)
        else:
            ctx.print0(f"skipped the two-GPU run: it needs 2 GPUs per rank "
                       f"({2 * local_world} here), this machine has {gpus}")
        ctx.print0("RESULT: the device_ids rule holds" if ok else "RESULT: a check FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
