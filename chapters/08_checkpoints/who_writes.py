"""Who writes the checkpoint: rank 0 alone, then a barrier. What goes wrong otherwise, every run.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/who_writes.py

``torch.save`` is a local file write: torch/serialization.py ``save`` -> ``_save`` pickles the
object and writes a zip archive through ``torch._C.PyTorchFileWriter``; nothing in it touches
``torch.distributed``. So the claim "all processes must take part in ``torch.save``" is wrong:
rank 0 saves, and the only call every rank makes is the ``dist.barrier()`` after it, which keeps
the others from reading (or moving on past) a checkpoint that is not written yet.

What each function shows (each runs in every rank of a process group, e.g. through
``run_ranks``, and returns plain data; the interleavings are forced with barriers and with
:class:`checkpoint_files.PausingWriter`, which stops a real ``torch.save`` at a chosen byte):

* :func:`rank0_writes`: while rank 0 runs ``torch.save``, no collective is called on any rank and
  no function of ``torch.distributed`` runs (a profiler hook counts them); each rank makes one
  collective in all, the barrier; after it, rank 1 loads exactly rank 0's state.
* :func:`every_rank_writes_atomically`: every rank saves *its own* state (here its RNG state,
  which differs per rank) to the same path, each through its own temporary file and
  ``os.replace``, in turns. Nothing fails and every read gives a complete file, but the file holds
  whoever renamed last, and a reader between the turns gets another rank's state.
* :func:`every_rank_writes_plainly`: two plain ``torch.save`` calls on one path, interleaved as
  two processes can interleave them (rank 0 has written half its bytes when rank 1 truncates the
  file and writes all of its own; rank 0 then writes its second half at its own offset). The torn
  file *loads without an error*, and holds half of one rank's tensor and half of the other's.
  ``torch.save`` writes a CRC-32 for every record, but PyTorch's build compiles its zip reader
  (miniz) with ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS`` (``add_definitions`` in the PyTorch
  repository's CMake files, cmake/Dependencies.cmake), so ``torch.load`` never compares them.
  When the two halves fit together (same shapes, same names, as on DDP replicas), nothing
  notices; Python's ``zipfile.ZipFile(path).testzip()``, which does check, names the torn record.
* :func:`reader_without_barrier`: rank 1 reads while rank 0's save of step 2 is half written,
  over a file that holds step 1. A plain ``torch.save`` has already truncated the path: the load
  fails, and step 1 is gone. An atomic save leaves step 1 in place: the load succeeds with the
  *old* step (a silent stale read). Before the first checkpoint exists the read fails with
  ``FileNotFoundError``. After the barrier, rank 1 reads step 2. The barrier is needed whatever
  the write method.

Rank 0 prints the results; the script exits 1 if any check fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling module, also when this
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # file is imported by its path
from checkpoint_files import (  # noqa: E402
    PausingWriter, replace_atomically, save_atomically, saved_size)

from ddpcourse.dist_env import process_group  # noqa: E402
from ddpcourse.report import report_checks

COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "irecv", "isend", "monitored_barrier", "recv", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send",
)


LOADED_RANK0 = "loaded equals rank 0's state"


def first_line(error: BaseException) -> str:
    """The error's type and first sentence."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text.split('. ')[0]}"


def replica_state(step: int) -> dict:
    """What every rank holds alike: a model's weights (same seed on every rank, as after DDP's
    broadcast) and the step."""
    generator = torch.Generator().manual_seed(step)
    return {"step": step, "weight": torch.randn(16, 8, generator=generator),
            "bias": torch.randn(16, generator=generator)}


def rank_own_state(rank: int) -> dict:
    """What differs per rank: its RNG state (each rank draws its own dropout masks, augments)."""
    torch.manual_seed(1000 + rank)
    return {"written by rank": rank, "rng_state": torch.get_rng_state()}


