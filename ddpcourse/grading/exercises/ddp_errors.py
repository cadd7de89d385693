"""Chapter 09, DDP's own errors: visible checks for the three labs of the exercise ``ddp_errors``,
and the cases the hidden checks reuse.

The contracts are the docstrings of ``train_with_aux``, ``save_checkpoint``/``resume`` and
``train_tower`` in solutions/09_debugging/ddp_errors.nb.py (students:
exercises/09_debugging/ddp_errors.ipynb). Every case runs the student's code in real gloo ranks;
a rank reports only data, and the judge compares it with one process's training, which this
module does not compute: the visible cases' results are written out (:data:`WRITTEN_OUT`, each
tensor as its sum and norm), the hidden cases' computed by autograder/hidden/ddp_errors.py on the
grader's side, which tests/test_grading_ddp_errors.py holds them to.

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

Each lab also asks a diagnosis of the given code's failure (``diagnose_<lab>()``: which
iteration, which parameter, how many all-reduces...). Its answer space is small enough to try
every value against any check that tells right from wrong, so nothing here judges it or knows
it: :func:`~ddpcourse.grading.exercises.read_the_logs.observe_diagnosis` only records the returned
dict, and the expected facts and the explanation of each failure (printed in the graded feedback)
live in autograder/hidden/ddp_errors.py, judged by autograder/hidden/diagnoses.py. The visible
checks print nothing after a pass.
"""

from __future__ import annotations

import collections
import math
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ddpcourse.grading.checks import (Case, CheckFailed, audited_traffic, cut_text,
                                      judge_each_rank, observed, run_student, safe_text)
from ddpcourse.grading.collective_names import all_reduce_bytes, reported_collective_calls
from ddpcourse.grading.exercises.resumable_checkpoint import (_same_tensors, _start_audit,
                                                              _stop_audit, read_checkpoint,
                                                              shared_directory)
from ddpcourse.grading.written_out import sum_and_norm, table_lookup

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
AUDITED_CASES_BUILD_DDP = True  # the grader's one-rank hosts preload what DDP imports
FEATURES, HIDDEN, CLASSES, AUX_CLASSES = 6, 16, 3, 10
ATOL, RTOL = 1e-6, 1e-5
MAP_BYTES_PER_PARAMETER = 4  # the reducer's map of used parameters: one int32 per tensor
WAIT_FOR_PEERS_S = 0.5
FILE_NAME = "checkpoint.pt"
_MAX_TEXT = 400
# A situation's truth (one process's weights): what a judge compares with. This module computes
# none: the visible cases' are written out (WRITTEN_OUT), the hidden cases' computed by
# autograder/hidden/ddp_errors.py on the grader's side.
Truth = Callable[[dict, int], dict]


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


# How a tensor of a visible case's truth is written out: its sum and its 2-norm (float64).
digest = sum_and_norm


def _close_weights(got: Any, expected: dict, what: str, exact: bool) -> None:
    """``got`` (a rank's report) equals ``expected``: tensors bit for bit (``exact``) or within
    ATOL + RTOL * |w|; a visible case's written-out :func:`digest` within ``numel * ATOL + RTOL *
    sqrt(numel) * norm`` (what the element-wise tolerance allows)."""
    if exact and all(isinstance(t, torch.Tensor) for t in expected.values()):
        _same_tensors(got, expected, what)
        return
    if not isinstance(got, dict):
        raise CheckFailed(f"{what}: expected a dict of tensors, got {type(got).__name__}")
    if set(got) != set(expected):
        extra = sorted(set(got) - set(expected))
        hint = (" (keys start with 'module.': save ddp_model.module.state_dict(), which loads "
                "into the plain model)" if extra and all(str(k).startswith("module.")
                                                        for k in extra) else "")
        raise CheckFailed(f"{what}: the keys differ; missing "
                          f"{cut_text(sorted(set(expected) - set(got)), 200)}, unexpected "
                          f"{cut_text(extra, 200)}{hint}")
    for name, tensor in expected.items():
        value = got[name]
        if isinstance(tensor, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or \
                    value.dtype != tensor.dtype:
                raise CheckFailed(f"{what}: {name!r} is not a tensor like the model's")
            if not torch.allclose(value, tensor, rtol=RTOL, atol=ATOL):
                diff = (value.double() - tensor.double()).abs().max().item()
                raise CheckFailed(f"{what}: {name!r} differs from one process's by up to "
                                  f"{diff:.3g}")
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise CheckFailed(f"{what}: {name!r} is not a tensor like the model's")
        diff = max(abs(a - b) for a, b in zip(digest(value), tensor))
        if diff > ATOL * value.numel() + RTOL * math.sqrt(value.numel()) * tensor[1]:
            raise CheckFailed(f"{what}: {name!r} differs from one process's (its sum or norm "
                              f"by {diff:.3g})")


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
    return sum(all_reduce_bytes(reported_collective_calls(traffic, what)))


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


def judge_unused_against(truth: Truth, observations, world_size, s):
    """``truth(s, world_size)``: ``{"weights": one process's}``."""
    aux = ("no step" if not s["aux_steps"] else
           f"step(s) {', '.join(map(str, s['aux_steps']))} only")
    what = (f"train_with_aux on {world_size} rank(s), {s['steps']} steps, aux labels at {aux}")
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what))
    _judge_replicas(observations, "weights", what)
    reference = truth(s, world_size)["weights"]
    judge_each_rank(observations, lambda rank, o: _close_weights(
        observed(o, "weights", dict), reference,
        f"{what}: the weights, compared with one process on every rank's batches", exact=False))
    judge_each_rank(observations, lambda rank, o: _judge_traffic_of(o, s, what))


