"""Chapter 11, ZeRO-1 by hand: visible checks for ``ShardedOptimizer``, and the cases the hidden
checks reuse.

The contract is the docstring of ``ShardedOptimizer`` in
solutions/11_beyond_ddp/sharded_optimizer.nb.py (students:
exercises/11_beyond_ddp/sharded_optimizer.ipynb).

Each case is a :class:`~ddpcourse.grading.checks.Case`. Every rank builds the same model, wraps
its parameters in the student's ``ShardedOptimizer`` and trains a few steps on the same batch (the
gradients every rank holds after DDP's average); it then reports its weights and what it holds:
the bytes of the tensors in ``self.optimizer.state``, of every tensor the object reaches, and (in
the memory cases, :func:`observe_memory`) of every tensor the rank's process made from the
optimizer's construction on and still holds (found through the garbage collector: a module
global, a class attribute, a closure), the model's own parameters and gradients left out. The
judge trains the same model with the unsharded optimizer in one process: every rank's weights
must equal those; the state of every rank must be at most a 1/N share of the unsharded
optimizer's (10 % and 64 bytes of slack), which whole-parameter partitioning
(``ZeroRedundancyOptimizer``'s) misses on a model with one large tensor; and nothing else may
hold a copy of more than the rank's share.

With ``other_pieces_differ`` (the hidden cases), each rank's gradients are disturbed, differently
in every rank, outside the piece the contract gives the rank (``ceil(n / N)`` contiguous elements,
piece ``r`` on rank ``r``; :func:`disturb_other_pieces`), as under ZeRO, where a rank's gradients
are averaged only over its piece: an optimizer that uses other elements of the gradients (pieces
cut another way, floor-sized or round-robin; or the whole optimizer run in every rank) ends with
other weights than the unsharded optimizer's.
"""

from __future__ import annotations

import gc
import types
from typing import Any

import torch
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, by_rank, cut_text, expect_close,
                                      observed, run_student, type_name)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
# name -> layers (in, out): one large weight and small ones, so whole-tensor shares are uneven
MODELS = {"uneven": ((12, 16), (16, 3)), "three": ((5, 7), (7, 7), (7, 2))}
TOLERANCE = (1e-10, 1e-12)  # float64; a sharded element-wise optimizer does the same arithmetic
SLACK, SLACK_BYTES = 1.10, 64


def build_model(name: str, seed: int) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (inp, out) in enumerate(MODELS[name]):
            layers += [nn.Linear(inp, out)] + ([nn.Tanh()] if i < len(MODELS[name]) - 1 else [])
        return nn.Sequential(*layers).double()


def batch(name: str, seed: int, step: int):
    generator = torch.Generator().manual_seed(seed * 31 + step)
    inp, out = MODELS[name][0][0], MODELS[name][-1][1]
    return (torch.randn(8, inp, generator=generator, dtype=torch.float64),
            torch.randn(8, out, generator=generator, dtype=torch.float64))


def disturb_other_pieces(params: list[torch.Tensor], rank: int, world_size: int,
                         step: int) -> None:
    """Add noise, different in every rank and step, to the gradients' elements outside this rank's
    piece: the elements ``[r * c, (r + 1) * c)`` of the flat vector, ``c = ceil(n / N)`` (the
    contract's cut, stated in the docstring)."""
    total = sum(p.numel() for p in params)
    piece = -(-total // world_size)
    start, end = min(rank * piece, total), min((rank + 1) * piece, total)
    generator = torch.Generator().manual_seed(7919 * (rank + 1) + step)
    noise = torch.randn(total, generator=generator, dtype=torch.float64)
    noise[start:end] = 0
    offset = 0
    with torch.no_grad():
        for p in params:
            p.grad.add_(noise[offset:offset + p.numel()].view_as(p.grad).to(p.grad.dtype))
            offset += p.numel()


def train(model: nn.Module, optimizer: Any, name: str, seed: int, steps: int,
          disturb: tuple[int, int] | None = None) -> None:
    """``steps`` steps; with ``disturb`` (rank, world_size), each rank's gradients differ outside
    its piece (:func:`disturb_other_pieces`)."""
    for step in range(steps):
        x, y = batch(name, seed, step)
        for p in model.parameters():
            p.grad = None
        nn.functional.mse_loss(model(x), y).backward()
        if disturb is not None:
            disturb_other_pieces(list(model.parameters()), *disturb, step)
        optimizer.step()


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def state_tensors(optimizer: Any) -> list[torch.Tensor]:
    state = getattr(optimizer, "state", None)
    found = []
    if isinstance(state, dict):
        for entry in state.values():
            if isinstance(entry, dict):
                found += [v for v in entry.values() if isinstance(v, torch.Tensor)]
    return found


_SKIP = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         type, str, bytes, int, float, bool, type(None))


