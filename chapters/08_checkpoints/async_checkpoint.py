"""dcp.async_save: training goes on while the checkpoint is written; what it copies, what to wait for.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/async_checkpoint.py

``dcp.save`` blocks the training loop until every rank has written its files and rank 0 the
``.metadata``. ``dcp.async_save`` (torch/distributed/checkpoint/state_dict_saver.py) first
copies the state into CPU memory ("staging", in the calling thread with the default stager of
torch 2.13), then runs ``dcp.save`` on that copy in a thread of its own
(``_ThreadBasedAsyncCheckpointExecutor`` in _async_thread_executor.py) and returns at once.
Shown here on 2 ranks, with facts that do not depend on timing (a storage writer that waits at a
gate we open decides when the write happens):

* it returns a ``concurrent.futures.Future`` (an ``AsyncSaveResponse`` only with a stager that
  stages in the background) that is not done yet, and no ``.metadata`` exists: the checkpoint is
  not loadable until ``future.result()`` returns (its value: the checkpoint's ``Metadata``);
* it writes the state as it was at the call: an optimizer step taken after it returns, before the
  write, changes nothing in the checkpoint (every tensor equal to the call-time copy, bit for
  bit). ``dcp.save`` run in a thread of your own without that copy writes whatever the tensors
  hold when the write happens: here the weights of the *next* step;
* the price of the copy: every rank stages the whole state (all its bytes, counted), though
  each writes only the part DCP gives it (see dcp_reshard.py): memory for a second copy;
* the background thread calls collectives (``gather_object``, ``scatter_object_list``,
  ``broadcast_object_list``, counted with the thread's name) while the main thread trains. So
  give checkpointing a gloo group of its own (``process_group=``), so that its collectives never
  interleave with training's in a different order on different ranks; and wait for the previous
  future before the next ``async_save`` and before leaving the process group (the PyTorch recipe
  "Asynchronous Saving with Distributed Checkpoint (DCP)" does the former).

Not shown (no GPU needed here): with NCCL, ``async_save`` asserts that its group has a CPU
backend ("A CPU backend must be enabled for async save; try initializing process group with
'cpu:gloo,cuda:nccl'", ``async_save`` in state_dict_saver.py): pass a gloo group, as here, or
initialise with ``backend="cpu:gloo,cuda:nccl"``.

How long the training loop stalls per checkpoint with ``dcp.save`` and with
``dcp.async_save`` is a timing, so the lesson reads it from a recorded run:
benchmarks/results/ch08_async_save.json (benchmarks/ch08_async_save.py).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.dist_env import cpu_group, process_group
from ddpcourse.report import report_checks_of_every_rank

GATE_TIMEOUT_S = 60.0  # a writer never waits longer than this for its gate (a bug, not a demo)
COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list",
               "all_gather_object", "barrier", "all_reduce", "broadcast")


class GatedWriter(dcp.FileSystemWriter):
    """A FileSystemWriter that writes its data only once ``gate`` is set: the demo, not the
    clock, decides whether the training step comes before the write."""

    def __init__(self, path, gate: threading.Event):
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan, planner):
        if not self.gate.wait(GATE_TIMEOUT_S):
            raise TimeoutError("the demo never opened the gate")
        return super().write_data(plan, planner)


class CountingStager(DefaultStager):
    """torch 2.13's default stager for async_save (synchronous, plain CPU memory), recording how
    many tensor bytes it copied and whether any copy shares memory with what it copied."""

    def __init__(self):
        super().__init__(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))
        self.staged_bytes = 0
        self.shares_memory = None

    def stage(self, state_dict, **kwargs):
        staged = super().stage(state_dict, **kwargs)
        live, copies = tensors_of(state_dict), tensors_of(staged)
        self.staged_bytes = sum(t.numel() * t.element_size() for t in copies)
        self.shares_memory = any(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                                 for a, b in zip(live, copies))
        return staged


def tensors_of(tree) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list, in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in tensors_of(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in tensors_of(item)]
    return []


def build() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)),
              process_group=cpu_group())
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)


def train_step(ddp: DDP, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    ddp(data).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def state_of(ddp: DDP, optimizer: torch.optim.Optimizer) -> dict:
    model_state, optim_state = get_state_dict(ddp, optimizer)
    return {"model": model_state, "optim": optim_state}


def copy_of(tree):
    """A detached deep copy of the tensors of a nested state dict (other values kept)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: copy_of(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [copy_of(item) for item in tree]
    return tree


def equal_tensors(a, b) -> bool:
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) > 0 and all(torch.equal(x, y) for x, y in zip(ta, tb))


def load_back(like: dict, checkpoint: Path, group) -> dict:
    """The checkpoint read into zeros of the same structure."""
    target = copy_of(like)
    for t in tensors_of(target):
        t.zero_()
    dcp.load(target, checkpoint_id=str(checkpoint), process_group=group)
    return target


