"""Chapter 11, tensor parallelism by hand: visible checks for ``ColumnParallelLinear`` and
``RowParallelLinear``, and the case the hidden checks reuse.

The contract is the docstrings of the two classes in
solutions/11_beyond_ddp/tensor_parallel_linear.nb.py (students:
exercises/11_beyond_ddp/tensor_parallel_linear.ipynb).

Each case is a :class:`~ddpcourse.grading.checks.Case`. In every rank the observe builds the dense
layers from a seed, wraps them in the student's classes over this rank's tensor-parallel group
(the contiguous ranks ``[k * tp, (k + 1) * tp)``; each group gets its own input), runs one forward
and one backward with a fixed output gradient, and reports what the module holds (its
parameters' shapes and sizes, every tensor it keeps), what came out (the output, the input's
gradient, the parameters' gradients) and the dense layers as the student's classes left them
(unchanged: :mod:`ddpcourse.grading.left_unchanged`). The judge rebuilds the dense layers and
the inputs from the same seeds and runs them in one process: the sharded layers must give the
dense output and gradients, each rank's share of them, to float64 rounding. The mode "repeat"
(a hidden case) calls each layer twice before one backward, with a residual: the contract is the
layers' behaviour, however their collectives are written (an autograd.Function or a hook), and a
layer that hooks the caller's tensor, or sums the input's gradient only once per module, gives
wrong input gradients there. The answer (how to shard, which collective goes where) is nowhere here:
only the dense layer the result must equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, by_rank, cut_text, expect_close,
                                      observed, run_student, type_name)
from ddpcourse.grading.exercises.sharded_optimizer import reachable_tensors
from ddpcourse.grading.left_unchanged import copy_of, judge_left_unchanged

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
BATCH = 3
TOLERANCE = (1e-10, 1e-12)  # float64: the sharded sums differ from the dense ones by rounding
NAMES = {"column": "ColumnParallelLinear", "row": "RowParallelLinear",
         "mlp": "ColumnParallelLinear -> tanh -> RowParallelLinear",
         "repeat": "y = x + Row(tanh(Column(x))), then the same layers again on y (residual, "
                   "each layer called twice before one backward)"}


def dense_layers(sizes: tuple[int, int, int], bias: bool, seed: int) -> tuple[nn.Linear, nn.Linear]:
    """Linear(sizes[0], sizes[1]) and Linear(sizes[1], sizes[2]), float64, from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        first = nn.Linear(sizes[0], sizes[1], bias=bias).double()
        second = nn.Linear(sizes[1], sizes[2], bias=bias).double()
    return first, second


def dense_state(first: nn.Linear, second: nn.Linear) -> dict[str, torch.Tensor]:
    """The dense layers' parameters by name (``first.weight``, ...), as they are now."""
    return {f"{which}.{name}": p for which, layer in (("first", first), ("second", second))
            for name, p in layer.named_parameters()}


def group_data(sizes: tuple[int, int, int], seed: int, group_index: int):
    """The input and the output gradient of one tensor-parallel group (each group its own)."""
    generator = torch.Generator().manual_seed(seed * 101 + group_index)
    x = torch.randn(BATCH, sizes[0], generator=generator, dtype=torch.float64)
    grads = {width: torch.randn(BATCH, width, generator=generator, dtype=torch.float64)
             for width in sorted(set(sizes))}
    return x, grads


def my_group(rank: int, world_size: int, tp_size: int):
    """This rank's tensor-parallel group: the default group when it spans every rank; else every
    rank creates every group (contiguous blocks of tp_size ranks) and keeps its own."""
    if tp_size == world_size:
        return dist.group.WORLD
    mine = None
    for start in range(0, world_size, tp_size):
        group = dist.new_group(list(range(start, start + tp_size)))
        if start <= rank < start + tp_size:
            mine = group
    return mine


def held(module: Any) -> dict:
    """What a module keeps: its parameters by name, and the elements of every tensor it reaches
    (parameters, buffers, attributes, in lists and dicts too; gradients left out)."""
    if not isinstance(module, nn.Module):
        return {"is_module": False, "type": type_name(module)}
    storages = {}
    for t in reachable_tensors(module, grads=False):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes() // max(t.element_size(), 1)
    return {"is_module": True, "elements": int(sum(storages.values())),
            "parameters": sorted(name for name, _ in module.named_parameters())}