def shared_directory(rank: int, parent: str | None = None) -> str:
    """A fresh directory every rank sees: rank 0 makes it and broadcasts its name."""
    name = [tempfile.mkdtemp(prefix="who_writes_", dir=parent) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


class CollectiveCounter:
    """Counts calls of ``torch.distributed``'s collectives and point-to-point functions (the
    public names, in both ``torch.distributed`` and ``distributed_c10d``) while active."""

    def __init__(self):
        self.calls: list[str] = []
        self._originals: list[tuple[Any, str, Callable]] = []

    def __enter__(self) -> "CollectiveCounter":
        modules = (dist, dist.distributed_c10d)
        for module in modules:
            for name in COLLECTIVES:
                original = getattr(module, name, None)
                if original is None:
                    continue
                self._originals.append((module, name, original))
                setattr(module, name, self._counting(name, original))
        return self

    def _counting(self, name: str, original: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)
        return counted

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)


def calls_during(action: Callable[[], Any]) -> dict:
    """Run ``action`` under a profiler hook: how many Python functions ran in all, how many of
    them were ``torch.distributed`` code, and how many C functions of its bindings were called."""
    counts = {"python functions": 0, "in torch/distributed": 0, "distributed C bindings": 0}
    marker = os.sep.join(("torch", "distributed", ""))

    def profile(frame, event, arg):
        if event == "call":
            counts["python functions"] += 1
            if marker in frame.f_code.co_filename:
                counts["in torch/distributed"] += 1
        elif event == "c_call" and str(getattr(arg, "__module__", "")).startswith(
                "torch._C._distributed"):
            counts["distributed C bindings"] += 1

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return counts


# --- rank 0 writes, then a barrier ----------------------------------------------------------

def rank0_writes(rank: int, world_size: int, directory: str) -> dict:
    """Rank 0 saves; everyone meets at a barrier; then every rank loads the file. Returns the
    collectives each rank called during the save and in all, what ran during ``torch.save``, and
    whether the loaded state equals rank 0's."""
    path = Path(directory) / "rank0.pt"
    state = replica_state(step=3)
    during_save: dict = {}
    with CollectiveCounter() as counter:
        if rank == 0:
            during_save = calls_during(lambda: torch.save(state, path))
        collectives_during_save = list(counter.calls)
        dist.barrier()
    loaded = torch.load(path, weights_only=True)
    same = loaded.keys() == state.keys() and all(
        torch.equal(loaded[k], state[k]) if torch.is_tensor(state[k]) else loaded[k] == state[k]
        for k in state)
    return {"called torch.save": rank == 0, "collectives during the save": collectives_during_save,
            "collectives in all": counter.calls, "inside torch.save": during_save,
            LOADED_RANK0: same}


# --- every rank writes the same file ---------------------------------------------------------

def every_rank_writes_atomically(rank: int, world_size: int, directory: str) -> dict:
    """Ranks save their own state to one path in turns (rank 0 first), each atomically. After
    every turn, every rank reads the file. Returns who wrote what each read saw."""
    path = Path(directory) / "everyone_atomic.pt"
    seen = []
    for turn in range(world_size):
        if rank == turn:
            save_atomically(rank_own_state(rank), path)
        dist.barrier()
        seen.append(torch.load(path, weights_only=True)["written by rank"])
        dist.barrier()  # nobody writes the next turn while a rank still reads
    final = torch.load(path, weights_only=True)
    mine = rank_own_state(rank)["rng_state"]
    return {"writer seen after each turn": seen,
            "file holds my own RNG state": torch.equal(final["rng_state"], mine),
            "leftover files": sorted(p.name for p in Path(directory).iterdir()
                                     if p.name.startswith(".everyone"))}


