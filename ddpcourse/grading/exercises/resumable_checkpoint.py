"""Chapter 08, checkpoints: visible checks for ``save_checkpoint`` and ``load_checkpoint`` (the
exercise ``resumable_checkpoint``), and the cases the hidden checks reuse.

The contract is the docstrings of both functions in
solutions/08_checkpoints/resumable_checkpoint.nb.py (students:
exercises/08_checkpoints/resumable_checkpoint.ipynb). Every case gets the two functions together
(:func:`~ddpcourse.grading.checks.together`) and runs them in real ranks (gloo, CPU) that share
a fresh directory; the ranks train with the grader's own loop and only save and load with the
student's functions. Each case checks one property, with the grader's own code for the other
half, so that one mistake fails one test:

* ``SAVE`` (the student's save, read back by the grader): what the file holds (``model`` without
  DDP's ``module.`` prefix, ``optimizer``, ``step``, the extra keyword arguments) equals the live
  state; who wrote it: each rank passes an extra value that records, in the rank, whether it was
  serialised (only rank 0's may be), and an audit hook (:func:`sys.addaudithook`) records every
  file the call opened for writing or renamed in the directory (ranks other than 0: none; rank 0:
  the final path only ever as the target of one ``os.replace`` from the same directory). And
  when it returned: rank 0's extra value holds the serialisation until every other rank has
  returned or a second has passed, and each other rank reads the file as soon as its call
  returns, so a rank that does not wait for the write (no barrier) is caught every time, not by
  luck. Every save of every case is audited the same way (``judge_writes``), with or without
  extra keyword arguments, and the large hidden save runs as 2 machines of 2 ranks
  (:class:`as_launched_on_nodes`), where a writer chosen by ``LOCAL_RANK`` shows up.
* ``CRASH`` (one rank): a second save whose extra value raises while it is serialised, the way a
  crash or a full disk would interrupt it. The previous checkpoint must still be at ``path``,
  loadable and unchanged.
* ``LOAD`` (the grader's file, the student's load): every rank, whose model and optimizer
  started elsewhere, holds exactly the file's model and optimizer state and returns its step;
  one more step of the grader's loop keeps the replicas identical.
* ``RESUME`` (both): steps, save, more steps on one model; a fresh model and optimizer that load
  the file and run the same later steps end bit for bit equal (two ranks: gloo's sum of two
  values does not depend on DDP's bucket layout, which differs between the two models).

What a rank reports is data; the judge, which never runs the student's code, compares it with
the state the grader's own code saw and says what is wrong.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcourse.grading.checks import (Case, CheckFailed, cut_text, judge_each_rank, observed,
                                      run_student, safe_text, together)
from ddpcourse.launcher import call_scratch_dir

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
FILE_NAME = "checkpoint.pt"
WAIT_FOR_PEERS_S = 0.5  # rank 0's serialisation waits this long for a peer that returns early
FEATURES, HIDDEN, CLASSES, ROWS = 6, 10, 3, 4
_MAX_TEXT = 300


class Net(nn.Module):
    """A small classifier with a buffer (BatchNorm's running statistics belong in the file too)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.norm = nn.BatchNorm1d(HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def setting(seed: int = 0, optimizer: str = "adam", steps: int = 2, more: int = 2,
            step: int | None = None, previous: bool = False, nodes: int = 1) -> dict:
    """One situation: the optimizer, the grader's steps before the save (``steps``) and after it
    (``more``), the step number saved (``steps`` unless given), whether an older checkpoint
    is at the path already (``previous``: the save replaces it), and on how many machines the
    ranks run (``nodes``: the environment torchrun sets there, where ``LOCAL_RANK`` is not
    ``RANK``; see :func:`as_launched_on_nodes`)."""
    return {"seed": seed, "optimizer": optimizer, "steps": steps, "more": more,
            "step": steps if step is None else step, "previous": previous, "nodes": nodes}


