"""Hidden checks for chapter 02: 1, 3 and 4 ranks, uneven rows, float64, frozen parameters.

The measurement (:func:`measured_bytes`: fresh ranks that run only this module's code join a gloo
group, train the model one Adam step under each strategy and count, tensor by tensor, what each
rank holds) is the grader's reference, kept here because it yields the answer of any model: the
visible module has only its visible case's bytes written out (VISIBLE_MEASURED), which
tests/test_grading_memory_per_rank.py holds to it."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ddpcourse.grading.checks import CHECK_TIMEOUT_S, Case, run_student
from ddpcourse.grading.exercises.memory_per_rank import (DOUBLE, DTYPES, ERRORS, UNEVEN,
                                                         build_model, judge_memory_with,
                                                         observe_memory, run_memory)
from ddpcourse.launcher import RankError, run_ranks

BAD_ARGUMENTS = [(3, 3, "ddp"), (4, -1, "ddp"), (3, 0, "dp"), (1, 1, "fsdp"), (4, 0, "zero")]


def local_bytes(tensor) -> int:
    """Bytes of the elements this rank owns: a DTensor's local shard, a tensor's elements."""
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def count_held(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    state = sum(local_bytes(value) for per_param in optimizer.state.values()
                for value in per_param.values() if isinstance(value, torch.Tensor))
    return {"params": sum(local_bytes(p) for p in params),
            "grads": sum(local_bytes(p.grad) for p in params),
            "adam_state": state}


def _one_adam_step(model: nn.Module, wrapped: nn.Module, spec, rank: int) -> torch.optim.Optimizer:
    optimizer = torch.optim.Adam(model.parameters())
    first = next(layer for layer in spec[2] if layer[0] != "tanh")
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4, first[1], generator=generator, dtype=DTYPES[spec[1]])
    wrapped(x).pow(2).mean().backward()
    optimizer.step()
    return optimizer


def measure_ddp(spec, rank: int) -> dict[str, int]:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(spec)
    optimizer = _one_adam_step(model, DistributedDataParallel(model), spec, rank)
    return count_held(model, optimizer)


def measure_fsdp(spec, rank: int, world_size: int) -> dict[str, int]:
    """FSDP2 as chapter 02 applies it: ``fully_shard`` on each layer with parameters, then on
    the root module."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(spec)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = _one_adam_step(model, model, spec, rank)
    return count_held(model, optimizer)


def _measure_in_rank(rank, world_size, specs, strategies):
    return {f"{spec[0]}/{strategy}": (measure_ddp(spec, rank) if strategy == "ddp"
                                      else measure_fsdp(spec, rank, world_size))
            for spec in specs for strategy in strategies}


@functools.lru_cache(maxsize=64)
def _measure(specs: tuple, strategies: tuple, world_size: int) -> tuple:
    try:
        return tuple(run_ranks(_measure_in_rank, world_size, specs, strategies, backend="gloo",
                               timeout=max(CHECK_TIMEOUT_S, 60.0), seed=0, relay_output=False))
    except RankError as err:  # the grader's own failure, never the student's
        raise RuntimeError(f"the reference measurement failed: {err}") from None


def measured_bytes(specs, strategies, world_size: int) -> list[dict[str, dict[str, int]]]:
    """Per rank, ``{"MODEL/STRATEGY": {"params": ..., "grads": ..., "adam_state": ...}}``,
    measured in fresh ranks that run no student code (once per models, strategies and world
    size in a process)."""
    return [{key: dict(held) for key, held in per_rank.items()}
            for per_rank in _measure(tuple(specs), tuple(strategies), world_size)]


def judge_measured(observations, world_size, specs, strategies):
    judge_memory_with(measured_bytes, observations, world_size, specs, strategies)


MEMORY = Case(observe_memory, judge_measured)


def check_bytes_per_rank(bytes_per_rank) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(ERRORS, 1, bytes_per_rank, BAD_ARGUMENTS, init_process_group=False,
                hide_internals=True)
    run_memory(bytes_per_rank, 1, [UNEVEN], case=MEMORY, hide_internals=True)
    for world_size in (3, 4):
        run_memory(bytes_per_rank, world_size, [UNEVEN, DOUBLE], case=MEMORY,
                   hide_internals=True)
