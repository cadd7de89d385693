"""A complete DDP training script: the chapter in one file, and the base of chapters 08-10.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/train.py

The same command runs on CPUs (gloo) and on one GPU per rank (NCCL, ``device_ids=[local_rank]``);
``ddpcourse.dist_env.process_group`` picks the backend. It trains a small MLP classifier on
generated data (never downloaded) and shows, in order, what each step of the chapter added:

* seeds set once (:func:`seed_everything`), the same on every rank; the data is generated from
  its own seed, so every rank holds the same data set;
* ``DistributedSampler`` (shuffled, ``set_epoch`` before every epoch) so the ranks share each
  epoch's samples, each seeing a different part of every global batch;
* the model built and placed on its device *before* it is wrapped in DDP (optionally compiled
  first: ``model.compile()``, then ``DDP(model)``, the order of the docs page "Where to apply
  torch.compile?"; the DDP notes show the other one, and the lesson shows both work);
* optional gradient accumulation: ``no_sync()`` around the forward *and* the backward of every
  micro-batch but the last of each window, the loss divided by the window's length;
* optional autocast (``--amp bf16`` or ``fp16``), with a GradScaler for fp16 (on CUDA, and on the
  CPU too, where torch 2.13 supports it: fp16's small range needs it on either device);
* a tqdm progress bar on rank 0 only;
* per epoch, a global mean training loss and a global evaluation loss and accuracy, computed from
  all-reduced sums and counts (each rank evaluates the strided, unpadded slice
  ``rank::world_size`` of the evaluation set, so every sample counts exactly once: no sampler
  padding), evaluated through ``model.module`` (no DDP collectives in evaluation);
* ``--save PATH``: rank 0 saves ``model.module.state_dict()`` (keys without DDP's ``module.``
  prefix), the others wait at a barrier.

Its own check (every rank; rank 0 prints it, and the script exits 1 if any fails): the global
training loss decreases, the final accuracy beats chance, every evaluation sample was counted
once, and the final weights are bitwise identical on every rank (a CRC32 of their bytes, gathered
with ``all_gather``).

Structure for the chapters that extend it: :func:`parse_args` -> :class:`Config`;
:func:`build_data`, :func:`build_model`, :func:`wrap_model`, :func:`train_one_epoch`,
:func:`evaluate`; :func:`train` runs everything in an existing process group (``run_ranks`` calls
it too) and returns plain data; :func:`problems` checks it; :func:`main` launches it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import sys
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset
from tqdm import tqdm

from ddpcourse.dist_env import group_device, loader_workers_context, process_group
from ddpcourse.report import report_checks

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Config:
    epochs: int = 3
    batch_size: int = 32  # per rank and per micro-batch: a step sees world * batch * accumulation
    accumulation_steps: int = 1
    lr: float = 0.05
    momentum: float = 0.9
    amp: str = "none"  # "none", "bf16" or "fp16"
    compile: str = ""  # "" (eager), a torch.compile backend, or "auto"
    seed: int = 0
    train_samples: int = 2048
    eval_samples: int = 509  # odd on purpose: the ranks' evaluation slices differ in length
    features: int = 16
    classes: int = 4
    hidden: int = 64
    workers: int = 0
    progress: bool = True
    save: str = ""  # a path: rank 0 saves the trained model there


def parse_args(argv: list[str] | None = None) -> Config:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help="per rank and per micro-batch")
    parser.add_argument("--accumulation-steps", type=int, default=defaults.accumulation_steps)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--amp", choices=["none", *AMP_DTYPES], default=defaults.amp)
    parser.add_argument("--compile", nargs="?", const="auto", default=defaults.compile,
                        metavar="BACKEND", help="torch.compile the model before wrapping it "
                        "(auto: inductor on CUDA, aot_eager on the CPU)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--train-samples", type=int, default=defaults.train_samples)
    parser.add_argument("--eval-samples", type=int, default=defaults.eval_samples)
    parser.add_argument("--workers", type=int, default=defaults.workers,
                        help="DataLoader worker processes per rank")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--save", default=defaults.save, metavar="PATH")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.accumulation_steps < 1 or args.epochs < 1:
        parser.error("--epochs, --batch-size and --accumulation-steps must be at least 1")
    return dataclasses.replace(defaults, **vars(args))


def seed_everything(seed: int) -> None:
    """The same seed on every rank: identical initial weights (DDP would broadcast rank 0's
    anyway) and reproducible runs. Per-rank randomness (augmentation) would add the rank."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_classification(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian clusters around ``classes`` random centres that overlap: learnable, never
    perfectly (some samples lie nearer another class's centre)."""
    generator = torch.Generator().manual_seed(seed)
    centres = 0.5 * torch.randn(classes, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    x = centres[labels] + torch.randn(samples, features, generator=generator)
    return TensorDataset(x, labels)


def build_data(config: Config, rank: int, world_size: int, device: torch.device):
    """The training loader (with its DistributedSampler) and the evaluation set (whole), drawn
    from one generated data set (the same clusters), identical on every rank."""
    data = make_classification(config.train_samples + config.eval_samples, config.features,
                               config.classes, seed=config.seed + 1)
    x, y = data.tensors
    train_set = TensorDataset(x[:config.train_samples], y[:config.train_samples])
    eval_set = TensorDataset(x[config.train_samples:], y[config.train_samples:])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=config.seed)
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler,
                        num_workers=config.workers, persistent_workers=config.workers > 0,
                        multiprocessing_context=loader_workers_context(config.workers),
                        pin_memory=device.type == "cuda")
    return loader, sampler, eval_set


