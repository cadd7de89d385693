"""Chapter 07's training script, made resumable: checkpoints that restart a run bit for bit.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/train.py

With checkpoints and a fault (a worker SIGKILLs itself at step 10 of the first attempt; torchrun
restarts the whole group, which resumes from the checkpoint of step 8)::

    torchrun --standalone --nproc_per_node 2 --max_restarts 1 chapters/08_checkpoints/train.py \\
        --checkpoint-dir /tmp/ckpt --checkpoint-every 4 --resume --kill-at-step 10

It reuses chapter 07's ``train.py`` (imported by its path as ``ch07_train``: data generation,
seeds, compile-then-wrap, autocast, the global evaluation, the checksums and its checks) and adds:

* a model with dropout and a training set with random noise added to every sample as it is
  fetched (by the DataLoader's worker processes when ``--workers`` > 0; ``_noisy_samples.py``,
  since the workers start from a fork server and import it by name), both drawn from streams
  that differ per rank (seeded with ``seed + rank``): random-number state is part of the training
  state, and it is a different state on every rank;
* a cosine learning-rate schedule over the whole run, stepped after every optimizer step;
* a DataLoader ``generator`` of its own: each ``iter(loader)`` draws the workers' base seed from it
  (``_BaseDataLoaderIter.__init__`` in torch/utils/data/dataloader.py; without a generator it is
  drawn from the global torch stream, even with no workers), and worker ``i`` seeds ``random``,
  ``numpy`` and ``torch`` from that base seed + ``i`` (``_worker_loop`` in
  torch/utils/data/_utils/worker.py). Workers are not persistent: persistent workers are seeded
  once, in the first epoch, and their streams can't be saved from the main process;
* the evaluation (chapter 07's) inside ``torch.random.fork_rng``: its DataLoader has no generator,
  so every evaluation would take one draw from the global torch stream after a checkpoint at the
  end of an epoch was saved, and a resumed run would be one draw behind (:func:`evaluate_apart`);
* checkpoints (``--checkpoint-dir``, every ``--checkpoint-every`` optimizer steps; default once
  per epoch), each holding: ``model.module.state_dict()`` (no ``module.`` prefix), the optimizer,
  the scheduler, the GradScaler (fp16), the step counter and the position in the epoch (epoch,
  batches done), the sampler's epoch, and every rank's random-number states (Python, NumPy, torch
  CPU, this rank's CUDA device, the loader generator as the epoch began), gathered
  to rank 0. Rank 0 alone writes, atomically (``checkpoint_files.CheckpointDir``: temporary file,
  fsync, ``os.replace``, a ``latest`` pointer, the last ``--keep`` kept), then every rank meets at
  a barrier. Several nodes need a shared file system for the directory;
* ``--resume``: every rank loads the latest checkpoint (``map_location="cpu"``: no rank touches
  another rank's GPU, and random-number states must be CPU byte tensors for
  ``torch.set_rng_state`` / ``torch.cuda.set_rng_state``), restores the model *before* wrapping it
  in DDP and the optimizer, scheduler and scaler on every rank, then, in the epoch it stopped in,
  replays the loader from the saved generator state, skips the batches already trained on, and
  only then restores the random-number states: from there every draw is the one the
  uninterrupted run made;
* fault injection for the lesson: ``--kill-at-step S`` (rank ``--fault-rank`` SIGKILLs itself once
  ``S`` optimizer steps are done, before that step's checkpoint, in attempt 0 only:
  ``TORCHELASTIC_RESTART_COUNT`` == 0), ``--raise-at-step S`` (raises instead), ``--stop-at-step S``
  (every rank leaves after step S and its checkpoint, like a job whose allocation ends);
* ``--save-final PATH``: rank 0 writes the final ``model.module.state_dict()`` (atomically);
  ``--event-file PATH``: every rank appends one JSON line per event (started with its pid, resumed,
  checkpoint, fault, finished) so a driver can tell what happened in which attempt;
* ``--forget PIECE`` (repeatable): leave one piece of the checkpoint out when resuming, to see
  what breaks (resume_bit_exact.py measures every piece).

It joins with ``ddpcourse.dist_env.process_group(restart_safe=True)``: after a torchrun restart a
plain ``env://`` join can read the dead attempt's addresses from torchrun's store and fail with
gloo's "Connection refused" (chapters/03_torchrun/restart_demo.py).

Its own check (rank 0 prints it; exit 1 if one fails): chapter 07's checks on the epochs this
attempt finished (loss decreasing, accuracy above chance, every evaluation sample counted once,
weights identical on every rank) and that the run ended at the last step of the last epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

from ddpcourse.dist_env import cpu_group, group_device, loader_workers_context, process_group
from ddpcourse.imports import import_by_path
from ddpcourse.report import report_checks

HERE = Path(__file__).resolve().parent


ch07 = import_by_path("ch07_train", HERE.parent / "07_training_loop" / "train.py")
checkpoint_files = import_by_path("ch08_checkpoint_files", HERE / "checkpoint_files.py")
if str(HERE) not in sys.path:  # workers import _noisy_samples by name (its docstring says why)
    sys.path.insert(0, str(HERE))
from _noisy_samples import NoisySamples, report_if_stuck  # noqa: E402

# What a resumable checkpoint holds besides the model; each can be left out with --forget.
PIECES = ("optimizer", "scheduler", "step counter", "sampler epoch", "torch RNG", "per-rank RNG",
          "Python RNG", "NumPy RNG", "CUDA RNG", "loader generator", "GradScaler")


@dataclass
class Config(ch07.Config):
    dropout: float = 0.1
    noise: float = 0.1  # standard deviation of the noise added to each training sample
    scaler_growth_interval: int = 2000  # torch's default
    checkpoint_dir: str = ""
    checkpoint_every: int = 0  # optimizer steps; 0: once per epoch
    keep: int = 2
    resume: bool = False
    kill_at_step: int = 0
    raise_at_step: int = 0
    stop_at_step: int = 0
    fault_rank: int = 1
    save_final: str = ""
    event_file: str = ""
    forget: tuple = ()  # pieces a resume leaves out (for the lesson's table)
    persistent_workers: bool = False  # True only to show why it is off (resume_bit_exact.py)
    evaluation_apart: bool = True  # False only to show why it is on (resume_bit_exact.py)
    stuck_worker_s: float = 0.0  # > 0: a DataLoader worker alive this long dumps its stacks, exits


def parse_args(argv: list[str] | None = None) -> Config:
    """This chapter's options; the rest go to chapter 07's parser (--epochs, --batch-size, --amp,
    --workers, ...)."""
    defaults = Config()
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every option of chapters/07_training_loop/train.py is accepted too.")
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument("--noise", type=float, default=defaults.noise)
    parser.add_argument("--checkpoint-dir", default=defaults.checkpoint_dir, metavar="DIR")
    parser.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                        metavar="N", help="optimizer steps between checkpoints (0: every epoch)")
    parser.add_argument("--keep", type=int, default=defaults.keep, help="checkpoints kept")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir, if any")
    parser.add_argument("--kill-at-step", type=int, default=0, metavar="S")
    parser.add_argument("--raise-at-step", type=int, default=0, metavar="S")
    parser.add_argument("--stop-at-step", type=int, default=0, metavar="S")
    parser.add_argument("--fault-rank", type=int, default=defaults.fault_rank)
    parser.add_argument("--save-final", default="", metavar="PATH")
    parser.add_argument("--event-file", default="", metavar="PATH")
    parser.add_argument("--forget", action="append", choices=PIECES, default=[], metavar="PIECE",
                        help=f"leave a piece out when resuming: {', '.join(PIECES)}")
    mine, rest = parser.parse_known_args(argv)
    if mine.checkpoint_every < 0 or mine.keep < 1:
        parser.error("--checkpoint-every must be >= 0 and --keep >= 1")
    if (mine.resume or mine.kill_at_step or mine.raise_at_step) and not mine.checkpoint_dir:
        parser.error("--resume, --kill-at-step and --raise-at-step need --checkpoint-dir")
    base = ch07.parse_args(rest)
    return Config(**{**dataclasses.asdict(base), **vars(mine), "forget": tuple(mine.forget)})


def attempt() -> int:
    """torchrun's restart count (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def log_event(config: Config, event: str, **extra) -> None:
    if config.event_file:
        line = json.dumps({"attempt": attempt(), "rank": dist.get_rank(), "pid": os.getpid(),
                           "event": event, **extra})
        with open(config.event_file, "a") as f:  # one short line per write: appends stay whole
            f.write(line + "\n")