class as_launched_on_nodes:
    """Within it, the rank's environment is what torchrun sets for rank ``rank`` of
    ``world_size`` ranks spread evenly over ``nodes`` machines (``torch/distributed/elastic/
    agent/server/local_elastic_agent.py``, ``_start_workers``): ``LOCAL_RANK`` and
    ``GROUP_RANK`` (the node) differ from ``RANK`` beyond the first machine. Restored after."""

    def __init__(self, rank: int, world_size: int, nodes: int):
        per_node = max(1, world_size // max(1, nodes))
        self.values = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": rank % per_node,
                       "LOCAL_WORLD_SIZE": per_node, "GROUP_RANK": rank // per_node,
                       "GROUP_WORLD_SIZE": nodes, "ROLE_RANK": rank,
                       "ROLE_WORLD_SIZE": world_size}
        self.saved: dict = {}

    def __enter__(self):
        for name, value in self.values.items():
            self.saved[name] = os.environ.get(name)
            os.environ[name] = str(value)
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_model(seed: int) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net()


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    raise ValueError(name)


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of optimizer step ``step``: the same for every run of a setting."""
    generator = torch.Generator().manual_seed(1_000_003 * seed + 1009 * step + rank)
    return (torch.randn(ROWS, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (ROWS,), generator=generator))


def train(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer, seed: int,
          steps: range, rank: int) -> None:
    """The grader's loop: one optimizer step per index of ``steps``, on that step's batch."""
    for step in steps:
        x, y = batch(seed, step, rank)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict as plain data (copies of its tensors)."""
    state = optimizer.state_dict()
    return {"state": {int(index): {name: value.clone() if isinstance(value, torch.Tensor)
                                   else value for name, value in entry.items()}
                      for index, entry in state["state"].items()},
            "param_groups": [dict(group) for group in state["param_groups"]]}


def shared_directory(rank: int) -> str:
    """A fresh directory that every rank of the case uses (rank 0 makes it, in the call's
    scratch folder: it goes when the call ends)."""
    made = [tempfile.mkdtemp(prefix="checkpoint-check-", dir=call_scratch_dir()) if rank == 0
            else None]
    dist.broadcast_object_list(made, src=0)
    return made[0]


# --- in the rank: who wrote what, and when --------------------------------------------------------

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_audit: dict | None = None  # while a call is audited: {"directory": ..., "writes": [...]}
_hook_installed = False


def _inside(path: Any, directory: str) -> str | None:
    """``path`` relative to ``directory`` when it lies there, else None."""
    if isinstance(path, int) or path is None:
        return None
    try:
        full = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None
    return os.path.relpath(full, directory) if full.startswith(directory + os.sep) else None


def _audit_hook(event: str, args: tuple) -> None:
    audit = _audit
    if audit is None:
        return
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                   else isinstance(flags, int) and bool(flags & _WRITE_FLAGS))
        name = _inside(path, audit["directory"])
        if writing and name is not None:
            audit["writes"].append(["open", name, ""])
            if audit.get("on_write") is not None:  # a fault injected while a file is written
                audit["on_write"](name)
    elif event == "os.rename":  # os.rename and os.replace (and shutil.move's rename)
        source, target = _inside(args[0], audit["directory"]), _inside(args[1], audit["directory"])
        if target is not None:
            audit["writes"].append(["replace", target,
                                    source if source is not None else str(args[0])])
    elif event in ("os.remove", "os.truncate", "os.link", "os.symlink"):
        name = _inside(args[1] if event in ("os.link", "os.symlink") else args[0],
                       audit["directory"])
        if name is not None:
            audit["writes"].append([event.removeprefix("os."), name, ""])


def _start_audit(directory: str) -> dict:
    global _audit, _hook_installed
    if not _hook_installed:  # an audit hook cannot be removed: it stays, idle, in this process
        sys.addaudithook(_audit_hook)
        _hook_installed = True
    _audit = {"directory": os.path.abspath(directory), "writes": []}
    return _audit


def _stop_audit() -> None:
    global _audit
    _audit = None


class SerialisedBy:
    """An extra value a rank passes to ``save_checkpoint``: it records, in this rank, each time it
    is pickled (a rank that pickles it is writing the checkpoint), and pickles as the rank's
    number. Rank 0's can hold its serialisation until the other ranks' calls have returned."""

    times = 0

    def __init__(self, rank: int, directory: str = "", world_size: int = 1,
                 hold: bool = False):
        self.rank, self.directory, self.world_size, self.hold = rank, directory, world_size, hold

    def __reduce__(self):
        SerialisedBy.times += 1
        if self.hold:
            _wait_for_peers(self.directory, self.world_size)
        return int, (self.rank,)


class SimulatedCrash(RuntimeError):
    """Raised while the checkpoint is being serialised: a crash, a full disk, a kill."""


