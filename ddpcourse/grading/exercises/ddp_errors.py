"""Chapter 09, DDP's own errors: visible checks for the three labs of the exercise ``ddp_errors``,
and the cases the hidden checks reuse.

The contracts are the docstrings of ``train_with_aux``, ``save_checkpoint``/``resume`` and
``train_tower`` in solutions/09_debugging/ddp_errors.nb.py (students:
exercises/09_debugging/ddp_errors.ipynb). Every case runs the student's code in real gloo ranks;
a rank reports only data, and the judge computes its own one-process reference.

* ``UNUSED`` (lab 1, an unused head): ``train_with_aux`` trains a :class:`TwoHeads` whose ``aux``
  head gets a loss on some steps or on none. The judge wants the weights of one process, identical
  replicas, and, counted on the wire (in the rank, or by the grader's broker), gradients only:
  ``find_unused_parameters=True`` all-reduces, on every step, a map of which parameters were used
  (one 4-byte integer per parameter tensor: torch/csrc/distributed/c10d/reducer.cpp,
  ``Reducer::all_reduce_local_used_map``), and that is how the check sees it.
  ``static_graph=True`` all-reduces that map once, on the first step, which the check allows.
* ``RESUME`` (lab 10, the checkpoint): the grader trains, every rank calls ``save_checkpoint``,
  then a fresh plain model and optimizer go through ``resume`` and the grader's loop continues.
  Who wrote is seen two ways: an audit hook on Python's file operations in the folder (as
  chapter 08's resumable_checkpoint does), and a value in every rank's optimizer that counts its
  own pickling (``torch.save`` to a path opens the file in C++, unseen by the hook). Rank 0's
  value holds its pickling until the other ranks' calls returned, so a save without a barrier is
  caught every time. The file must load into the plain model, and the resumed run must end with
  the uninterrupted run's weights (bit for bit on one or two ranks). Not seen: a rank other than
  0 that writes only the model's weights with ``torch.save`` to a path (no Python file event, no
  optimizer state pickled); a save without the optimizer fails on rank 0 anyway.
* ``CHECKPOINTED`` (lab 11, reentrant activation checkpointing): ``train_tower`` trains a
  :class:`Tower` whose block is checkpointed; the block counts its forwards, which must run
  again in the backward (checkpointing kept), and the weights must be one process's.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ddpcourse.grading.checks import (Case, CheckFailed, audited_traffic, cut_text,
                                      judge_each_rank, observed, run_student, safe_text)
from ddpcourse.grading.exercises.resumable_checkpoint import (_same_tensors, _start_audit,
                                                              _stop_audit, read_checkpoint,
                                                              shared_directory)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
AUDITED_CASES_BUILD_DDP = True  # the grader's one-rank hosts preload what DDP imports
FEATURES, HIDDEN, CLASSES, AUX_CLASSES = 6, 16, 3, 10
ATOL, RTOL = 1e-6, 1e-5
MAP_BYTES_PER_PARAMETER = 4  # the reducer's map of used parameters: one int32 per tensor
WAIT_FOR_PEERS_S = 0.5
FILE_NAME = "checkpoint.pt"
_MAX_TEXT = 400


def _raised(exc: BaseException | None) -> dict | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": safe_text(lambda: exc, 3000)}


def _no_exception(observation: Any, what: str, key: str = "raised") -> None:
    raised = observed(observation, key, (dict, type(None)))
    if raised is None:
        return
    kind, message = observed(raised, "type", str), observed(raised, "message", str)
    hint = ""
    if "Expected to have finished reduction" in message:
        hint = ("\nDDP waited for a gradient of every parameter it wraps, and some got none: "
                "a parameter outside the loss.")
    elif "marked as ready twice" in message or "mark a variable ready only once" in message:
        hint = ("\nA parameter's gradient hook fired twice in one backward: reentrant "
                "checkpointing runs a backward of its own, which DDP's bookkeeping does not "
                "expect.")
    elif "module." in message and ("Missing key" in message or "Unexpected key" in message):
        hint = "\nThe keys carry DDP's 'module.' prefix: a plain model has none."
    raise CheckFailed(f"{what}: {key.replace('_', ' ')}: {cut_text(kind, 80)}: "
                      f"{error_text(message)}{hint}")


def error_text(message: str) -> str:
    """A long error's beginning and its last line, where DDP names the parameter."""
    if len(message) <= _MAX_TEXT:
        return message
    last = message.strip().splitlines()[-1]
    return f"{cut_text(message, 250)}\n... {cut_text(last, 250)}"


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _rank_seed(seed: int, rank: int) -> int:
    return 7919 * seed + 104_729 * rank + 13