# --------------------------------------------------------------------------- data and model

def build_data(config: Config, rank: int, world_size: int, device: torch.device):
    """Chapter 07's data (identical on every rank), noisy training samples, and a loader with a
    generator of its own (seeded per rank) and non-persistent workers."""
    data = ch07.make_classification(config.train_samples + config.eval_samples, config.features,
                                    config.classes, seed=config.seed + 1)
    x, y = data.tensors
    train_set = NoisySamples(TensorDataset(x[:config.train_samples], y[:config.train_samples]),
                             config.noise)
    eval_set = TensorDataset(x[config.train_samples:], y[config.train_samples:])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=config.seed)
    generator = torch.Generator().manual_seed(config.seed + 10_000 + rank)
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=sampler,
                        num_workers=config.workers, generator=generator,
                        multiprocessing_context=loader_workers_context(config.workers),
                        persistent_workers=config.persistent_workers and config.workers > 0,
                        worker_init_fn=(functools.partial(report_if_stuck, config.stuck_worker_s)
                                        if config.stuck_worker_s > 0 else None),
                        pin_memory=device.type == "cuda")
    return loader, sampler, eval_set, generator


class DropoutClassifier(ch07.Classifier):
    """Chapter 07's classifier with dropout after each hidden layer."""

    def __init__(self, features: int, hidden: int, classes: int, dropout: float):
        super().__init__(features, hidden, classes)
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout))