def every_rank_writes_plainly(rank: int, world_size: int, directory: str) -> dict:
    """Ranks 0 and 1 ``torch.save`` tensors of the same shapes (as DDP replicas have) but their
    own values (rank r writes r + 1) to one path, forced into this order: rank 0 opens the file
    and writes half its bytes; rank 1 opens it (truncating it) and saves completely; rank 0 writes
    the rest at its own offset. Then every rank loads the file. Returns what the load gave: per
    tensor, how many of its elements hold each value.

    Both ranks save into ``open(path, "wb")``: the bytes are those of ``torch.save(state, path)``
    except for the name of the archive's top folder, which ``torch.save`` takes from the file
    name when given a path and sets to ``archive`` when given a file object. Both writers must
    use the same form for the two halves to fit together, as they do when every rank runs the
    same line of code."""
    path = Path(directory) / "everyone_plain.pt"
    value = float(rank + 1)
    state = {"weight": torch.full((256,), value), "bias": torch.full((4,), value)}
    half = saved_size(state) // 2

    def let_rank1_write():
        dist.barrier()  # 1: rank 0 is half way; rank 1 saves now
        dist.barrier()  # 2: rank 1 is done

    if rank == 0:
        with open(path, "wb") as file:  # what torch.save(state, path) does first
            torch.save(state, PausingWriter(file, half, let_rank1_write))
    elif rank == 1:
        dist.barrier()  # 1
        with open(path, "wb") as file:
            torch.save(state, file)
        dist.barrier()  # 2
    else:
        dist.barrier()
        dist.barrier()
    dist.barrier()  # 3: rank 0 has finished
    with zipfile.ZipFile(path) as archive:
        bad_record = archive.testzip()  # the first record whose CRC-32 does not match
    bad_record = bad_record.split("/", 1)[-1] if bad_record else None
    try:
        loaded = torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - which error a torn file gives is the point
        return {"bytes": path.stat().st_size, "load error": first_line(error), "values": None,
                "CRC-32 mismatch (zipfile)": bad_record}
    return {"bytes": path.stat().st_size, "load error": None,
            "CRC-32 mismatch (zipfile)": bad_record,
            "values": {name: {value: int((t == value).sum()) for value in sorted(set(t.tolist()))}
                       for name, t in loaded.items()}}


# --- a rank reads before rank 0 has finished -------------------------------------------------

def read_outcome(path: Path) -> str | int:
    """The step a load of ``path`` gives, or the error it raises."""
    try:
        return torch.load(path, weights_only=True)["step"]
    except Exception as error:  # noqa: BLE001 - the error is the result
        return first_line(error)


def reader_without_barrier(rank: int, world_size: int, directory: str) -> dict:
    """Rank 0 saves step 2 over step 1 (``"plain"``: ``torch.save`` to the path; ``"atomic"``:
    :func:`save_atomically`), and also saves a first checkpoint where there was none; rank 1 reads
    when half of the new file is written, as if it had not waited at the barrier. Returns what
    rank 1 read half way, and after the barrier."""
    results = {}
    cases = {"plain, over step 1": ("plain", True), "atomic, over step 1": ("atomic", True),
             "atomic, first checkpoint": ("atomic", False)}
    for name, (method, previous) in cases.items():
        path = Path(directory) / f"{method}_{'over' if previous else 'first'}.pt"
        if rank == 0 and previous:
            save_atomically(replica_state(step=1), path)
        dist.barrier()
        half_way = None

        def let_the_others_read():
            dist.barrier()  # 1: half written; the others read now
            dist.barrier()  # 2: they have read

        if rank == 0:
            state = replica_state(step=2)

            def save_pausing_half_way(file) -> None:
                torch.save(state, PausingWriter(file, saved_size(state) // 2,
                                                let_the_others_read))

            if method == "plain":
                with open(path, "wb") as file:  # what torch.save(state, path) does first
                    save_pausing_half_way(file)
            else:
                replace_atomically(path, save_pausing_half_way)
        else:
            dist.barrier()  # 1
            half_way = read_outcome(path)
            dist.barrier()  # 2
        dist.barrier()  # the barrier a correct program has after the save
        results[name] = {"read half way": half_way, "read after the barrier": read_outcome(path)}
    return results


# --- everything, and the check ---------------------------------------------------------------

def run_all(rank: int, world_size: int, parent: str | None = None) -> dict:
    """Every demo in this rank, in a fresh shared directory (removed at the end)."""
    directory = shared_directory(rank, parent)
    try:
        return {
            "rank 0 writes": rank0_writes(rank, world_size, directory),
            "every rank writes atomically": every_rank_writes_atomically(rank, world_size,
                                                                         directory),
            "every rank writes plainly": every_rank_writes_plainly(rank, world_size, directory),
            "reader without barrier": reader_without_barrier(rank, world_size, directory),
        }
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