def reachable_tensors(root: Any, limit: int = 20_000, grads: bool = True) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through attributes, dicts, lists, tuples and sets
    (with ``grads``, a tensor's ``.grad`` too)."""
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    todo = [root]
    while todo and len(seen) < limit:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if grads and obj.grad is not None:
                todo.append(obj.grad)
            continue
        if isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        else:
            try:
                todo += list(vars(obj).values())
            except TypeError:
                pass
    return found


def live_tensors(collect: bool) -> list[torch.Tensor]:
    """Every tensor of this process that the garbage collector tracks (all of Python's); with
    ``collect``, after a full collection, so that unreachable cycles are not counted."""
    if collect:
        gc.collect()
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def kept_by_python(candidates: list[torch.Tensor], everything: list[torch.Tensor]) -> list:
    """The ``candidates`` that a Python object refers to (a module global, a class attribute, a
    closure cell, an object's attribute, a list or a dict), or that are the ``.grad`` of a live
    tensor (``everything``, which is left out as a referrer). A tensor only the C++ side still
    holds is left out: gloo's worker thread can keep the buffers of a finished collective for a
    moment after ``wait()`` returned, and counting those would fail honest ranks at random."""
    if not candidates:
        return []
    wanted = {id(t): t for t in candidates}
    kept: dict[int, torch.Tensor] = {}
    for referrer in gc.get_referrers(*candidates):
        if referrer is everything or referrer is candidates or referrer is wanted:
            continue
        for inner in gc.get_referents(referrer):
            if id(inner) in wanted:
                kept[id(inner)] = inner
    for t in everything:
        try:
            grad = t.grad if t.is_leaf else None
        except Exception:  # noqa: BLE001 - an odd tensor subclass: it has no .grad to count
            continue
        if grad is not None and id(grad) in wanted:
            kept[id(grad)] = grad
    return list(kept.values())


def observe_training(rank, world_size, ShardedOptimizer, model_name, optimizer_name, kwargs,
                     steps, seed, other_pieces_differ=False, count_process=False):
    """Train ``steps`` steps with the student's optimizer over the model's parameters; report
    the weights, the bytes of ``.optimizer.state`` and of every tensor the object holds; with
    ``count_process``, also of every tensor the process made since just before the optimizer
    was built and still holds. With ``other_pieces_differ``, the ranks' gradients differ outside
    each rank's piece."""
    model = build_model(model_name, seed)
    params = list(model.parameters())
    # kept alive until the count: no new storage reuses their addresses
    before = live_tensors(collect=False) if count_process else []
    sharded = ShardedOptimizer(params, OPTIMIZERS[optimizer_name], **dict(kwargs))
    train(model, sharded, model_name, seed, steps,
          (rank, world_size) if other_pieces_differ else None)
    own = {p.untyped_storage().data_ptr() for p in params}
    own |= {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    held = [t for t in reachable_tensors(sharded) if t.untyped_storage().data_ptr() not in own]
    made = None
    if count_process:
        own |= {t.untyped_storage().data_ptr() for t in before}
        everything = live_tensors(collect=True)
        made = kept_by_python(
            [t for t in everything if t.untyped_storage().data_ptr() not in own], everything)
        del before, everything
    inner = getattr(sharded, "optimizer", None)
    return {"weights": [p.detach().clone() for p in params],
            "has_optimizer": isinstance(inner, torch.optim.Optimizer),
            "inner_type": type_name(inner),
            "state_bytes": tensor_bytes(state_tensors(inner)),
            "held_bytes": tensor_bytes(held),
            "process_bytes": None if made is None else tensor_bytes(made)}


def observe_memory(rank, world_size, ShardedOptimizer, *args):
    """:func:`observe_training` that also counts every tensor the rank's process keeps (it walks
    every Python object of the process, twice: only the memory cases pay for it)."""
    return observe_training(rank, world_size, ShardedOptimizer, *args, count_process=True)


def unsharded(model_name, optimizer_name, kwargs, steps, seed) -> dict:
    """The same training with the plain optimizer in one process: the weights, the bytes of its
    state and of the parameters."""
    model = build_model(model_name, seed)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters(), **dict(kwargs))
    train(model, optimizer, model_name, seed, steps)
    return {"weights": [p.detach() for p in model.parameters()],
            "state_bytes": tensor_bytes(state_tensors(optimizer)),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _what(world_size, model_name, optimizer_name, kwargs, steps,
          other_pieces_differ=False) -> str:
    args = ", ".join(f"{k}={v}" for k, v in kwargs)
    return (f"ShardedOptimizer(params, torch.optim.{optimizer_name}{', ' + args if args else ''})"
            f" on {world_size} ranks, {steps} steps, model {model_name!r}"
            + (", each rank's gradients different from the others' outside its own piece "
               "(ceil(n / N) contiguous elements, piece r on rank r): step() must use only "
               "its piece's" if other_pieces_differ else ""))


def judge_weights(observations, world_size, model_name, optimizer_name, kwargs, steps, seed,
                  other_pieces_differ=False):
    reference = unsharded(model_name, optimizer_name, kwargs, steps, seed)
    rtol, atol = TOLERANCE
    wrong = []
    for rank, report in enumerate(observations):
        try:
            weights = observed(report, "weights", list)
            if len(weights) != len(reference["weights"]):
                raise CheckFailed(f"the rank's report has {len(weights)} weights")
            for i, (got, want) in enumerate(zip(weights, reference["weights"])):
                if not isinstance(got, torch.Tensor):
                    raise CheckFailed(f"the rank's report has a {type_name(got)} as parameter {i}")
                expect_close(got, want, f"parameter {i} (shape {tuple(want.shape)}) after "
                             f"{steps} steps, against the unsharded optimizer's", rtol, atol)
        except CheckFailed as failed:
            wrong.append((rank, str(failed)))
    if wrong:
        what = _what(world_size, model_name, optimizer_name, kwargs, steps, other_pieces_differ)
        raise CheckFailed(f"{what}:\n{by_rank(wrong)}")


def judge_memory(observations, world_size, model_name, optimizer_name, kwargs, steps, seed,
                 other_pieces_differ=False):
    reference = unsharded(model_name, optimizer_name, kwargs, steps, seed)
    total, params = reference["state_bytes"], reference["param_bytes"]
    state_allowed = int(total / world_size * SLACK) + SLACK_BYTES
    held_allowed = int((total + 2 * params) / world_size * SLACK) + SLACK_BYTES
    wrong, states = [], []
    for rank, report in enumerate(observations):
        try:
            if observed(report, "has_optimizer", bool) is not True:
                raise CheckFailed(f"its .optimizer is a {cut_text(report.get('inner_type'), 80)}, "
                                  "not a torch.optim.Optimizer")
            state = observed(report, "state_bytes", int)
            held = observed(report, "held_bytes", int)
            made = observed(report, "process_bytes", int)
            states.append(state)
            if state > state_allowed:
                raise CheckFailed(
                    f".optimizer.state holds {state} bytes; the unsharded optimizer's state is "
                    f"{total} bytes, so a 1/{world_size} share is at most {state_allowed} "
                    "(10 % and 64 bytes of slack): shard the elements, not whole parameters")
            if held > held_allowed:
                raise CheckFailed(
                    f"the object holds {held} bytes of tensors besides the model's parameters "
                    f"and gradients; a 1/{world_size} share of the state and of one copy of the "
                    f"parameters and their gradients is at most {held_allowed}: keep only this "
                    "rank's share between steps")
            if made > held_allowed:
                raise CheckFailed(
                    f"the rank's process holds {made} bytes of tensors made since "
                    "ShardedOptimizer was built, besides the model's parameters and gradients; "
                    f"a 1/{world_size} share of the state and of one copy of the parameters and "
                    f"their gradients is at most {held_allowed}: nothing (a module global, a "
                    "class attribute, a closure) may keep more than this rank's share between "
                    "steps")
        except CheckFailed as failed:
            wrong.append((rank, str(failed)))
    if not wrong and sum(states) < 0.9 * total:
        wrong = [(rank, f"the ranks' .optimizer.state hold {sum(states)} bytes together; the "
                        f"unsharded optimizer's state is {total}: the whole state must be in "
                        "the ranks' .optimizer") for rank in range(world_size)]
    if wrong:
        what = _what(world_size, model_name, optimizer_name, kwargs, steps, other_pieces_differ)
        raise CheckFailed(f"{what}:\n{by_rank(wrong)}")


WEIGHTS = Case(observe_training, judge_weights)
MEMORY = Case(observe_memory, judge_memory)
ADAM = ("Adam", (("lr", 0.05),))


def check_same_weights_as_unsharded(ShardedOptimizer) -> None:
    """2 ranks, Adam, 3 steps: every rank's weights equal the unsharded Adam's."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(WEIGHTS, 2, ShardedOptimizer, "uneven", *ADAM, 3, 0)


def check_state_is_sharded(ShardedOptimizer) -> None:
    """4 ranks, Adam: each rank's optimizer state at most about 1/4 of the unsharded state."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(MEMORY, 4, ShardedOptimizer, "uneven", *ADAM, 2, 1)