def build_model(config: Config, device: torch.device) -> nn.Module:
    torch.manual_seed(config.seed)
    return DropoutClassifier(config.features, config.hidden, config.classes,
                             config.dropout).to(device)


# ----------------------------------------------------------------------- random-number state

def rng_state(generator_at_epoch_start: torch.Tensor) -> dict:
    """This rank's random-number state, as tensors and plain values (``torch.load`` with
    ``weights_only=True`` accepts them; a NumPy array it would refuse). The loader's generator
    is saved as it was when the epoch began: only ``iter(loader)`` draws from it, once per epoch,
    so replaying that draw (see ``Trainer.start_epoch``) restores its state too."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
             "torch": torch.get_rng_state(),
             "loader generator at epoch start": generator_at_epoch_start}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's GPU
    return state


def set_rng_state(state: dict, forget: tuple) -> None:
    if "Python RNG" not in forget:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "NumPy RNG" not in forget:
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "torch RNG" not in forget:
        torch.set_rng_state(state["torch"])
    if "CUDA RNG" not in forget and "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_to_rank0(obj):
    """Every rank's ``obj`` in a list on rank 0 (None elsewhere), over a CPU-capable group."""
    found = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, found, dst=0, group=cpu_group())
    return found


# ------------------------------------------------------------------------------- training

@dataclass
class Position:
    """Where a run stands: optimizer steps done, and the epoch and batches done in it."""
    step: int = 0
    epoch: int = 0
    batch: int = 0