class Classifier(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build_model(config: Config, device: torch.device) -> nn.Module:
    """The plain model, on its device (DDP must wrap a model that is already there)."""
    torch.manual_seed(config.seed)
    return Classifier(config.features, config.hidden, config.classes).to(device)


def compile_backend(config: Config, device: torch.device) -> str:
    if config.compile == "auto":
        return "inductor" if device.type == "cuda" else "aot_eager"
    return config.compile


def wrap_model(model: nn.Module, config: Config, device: torch.device) -> DDP:
    """Compile (optionally) the plain model in place, then wrap it (the lesson's section 8:
    either order works). ``.compile()`` keeps the model's class and state_dict keys;
    ``torch.compile(model)`` would return a wrapper whose keys start with ``_orig_mod.``."""
    if config.compile:
        model.compile(backend=compile_backend(config, device))
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)




def autocast(config: Config, device: torch.device):
    return torch.autocast(device.type, dtype=AMP_DTYPES.get(config.amp, torch.bfloat16),
                          enabled=config.amp != "none")


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, config: Config, device: torch.device,
                    progress: tqdm | None = None) -> dict:
    """One pass over this rank's shard. Returns the global mean training loss (all-reduced sum
    over count), the number of samples behind it and this rank's optimizer steps."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, sample count
    batches, steps = len(loader), 0
    for index, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        window_start = index - index % config.accumulation_steps
        window = min(config.accumulation_steps, batches - window_start)  # the last may be short
        sync = index == window_start + window - 1
        with contextlib.nullcontext() if sync else model.no_sync():  # forward AND backward
            with autocast(config, device):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss / window).backward()
        totals += torch.stack([loss.detach().double() * len(y),
                               torch.tensor(float(len(y)), dtype=torch.float64, device=device)])
        if sync:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
        if progress is not None:
            progress.update(1)
    dist.all_reduce(totals)
    return {"train_loss": (totals[0] / totals[1]).item(), "train_samples": int(totals[1].item()),
            "steps": steps}


@torch.no_grad()
def evaluate(module: nn.Module, eval_set: TensorDataset, config: Config,
             device: torch.device) -> dict:
    """Global loss and accuracy on the whole evaluation set, every sample once.

    Called with ``model.module`` on every rank: the plain model runs no DDP collective, so ranks
    with slices of different lengths cannot block each other."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = Subset(eval_set, range(rank, len(eval_set), world_size))  # unpadded, disjoint
    module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in DataLoader(shard, batch_size=4 * config.batch_size):
        x, y = x.to(device), y.to(device)
        with autocast(config, device):
            logits = module(x)
        totals += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum").double(),
                               (logits.argmax(1) == y).sum().double(),
                               torch.tensor(float(len(y)), dtype=torch.float64, device=device)])
    module.train()
    dist.all_reduce(totals)
    return {"eval_loss": (totals[0] / totals[2]).item(),
            "eval_accuracy": (totals[1] / totals[2]).item(), "eval_samples": int(totals[2].item())}