def collective_threads():
    """Context: count collectives by (name, calling thread's name) while it is open."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name, original):
        def wrapper(*args, **kwargs):
            counts[(name, threading.current_thread().name)] += 1
            return original(*args, **kwargs)
        return wrapper

    class Patch:
        def __enter__(self):
            for name, original in originals.items():
                setattr(dist, name, counted(name, original))
            return counts

        def __exit__(self, *exc):
            for name, original in originals.items():
                setattr(dist, name, original)

    return Patch()


def async_save_demo(rank: int, world_size: int, directory: str) -> dict:
    """async_save with the write held at a gate while one more training step runs."""
    directory = Path(directory)
    checkpoint_group = dist.new_group(backend="gloo")  # checkpointing's own collectives
    ddp, optimizer = build()
    train_step(ddp, optimizer, rank, 0)
    at_call = copy_of(state_of(ddp, optimizer))
    gate, stager = threading.Event(), CountingStager()
    with collective_threads() as calls:
        future = dcp.async_save(state_of(ddp, optimizer), process_group=checkpoint_group,
                                storage_writer=GatedWriter(directory / "async", gate),
                                async_stager=stager)
        returned = {"type": f"{type(future).__module__}.{type(future).__qualname__}",
                    "is a Future": isinstance(future, Future), "done": future.done(),
                    ".metadata exists": (directory / "async" / ".metadata").exists()}
        train_step(ddp, optimizer, rank, 1)  # changes weights and optimizer state in place
        after_step = copy_of(state_of(ddp, optimizer))
        gate.set()
        metadata = future.result(timeout=GATE_TIMEOUT_S)
    stager.close()  # a stager we pass in stays ours to close (async_save's docstring)
    saved = load_back(at_call, directory / "async", checkpoint_group)
    return {
        "returned": returned,
        "result": type(metadata).__name__,
        ".metadata after result()": (directory / "async" / ".metadata").exists(),
        "the step changed the state": not equal_tensors(at_call, after_step),
        "checkpoint equals the state at the call": equal_tensors(saved, at_call),
        "staged bytes": stager.staged_bytes,
        "state bytes": sum(t.numel() * t.element_size() for t in tensors_of(at_call)),
        "staged copy shares memory with the model": stager.shares_memory,
        "items written by this rank": sum(
            info.relative_path.startswith(f"__{rank}_") for info in metadata.storage_data.values()),
        "items in the checkpoint": len(metadata.storage_data),
        "collectives by thread": {f"{name} in {thread.rsplit('_', 1)[0]}": n
                                  for (name, thread), n in sorted(calls.items())},
    }


def own_thread_demo(rank: int, world_size: int, directory: str) -> dict:
    """The mistake async_save's copy prevents: dcp.save on the live tensors, in a thread of our
    own, with one training step before the write."""
    directory = Path(directory)
    checkpoint_group = dist.new_group(backend="gloo")
    ddp, optimizer = build()
    train_step(ddp, optimizer, rank, 0)
    at_call = copy_of(state_of(ddp, optimizer))
    gate, errors = threading.Event(), []

    def save_in_background():
        try:
            dcp.save(state_of(ddp, optimizer), process_group=checkpoint_group,
                     storage_writer=GatedWriter(directory / "own_thread", gate))
        except Exception as error:  # noqa: BLE001  (reported to the main thread)
            errors.append(repr(error))

    writer = threading.Thread(target=save_in_background, name="own-checkpoint-thread")
    writer.start()
    train_step(ddp, optimizer, rank, 1)
    after_step = copy_of(state_of(ddp, optimizer))
    gate.set()
    writer.join(GATE_TIMEOUT_S)
    saved = load_back(at_call, directory / "own_thread", checkpoint_group)
    return {"errors": errors, "finished": not writer.is_alive(),
            "checkpoint equals the state at the call": equal_tensors(saved, at_call),
            "checkpoint equals the state after the next step": equal_tensors(saved, after_step)}


def run_all(rank: int, world_size: int, directory: str) -> dict:
    return {"async_save": async_save_demo(rank, world_size, directory),
            "own thread": own_thread_demo(rank, world_size, directory)}


def problems(results: dict) -> list[str]:
    """What one rank's results contradict in the lesson."""
    found = []

    def expect(condition: bool, claim: str) -> None:
        if not condition:
            found.append(claim)

    a = results["async_save"]
    r = a["returned"]
    expect(r["is a Future"] and r["type"] == "concurrent.futures._base.Future",
           "async_save should return a concurrent.futures.Future")
    expect(r["done"] is False and r[".metadata exists"] is False,
           "async_save should return before the checkpoint is written (no .metadata yet)")
    expect(a["result"] == "Metadata" and a[".metadata after result()"],
           "future.result() should give the Metadata, once the .metadata file exists")
    expect(a["the step changed the state"],
           "the training step after the call should change the state (else nothing is shown)")
    expect(a["checkpoint equals the state at the call"],
           "async_save should write the state as it was at the call, bit for bit")
    expect(a["staged bytes"] == a["state bytes"] > 0
           and a["staged copy shares memory with the model"] is False,
           "every rank should stage a separate copy of the whole state")
    expect(0 < a["items written by this rank"] < a["items in the checkpoint"],
           "a rank should write only its part of what it staged")
    background = [k for k in a["collectives by thread"] if k.endswith("AsyncCheckpointExecutor")]
    expect(any(k.startswith("gather_object") for k in background)
           and any(k.startswith("broadcast_object_list") for k in background),
           "the save's collectives should run in async_save's background thread")
    expect(not any(k.endswith("MainThread") for k in a["collectives by thread"]),
           "async_save should call no collective in the calling thread")
    own = results["own thread"]
    expect(own["errors"] == [] and own["finished"], "the hand-made background save should finish")
    expect(own["checkpoint equals the state after the next step"]
           and not own["checkpoint equals the state at the call"],
           "dcp.save in a thread without a copy should write the state of the later step")
    return found


def main() -> int:
    with process_group() as ctx:
        directory = [tempfile.mkdtemp(prefix="ch08_async_") if ctx.is_main else None]
        dist.broadcast_object_list(directory, group=cpu_group())
        results = run_all(ctx.rank, ctx.world_size, directory[0])
        if ctx.is_main:
            for part, values in results.items():
                print(f"{part}:")
                for key, value in values.items():
                    print(f"  {key}: {value}")
        code = report_checks_of_every_rank(problems(results), group=cpu_group())
        dist.barrier(group=cpu_group())
        if ctx.is_main:
            shutil.rmtree(directory[0], ignore_errors=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
