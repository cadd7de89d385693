"""What to save and how to load it: ``model.module.state_dict()``, ``map_location``, load order.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/state_dict_keys.py

What each function shows (each runs in every rank of a process group, e.g. through
``run_ranks``, and returns plain data; :func:`problems` lists what contradicts the lesson):

* :func:`prefixes`: ``ddp.state_dict()`` names every entry ``module.<name>`` (DDP holds the model
  as its attribute ``module``); ``ddp.module.state_dict()`` has the model's own names. A
  ``torch.compile``'d model does the same with ``_orig_mod.`` (``OptimizedModule`` holds the model
  as ``_orig_mod``; no compilation happens until the first call, so reading its keys is free), and
  DDP around it gives ``module._orig_mod.``. A plain model refuses prefixed keys with
  ``strict=True``; with ``strict=False`` it loads *nothing*, silently. Old files are fixed in place
  by ``consume_prefix_in_state_dict_if_present`` (torch/nn/modules/utils.py). Saved from
  ``ddp.module``, the file loads into a plain single-device model with ``strict=True``, which
  then computes what the DDP model computes.
* :func:`map_locations`: a file records the device of every tensor as a location tag
  (``location_tag`` in torch/serialization.py), and ``torch.load`` without ``map_location``
  puts each tensor back on that device. The tag is what a ``map_location`` function receives.
  To show a file written on a GPU on this CPU machine, the demo tags CPU tensors ``cuda:0`` at
  save time with the public ``torch.serialization.register_package`` (a tagger that outranks the
  CPU one): loading it without ``map_location`` then fails on a machine without CUDA, and
  ``map_location="cpu"`` or a function loads it. :func:`gpu_map_locations` runs the real thing
  when every rank has a GPU: without ``map_location`` every rank restores rank 0's tensor onto
  ``cuda:0`` (and so opens a CUDA context and allocates memory on GPU 0), with
  ``map_location=f"cuda:{local_rank}"`` each rank onto its own.
* :func:`load_order`: only rank 0 loads the checkpoint into its model *before* wrapping; the DDP
  constructor broadcasts rank 0's parameters (``_sync_module_states``), so every rank starts from
  the checkpoint. The optimizer is not part of the broadcast: if only rank 0 loads Adam's state,
  rank 1's is empty, and although the all-reduced gradients are identical, the next step moves the
  ranks' weights apart (Adam's first step from empty moments is ``lr * sign(grad)``-sized, not the
  resumed one). When every rank loads the optimizer state, the ranks stay bit-identical.

Rank 0 prints the results; the script exits 1 if any check fails. The GPU part prints a
"skipped" line unless every rank has its own GPU; the rest runs on the CPU everywhere (in a gloo
group beside the NCCL one on GPU machines).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.dist_env import cpu_group, process_group
from ddpcourse.report import report_checks

LEARNING_RATE = 0.01


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def batch(rank: int, step: int) -> torch.Tensor:
    """Each rank's own batch (different per rank and step, the same in every run)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 4, generator=generator)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"


def shared_directory(rank: int) -> str:
    """A fresh directory every rank sees: rank 0 makes it and broadcasts its name."""
    name = [tempfile.mkdtemp(prefix="state_dict_keys_") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0, group=cpu_group())
    return name[0]