def problems(results: list[dict]) -> list[str]:
    """What in the ranks' results contradicts the docstring (empty: all shown)."""
    found = []

    def expect(condition: bool, claim: str) -> None:
        if not condition:
            found.append(claim)

    world_size = len(results)
    r0, r1 = results[0], results[1]
    save = r0["rank 0 writes"]
    expect(save["inside torch.save"].get("python functions", 0) > 0,
           "the profiler hook should have seen torch.save's Python functions")
    expect(save["inside torch.save"].get("in torch/distributed") == 0
           and save["inside torch.save"].get("distributed C bindings") == 0,
           "torch.save should run no torch.distributed code")
    for rank, r in enumerate(results):
        mine = r["rank 0 writes"]
        expect(mine["collectives during the save"] == [],
               f"rank {rank} should call no collective while rank 0 saves")
        expect(mine["collectives in all"] == ["barrier"],
               f"rank {rank}'s only collective should be the barrier, got "
               f"{mine['collectives in all']}")
        expect(mine["called torch.save"] == (rank == 0), "only rank 0 should call torch.save")
        expect(mine[LOADED_RANK0],
               f"rank {rank} should load rank 0's state after the barrier")
    for rank, r in enumerate(results):
        atomic = r["every rank writes atomically"]
        expect(atomic["writer seen after each turn"] == list(range(world_size)),
               f"rank {rank} should see the file change hands at every turn")
        expect(atomic["file holds my own RNG state"] == (rank == world_size - 1),
               "the file should end up holding the last writer's RNG state only")
        expect(atomic["leftover files"] == [], "atomic writes should leave no temporary files")
    torn = [r["every rank writes plainly"] for r in results]
    expect(all(t == torn[0] for t in torn), "every rank should load the same torn file")
    expect(torn[0]["load error"] is None and torn[0]["values"] is not None
           and sorted(torn[0]["values"]["weight"]) == [1.0, 2.0],
           "the torn file should load silently with a tensor half rank 0's, half rank 1's, got "
           f"{torn[0]}")
    expect(torn[0]["CRC-32 mismatch (zipfile)"] is not None,
           "zipfile's testzip should find a record whose CRC-32 does not match")
    reads = r1["reader without barrier"]
    plain = reads["plain, over step 1"]
    expect(isinstance(plain["read half way"], str)
           and "failed finding central directory" in plain["read half way"],
           f"a read of a half-written plain save should fail, got {plain['read half way']!r}")
    atomic = reads["atomic, over step 1"]
    expect(atomic["read half way"] == 1,
           "a read during an atomic save should get the previous step (stale, complete)")
    first = reads["atomic, first checkpoint"]
    expect(str(first["read half way"]).startswith("FileNotFoundError"),
           "a read before the first checkpoint is renamed into place should find no file")
    for name, outcome in reads.items():
        expect(outcome["read after the barrier"] == 2, f"{name}: after the barrier, step 2")
    return found


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        mine = run_all(ctx.rank, ctx.world_size)
        results: list = [None] * ctx.world_size
        dist.all_gather_object(results, mine)
        if not ctx.is_main:
            return 0
        for rank, r in enumerate(results):
            save = r["rank 0 writes"]
            print(f"rank {rank}: called torch.save: {save['called torch.save']}; collectives "
                  f"during the save: {save['collectives during the save']}; in all: "
                  f"{save['collectives in all']}; loaded rank 0's state: "
                  f"{save[LOADED_RANK0]}")
        print("inside rank 0's torch.save:", results[0]["rank 0 writes"]["inside torch.save"])
        for rank, r in enumerate(results):
            atomic = r["every rank writes atomically"]
            print(f"every rank writes atomically, rank {rank} reads writers "
                  f"{atomic['writer seen after each turn']}; the file holds my RNG state: "
                  f"{atomic['file holds my own RNG state']}")
        print("every rank writes plainly, interleaved:", results[0]["every rank writes plainly"])
        for name, outcome in results[1]["reader without barrier"].items():
            print(f"rank 1 reads, {name}: half way -> {outcome['read half way']!r}; after the "
                  f"barrier -> {outcome['read after the barrier']!r}")
        found = problems(results)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
