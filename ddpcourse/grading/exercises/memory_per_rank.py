"""Chapter 02, DP vs DDP vs FSDP: visible checks for ``bytes_per_rank``, and the measurement.

The contract is the docstring of ``bytes_per_rank`` in
solutions/02_dp_ddp_fsdp/memory_per_rank.nb.py (students:
exercises/02_dp_ddp_fsdp/memory_per_rank.ipynb).

The reference is a measurement, never a formula: each rank first asks the student's function for
its own prediction (before any process group exists, so the prediction cannot peek), then joins a
gloo group, trains the same model one Adam step under each strategy and counts, tensor by tensor,
what it holds. A DTensor counts its local shard (``to_local()``), the elements the rank owns;
FSDP2 keeps that shard in a buffer padded to ``ceil(dim0 / world_size)`` rows, and the padding is
not counted. Adam's state is every tensor in ``optimizer.state`` (``exp_avg``, ``exp_avg_sq`` and
the per-parameter ``step`` counter).
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading.checks import CheckFailed, run_student

KEYS = ("params", "grads", "adam_state")
STRATEGIES = ("ddp", "fsdp")
DTYPES = {"float32": torch.float32, "float64": torch.float64}

# A model is (name, dtype, layers); a layer is ("linear", in, out, frozen), ("layernorm", n,
# frozen) or ("tanh",), where frozen is False, True (every parameter of the layer) or "bias".
EVEN = ("even", "float32", (("linear", 8, 16, False), ("tanh",), ("linear", 16, 8, False),
                            ("tanh",), ("linear", 8, 4, False)))
UNEVEN = ("uneven", "float32", (("linear", 6, 7, False), ("tanh",), ("linear", 7, 5, True),
                                ("layernorm", 5, False), ("linear", 5, 2, False)))
DOUBLE = ("float64", "float64", (("linear", 5, 10, "bias"), ("tanh",), ("linear", 10, 3, False)))


def build_model(spec, seed: int = 0) -> nn.Sequential:
    """The model a spec describes, with fixed initial values; frozen parameters have
    ``requires_grad=False``."""
    _name, dtype_name, layers = spec
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for layer in layers:
        kind = layer[0]
        if kind == "tanh":
            modules.append(nn.Tanh())
            continue
        module = nn.Linear(layer[1], layer[2]) if kind == "linear" else nn.LayerNorm(layer[1])
        frozen = layer[-1]
        for pname, parameter in module.named_parameters():
            if frozen is True or frozen == pname:
                parameter.requires_grad_(False)
        modules.append(module)
    return nn.Sequential(*modules).to(DTYPES[dtype_name])


def describe(spec) -> str:
    """The model in words, for failure messages: what the student needs to redo the sum."""
    name, dtype_name, layers = spec
    parts = []
    for layer in layers:
        if layer[0] == "tanh":
            continue
        text = (f"Linear({layer[1]}, {layer[2]})" if layer[0] == "linear"
                else f"LayerNorm({layer[1]})")
        if layer[-1] is True:
            text += " frozen"
        elif layer[-1]:
            text += f" with frozen {layer[-1]}"
        parts.append(text)
    return f"model {name!r} ({dtype_name}: {', '.join(parts)})"


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


def _validate(prediction, what: str) -> dict[str, int]:
    if not isinstance(prediction, dict):
        raise CheckFailed(f"{what}: expected a dict with keys {list(KEYS)}, got "
                          f"{type(prediction).__name__}: {prediction!r}")
    if set(prediction) != set(KEYS):
        raise CheckFailed(f"{what}: expected exactly the keys {list(KEYS)}, got "
                          f"{sorted(prediction, key=str)}")
    wrong_type = {k: type(v).__name__ for k, v in prediction.items()
                  if type(v) is not int}
    if wrong_type:
        raise CheckFailed(f"{what}: every value must be an int (bytes), got types {wrong_type}")
    return prediction


def predict(bytes_per_rank, spec, world_size: int, rank: int, strategy: str) -> dict[str, int]:
    """The student's prediction for a fresh copy of the model (it may not reuse ours)."""
    what = f"bytes_per_rank({spec[0]!r} model, world_size={world_size}, rank={rank}, {strategy!r})"
    try:
        prediction = bytes_per_rank(build_model(spec), world_size, rank, strategy)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the exception is the finding
        raise CheckFailed(f"{what} raised {type(exc).__name__}: {exc}") from None
    return _validate(prediction, what)


def compare(spec, strategy: str, world_size: int, measured: dict, predicted: dict) -> list[str]:
    wrong = [k for k in KEYS if measured[k] != predicted[k]]
    if not wrong:
        return []
    detail = "; ".join(f"{k}: measured {measured[k]}, you predicted {predicted[k]}"
                       for k in wrong)
    return [f"{strategy}, world size {world_size}, {describe(spec)}: {detail}"]


def memory_case(rank, world_size, bytes_per_rank, specs, strategies, store_dir):
    """Predictions first (no process group yet), then the measurement; every mismatch of this
    rank in one message."""
    predictions = {(spec[0], s): predict(bytes_per_rank, spec, world_size, rank, s)
                   for spec in specs for s in strategies}
    store = dist.FileStore(os.path.join(store_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    try:
        problems = []
        for spec in specs:
            for strategy in strategies:
                measured = (measure_ddp(spec, rank) if strategy == "ddp"
                            else measure_fsdp(spec, rank, world_size))
                problems += compare(spec, strategy, world_size, measured,
                                    predictions[(spec[0], strategy)])
    finally:
        dist.destroy_process_group()
    if problems:
        raise CheckFailed("\n  ".join(["bytes held after one Adam step differ from the "
                                       "measurement:"] + problems))
    return predictions


def run_memory(bytes_per_rank, world_size: int, specs, strategies=STRATEGIES, **kwargs):
    with tempfile.TemporaryDirectory(prefix="ddpcourse-memory-per-rank-") as store_dir:
        return run_student(memory_case, world_size, bytes_per_rank, tuple(specs),
                           tuple(strategies), store_dir, init_process_group=False, **kwargs)


def expect_value_error(bytes_per_rank, spec, world_size, rank, strategy) -> None:
    what = f"bytes_per_rank(model, world_size={world_size}, rank={rank}, strategy={strategy!r})"
    try:
        got = bytes_per_rank(build_model(spec), world_size, rank, strategy)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the wrong exception type is the finding
        raise CheckFailed(f"{what}: expected ValueError, got {type(exc).__name__}: {exc}") from None
    raise CheckFailed(f"{what}: expected ValueError, got {got!r}")


def errors_case(rank, world_size, bytes_per_rank, cases):
    for ws, r, strategy in cases:
        expect_value_error(bytes_per_rank, EVEN, ws, r, strategy)


VISIBLE_ERRORS = [(2, 0, "zero3"), (2, 2, "ddp"), (2, -1, "fsdp")]


def check_bytes_per_rank_even_model(bytes_per_rank) -> None:
    """Two ranks, every dim 0 divisible by 2: DDP and FSDP2, measured."""
    run_memory(bytes_per_rank, 2, [EVEN])


def check_bytes_per_rank_rejects_bad_arguments(bytes_per_rank) -> None:
    run_student(errors_case, 1, bytes_per_rank, VISIBLE_ERRORS, init_process_group=False)