class CrashWhileSaved:
    def __reduce__(self):
        raise SimulatedCrash("the grader's crash in the middle of the save")


def _returned_flag(directory: str, rank: int) -> str:
    return os.path.join(directory, f".returned-{rank}")


def _wait_for_peers(directory: str, world_size: int) -> None:
    deadline = time.monotonic() + WAIT_FOR_PEERS_S
    flags = [_returned_flag(directory, rank) for rank in range(1, world_size)]
    while time.monotonic() < deadline and not all(map(os.path.exists, flags)):
        time.sleep(0.01)


def _raised(exc: BaseException | None) -> dict | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": safe_text(lambda: exc, _MAX_TEXT)}


def read_checkpoint(path: str) -> dict:
    """What is at ``path``, as data: the file's contents, or why it cannot be read."""
    if not os.path.exists(path):
        return {"exists": False}
    try:
        with torch.serialization.safe_globals([int]):  # how a SerialisedBy pickles
            content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the finding
        return {"exists": True, "loads": False, "error": safe_text(lambda: exc, _MAX_TEXT)}
    if not isinstance(content, dict):
        return {"exists": True, "loads": True, "content": None, "kind": type(content).__name__}
    return {"exists": True, "loads": True, "content": content, "kind": "dict"}


# --- the cases: observe in the rank ------------------------------------------------------------


def observe_save(rank, world_size, functions, s):
    """The grader's steps, the student's save (audited), each rank's look at the file as soon as
    its call returns, then everyone's look once all have returned."""
    save_checkpoint, _ = functions
    directory = shared_directory(rank)
    path = os.path.join(directory, FILE_NAME)
    ddp_model = DistributedDataParallel(make_model(s["seed"] + 17 * rank))
    optimizer = make_optimizer(s["optimizer"], ddp_model)
    train(ddp_model, optimizer, s["seed"], range(s["steps"]), rank)
    if s.get("previous") and rank == 0:
        write_reference_checkpoint(path, {**s, "step": -1})
    dist.barrier()
    SerialisedBy.times = 0
    mark = SerialisedBy(rank, directory, world_size, hold=rank == 0)
    audit = _start_audit(directory)
    raised = None
    try:
        with as_launched_on_nodes(rank, world_size, s.get("nodes", 1)):
            save_checkpoint(path, ddp_model, optimizer, s["step"], written_by=mark,
                            note=f"s{s['seed']}")
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        raised = exc
    finally:
        _stop_audit()
    on_return = read_checkpoint(path)
    content = on_return.pop("content", None)
    on_return["step"] = content.get("step") if isinstance(content, dict) else None
    if rank != 0:
        open(_returned_flag(directory, rank), "w").close()
    dist.barrier()
    return {"raised": _raised(raised), "serialised": SerialisedBy.times,
            "writes": audit["writes"], "on_return": on_return,
            "file": read_checkpoint(path) if rank == 0 else None,
            "model": model_state(ddp_model.module), "optimizer": optimizer_state(optimizer)}


def observe_crash(rank, world_size, functions, s):
    """One rank: a complete save, then a save that crashes while it is serialised."""
    save_checkpoint, _ = functions
    directory = shared_directory(rank)
    path = os.path.join(directory, FILE_NAME)
    ddp_model = DistributedDataParallel(make_model(s["seed"]))
    optimizer = make_optimizer(s["optimizer"], ddp_model)
    train(ddp_model, optimizer, s["seed"], range(s["steps"]), rank)
    first = second = None
    audit = _start_audit(directory)
    try:
        save_checkpoint(path, ddp_model, optimizer, s["step"])
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        first = exc
    finally:
        _stop_audit()
    before = read_checkpoint(path)
    train(ddp_model, optimizer, s["seed"], range(s["steps"], s["steps"] + 1), rank)
    try:
        save_checkpoint(path, ddp_model, optimizer, s["step"] + 1, crash=CrashWhileSaved())
    except Exception as exc:  # noqa: BLE001 - the crash is expected to come through
        second = exc
    return {"first_raised": _raised(first), "second_raised": _raised(second),
            "before": before, "after": read_checkpoint(path), "writes": audit["writes"]}