def largest_difference_from_rank0(model: nn.Module) -> float:
    """The largest absolute difference between this model's weights on any rank and rank 0's
    (0.0 exactly when every rank holds the same bits)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat, group=cpu_group())
    return max((g - gathered[0]).abs().max().item() for g in gathered)


# --- prefixes --------------------------------------------------------------------------------

def prefixes(rank: int, world_size: int) -> dict:
    """The keys each way of saving gives, what a plain model does with them, and the fixes."""
    model = make_model(seed=0)
    ddp = DDP(model, process_group=cpu_group())
    compiled = torch.compile(make_model(seed=0))
    ddp_of_compiled = DDP(compiled, process_group=cpu_group())
    keys = {"ddp.state_dict()": list(ddp.state_dict()),
            "ddp.module.state_dict()": list(ddp.module.state_dict()),
            "torch.compile(model).state_dict()": list(compiled.state_dict()),
            "DDP(torch.compile(model)).state_dict()": list(ddp_of_compiled.state_dict())}
    try:
        make_model(seed=1).load_state_dict(ddp.state_dict())
        strict_error = None
    except RuntimeError as error:
        strict_error = " ".join(str(error).split())
    lenient = make_model(seed=1).load_state_dict(ddp.state_dict(), strict=False)
    fixed = {}
    for name, prefix in (("ddp.state_dict()", "module."),
                         ("DDP(torch.compile(model)).state_dict()", "module._orig_mod.")):
        old = dict((ddp if prefix == "module." else ddp_of_compiled).state_dict())
        consume_prefix_in_state_dict_if_present(old, prefix)
        fixed[name] = list(old)
    renamed = dict(ddp.state_dict())
    consume_prefix_in_state_dict_if_present(renamed, "module.")
    plain_entries = ddp.module.state_dict()
    only_renamed = (list(renamed) == list(plain_entries)
                    and all(torch.equal(renamed[k], plain_entries[k]) for k in plain_entries))
    directory = shared_directory(rank)
    path = Path(directory) / "model.pt"
    if rank == 0:
        torch.save(ddp.module.state_dict(), path)
    dist.barrier(group=cpu_group())
    plain = make_model(seed=1)
    plain.load_state_dict(torch.load(path, weights_only=True), strict=True)
    x = batch(rank, step=0)
    same_output = torch.equal(plain(x), ddp.module(x))
    dist.barrier(group=cpu_group())
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return {"keys": keys, "strict=True on prefixed keys": strict_error,
            "strict=False on prefixed keys: missing": lenient.missing_keys,
            "after consume_prefix_in_state_dict_if_present": fixed,
            "plain model, strict=True, same output": same_output,
            "ddp.state_dict() is ddp.module.state_dict() renamed, nothing more": only_renamed}


# --- map_location ----------------------------------------------------------------------------

@contextmanager
def tagged_as(location: str) -> Iterator[None]:
    """While active, ``torch.save`` records every CPU tensor's device as ``location``."""
    def tagger(storage):
        return location if storage.device.type == "cpu" else None

    def no_deserializer(obj, location):
        return None  # loading is left to torch's own deserializers

    registry = torch.serialization._package_registry  # no public way to unregister
    before = list(registry)
    torch.serialization.register_package(-1, tagger, no_deserializer)  # before "cpu" (10)
    try:
        yield
    finally:
        registry[:] = before


def map_locations(rank: int, world_size: int) -> dict:
    """A CPU file and a file tagged ``cuda:0``, loaded with and without ``map_location``. Returns
    the tags a ``map_location`` function receives, and the device or error of each load."""
    tensor = torch.arange(4.0)
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for name, tag in (("saved from the CPU", None), ("saved from cuda:0", "cuda:0")):
            path = Path(directory) / "t.pt"
            if tag is None:
                torch.save({"t": tensor}, path)
            else:
                with tagged_as(tag):
                    torch.save({"t": tensor}, path)
            seen = []

            def remember(storage, location):
                seen.append(location)
                return storage  # keep it on the CPU

            outcome = {}
            for how, map_location in (("no map_location", None), ('map_location="cpu"', "cpu"),
                                      ("map_location=function", remember)):
                try:
                    loaded = torch.load(path, map_location=map_location, weights_only=True)["t"]
                    outcome[how] = str(loaded.device)
                except (RuntimeError, AssertionError) as error:
                    outcome[how] = first_line(error)
            outcome["tags the function received"] = seen
            results[name] = outcome
    return results


