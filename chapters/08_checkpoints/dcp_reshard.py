"""torch.distributed.checkpoint (DCP): each rank writes its part; any world size loads it back.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/dcp_reshard.py --mode save --dir /tmp/ch08_dcp
    torchrun --standalone --nproc_per_node 1 chapters/08_checkpoints/dcp_reshard.py --mode load --dir /tmp/ch08_dcp
    torchrun --standalone --nproc_per_node 4 chapters/08_checkpoints/dcp_reshard.py --mode load --dir /tmp/ch08_dcp

Launch test: custom. It takes three launches (save at 2 ranks, load at 1 and at 4), which
tests/test_chapter_08_dcp.py runs through ``run_ranks``; each launch checks its own claims and
exits 1 if one fails.

A DDP model and its AdamW optimizer train a few steps at 2 ranks; their state is taken with
``torch.distributed.checkpoint.state_dict.get_state_dict`` (keys without DDP's ``module.``
prefix, optimizer state keyed by parameter name instead of by number) and saved with
``dcp.save``. What the save mode shows (rank 0 prints):

* the files written: one ``__R_0.distcp`` per rank R and one ``.metadata``, written last by the
  coordinator (rank 0) through a temporary file and a rename (``FileSystemWriter.finish`` in
  torch/distributed/checkpoint/filesystem.py): the checkpoint is loadable once ``.metadata``
  exists;
* who wrote what, read back from the metadata (``Metadata.storage_data``: each item's file,
  offset and length). Under DDP every rank holds every tensor, and DCP writes each replicated
  item once: the coordinator gives it to the rank with the fewest tensor bytes planned so far
  (``dedup_save_plans`` in torch/distributed/checkpoint/_dedup_save_plans.py; a non-tensor item
  counts as one byte), so the ranks share the writing instead of rank 0 writing everything;
  each item is stored with ``torch.save``'s framing (about 1.6 KB for a 16-float bias);
* ``dcp.save`` is collective: counted, it calls ``gather_object``, ``scatter_object_list`` and
  ``broadcast_object_list`` (the planning and the commit of ``_save_state_dict`` in
  state_dict_saver.py, through ``_DistWrapper`` in utils.py), which every rank of the group must
  join; called by rank 0 alone it fails after the group's timeout, and leaves no ``.metadata``.
  ``torch.save`` calls none of them (the chapter's "rank 0 writes" pattern).

The load mode, at any world size, builds the model from another seed, loads the checkpoint with
``dcp.load`` and ``set_state_dict`` and compares every tensor of the model and of the optimizer
state, and the hyper-parameters, with what the save mode had on rank 0 (``expected.pt``, written
by rank 0 beside the checkpoint): equal bit for bit, on every rank. Rank 0 then turns the DCP
directory into one ``torch.save`` file (``dcp_to_torch_save`` in
torch/distributed/checkpoint/format_utils.py), loads its ``"model"`` part into a plain,
unwrapped model, and turns the file back into a DCP directory (``torch_save_to_dcp``) that every
rank loads again, exactly. Both conversions are single-process (``no_dist=True``): they read or
write the whole state in one process.

Here each rank holds a whole replica, so "resharding" means only that the number of files read
differs from the number of ranks. With a sharded model (FSDP, chapter 11: each rank holds a
slice of every parameter as a ``DTensor``) the same calls write each rank's slices and, at
another world size, each rank reads exactly the pieces of its new slices from whichever files
hold them (``LoadPlan`` in torch/distributed/checkpoint/planner.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.dist_env import cpu_group, process_group, short_timeout_group
from ddpcourse.report import report_checks_of_every_rank

TRAIN_STEPS = 3
LONE_SAVE_TIMEOUT_S = 3.0  # how long rank 0's lone dcp.save waits for its peers before failing
COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list",
               "all_gather_object", "barrier", "all_reduce", "broadcast")


def build(seed: int) -> tuple[DDP, torch.optim.Optimizer]:
    """A small MLP from ``seed``, wrapped in DDP (on the CPU gloo group), and its AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DDP(model, process_group=cpu_group())
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)


def train(ddp: DDP, optimizer: torch.optim.Optimizer, rank: int, steps: int = TRAIN_STEPS):
    """A few steps, different data on each rank (DDP averages the gradients: equal replicas)."""
    for step in range(steps):
        data = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
        ddp(data).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def checkpoint_state(ddp: DDP, optimizer: torch.optim.Optimizer) -> dict:
    """What DCP saves and loads: ``{"model": ..., "optim": ...}`` as ``get_state_dict`` gives
    them (parameter names without ``module.``; optimizer state keyed by parameter name)."""
    model_state, optim_state = get_state_dict(ddp, optimizer)
    return {"model": model_state, "optim": optim_state}