def write_reference_checkpoint(path: str, s: dict) -> None:
    """The grader's own checkpoint in the contract's format: one process, ``s["steps"]`` steps on
    rank 0's batches. Written with a plain torch.save, while the other ranks wait at a barrier
    (nothing reads it before): how a save is made atomic is the exercise's answer, which this
    module (importable in the ranks) does not show."""
    model = make_model(s["seed"] + 5)
    optimizer = make_optimizer(s["optimizer"], model)
    for step in range(s["steps"]):
        x, y = batch(s["seed"], step, 0)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "step": s["step"], "note": "the grader's"}, path)


def observe_load(rank, world_size, functions, s):
    """The grader's file; models and optimizers that start elsewhere (rank-seeded, a step of
    their own); the student's load; then one more step of the grader's loop."""
    _, load_checkpoint = functions
    directory = shared_directory(rank)
    path = os.path.join(directory, FILE_NAME)
    if rank == 0:
        write_reference_checkpoint(path, s)
    dist.barrier()
    ddp_model = DistributedDataParallel(make_model(s["seed"] + 31 * (rank + 1)))
    optimizer = make_optimizer(s["optimizer"], ddp_model)
    train(ddp_model, optimizer, s["seed"] + 99, range(1), rank)
    raised = returned = None
    try:
        returned = load_checkpoint(path, ddp_model, optimizer)
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        raised = exc
    loaded = {"model": model_state(ddp_model.module), "optimizer": optimizer_state(optimizer)}
    if raised is None:
        train(ddp_model, optimizer, s["seed"], range(s["step"], s["step"] + 1), rank)
    return {"raised": _raised(raised), "returned": _returned(returned), **loaded,
            "file": read_checkpoint(path) if rank == 0 else None,
            "after_step": {name: p.detach().clone()
                           for name, p in ddp_model.module.named_parameters()}}


def _returned(value: Any) -> dict:
    return {"type": "None" if value is None else type(value).__name__,
            "int": value if type(value) is int else None,
            "text": safe_text(lambda: repr(value), _MAX_TEXT)}


def observe_resume(rank, world_size, functions, s):
    """Uninterrupted: ``steps + more`` steps, saving after ``steps``. Resumed: a fresh model and
    optimizer load that file and run the same last ``more`` steps from the step it returns."""
    save_checkpoint, load_checkpoint = functions
    directory = shared_directory(rank)
    path = os.path.join(directory, FILE_NAME)
    first = DistributedDataParallel(make_model(s["seed"] + 17 * rank))
    first_optimizer = make_optimizer(s["optimizer"], first)
    train(first, first_optimizer, s["seed"], range(s["steps"]), rank)
    raised = returned = None
    audit = _start_audit(directory)
    try:
        with as_launched_on_nodes(rank, world_size, s.get("nodes", 1)):
            save_checkpoint(path, first, first_optimizer, s["steps"])
        _stop_audit()
        train(first, first_optimizer, s["seed"], range(s["steps"], s["steps"] + s["more"]), rank)
        second = DistributedDataParallel(make_model(s["seed"] + 1000 + rank))
        second_optimizer = make_optimizer(s["optimizer"], second)
        returned = load_checkpoint(path, second, second_optimizer)
        if type(returned) is int and 0 <= returned <= s["steps"] + s["more"]:
            train(second, second_optimizer, s["seed"], range(returned, s["steps"] + s["more"]),
                  rank)
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        raised = exc
    finally:
        _stop_audit()
    return {"raised": _raised(raised), "returned": _returned(returned), "writes": audit["writes"],
            "uninterrupted": model_state(first.module),
            "resumed": model_state(second.module) if raised is None else None}


# --- the judges -------------------------------------------------------------------------------


def _no_exception(observation: Any, what: str, key: str = "raised",
                  call: str = "your code") -> None:
    raised = observed(observation, key, (dict, type(None)))
    if raised is not None:
        raise CheckFailed(f"{what}: {call} raised {cut_text(observed(raised, 'type', str), 80)}: "
                          f"{cut_text(observed(raised, 'message', str), _MAX_TEXT)}")