def grads_of(module: Any) -> dict:
    out = {}
    for name in ("weight", "bias"):
        value = getattr(module, name, None)
        out[name] = None if value is None else {
            "is_parameter": isinstance(value, nn.Parameter),
            "shape": list(value.shape) if isinstance(value, torch.Tensor) else None,
            "grad": value.grad.detach().clone() if isinstance(value, torch.Tensor)
            and value.grad is not None else None}
    return out


def residual_twice(column, row, x: torch.Tensor) -> torch.Tensor:
    """``y = x + row(tanh(column(x)))``, then the same on ``y``: each layer is called twice
    before backward, and its input also reaches the output another way (the residual)."""
    y = x + row(torch.tanh(column(x)))
    return y + row(torch.tanh(column(y)))


def observe_layers(rank, world_size, classes, mode, sizes, bias, seed, tp_size):
    """One forward and backward of the student's layer(s) (``mode``: "column", "row", "mlp",
    column then tanh then row, or "repeat", :func:`residual_twice`) on this rank's group; what
    the layers hold and produced."""
    ColumnParallelLinear, RowParallelLinear = classes
    group = my_group(rank, world_size, tp_size)
    tp_rank, group_index = rank % tp_size, rank // tp_size
    first, second = dense_layers(sizes, bias, seed)
    x, out_grads = group_data(sizes, seed, group_index)
    report: dict[str, Any] = {}
    if mode == "column":
        layer = ColumnParallelLinear(first, group)
        inp = x.clone().requires_grad_(True)
        out = layer(inp)
        share = sizes[1] // tp_size
        out.backward(out_grads[sizes[1]][:, tp_rank * share:(tp_rank + 1) * share])
        report["layers"] = {"column": held(layer)}
        report["grads"] = {"column": grads_of(layer)}
    elif mode == "row":
        layer = RowParallelLinear(first, group)
        share = sizes[0] // tp_size
        inp = x[:, tp_rank * share:(tp_rank + 1) * share].clone().requires_grad_(True)
        out = layer(inp)
        out.backward(out_grads[sizes[1]])
        report["layers"] = {"row": held(layer)}
        report["grads"] = {"row": grads_of(layer)}
    else:
        column, row = ColumnParallelLinear(first, group), RowParallelLinear(second, group)
        inp = x.clone().requires_grad_(True)
        if mode == "repeat":
            out = residual_twice(column, row, inp)
        else:
            out = row(torch.tanh(column(inp)))
        out.backward(out_grads[sizes[2]])
        report["layers"] = {"column": held(column), "row": held(row)}
        report["grads"] = {"column": grads_of(column), "row": grads_of(row)}
    report["output"] = out.detach().clone()
    report["input_grad"] = None if inp.grad is None else inp.grad.detach().clone()
    report["dense"] = copy_of(dense_state(first, second))  # as the layers left them
    return report


def expected_of(mode, sizes, bias, seed, tp_size, group_index):
    """The dense layer(s) in one process on the group's input: output, input gradient, and
    each layer's weight and bias gradients (full)."""
    first, second = dense_layers(sizes, bias, seed)
    x, out_grads = group_data(sizes, seed, group_index)
    x = x.clone().requires_grad_(True)
    if mode == "column" or mode == "row":
        out = first(x)
        out.backward(out_grads[sizes[1]])
        layers = {mode: first}
    else:
        out = (residual_twice(first, second, x) if mode == "repeat"
               else second(torch.tanh(first(x))))
        out.backward(out_grads[sizes[2]])
        layers = {"column": first, "row": second}
    return {"output": out.detach(), "input_grad": x.grad,
            "grads": {name: {"weight": layer.weight.grad,
                             "bias": None if layer.bias is None else layer.bias.grad}
                      for name, layer in layers.items()}}