def _judge_traffic_of(observation: Any, s: dict, what: str) -> None:
    try:
        judge_traffic(all_reduced_bytes(observation, what), s)
    except CheckFailed as failed:
        raise CheckFailed(f"{what}: {failed}") from None




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


def judge_resume_against(truth: Truth, observations, world_size, s):
    """``truth(s, world_size)``: ``{"saved": one process's weights after the steps before the
    save, "final": after the steps after the resume too}``."""
    known = truth(s, world_size)
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
    _close_weights(file.get("model"), known["saved"],
                   f"{what}: the file's 'model', loaded into the plain (unwrapped) model",
                   world_size <= 2)
    judge_each_rank(observations, lambda rank, o: _no_exception(o, what, "resume_raised"))
    final = known["final"]
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


def observe_checkpointed(rank, world_size, train_tower, s):
    model = make_tower(_rank_seed(s["seed"], rank), s["repeats"])
    counter = model.block[1]
    raised = None
    try:
        train_tower(model, tower_batches(s, rank), s["lr"])
    except Exception as exc:  # noqa: BLE001 - reported, judged outside
        raised = exc
    return {"raised": _raised(raised), "weights": _state(model), "block_forwards": counter.forwards}


def judge_checkpointed_against(truth: Truth, observations, world_size, s):
    """``truth(s, world_size)``: ``{"weights": one process's}``."""
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
    reference = truth(s, world_size)["weights"]
    judge_each_rank(observations, lambda rank, o: _close_weights(
        observed(o, "weights", dict), reference,
        f"{what}: the weights, compared with one process on every rank's batches", exact=False))




# --- the visible cases and their written-out truths -------------------------------------------

VISIBLE_UNUSED = unused_setting(seed=1, steps=4)
VISIBLE_RESUME = resume_setting(seed=2)
VISIBLE_TOWER = tower_setting(seed=3, repeats=1)


def situation_key(s: dict, world_size: int) -> str:
    """How :data:`WRITTEN_OUT` names a situation."""
    return f"{world_size} ranks, " + ", ".join(f"{k}={s[k]!r}" for k in sorted(s))


# The truths of the visible cases, as autograder/hidden/ddp_errors.py computes them (`python -m
# autograder.hidden.ddp_errors` prints them again): each tensor as its sum and norm.
WRITTEN_OUT: dict[str, dict[str, dict]] = {
    'unused': {
        '2 ranks, aux_steps=[], lr=0.5, rows=4, seed=1, steps=4': {
            'weights': {
                'backbone.weight': [1.5112000312656164, 2.20293439710036],
                'backbone.bias': [0.7910115979611874, 0.8847415166888976],
                'head.weight': [-0.25458505004644394, 1.0081306180909235],
                'head.bias': [0.1044401079416275, 0.3674363027616994],
                'aux.weight': [0.6679463982582092, 1.8989612109076426],
                'aux.bias': [-0.14633280038833618, 0.40625923967838806],
            },
        },
    },
    'resume': {
        "2 ranks, more=3, optimizer='adam', seed=2, steps=3": {
            'saved': {
                'inp.weight': [-3.5298448083922267, 2.231879332047403],
                'inp.bias': [-0.24602297134697437, 0.9824406689551259],
                'out.weight': [-1.6702841008082032, 0.9805601320162722],
                'out.bias': [-0.05995485186576843, 0.2779727189169706],
            },
            'final': {
                'inp.weight': [-3.5549222186673433, 2.229786161297562],
                'inp.bias': [-0.2982221134006977, 0.9960891071217112],
                'out.weight': [-1.729001851286739, 0.9791881208639848],
                'out.bias': [-0.0696333721280098, 0.27195628720866716],
            },
        },
    },
    'tower': {
        '2 ranks, lr=0.5, repeats=1, rows=4, seed=3, steps=3': {
            'weights': {
                'inp.weight': [1.3901801090687513, 2.3094958023781023],
                'inp.bias': [-0.4370478391647339, 1.0167913504792667],
                'block.0.weight': [2.3174151475541294, 2.311949587186688],
                'block.0.bias': [0.29304342716932297, 0.5105375064465499],
                'out.weight': [-0.6365291369147599, 1.0818931817092239],
                'out.bias': [0.11297556012868881, 0.23313377436046795],
                'pooler.weight': [-0.6500750184059143, 2.2679670038042814],
                'pooler.bias': [0.3203258514404297, 0.5458640027922408],
            },
        },
    },
}


def written_out(lab: str) -> Truth:
    """The visible cases' truth for ``lab``: their entry of :data:`WRITTEN_OUT`."""
    return table_lookup(WRITTEN_OUT, lab, situation_key)


def judge_unused(observations, world_size, s):
    judge_unused_against(written_out("unused"), observations, world_size, s)


def judge_resume(observations, world_size, s):
    judge_resume_against(written_out("resume"), observations, world_size, s)


def judge_checkpointed(observations, world_size, s):
    judge_checkpointed_against(written_out("tower"), observations, world_size, s)


UNUSED = Case(observe_unused, judge_unused, audit_traffic=True)
RESUME = Case(observe_resume, judge_resume)
CHECKPOINTED = Case(observe_checkpointed, judge_checkpointed)


# --- the visible checks -----------------------------------------------------------------------


def check_aux_head_never_used(train_with_aux) -> None:
    run_student(UNUSED, 2, train_with_aux, VISIBLE_UNUSED)


def check_resume(save_checkpoint, resume) -> None:
    from ddpcourse.grading.checks import together

    run_student(RESUME, 2, together(save_checkpoint, resume), VISIBLE_RESUME)


def check_checkpointed_tower(train_tower) -> None:
    run_student(CHECKPOINTED, 2, train_tower, VISIBLE_TOWER)