def _same_tensors(got: Any, expected: dict, what: str) -> None:
    """``got`` (data from a rank) holds exactly ``expected``'s names and bit-equal tensors."""
    if not isinstance(got, dict):
        raise CheckFailed(f"{what}: expected a dict of tensors, got {type(got).__name__}")
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        hint = (" (keys start with 'module.': save ddp_model.module.state_dict(), which loads "
                "into the plain model)" if extra and all(str(k).startswith("module.")
                                                        for k in extra) else "")
        raise CheckFailed(f"{what}: the keys differ; missing {cut_text(missing, 200)}, "
                          f"unexpected {cut_text(extra, 200)}{hint}")
    for name, tensor in expected.items():
        value = got[name]
        if not isinstance(value, torch.Tensor) or value.dtype != tensor.dtype or \
                value.shape != tensor.shape or not torch.equal(value, tensor):
            shown = (f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                     else type(value).__name__)
            diff = ""
            if isinstance(value, torch.Tensor) and value.shape == tensor.shape:
                diff = f", largest difference {(value.double() - tensor.double()).abs().max():.3g}"
            raise CheckFailed(f"{what}: {name!r} differs ({shown} vs {tensor.dtype} "
                              f"{tuple(tensor.shape)}{diff})")


def _same_optimizer(got: Any, expected: dict, what: str) -> None:
    if not isinstance(got, dict) or not isinstance(got.get("state"), dict) or \
            not isinstance(got.get("param_groups"), list):
        raise CheckFailed(f"{what}: expected an optimizer state_dict (keys 'state' and "
                          "'param_groups')")
    if set(got["state"]) != set(expected["state"]):
        raise CheckFailed(f"{what}: state for parameters {sorted(got['state'])}, expected "
                          f"{sorted(expected['state'])} (was optimizer.state_dict() saved "
                          "and loaded?)")
    for index, entry in expected["state"].items():
        other = got["state"][index]
        if not isinstance(other, dict) or set(other) != set(entry):
            raise CheckFailed(f"{what}: parameter {index}'s state differs in its keys")
        for name, value in entry.items():
            same = (isinstance(other[name], torch.Tensor) and torch.equal(other[name], value)
                    if isinstance(value, torch.Tensor) else other[name] == value)
            if not same:
                raise CheckFailed(f"{what}: parameter {index}'s {name!r} differs")
    if len(got["param_groups"]) != len(expected["param_groups"]) or any(
            g != e for g, e in zip(got["param_groups"], expected["param_groups"])):
        raise CheckFailed(f"{what}: the param_groups (learning rate and the rest) differ")


def _shown(s: dict, world_size: int, what: str) -> str:
    nodes = s.get("nodes", 1)
    machines = f" on {nodes} machines" if nodes > 1 else ""
    return f"{what} ({world_size} rank(s){machines}, {s['optimizer']}, step {s['step']})"


def judge_save(observations, world_size, s):
    what = _shown(s, world_size, "save_checkpoint")
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what, call="save_checkpoint"))
    judge_each_rank(observations, lambda rank, o: _judge_writer(rank, o, what))
    judge_each_rank(observations, lambda rank, o: _judge_returned_late(rank, o, what, s))
    first = observations[0]
    file = observed(first, "file", dict)
    if not file.get("loads"):
        raise CheckFailed(f"{what}: after every rank returned, the file "
                          + ("does not exist" if not file.get("exists") else
                             f"does not load with torch.load(path, weights_only=True): "
                             f"{cut_text(file.get('error', ''), _MAX_TEXT)}"))
    content = file.get("content")
    if not isinstance(content, dict):
        raise CheckFailed(f"{what}: the file holds a {file.get('kind')}, not a dict")
    expected_keys = {"model", "optimizer", "step", "written_by", "note"}
    if not expected_keys <= set(content):
        raise CheckFailed(f"{what}: the file's dict has keys {sorted(map(str, content))}; "
                          f"expected {sorted(expected_keys)} (the extra keyword arguments are "
                          "saved as keys of their own)")
    live_model = observed(first, "model", dict)
    _same_tensors(content["model"], live_model, f"{what}: the file's 'model' against the model")
    _same_optimizer(content["optimizer"], observed(first, "optimizer", dict),
                    f"{what}: the file's 'optimizer' against the optimizer")
    if content["step"] != s["step"] or type(content["step"]) is not int:
        raise CheckFailed(f"{what}: the file's 'step' is {cut_text(repr(content['step']), 80)}, "
                          f"expected {s['step']}")
    note = f"s{s['seed']}"
    if content["note"] != note:
        raise CheckFailed(f"{what}: the extra keyword argument note={note!r} came back as "
                          f"{cut_text(repr(content['note']), 80)}")
    if content["written_by"] != 0:
        raise CheckFailed(f"{what}: the file was written with rank "
                          f"{cut_text(repr(content['written_by']), 40)}'s values: only rank 0 "
                          "writes")