def _close_weights(got: Any, expected: dict[str, torch.Tensor], what: str,
                   exact: bool) -> None:
    """``got`` (a rank's report) equals ``expected``: bit for bit, or within ATOL + RTOL * |w|."""
    if exact:
        _same_tensors(got, expected, what)
        return
    if not isinstance(got, dict) or set(got) != set(expected):
        raise CheckFailed(f"{what}: the report of the parameters has the wrong names")
    for name, tensor in expected.items():
        value = got[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or \
                value.dtype != tensor.dtype:
            raise CheckFailed(f"{what}: {name!r} is not a tensor like the model's")
        if not torch.allclose(value, tensor, rtol=RTOL, atol=ATOL):
            diff = (value.double() - tensor.double()).abs().max().item()
            raise CheckFailed(f"{what}: {name!r} differs from one process's by up to {diff:.3g}")


def _judge_replicas(observations, key: str, what: str) -> None:
    """Bit for bit: every rank applied the same averaged gradients."""
    first = observed(observations[0], key, dict)
    for rank, observation in enumerate(observations[1:], start=1):
        mine = observed(observation, key, dict)
        for name, tensor in first.items():
            other = mine.get(name)
            if not isinstance(tensor, torch.Tensor):
                raise CheckFailed(f"{what}: rank 0's report of {cut_text(name, 80)!r} is not a "
                                  "tensor")
            if not isinstance(other, torch.Tensor) or other.shape != tensor.shape or \
                    other.dtype != tensor.dtype or not torch.equal(other, tensor):
                raise CheckFailed(f"{what}: rank {rank}'s {name!r} differs from rank 0's: the "
                                  "replicas are no longer identical")


# --- lab 1: an unused head -----------------------------------------------------------------------


class TwoHeads(nn.Module):
    """A backbone, the task's head, and an auxiliary head that only some steps train."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.aux = nn.Linear(HIDDEN, AUX_CLASSES)

    def forward(self, x, with_aux: bool = False):
        features = torch.tanh(self.backbone(x))
        return self.head(features), (self.aux(features) if with_aux else None)


def make_two_heads(seed: int) -> TwoHeads:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TwoHeads()


def unused_setting(seed: int = 0, steps: int = 4, rows: int = 4, aux_steps: tuple = (),
                   lr: float = 0.5) -> dict:
    """``steps`` steps of ``rows`` rows per rank; the aux head has labels at ``aux_steps`` only."""
    return {"seed": seed, "steps": steps, "rows": rows, "aux_steps": list(aux_steps), "lr": lr}


def aux_batches(s: dict, rank: int) -> list:
    """Rank ``rank``'s ``(x, y, aux_y)`` of every step; ``aux_y`` None where it has none."""
    generator = torch.Generator().manual_seed(1_000_003 * s["seed"] + rank)
    batches = []
    for step in range(s["steps"]):
        x = torch.randn(s["rows"], FEATURES, generator=generator)
        y = torch.randint(0, CLASSES, (s["rows"],), generator=generator)
        aux_y = torch.randint(0, AUX_CLASSES, (s["rows"],), generator=generator)
        batches.append((x, y, aux_y if step in s["aux_steps"] else None))
    return batches


def aux_loss(model: nn.Module, x, y, aux_y):
    """The contract's loss of one rank's batch."""
    out, aux = model(x, with_aux=aux_y is not None)
    loss = F.cross_entropy(out, y)
    return loss if aux_y is None else loss + F.cross_entropy(aux, aux_y)


def unused_reference(s: dict, world_size: int) -> dict[str, torch.Tensor]:
    """One process: rank 0's initial model, plain SGD, each step's gradient the mean over the
    ranks of each rank's loss gradient (what DDP's average gives)."""
    model = make_two_heads(_rank_seed(s["seed"], 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    every = [aux_batches(s, rank) for rank in range(world_size)]
    for step in range(s["steps"]):
        optimizer.zero_grad()
        total = sum(aux_loss(model, *every[rank][step]) for rank in range(world_size))
        (total / world_size).backward()
        optimizer.step()
    return _state(model)


def gradient_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def observe_unused(rank, world_size, train_with_aux, s):
    model = make_two_heads(_rank_seed(s["seed"], rank))
    batches = aux_batches(s, rank)
    raised = None
    with audited_traffic() as traffic:
        try:
            train_with_aux(model, batches, s["lr"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            raised = exc
    return {"raised": _raised(raised), "weights": _state(model), "traffic": traffic}


def all_reduced_bytes(observation: Any, what: str) -> int:
    traffic = observed(observation, "traffic", dict)
    total = 0
    for entry in observed(traffic, "collective_calls", list):
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or type(entry[1]) is not int):
            raise CheckFailed(f"{what}: the rank's communication record is malformed")
        if entry[0] == "all_reduce":
            total += entry[1]
    return total


def judge_traffic(total: int, s: dict) -> None:
    """Gradients only: each step all-reduces the backbone's and head's gradients, and the aux
    head's on as many steps as the code lets it (0 to all); at most one map of used parameters
    (``static_graph=True``'s first step). A map on every step is ``find_unused_parameters``."""
    model = make_two_heads(0)
    trained = gradient_bytes(model.backbone) + gradient_bytes(model.head)
    aux = gradient_bytes(model.aux)
    most_map = MAP_BYTES_PER_PARAMETER * len(list(model.parameters()))
    steps = s["steps"]
    extras = [total - steps * trained - k * aux for k in range(steps + 1)]
    if any(extra == 0 or 0 < extra <= most_map for extra in extras):
        return
    per_step = [extra // steps for extra in extras
                if extra > 0 and extra % steps == 0 and extra // steps <= most_map]
    if per_step:
        raise CheckFailed(
            f"every step all-reduced {per_step[0]} bytes besides the gradients: "
            f"{per_step[0] // MAP_BYTES_PER_PARAMETER} parameter(s) x 4 bytes, the map of used "
            "parameters that find_unused_parameters=True all-reduces on every step (after a "
            "traversal of the autograd graph). The lab asks for a fix without it: give the "
            "unused head no part in what DDP waits for, or a part in the loss")
    raise CheckFailed(f"the ranks all-reduced {total} bytes in {steps} steps; gradients only "
                      f"would be {steps} x {trained} (backbone and head) plus {aux} for each step "
                      "that also all-reduces the aux head's")


def judge_unused(observations, world_size, s):
    aux = ("no step" if not s["aux_steps"] else
           f"step(s) {', '.join(map(str, s['aux_steps']))} only")
    what = (f"train_with_aux on {world_size} rank(s), {s['steps']} steps, aux labels at {aux}")
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what))
    _judge_replicas(observations, "weights", what)
    reference = unused_reference(s, world_size)
    judge_each_rank(observations, lambda rank, o: _close_weights(
        observed(o, "weights", dict), reference,
        f"{what}: the weights, compared with one process on every rank's batches", exact=False))
    judge_each_rank(observations, lambda rank, o: _judge_traffic_of(o, s, what))


def _judge_traffic_of(observation: Any, s: dict, what: str) -> None:
    try:
        judge_traffic(all_reduced_bytes(observation, what), s)
    except CheckFailed as failed:
        raise CheckFailed(f"{what}: {failed}") from None


UNUSED = Case(observe_unused, judge_unused, audit_traffic=True)


# --- lab 10: the checkpoint ------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.inp(x)))


def make_net(seed: int) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net()


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    raise ValueError(name)


def resume_setting(seed: int = 0, optimizer: str = "adam", steps: int = 3,
                   more: int = 3) -> dict:
    """``steps`` steps, the save, then ``more`` steps after the resume."""
    return {"seed": seed, "optimizer": optimizer, "steps": steps, "more": more}


def net_batch(seed: int, step: int, rank: int):
    generator = torch.Generator().manual_seed(1_000_003 * seed + 1009 * step + rank)
    return (torch.randn(4, FEATURES, generator=generator),
            torch.randint(0, CLASSES, (4,), generator=generator))


def grader_steps(ddp_model, optimizer, seed: int, steps: range, rank: int) -> None:
    for step in steps:
        x, y = net_batch(seed, step, rank)
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()


def resume_reference(s: dict, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, ``steps`` steps: each rank's gradient divided by the world size, then summed
    in rank order, as DDP does (exact for one or two ranks)."""
    model = make_net(_rank_seed(s["seed"], 0))
    optimizer = make_optimizer(s["optimizer"], model)
    params = list(model.parameters())
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            x, y = net_batch(s["seed"], step, rank)
            grads.append(torch.autograd.grad(F.cross_entropy(model(x), y), params))
        for index, param in enumerate(params):
            total = grads[0][index] / world_size
            for other in grads[1:]:
                total = total + other[index] / world_size
            param.grad = total
        optimizer.step()
    return _state(model)


class HeldWhilePickled:
    """Every rank's optimizer holds one (in a param group), which counts, in the rank, how often
    it is pickled: a rank that pickles its optimizer's state is writing a checkpoint (torch.save
    to a path opens the file in C++, where no Python audit hook sees it). Rank 0's pickling
    waits until every other rank's save has returned, or WAIT_FOR_PEERS_S. It pickles as an
    empty OrderedDict, which ``torch.load(weights_only=True)`` accepts."""

    times = 0

    def __init__(self, directory: str, world_size: int, hold: bool):
        self.directory, self.world_size, self.hold = directory, world_size, hold

    def __reduce__(self):
        HeldWhilePickled.times += 1
        if self.hold:
            deadline = time.monotonic() + WAIT_FOR_PEERS_S
            flags = [_returned_flag(self.directory, rank) for rank in range(1, self.world_size)]
            while time.monotonic() < deadline and not all(map(os.path.exists, flags)):
                time.sleep(0.01)
        return collections.OrderedDict, ()


def _returned_flag(directory: str, rank: int) -> str:
    return os.path.join(directory, f".returned-{rank}")


def observe_resume(rank, world_size, functions, s):
    save_checkpoint, resume = functions
    directory = shared_directory(rank)
    path = os.path.join(directory, FILE_NAME)
    ddp_model = DistributedDataParallel(make_net(_rank_seed(s["seed"], rank)))
    optimizer = make_optimizer(s["optimizer"], ddp_model)
    optimizer.param_groups[0]["grader_mark"] = HeldWhilePickled(directory, world_size, rank == 0)
    grader_steps(ddp_model, optimizer, s["seed"], range(s["steps"]), rank)
    HeldWhilePickled.times = 0
    audit = _start_audit(directory)
    raised = None
    try:
        save_checkpoint(ddp_model, optimizer, path)
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        raised = exc
    finally:
        _stop_audit()
    on_return = read_checkpoint(path)
    on_return.pop("content", None)
    if rank != 0:
        open(_returned_flag(directory, rank), "w").close()
    dist.barrier()
    file = read_checkpoint(path)
    saved = file.pop("content", None)
    file["model"] = saved.get("model") if isinstance(saved, dict) else None
    file["keys"] = sorted(map(str, saved)) if isinstance(saved, dict) else None
    resumed, resume_raised = None, None
    if raised is None:
        model = make_net(_rank_seed(s["seed"] + 1, rank))  # a fresh job's model and optimizer
        fresh_optimizer = make_optimizer(s["optimizer"], model)
        try:
            resume(model, fresh_optimizer, path)
            grader_steps(DistributedDataParallel(model), fresh_optimizer, s["seed"],
                         range(s["steps"], s["steps"] + s["more"]), rank)
            resumed = _state(model)
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            resume_raised = exc
    return {"raised": _raised(raised), "resume_raised": _raised(resume_raised),
            "writes": audit["writes"], "pickled": HeldWhilePickled.times,
            "on_return": on_return,
            "file": file if rank == 0 else None, "resumed": resumed}


def _judge_writer(rank: int, observation: Any, what: str) -> None:
    writes = observed(observation, "writes", list)
    names = sorted({str(entry[1]) for entry in writes if isinstance(entry, list) and
                    len(entry) == 3})
    pickled = observed(observation, "pickled", int)
    if rank != 0 and (names or pickled):
        wrote = (f"wrote {cut_text(names, 200)}" if names else
                 "serialised its optimizer's state (it wrote a checkpoint)")
        raise CheckFailed(
            f"{what}: this rank {wrote}; only rank 0 may write. Every "
            "replica holds the same weights, so one copy is the checkpoint: ranks writing one "
            "path race (a torn or half-written file), and a file per rank is the same bytes N "
            "times over, which a job resumed on another number of ranks cannot use")
    if rank == 0 and not pickled:
        raise CheckFailed(f"{what}: rank 0 did not save its optimizer's state "
                          "(optimizer.state_dict())")


def _judge_on_return(rank: int, observation: Any, what: str) -> None:
    on_return = observed(observation, "on_return", dict)
    if not on_return.get("loads"):
        raise CheckFailed(f"{what}: when this rank's save_checkpoint returned, the checkpoint "
                          "was not complete yet: every rank must wait for rank 0's write "
                          "(dist.barrier() after it, on every rank) before going on")


def judge_resume(observations, world_size, s):
    what = (f"save_checkpoint after {s['steps']} steps, resume and {s['more']} more steps "
            f"({world_size} rank(s), {s['optimizer']})")
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what))
    judge_each_rank(observations, lambda rank, o: _judge_writer(rank, o, what))
    judge_each_rank(observations, lambda rank, o: _judge_on_return(rank, o, what))
    file = observed(observations[0], "file", dict)
    if not file.get("loads"):
        raise CheckFailed(f"{what}: the file does not load with torch.load(path, "
                          f"weights_only=True): {cut_text(file.get('error', ''), _MAX_TEXT)}")
    keys = file.get("keys")
    if not isinstance(keys, list) or not {"model", "optimizer"} <= set(map(str, keys)):
        hint = (" (the wrapper's state_dict: its keys start with 'module.', and it has no "
                "optimizer state)" if isinstance(keys, list) and keys and
                all(str(key).startswith("module.") for key in keys) else "")
        raise CheckFailed(f"{what}: the file must hold a dict with 'model' and 'optimizer', "
                          f"it has {cut_text(keys, 200)}{hint}")
    _close_weights(file.get("model"), resume_reference(s, world_size, s["steps"]),
                   f"{what}: the file's 'model', loaded into the plain (unwrapped) model",
                   world_size <= 2)
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what, "resume_raised"))
    final = resume_reference(s, world_size, s["steps"] + s["more"])
    exact = world_size <= 2

    def judge_rank(rank, observation):
        try:
            _close_weights(observed(observation, "resumed", dict), final, what, exact)
        except CheckFailed as failed:
            raise CheckFailed(
                f"{failed}\nThe resumed run does not continue the uninterrupted one: restore "
                "the optimizer's state too (Adam's moments and step counts, SGD's momentum), "
                "on every rank") from None

    judge_each_rank(observations, judge_rank)


RESUME = Case(observe_resume, judge_resume)


# --- lab 11: reentrant activation checkpointing -------------------------------------------------


class CountedTanh(nn.Module):
    """tanh, counting its forwards (a recomputation in the backward too, which module hooks do
    not see under non-reentrant checkpointing)."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return torch.tanh(x)


class Tower(nn.Module):
    """An input layer, one block applied ``repeats`` times (shared weights), an output layer, and
    a ``pooler`` this job does not use. ``enable_checkpointing`` recomputes the block's
    activations in the backward instead of keeping them (as Hugging Face's
    ``gradient_checkpointing_enable`` does)."""

    def __init__(self, repeats: int = 1):
        super().__init__()
        self.inp = nn.Linear(FEATURES, HIDDEN)
        self.block = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), CountedTanh())
        self.out = nn.Linear(HIDDEN, CLASSES)
        self.pooler = nn.Linear(HIDDEN, HIDDEN)
        self.repeats = repeats
        self.checkpointing: dict | None = None

    def enable_checkpointing(self, use_reentrant: bool) -> None:
        self.checkpointing = {"use_reentrant": use_reentrant}

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(self.repeats):
            h = (self.block(h) if self.checkpointing is None else
                 checkpoint(self.block, h, **self.checkpointing))
        return self.out(h)


def make_tower(seed: int, repeats: int) -> Tower:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Tower(repeats)


def tower_setting(seed: int = 0, repeats: int = 1, steps: int = 3, rows: int = 4,
                  lr: float = 0.5) -> dict:
    return {"seed": seed, "repeats": repeats, "steps": steps, "rows": rows, "lr": lr}


def tower_batches(s: dict, rank: int) -> list:
    generator = torch.Generator().manual_seed(1_000_033 * s["seed"] + rank)
    return [(torch.randn(s["rows"], FEATURES, generator=generator),
             torch.randint(0, CLASSES, (s["rows"],), generator=generator))
            for _ in range(s["steps"])]


def tower_reference(s: dict, world_size: int) -> dict[str, torch.Tensor]:
    model = make_tower(_rank_seed(s["seed"], 0), s["repeats"])
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    every = [tower_batches(s, rank) for rank in range(world_size)]
    for step in range(s["steps"]):
        optimizer.zero_grad()
        total = sum(F.cross_entropy(model(every[r][step][0]), every[r][step][1])
                    for r in range(world_size))
        (total / world_size).backward()
        optimizer.step()
    return _state(model)


def observe_checkpointed(rank, world_size, train_tower, s):
    model = make_tower(_rank_seed(s["seed"], rank), s["repeats"])
    counter = model.block[1]
    raised = None
    try:
        train_tower(model, tower_batches(s, rank), s["lr"])
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        raised = exc
    return {"raised": _raised(raised), "weights": _state(model), "block_forwards": counter.forwards}


def judge_checkpointed(observations, world_size, s):
    what = (f"train_tower on {world_size} rank(s), the block applied {s['repeats']} time(s) per "
            f"forward, {s['steps']} steps")
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what))
    expected = 2 * s["repeats"] * s["steps"]

    def judge_forwards(rank, observation):
        seen = observed(observation, "block_forwards", int)
        if seen != expected:
            raise CheckFailed(
                f"{what}: the block's forward ran {seen} time(s), expected {expected}: once in "
                "each forward and once more in each backward, where activation checkpointing "
                "recomputes it. Keep the checkpointing (it is what saves the memory)")

    judge_each_rank(observations, judge_forwards)
    _judge_replicas(observations, "weights", what)
    reference = tower_reference(s, world_size)
    judge_each_rank(observations, lambda rank, o: _close_weights(
        observed(o, "weights", dict), reference,
        f"{what}: the weights, compared with one process on every rank's batches", exact=False))


CHECKPOINTED = Case(observe_checkpointed, judge_checkpointed)


# --- the visible checks -----------------------------------------------------------------------


def check_aux_head_never_used(train_with_aux) -> None:
    run_student(UNUSED, 2, train_with_aux, unused_setting(seed=1, steps=4))


def check_resume(save_checkpoint, resume) -> None:
    from ddpcourse.grading.checks import together

    run_student(RESUME, 2, together(save_checkpoint, resume), resume_setting(seed=2))


def check_checkpointed_tower(train_tower) -> None:
    run_student(CHECKPOINTED, 2, train_tower, tower_setting(seed=3, repeats=1))