@dataclass
class Trainer:
    config: Config
    rank: int
    world_size: int
    device: torch.device
    loader: DataLoader
    sampler: DistributedSampler
    eval_set: TensorDataset
    generator: torch.Generator
    model: nn.Module  # DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    directory: object = None  # a CheckpointDir, or None
    position: Position = dataclasses.field(default_factory=Position)
    sampler_epoch_offset: int = 0  # 0 unless a resume forgot the sampler's epoch
    pending_rng: dict | None = None  # states to restore once the resumed epoch is replayed
    generator_at_epoch_start: torch.Tensor | None = None
    resumed_from: int | None = None
    checkpoints: list = dataclasses.field(default_factory=list)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.loader)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.batches_per_epoch / self.config.accumulation_steps)

    # ---- checkpoints

    def state(self) -> dict:
        """The checkpoint of the current position. Every rank calls it (the random-number states
        are gathered to rank 0); only rank 0's return value is complete."""
        position = dataclasses.replace(self.position)
        at_epoch_start = self.generator_at_epoch_start
        if position.batch == self.batches_per_epoch:  # the epoch is over: the next one's start
            position = Position(position.step, position.epoch + 1, 0)
            at_epoch_start = self.generator.get_state()
        every_rng = gather_to_rank0(rng_state(at_epoch_start))
        state = {"model": self.model.module.state_dict(),
                 "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(),
                 "step": position.step, "epoch": position.epoch, "batch": position.batch,
                 "sampler epoch": self.sampler.epoch, "rng": every_rng,
                 "world size": self.world_size, "config": dataclasses.asdict(self.config)}
        if self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()
        return state

    def save_checkpoint(self) -> None:
        state = self.state()
        if self.rank == 0:
            path = self.directory.save(state, self.position.step)
            self.checkpoints.append(path.name)
            log_event(self.config, "checkpoint", step=self.position.step)
        dist.barrier()  # nobody reads (or dies believing it is written) before it is complete

    # ---- the loop

    def run(self) -> list[dict]:
        """Train from ``position`` to the end (or to ``stop_at_step``); one record per epoch
        finished."""
        records = []
        show = self.config.progress and self.rank == 0
        for epoch in range(self.position.epoch, self.config.epochs):
            self.sampler.set_epoch(epoch - self.sampler_epoch_offset)
            batches = self.start_epoch(epoch)
            with tqdm(total=self.batches_per_epoch, initial=self.position.batch,
                      desc=f"epoch {epoch + 1}/{self.config.epochs}", disable=not show,
                      leave=False, file=sys.stderr) as progress:
                record, stopped = self.train_batches(batches, progress)
            if stopped:
                break
            record.update(evaluate_apart(self.model.module, self.eval_set, self.config,
                                         self.device), epoch=epoch + 1)
            records.append(record)
            if self.rank == 0:
                print(f"epoch {epoch + 1}/{self.config.epochs}: train loss "
                      f"{record['train_loss']:.4f}  eval loss {record['eval_loss']:.4f}  "
                      f"eval accuracy {100 * record['eval_accuracy']:.1f}%", flush=True)
        return records

    def start_epoch(self, epoch: int):
        """The epoch's batch iterator, positioned after the batches already done. In the epoch a
        resume lands in, the loader draws its workers' base seed from the generator state the
        epoch started with, and the skipped batches are fetched again (the workers' streams
        advance as they did); then the saved random-number states take over."""
        skip = self.position.batch if epoch == self.position.epoch else 0
        if epoch != self.position.epoch:
            self.position = Position(self.position.step, epoch, 0)
        if self.pending_rng is not None and "loader generator" not in self.config.forget:
            self.generator.set_state(self.pending_rng["loader generator at epoch start"])
        self.generator_at_epoch_start = self.generator.get_state()
        batches = iter(self.loader)
        for _ in range(skip):
            next(batches)
        if self.pending_rng is not None:
            set_rng_state(self.pending_rng, self.config.forget)
            self.pending_rng = None
        return batches

    def train_batches(self, batches, progress) -> tuple[dict, bool]:
        """Chapter 07's accumulation loop from the current batch; after every optimizer step:
        the scheduler, the faults, the checkpoint, the planned stop."""
        config, device, model = self.config, self.device, self.model
        model.train()
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, sample count
        count = self.batches_per_epoch
        for index, (x, y) in enumerate(batches, start=self.position.batch):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            window_start = index - index % config.accumulation_steps
            window = min(config.accumulation_steps, count - window_start)
            sync = index == window_start + window - 1
            with contextlib.nullcontext() if sync else model.no_sync():  # forward AND backward
                with ch07.autocast(config, device):
                    loss = F.cross_entropy(model(x), y)
                self.scaler.scale(loss / window).backward()
            totals += torch.stack([loss.detach().double() * len(y),
                                   torch.tensor(float(len(y)), dtype=torch.float64,
                                                device=device)])
            progress.update(1)
            if not sync:
                continue
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.position = Position(self.position.step + 1, self.position.epoch, index + 1)
            self.inject_fault()
            if self.directory is not None and self.position.step % self.checkpoint_every == 0:
                self.save_checkpoint()
            if self.position.step == config.stop_at_step:
                if self.directory is not None and self.position.step % self.checkpoint_every:
                    self.save_checkpoint()
                return {}, True
        dist.all_reduce(totals)
        return {"train_loss": (totals[0] / totals[1]).item(),
                "train_samples": int(totals[1].item())}, False

    @property
    def checkpoint_every(self) -> int:
        return self.config.checkpoint_every or self.steps_per_epoch

    def inject_fault(self) -> None:
        config, step = self.config, self.position.step
        if attempt() != 0 or self.rank != config.fault_rank:
            return
        if step == config.kill_at_step:
            log_event(config, "fault", step=step, how="SIGKILL")
            os.kill(os.getpid(), signal.SIGKILL)
        if step == config.raise_at_step:
            log_event(config, "fault", step=step, how="raise")
            raise RuntimeError(f"rank {self.rank} fails on purpose after step {step} in attempt 0")