def _judge_writer(rank: int, observation: Any, what: str) -> None:
    serialised = observed(observation, "serialised", int)
    writes = observed(observation, "writes", list)
    if rank != 0 and serialised and not writes:
        raise CheckFailed(f"{what}: this rank wrote to the checkpoint's directory (it serialised "
                          "the checkpoint): only rank 0 may write; the other ranks only wait "
                          "(dist.barrier())")
    if rank == 0 and serialised == 0:
        raise CheckFailed(f"{what}: rank 0 never serialised its extra keyword arguments: save "
                          "them in the checkpoint (torch.save of one dict)")
    judge_writes(rank, observation, what)


def judge_writes(rank: int, observation: Any, what: str) -> None:
    """Every save is audited (with extra keyword arguments or without, on one machine or
    several): ranks other than 0 write nothing in the directory; rank 0 puts the final path in
    place with exactly one ``os.replace`` from the same directory."""
    writes = observed(observation, "writes", list)
    if rank != 0 and writes:
        raise CheckFailed(f"{what}: this rank wrote to the checkpoint's directory "
                          f"({_describe_writes(writes)}): only rank 0 may write (RANK, not "
                          "LOCAL_RANK: every machine has a local rank 0); the other ranks only "
                          "wait (dist.barrier())")
    if rank != 0:
        return
    final_writes = [w for w in writes if isinstance(w, list) and len(w) == 3 and w[1] == FILE_NAME]
    opened = [w for w in final_writes if w[0] != "replace"]
    replaced = [w for w in final_writes if w[0] == "replace"]
    if opened:
        raise CheckFailed(f"{what}: rank 0 wrote the final path itself ({_describe_writes(opened)})"
                          ": a crash in the middle leaves a truncated checkpoint. Write a "
                          "temporary file in the same directory, then os.replace(temporary, path)")
    if len(replaced) != 1:
        raise CheckFailed(
            f"{what}: rank 0 moved a file onto the final path {len(replaced)} times; expected "
            "exactly one os.replace(temporary, path) (a torch.save straight to the path is not "
            "atomic: it truncates the previous checkpoint before writing)")
    source = replaced[0][2]
    if os.sep in source or source.startswith(".."):
        raise CheckFailed(f"{what}: rank 0 replaced the checkpoint with {cut_text(source, 120)}, "
                          "which is not in the checkpoint's directory: os.replace is atomic only "
                          "within one file system, so write the temporary file next to the "
                          "checkpoint")


def _describe_writes(writes: list) -> str:
    shown = [f"{w[0]} {w[1]}" + (f" from {w[2]}" if w[2] else "")
             for w in writes[:4] if isinstance(w, list) and len(w) == 3]
    return cut_text("; ".join(shown), 240)


def _judge_returned_late(rank: int, observation: Any, what: str, s: dict) -> None:
    """A rank whose call returns must find the complete checkpoint at the path."""
    on_return = observed(observation, "on_return", dict)
    if not on_return.get("loads") or on_return.get("step") != s["step"]:
        state = ("did not exist yet" if not on_return.get("exists") else
                 "was not complete" if not on_return.get("loads") else
                 f"was still the previous one (step {cut_text(repr(on_return.get('step')), 40)})")
        raise CheckFailed(f"{what}: when this rank's save_checkpoint returned, the checkpoint "
                          f"{state}: every rank must return only after rank 0 finished writing "
                          "(dist.barrier() after the write, on every rank)")


def judge_crash(observations, world_size, s):
    what = _shown(s, world_size, "a save_checkpoint that crashes midway")
    [observation] = observations
    _no_exception(observation, what, "first_raised", "the first (normal) save_checkpoint")
    judge_writes(0, observation, f"{what}, its first (normal) save")
    before = observed(observation, "before", dict)
    if not before.get("loads") or not isinstance(before.get("content"), dict):
        raise CheckFailed(f"{what}: the first save left no loadable checkpoint")
    second = observed(observation, "second_raised", (dict, type(None)))
    if second is None:
        raise CheckFailed(f"{what}: the second save was given an extra value that raises when it "
                          "is serialised (as a crash would stop the write), yet it returned "
                          "normally: save every extra keyword argument, and let errors through")
    after = observed(observation, "after", dict)
    if not after.get("exists"):
        raise CheckFailed(f"{what}: after the crash there is no checkpoint at the path: the "
                          "previous one was deleted before the new one was complete")
    if not after.get("loads") or not isinstance(after.get("content"), dict):
        raise CheckFailed(f"{what}: after the crash the file at the path does not load "
                          f"({cut_text(after.get('error', ''), 200)}): the crash destroyed the "
                          "previous checkpoint. Write a temporary file in the same directory and "
                          "os.replace it onto the path only once it is complete")
    got, expected = after["content"], before["content"]
    if got.get("step") != expected.get("step"):
        raise CheckFailed(f"{what}: after the crash the file holds step "
                          f"{cut_text(repr(got.get('step')), 40)}, expected the previous "
                          f"checkpoint's {expected.get('step')!r}")
    _same_tensors(got.get("model"), expected["model"],
                  f"{what}: the previous checkpoint's model after the crash")