def snapshot(ddp: DDP, optimizer: torch.optim.Optimizer) -> dict:
    """A detached copy of the state, flat, under the names DCP's metadata gives them
    (``model.NAME``, ``optim.state.NAME.exp_avg`` ...), plus ``param_groups``: what "equal,
    exactly" is checked on."""
    state = checkpoint_state(ddp, optimizer)
    flat = {f"model.{k}": v.detach().clone() for k, v in state["model"].items()}
    for name, per_param in state["optim"]["state"].items():
        for key, value in per_param.items():
            flat[f"optim.state.{name}.{key}"] = value.detach().clone()
    flat["param_groups"] = state["optim"]["param_groups"]
    return flat


def differences(expected: dict, actual: dict) -> list[str]:
    """Names whose value differs (bits, shape, dtype), or that one side lacks."""
    found = sorted(set(expected) ^ set(actual))
    for name in sorted(set(expected) & set(actual)):
        a, b = expected[name], actual[name]
        same = (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b
        if not same:
            found.append(name)
    return found


@contextmanager
def counting_collectives():
    """Count the calls of torch.distributed's collectives made inside the block (DCP calls them
    as ``dist.NAME``, so replacing the module attributes sees them)."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name, original):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def writers(metadata) -> dict[str, int]:
    """Item name -> the rank whose file holds it (``__R_0.distcp`` was written by rank R)."""
    return {index.fqn: int(re.match(r"__(\d+)_", info.relative_path).group(1))
            for index, info in metadata.storage_data.items()}


def save_mode(rank: int, world_size: int, directory: str) -> dict:
    """Train at this world size, save with DCP, and show who wrote what and that the save is a
    collective. Returns rank 0's findings (the other ranks return their own view)."""
    directory = Path(directory)
    checkpoint = directory / "dcp"
    ddp, optimizer = build(seed=0)
    train(ddp, optimizer, rank)
    expected = snapshot(ddp, optimizer)
    with counting_collectives() as dcp_calls:
        metadata = dcp.save(checkpoint_state(ddp, optimizer), checkpoint_id=str(checkpoint),
                            process_group=cpu_group())
    with counting_collectives() as torch_save_calls:
        if rank == 0:
            torch.save(expected, directory / "expected.pt")  # the reference the load mode checks
    dist.barrier(group=cpu_group())
    report = {"rank": rank, "world_size": world_size, "dcp.save collectives": dict(dcp_calls),
              "torch.save collectives": dict(torch_save_calls)}
    if rank == 0:
        by_item = writers(metadata)
        lengths = {index.fqn: info.length for index, info in metadata.storage_data.items()}
        report.update(
            files={p.name: p.stat().st_size for p in sorted(checkpoint.iterdir())},
            writer_of=by_item,
            items_per_rank=dict(Counter(by_item.values())),
            bytes_per_rank={r: sum(n for k, n in lengths.items() if by_item[k] == r)
                            for r in sorted(set(by_item.values()))},
            state_keys=sorted(metadata.state_dict_metadata),
            tensor_keys=sorted(k for k, v in expected.items() if isinstance(v, torch.Tensor)),
        )
    report["lone save"] = lone_rank_save(rank, directory / "lone")
    return report


def lone_rank_save(rank: int, directory: Path) -> dict:
    """Rank 0 calls ``dcp.save`` while the others do not: it waits for them in its first
    collective and fails when the group's timeout (LONE_SAVE_TIMEOUT_S) expires. The others
    meanwhile wait at a barrier of the patient default group. Returns rank 0's error."""
    group = short_timeout_group(LONE_SAVE_TIMEOUT_S, "gloo")
    result = {"error": None, "metadata written": None}
    if rank == 0:
        try:
            dcp.save({"x": torch.zeros(3)}, checkpoint_id=str(directory), process_group=group)
        except Exception as error:  # noqa: BLE001  (whatever it raises is the finding)
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        result["metadata written"] = (directory / ".metadata").exists()
    dist.barrier(group=cpu_group())
    return result


def load_mode(rank: int, world_size: int, directory: str) -> dict:
    """Load the checkpoint at this world size into a model built from another seed; compare
    with what was saved; rank 0 converts to one torch.save file and back, every rank reloads."""
    directory = Path(directory)
    expected = torch.load(directory / "expected.pt", weights_only=False)
    ddp, optimizer = build(seed=1)
    train(ddp, optimizer, rank, steps=1)  # different weights and optimizer state to overwrite
    before = differences(expected, snapshot(ddp, optimizer))
    load_into(ddp, optimizer, directory / "dcp")
    report = {"rank": rank, "world_size": world_size, "differed before loading": before,
              "differences after loading": differences(expected, snapshot(ddp, optimizer))}
    if rank == 0:
        report["conversion"] = convert(directory, expected)
    dist.barrier(group=cpu_group())
    ddp, optimizer = build(seed=2)
    load_into(ddp, optimizer, directory / f"back_to_dcp_{world_size}")
    report["differences after the round trip"] = differences(expected, snapshot(ddp, optimizer))
    return report


def load_into(ddp: DDP, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """``dcp.load`` fills the tensors of a state dict of the right structure in place (every rank
    reads what it needs from whichever files hold it); ``set_state_dict`` puts it in the model and
    the optimizer."""
    state = checkpoint_state(ddp, optimizer)
    dcp.load(state, checkpoint_id=str(checkpoint), process_group=cpu_group())
    set_state_dict(ddp, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def convert(directory: Path, expected: dict) -> dict:
    """DCP directory -> one torch.save file -> DCP directory, in this process alone."""
    single_file = directory / f"single_{dist.get_world_size()}.pt"
    dcp_to_torch_save(directory / "dcp", single_file)
    whole = torch.load(single_file, weights_only=False)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # not wrapped
    plain.load_state_dict(whole["model"], strict=True)
    plain_state = {f"model.{k}": v for k, v in plain.state_dict().items()}
    torch_save_to_dcp(single_file, directory / f"back_to_dcp_{dist.get_world_size()}")
    return {"top-level keys": sorted(whole), "optim keys": sorted(whole["optim"]),
            "plain model differences": differences(
                {k: v for k, v in expected.items() if k.startswith("model.")}, plain_state)}


def problems(report: dict, mode: str) -> list[str]:
    """What one rank's report (rank 0's for the save mode) contradicts in the lesson."""
    found = []

    def expect(condition: bool, claim: str) -> None:
        if not condition:
            found.append(claim)

    if mode == "save":
        world_size = report["world_size"]
        files = report["files"]
        expect(sorted(files) == [".metadata"] + [f"__{r}_0.distcp" for r in range(world_size)],
               "one .metadata and one __R_0.distcp per rank should be written")
        expect(all(n > 0 for n in files.values()), "every file should hold something")
        written = report["writer_of"]
        expect(sorted(written) == report["state_keys"],
               "every item of the checkpoint should be written, once")
        expect(set(report["tensor_keys"]) <= set(written),
               "every tensor of model and optimizer should be saved")
        expect(sorted(report["items_per_rank"]) == list(range(world_size)),
               "every rank should write part of the replicated state, not rank 0 alone")
        expect(sum(report["bytes_per_rank"].values())
               <= sum(n for name, n in files.items() if name != ".metadata"),
               "the items' lengths should add up within the data files")
        calls = report["dcp.save collectives"]
        expect(calls.get("gather_object", 0) >= 1 and calls.get("broadcast_object_list", 0) >= 1,
               "dcp.save should call collectives (gather_object, broadcast_object_list)")
        expect(report["torch.save collectives"] == {}, "torch.save should call no collective")
        lone = report["lone save"]
        expect(lone["error"] is not None, "dcp.save called by rank 0 alone should fail")
        expect(lone["metadata written"] is False, "a failed dcp.save should leave no .metadata")
    else:
        expect(report["differed before loading"] != [],
               "the model to load into should start different (else the test proves nothing)")
        expect(report["differences after loading"] == [],
               f"loaded at world size {report['world_size']}, every tensor and hyper-parameter "
               "should equal what was saved, exactly")
        expect(report["differences after the round trip"] == [],
               "DCP -> torch.save -> DCP should load back exactly")
        conversion = report.get("conversion")
        if conversion is not None:
            expect(conversion["top-level keys"] == ["model", "optim"]
                   and conversion["optim keys"] == ["param_groups", "state"],
                   "the torch.save file should hold the same nested dict that was saved")
            expect(conversion["plain model differences"] == [],
                   "the file's model part should load, strictly, into an unwrapped model")
    return found


def print_report(report: dict, mode: str) -> None:
    if mode == "save":
        print(f"saved at world size {report['world_size']}; files:", report["files"])
        print("items written per rank:", report["items_per_rank"],
              "bytes per rank:", report["bytes_per_rank"])
        for name, rank in sorted(report["writer_of"].items()):
            print(f"  {name:<45} written by rank {rank}")
        print("collectives called by dcp.save:", report["dcp.save collectives"],
              "| by torch.save:", report["torch.save collectives"])
        print("dcp.save on rank 0 alone:", report["lone save"])
    else:
        print(f"loaded at world size {report['world_size']}: differed before loading in "
              f"{len(report['differed before loading'])} entries; differences after loading: "
              f"{report['differences after loading']}; after DCP -> torch.save -> DCP: "
              f"{report['differences after the round trip']}")
        if "conversion" in report:
            print("dcp_to_torch_save file:", report["conversion"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("save", "load"), required=True)
    parser.add_argument("--dir", required=True, help="where the checkpoint goes (save) or is")
    args = parser.parse_args()
    with process_group() as ctx:
        if args.mode == "save":
            if ctx.world_size < 2:
                ctx.print0("save with 2 or more ranks: the point is several writers")
                return 1
            if ctx.is_main:
                os.makedirs(args.dir, exist_ok=True)
            dist.barrier(group=cpu_group())
            report = save_mode(ctx.rank, ctx.world_size, args.dir)
        else:
            report = load_mode(ctx.rank, ctx.world_size, args.dir)
        found = problems(report, args.mode) if (ctx.is_main or args.mode == "load") else []
        if ctx.is_main:
            print_report(report, args.mode)
        return report_checks_of_every_rank(found, group=cpu_group())


if __name__ == "__main__":
    sys.exit(main())