def evaluate_apart(module: nn.Module, eval_set: TensorDataset, config: Config,
                   device: torch.device) -> dict:
    """Chapter 07's evaluation, with the global CPU torch stream put back afterwards.

    Its DataLoader has no generator, so each ``iter()`` draws a base seed from the global torch
    stream (even with no workers): one draw per evaluation. A checkpoint saved at the last step
    of an epoch holds the state *before* that evaluation, so the resumed run would be one draw
    behind the uninterrupted one (resume_bit_exact.py measures it). Evaluating inside
    ``torch.random.fork_rng`` leaves the training's stream untouched."""
    if not config.evaluation_apart:
        return ch07.evaluate(module, eval_set, config, device)
    with torch.random.fork_rng(devices=[]):
        return ch07.evaluate(module, eval_set, config, device)


def restore(trainer: Trainer, state: dict) -> None:
    """Everything but the model (restored before wrapping) and the random-number states
    (restored once the resumed epoch has been replayed to its position)."""
    forget = trainer.config.forget
    if "optimizer" not in forget:
        trainer.optimizer.load_state_dict(state["optimizer"])
    if "scheduler" not in forget:
        trainer.scheduler.load_state_dict(state["scheduler"])
    if "GradScaler" not in forget and "scaler" in state:
        trainer.scaler.load_state_dict(state["scaler"])
    if "step counter" not in forget:
        trainer.position = Position(state["step"], state["epoch"], state["batch"])
        if "sampler epoch" in forget:  # the resumed run counts the sampler's epochs from 0
            trainer.sampler_epoch_offset = state["epoch"]
    rank = 0 if "per-rank RNG" in forget else trainer.rank
    trainer.pending_rng = state["rng"][rank]
    trainer.resumed_from = state["step"]


def flat_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    return {(index, name): value.detach().cpu().clone()
            for index, values in optimizer.state_dict()["state"].items()
            for name, value in values.items() if torch.is_tensor(value)}


