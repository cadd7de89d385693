"""One GPU per rank: set_device, init_process_group(device_id=...), DDP(device_ids=[...]).

    torchrun --standalone --nproc_per_node 2 chapters/04_process_groups/gpu_setup.py

GPU-only: it needs NCCL and one GPU per local rank. Anywhere else (a CPU laptop, CI) rank 0 prints
one line saying why it skipped, and every rank exits 0. On GPUs it does, in each rank:

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)                       # this process's current device
    dist.init_process_group("nccl", device_id=device)   # bound to it; NCCL connects now
    model = DDP(Net().to(device), device_ids=[local_rank])   # inputs are moved to it in forward

then one training step on an input left on the CPU, and rank 0 prints what every rank saw: its
current device, where its parameters, its output and a tensor made with plain ``device="cuda"``
are, and whether the gradients agree. Exit code 1 if two ranks share a GPU or the gradients differ.

``--forget-set-device`` is the careless version: no ``set_device``, no ``device_id``, plain
``"cuda"`` everywhere. Every rank's current device is then GPU 0, so every rank's CUDA context and
every plain-"cuda" tensor land on GPU 0 (rank 0 also lists, when ``nvidia-smi`` can see them, the
GPU of every rank's process). This variant gathers its reports over a gloo group and never starts
NCCL, which would refuse two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = timedelta(seconds=60)


def why_not_here(local_world_size: int) -> str | None:
    """None when every local rank can have a GPU of its own with NCCL, else the reason."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    if torch.cuda.device_count() < local_world_size:
        return f"{torch.cuda.device_count()} GPU(s) for {local_world_size} local ranks"
    return None


def set_up(local_rank: int) -> tuple[torch.device, torch.nn.Module]:
    """The canonical set-up: one GPU per rank, the group bound to it, DDP told which it is."""
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=TIMEOUT)
    torch.manual_seed(0)  # the same initial weights everywhere (DDP would broadcast rank 0's anyway)
    model = DDP(torch.nn.Linear(4, 1).to(device), device_ids=[local_rank])
    return device, model


def report_correct(rank: int, local_rank: int) -> dict:
    device, model = set_up(local_rank)
    inputs = torch.full((8, 4), float(rank + 1))  # on the CPU: DDP moves it to device_ids[0]
    output = model(inputs)
    output.sum().backward()
    return {"rank": rank, "local_rank": local_rank,
            "current_device": torch.cuda.current_device(),
            "parameters_on": str(next(model.parameters()).device),
            "output_on": str(output.device),
            "plain_cuda_tensor_on": str(torch.ones(1, device="cuda").device),
            "grad": model.module.weight.grad.flatten().tolist()}


def report_careless(rank: int) -> dict:
    dist.init_process_group("gloo", timeout=TIMEOUT)  # CPU reports only; no NCCL
    tensor = torch.ones(1, device="cuda")  # creates this process's CUDA context, on the current device
    return {"rank": rank, "pid": os.getpid(), "current_device": torch.cuda.current_device(),
            "plain_cuda_tensor_on": str(tensor.device)}


def gpu_of_each_process() -> dict[int, str]:
    """pid -> GPU index, as nvidia-smi sees compute processes (empty if it cannot)."""
    if shutil.which("nvidia-smi") is None:
        return {}

    def query(what: str, kind: str) -> list[list[str]]:
        done = subprocess.run(["nvidia-smi", f"--query-{kind}={what}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
        return [[field.strip() for field in line.split(",")]
                for line in done.stdout.splitlines() if line.strip()]

    index_of_bus = {bus: index for index, bus in query("index,pci.bus_id", "gpu")}
    return {int(pid): index_of_bus.get(bus, bus)
            for pid, bus in query("pid,gpu_bus_id", "compute-apps") if pid.isdigit()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forget-set-device", action="store_true",
                        help="the careless version: every rank ends up on GPU 0")
    opts = parser.parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    reason = why_not_here(int(os.environ["LOCAL_WORLD_SIZE"]))
    if reason is not None:
        if rank == 0:
            print(f"skipped: this script needs NCCL and one GPU per local rank ({reason})", flush=True)
        return 0

    mine = report_careless(rank) if opts.forget_set_device else report_correct(rank, local_rank)
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    gpus = gpu_of_each_process() if opts.forget_set_device and rank == 0 else {}
    dist.barrier()  # every rank's CUDA context exists until rank 0 has looked
    ok = True
    if rank == 0:
        for r in reports:
            pid = r.get("pid")
            seen_by_smi = f", nvidia-smi: its process is on GPU {gpus[pid]}" if pid in gpus else ""
            print(", ".join(f"{k} {v}" for k, v in r.items() if k != "pid") + seen_by_smi)
        devices = [r["current_device"] for r in reports]
        shared = len(set(devices)) < len(devices)
        print(f"current devices {devices}: " + ("shared: several ranks on one GPU" if shared
                                                 else "one GPU per rank"))
        if not opts.forget_set_device:
            same_grads = all(r["grad"] == reports[0]["grad"] for r in reports)
            print(f"gradients identical on every rank: {same_grads}")
            ok = not shared and same_grads
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