def judge_load(observations, world_size, s):
    what = _shown(s, world_size, "load_checkpoint")
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what, call="load_checkpoint"))
    file = observed(observations[0], "file", dict)
    content = file.get("content")
    if not isinstance(content, dict):
        raise CheckFailed(f"{what}: the grader's checkpoint is gone or changed after loading: "
                          "load_checkpoint must only read it")

    def judge_rank(rank, observation):
        returned = observed(observation, "returned", dict)
        if returned.get("int") != s["step"]:
            raise CheckFailed(f"expected the step {s['step']} (an int, the file's 'step'), got "
                              f"{cut_text(returned.get('text'), 80)}")
        _same_tensors(observed(observation, "model", dict), content["model"],
                      "the model after loading, against the file's 'model'")
        _same_optimizer(observed(observation, "optimizer", dict), content["optimizer"],
                        "the optimizer after loading, against the file's 'optimizer' (every "
                        "rank loads it: DDP's constructor broadcasts the model, never the "
                        "optimizer)")

    judge_each_rank(observations, lambda rank, o: _with_prefix(what, judge_rank, rank, o))
    first = observed(observations[0], "after_step", dict)
    for rank, observation in enumerate(observations[1:], start=1):
        _same_tensors(observed(observation, "after_step", dict), first,
                      f"{what}: rank {rank}'s parameters one step after loading, against rank "
                      "0's")


def _with_prefix(what: str, judge_rank, rank: int, observation: Any) -> None:
    try:
        judge_rank(rank, observation)
    except CheckFailed as failed:
        raise CheckFailed(f"{what}: {failed}") from None


def judge_resume(observations, world_size, s):
    what = (f"steps 0-{s['steps'] - 1}, save_checkpoint, steps {s['steps']}-"
            f"{s['steps'] + s['more'] - 1}; then a fresh model that load_checkpoint()s and runs "
            f"the same last steps ({world_size} rank(s), {s['optimizer']})")
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what))
    judge_each_rank(observations, lambda rank, o: judge_writes(rank, o, f"{what}: its save"))

    def judge_rank(rank, observation):
        returned = observed(observation, "returned", dict)
        if returned.get("int") != s["steps"]:
            raise CheckFailed(f"{what}: load_checkpoint returned "
                              f"{cut_text(returned.get('text'), 80)}, expected {s['steps']}")
        _same_tensors(observed(observation, "resumed", dict),
                      observed(observation, "uninterrupted", dict),
                      f"{what}: the resumed model against the uninterrupted one, bit for bit")

    judge_each_rank(observations, judge_rank)


SAVE = Case(observe_save, judge_save)
CRASH = Case(observe_crash, judge_crash)
LOAD = Case(observe_load, judge_load)
RESUME = Case(observe_resume, judge_resume)


def check_save_writes_the_contract(save_checkpoint, load_checkpoint) -> None:
    run_student(SAVE, 2, together(save_checkpoint, load_checkpoint), setting(seed=1))


def check_a_crash_keeps_the_previous_checkpoint(save_checkpoint, load_checkpoint) -> None:
    run_student(CRASH, 1, together(save_checkpoint, load_checkpoint), setting(seed=2))


def check_load_restores_every_rank(save_checkpoint, load_checkpoint) -> None:
    run_student(LOAD, 2, together(save_checkpoint, load_checkpoint), setting(seed=3, steps=3))


def check_resume_is_bit_exact(save_checkpoint, load_checkpoint) -> None:
    run_student(RESUME, 2, together(save_checkpoint, load_checkpoint), setting(seed=4))