def shard(kind: str, name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's share of a dense parameter (or its gradient) in the contract's layout: a
    column-parallel layer keeps rows of the weight and of the bias; a row-parallel layer keeps
    columns of the weight and the whole bias."""
    if kind == "column":
        return full.tensor_split(tp_size, dim=0)[tp_rank]
    if name == "weight":
        return full.tensor_split(tp_size, dim=1)[tp_rank]
    return full


def judge_layers(observations, world_size, mode, sizes, bias, seed, tp_size):
    shape = tuple(sizes[:2]) if mode in ("column", "row") else tuple(sizes)
    what = (f"{NAMES[mode]} of Linear{shape}"
            f"{'' if bias else ' without bias'}, tensor-parallel groups of {tp_size} ranks")
    rtol, atol = TOLERANCE
    wrong = []
    for rank, report in enumerate(observations):
        tp_rank = rank % tp_size
        expected = expected_of(mode, sizes, bias, seed, tp_size, rank // tp_size)
        try:
            if not isinstance(report, dict):
                raise CheckFailed(f"the rank's report is a {type_name(report)}")
            layers = observed(report, "layers", dict)
            grads = observed(report, "grads", dict)
            for kind, dense_grads in expected["grads"].items():
                holds = observed(layers, kind, dict)
                if observed(holds, "is_module", bool) is not True:
                    raise CheckFailed(f"the {kind}-parallel layer is a "
                                      f"{cut_text(holds.get('type'), 100)}, not an nn.Module")
                wanted = 0
                for name in ("weight", "bias"):
                    entry = observed(grads, kind, dict).get(name)
                    dense = dense_grads[name]
                    if dense is None:
                        if entry is not None:
                            raise CheckFailed(f"the {kind}-parallel layer has a {name}, the dense "
                                              "layer has none: its bias must be None")
                        continue
                    want = shard(kind, name, dense, tp_rank, tp_size)
                    wanted += want.numel()
                    if not isinstance(entry, dict) or entry.get("is_parameter") is not True:
                        raise CheckFailed(f"the {kind}-parallel layer's .{name} is not an "
                                          "nn.Parameter")
                    if entry.get("shape") != list(want.shape):
                        raise CheckFailed(f"the {kind}-parallel layer's .{name} has shape "
                                          f"{cut_text(entry.get('shape'), 80)}; this rank's share "
                                          f"is {list(want.shape)}")
                    got = entry.get("grad")
                    if not isinstance(got, torch.Tensor):
                        raise CheckFailed(f"the {kind}-parallel layer's .{name} got no gradient")
                    expect_close(got, want, f"the {kind}-parallel layer's {name} gradient",
                                 rtol, atol, tp_size)
                elements = observed(holds, "elements", int)
                if elements > wanted:
                    raise CheckFailed(f"the {kind}-parallel layer keeps {elements} elements in "
                                      f"tensors; its share of the dense layer is {wanted}: it must "
                                      "hold only this rank's shard (a view of the dense weight "
                                      "keeps all of it: clone the slice)")
            want_out = expected["output"]
            if mode == "column":
                want_out = want_out.tensor_split(tp_size, dim=1)[tp_rank]
            expect_close(observed(report, "output", torch.Tensor), want_out,
                         "the output" + (" (this rank's columns)" if mode == "column" else ""),
                         rtol, atol, tp_size)
            want_in = expected["input_grad"]
            if mode == "row":
                want_in = want_in.tensor_split(tp_size, dim=1)[tp_rank]
            got_in = report.get("input_grad")
            if not isinstance(got_in, torch.Tensor):
                raise CheckFailed("the input got no gradient: the layer must stay in autograd")
            expect_close(got_in, want_in, "the input's gradient"
                         + (" (this rank's columns)" if mode == "row" else " (the whole input)"),
                         rtol, atol, tp_size)
            judge_left_unchanged(observed(report, "dense", dict),
                                 dense_state(*dense_layers(sizes, bias, seed)),
                                 "the layer's construction, forward and backward",
                                 "the dense nn.Linear's", "parameters",
                                 "the layer copies its shard of the dense layer passed in, and "
                                 "never changes that layer")
        except CheckFailed as failed:
            wrong.append((rank, str(failed)))
    if wrong:
        raise CheckFailed(f"{what}:\n{by_rank(wrong)}")


LAYERS = Case(observe_layers, judge_layers)


def _run(world_size, classes, *args):
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(LAYERS, world_size, classes, *args)


def check_column_parallel(classes) -> None:
    """2 ranks, Linear(4, 6): output columns, whole input gradient, weight and bias gradients."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(2, classes, "column", (4, 6, 2), True, 0, 2)


def check_row_parallel(classes) -> None:
    """2 ranks, Linear(6, 4): whole output, input gradient columns, weight and bias gradients."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(2, classes, "row", (6, 4, 2), True, 1, 2)


def check_mlp(classes) -> None:
    """3 ranks: Linear(5, 6) column-parallel, tanh, Linear(6, 4) row-parallel = the dense MLP."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(3, classes, "mlp", (5, 6, 4), True, 2, 3)