def gpu_map_locations(rank: int, world_size: int) -> dict:
    """With one GPU per rank: rank 0 saves a tensor from ``cuda:0``; every rank loads it without
    and with ``map_location``. Returns the devices, and the bytes each rank allocated on GPU 0."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
        return {"skipped": f"needs one CUDA GPU per rank ({local_world}), found "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"}
    own = torch.device("cuda", local_rank)
    torch.cuda.set_device(own)
    directory = shared_directory(rank)
    path = Path(directory) / "gpu.pt"
    if rank == 0:
        torch.save({"t": torch.ones(1024, 1024, device="cuda:0")}, path)
    dist.barrier(group=cpu_group())
    before = torch.cuda.memory_allocated(0)
    loaded = torch.load(path, weights_only=True)["t"]
    without = {"device": str(loaded.device),
               "bytes this rank allocated on GPU 0": torch.cuda.memory_allocated(0) - before}
    del loaded
    loaded = torch.load(path, map_location=f"cuda:{local_rank}", weights_only=True)["t"]
    with_map = {"device": str(loaded.device)}
    dist.barrier(group=cpu_group())
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return {"skipped": None, "own device": str(own), "no map_location": without,
            'map_location=f"cuda:{local_rank}"': with_map}


# --- load before wrapping; the optimizer on every rank ---------------------------------------

def train_steps(ddp: DDP, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        ddp(batch(rank, step)).pow(2).mean().backward()
        optimizer.step()


def load_order(rank: int, world_size: int, steps_before: int = 3, steps_after: int = 2) -> dict:
    """Train ``steps_before`` steps and save (rank 0); then resume from the file twice: with
    only rank 0 loading model and optimizer, and with every rank loading the optimizer. Every
    rank starts from a differently seeded model, so only a broadcast can make them agree."""
    directory = shared_directory(rank)
    path = Path(directory) / "checkpoint.pt"
    ddp = DDP(make_model(seed=0), process_group=cpu_group())
    optimizer = torch.optim.Adam(ddp.parameters(), lr=LEARNING_RATE)
    train_steps(ddp, optimizer, rank, range(steps_before))
    if rank == 0:
        torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict()}, path)
    dist.barrier(group=cpu_group())
    saved_weights = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])

    results = {}
    for who_loads_optimizer in ("rank 0", "every rank"):
        model = make_model(seed=10 + rank)  # every rank differs before wrapping
        checkpoint = torch.load(path, weights_only=True)
        if rank == 0:
            model.load_state_dict(checkpoint["model"])
        resumed = DDP(model, process_group=cpu_group())
        after_wrapping = torch.cat([p.detach().reshape(-1) for p in resumed.module.parameters()])
        optimizer = torch.optim.Adam(resumed.parameters(), lr=LEARNING_RATE)
        if rank == 0 or who_loads_optimizer == "every rank":
            optimizer.load_state_dict(checkpoint["optimizer"])
        adam_steps = [int(s["step"]) for s in optimizer.state.values()]
        adam_entries = len(optimizer.state)
        train_steps(resumed, optimizer, rank, range(steps_before, steps_before + steps_after))
        results[f"{who_loads_optimizer} loads the optimizer"] = {
            "holds the checkpoint's weights after wrapping": torch.equal(after_wrapping,
                                                                         saved_weights),
            "Adam state entries after loading": adam_entries,
            "Adam step counts after loading": adam_steps,
            "largest weight difference from rank 0 after more steps":
                largest_difference_from_rank0(resumed.module),
        }
    dist.barrier(group=cpu_group())
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return results


# --- everything, and the check ---------------------------------------------------------------

def run_all(rank: int, world_size: int) -> dict:
    """Every demo in this rank, keyed by name (what :func:`problems` reads)."""
    return {"prefixes": prefixes(rank, world_size),
            "map_location": map_locations(rank, world_size),
            "gpu map_location": gpu_map_locations(rank, world_size),
            "load order": load_order(rank, world_size)}


def problems(results: list[dict]) -> list[str]:
    """What in the ranks' results contradicts the docstring (empty: all shown)."""
    found = []

    def expect(condition: bool, claim: str) -> None:
        if not condition:
            found.append(claim)

    r0 = results[0]
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    keys = r0["prefixes"]["keys"]
    expect(keys["ddp.state_dict()"] == [f"module.{n}" for n in names],
           "DDP's state_dict keys should carry module.")
    expect(keys["ddp.module.state_dict()"] == names, "ddp.module's keys should be the model's")
    expect(keys["torch.compile(model).state_dict()"] == [f"_orig_mod.{n}" for n in names],
           "torch.compile's keys should carry _orig_mod.")
    expect(keys["DDP(torch.compile(model)).state_dict()"] == [f"module._orig_mod.{n}"
                                                              for n in names],
           "DDP around a compiled model should give module._orig_mod.")
    p = r0["prefixes"]
    expect("Unexpected key(s)" in str(p["strict=True on prefixed keys"]),
           "strict=True should refuse prefixed keys")
    expect(p["strict=False on prefixed keys: missing"] == names,
           "strict=False should load nothing from prefixed keys")
    expect(all(v == names for v in p["after consume_prefix_in_state_dict_if_present"].values()),
           "consume_prefix_in_state_dict_if_present should restore the model's names")
    expect(p["ddp.state_dict() is ddp.module.state_dict() renamed, nothing more"],
           "DDP's state_dict should hold the module's tensors under module., nothing else")
    for rank, r in enumerate(results):
        expect(r["prefixes"]["plain model, strict=True, same output"],
               f"rank {rank}: the plain model should compute what ddp.module computes")
    cpu_file = r0["map_location"]["saved from the CPU"]
    expect(cpu_file["no map_location"] == "cpu" and cpu_file["tags the function received"]
           == ["cpu"], "a CPU file should load onto the CPU, its tag 'cpu'")
    gpu_file = r0["map_location"]["saved from cuda:0"]
    expect(gpu_file["tags the function received"] == ["cuda:0"],
           "a map_location function should receive the tag cuda:0")
    expect(gpu_file['map_location="cpu"'] == "cpu" and gpu_file["map_location=function"] == "cpu",
           "map_location should bring a cuda:0 file onto the CPU")
    if not torch.cuda.is_available():
        expect("CUDA" in gpu_file["no map_location"],
               "without CUDA, a cuda:0 file should fail to load without map_location")
    else:
        expect(gpu_file["no map_location"] == "cuda:0",
               "without map_location, a cuda:0 file should load onto cuda:0")
    for rank, r in enumerate(results):
        gpu = r["gpu map_location"]
        if gpu["skipped"]:
            continue
        expect(gpu["no map_location"]["device"] == "cuda:0",
               f"rank {rank}: without map_location the tensor should land on cuda:0")
        expect(gpu['map_location=f"cuda:{local_rank}"']["device"] == gpu["own device"],
               f"rank {rank}: map_location should put the tensor on the rank's own GPU")
        if rank > 0:
            expect(gpu["no map_location"]["bytes this rank allocated on GPU 0"] > 0,
                   f"rank {rank}: without map_location it should allocate on GPU 0")
    for rank, r in enumerate(results):
        only0 = r["load order"]["rank 0 loads the optimizer"]
        every = r["load order"]["every rank loads the optimizer"]
        for case in (only0, every):
            expect(case["holds the checkpoint's weights after wrapping"],
                   f"rank {rank}: after wrapping, every rank should hold rank 0's loaded weights")
        expect(every["Adam step counts after loading"] and
               set(every["Adam step counts after loading"]) == {3},
               f"rank {rank}: a loaded Adam state should be at step 3")
        drift = "largest weight difference from rank 0 after more steps"
        expect(every[drift] == 0.0,
               "with the optimizer loaded everywhere, the ranks should stay identical")
        expect(only0[drift] > 0.0,
               "with the optimizer loaded on rank 0 only, the ranks should drift apart")
        if rank > 0:
            expect(only0["Adam state entries after loading"] == 0
                   and only0["Adam step counts after loading"] == [],
                   f"rank {rank}: without loading, its Adam state should be empty")
    return found


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        mine = run_all(ctx.rank, ctx.world_size)
        results: list = [None] * ctx.world_size
        dist.all_gather_object(results, mine, group=cpu_group())
        if not ctx.is_main:
            return 0
        r0 = results[0]
        for name, keys in r0["prefixes"]["keys"].items():
            print(f"{name}: {keys}")
        for name in ("strict=True on prefixed keys", "strict=False on prefixed keys: missing",
                     "after consume_prefix_in_state_dict_if_present",
                     "ddp.state_dict() is ddp.module.state_dict() renamed, nothing more"):
            print(f"{name}: {r0['prefixes'][name]}")
        print("saved from ddp.module, loaded into a plain model (strict=True), same output:",
              [r["prefixes"]["plain model, strict=True, same output"] for r in results])
        for name, outcome in r0["map_location"].items():
            print(f"file {name}: {outcome}")
        for rank, r in enumerate(results):
            gpu = r["gpu map_location"]
            print(f"GPU map_location, rank {rank}:",
                  f"skipped: {gpu['skipped']}" if gpu["skipped"] else gpu)
        for rank, r in enumerate(results):
            for name, case in r["load order"].items():
                print(f"rank {rank}, {name}: {case}")
        found = problems(results)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