def train(rank: int, world_size: int, config: Config | None = None, **overrides) -> dict:
    """Train (or resume) in the current process group; every rank calls this. Returns plain data:
    the epochs this call finished, the final step, the weights and optimizer state."""
    config = dataclasses.replace(config or Config(), **overrides)
    device = group_device()
    ch07.seed_everything(config.seed)
    loader, sampler, eval_set, generator = build_data(config, rank, world_size, device)
    model = build_model(config, device)
    ch07.seed_everything(config.seed + rank)  # per-rank streams: dropout masks, noise
    log_event(config, "started")
    directory = None
    state = None
    if config.checkpoint_dir:
        directory = checkpoint_files.CheckpointDir(config.checkpoint_dir, keep=config.keep)
        if config.resume:
            state = directory.load_latest(map_location="cpu")
    if state is not None and state["world size"] != world_size:
        raise ValueError(f"the checkpoint was written by {state['world size']} ranks, this run has "
                         f"{world_size}: its per-rank random states and sampler shards do not "
                         "fit (dcp_reshard.py shows resharding with torch.distributed.checkpoint)")
    if state is not None:
        model.load_state_dict(state["model"])  # before wrapping: DDP starts from these weights
    ddp_model = ch07.wrap_model(model, config, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    batches = len(loader)
    total_steps = config.epochs * math.ceil(batches / config.accumulation_steps)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    scaler = torch.amp.GradScaler(device.type, enabled=config.amp == "fp16",
                                  growth_interval=config.scaler_growth_interval)
    trainer = Trainer(config, rank, world_size, device, loader, sampler, eval_set, generator,
                      ddp_model, optimizer, scheduler, scaler, directory)
    if state is not None:
        restore(trainer, state)
        log_event(config, "resumed", step=trainer.resumed_from)
        if rank == 0:
            print(f"resumed from the checkpoint of step {trainer.resumed_from} (epoch "
                  f"{state['epoch']}, batch {state['batch']}) in attempt {attempt()}", flush=True)
    first_step = trainer.position.step
    records = trainer.run()
    if config.save_final:
        if rank == 0:
            checkpoint_files.save_atomically(ddp_model.module.state_dict(), config.save_final)
        dist.barrier()
    log_event(config, "finished", step=trainer.position.step)
    return {"config": dataclasses.asdict(config), "world_size": world_size, "epochs": records,
            "final_step": trainer.position.step, "steps_run": trainer.position.step - first_step,
            "total_steps": total_steps,
            "resumed_from": trainer.resumed_from, "checkpoints": trainer.checkpoints,
            "checksums": ch07.gathered_checksums(ddp_model.module, device),
            "weights": {name: p.detach().cpu().clone()
                        for name, p in ddp_model.module.named_parameters()},
            "optimizer_state": flat_optimizer_state(optimizer),
            "rng": rng_state(trainer.generator_at_epoch_start)}


def problems(history: dict) -> list[str]:
    """What in ``train``'s history contradicts the lesson."""
    found = []
    if history["epochs"]:
        found += ch07.problems(history)
    elif len(set(history["checksums"])) != 1:
        found.append(f"the ranks' final weights differ: checksums {history['checksums']}")
    expected = history["config"]["stop_at_step"] or history["total_steps"]
    if history["final_step"] != expected:
        found.append(f"the run ended at step {history['final_step']}, not at step {expected}")
    return found


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    with process_group(restart_safe=True) as ctx:
        if ctx.is_main:
            print(f"attempt {attempt()}: {ctx.world_size} ranks, backend {ctx.backend}, device "
                  f"{ctx.device.type}; amp {config.amp}; checkpoints "
                  f"{config.checkpoint_dir or 'none'}", flush=True)
        history = train(ctx.rank, ctx.world_size, config)
        found = problems(history)
        ctx.print0(f"{history['final_step']} of {history['total_steps']} optimizer steps done"
                   + (f", resumed at step {history['resumed_from']}"
                      if history["resumed_from"] is not None else "")
                   + f"; weights identical on every rank: {len(set(history['checksums'])) == 1}")
        return report_checks(found, echo=ctx.print0)


if __name__ == "__main__":
    sys.exit(main())