def weights_checksum(module: nn.Module) -> int:
    """CRC32 of the bytes of every parameter: equal checksums mean (practically) equal bits."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()
    return zlib.crc32(flat.numpy().tobytes())


def gathered_checksums(module: nn.Module, device: torch.device) -> list[int]:
    mine = torch.tensor([weights_checksum(module)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(t.item()) for t in every]


def save(module: nn.Module, optimizer: torch.optim.Optimizer, config: Config,
         epochs_done: int) -> None:
    """Rank 0 writes; every rank waits until the file is complete."""
    if dist.get_rank() == 0:
        torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epochs_done": epochs_done, "config": dataclasses.asdict(config)},
                   config.save)
    dist.barrier()


def train(rank: int, world_size: int, config: Config | None = None, **overrides) -> dict:
    """Train in the current process group (every rank calls this); return the history."""
    config = dataclasses.replace(config or Config(), **overrides)
    device = group_device()
    seed_everything(config.seed)
    loader, sampler, eval_set = build_data(config, rank, world_size, device)
    model = wrap_model(build_model(config, device), config, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    scaler = torch.amp.GradScaler(device.type, enabled=config.amp == "fp16")
    show = config.progress and rank == 0
    epochs, steps = [], 0
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank
        with tqdm(total=len(loader), desc=f"epoch {epoch + 1}/{config.epochs}", disable=not show,
                  leave=False, file=sys.stderr) as progress:
            record = train_one_epoch(model, loader, optimizer, scaler, config, device, progress)
        steps += record.pop("steps")
        record.update(evaluate(model.module, eval_set, config, device), epoch=epoch + 1)
        epochs.append(record)
        if rank == 0:
            print(f"epoch {epoch + 1}/{config.epochs}: train loss {record['train_loss']:.4f}  "
                  f"eval loss {record['eval_loss']:.4f}  eval accuracy "
                  f"{100 * record['eval_accuracy']:.1f}% of {record['eval_samples']}", flush=True)
    if config.save:
        save(model.module, optimizer, config, config.epochs)
    return {"config": dataclasses.asdict(config), "world_size": world_size, "epochs": epochs,
            "optimizer_steps": steps, "checksums": gathered_checksums(model.module, device),
            "weights": torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]).cpu()}


def problems(history: dict) -> list[str]:
    """What in ``train``'s history contradicts the lesson."""
    found = []
    config, epochs = history["config"], history["epochs"]
    losses = [e["train_loss"] for e in epochs]
    if len(losses) >= 2 and not losses[-1] < losses[0]:
        found.append(f"the global training loss did not decrease: {losses}")
    chance = 1 / config["classes"]
    if not epochs[-1]["eval_accuracy"] > chance:
        found.append(f"final accuracy {epochs[-1]['eval_accuracy']:.3f} is no better than chance "
                     f"({chance:.3f})")
    counted = {e["eval_samples"] for e in epochs}
    if counted != {config["eval_samples"]}:
        found.append(f"evaluation counted {sorted(counted)} samples, not each of the "
                     f"{config['eval_samples']} once")
    if len(set(history["checksums"])) != 1:
        found.append(f"the ranks' final weights differ: checksums {history['checksums']}")
    return found


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    with process_group() as ctx:
        if ctx.is_main:
            print(f"{ctx.world_size} ranks, backend {ctx.backend}, device {ctx.device.type}; "
                  f"global batch {ctx.world_size} x {config.batch_size} x "
                  f"{config.accumulation_steps}; amp {config.amp}; "
                  f"compile {compile_backend(config, ctx.device) or 'no'}", flush=True)
        history = train(ctx.rank, ctx.world_size, config)
        found = problems(history)
        ctx.print0(f"{history['optimizer_steps']} optimizer steps; weights identical on every "
                   f"rank: {len(set(history['checksums'])) == 1}")
        return report_checks(found, echo=ctx.print0)


if __name__ == "__main__":
    sys.exit(main())
