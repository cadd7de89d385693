"""Chapter 02, DP vs DDP vs FSDP: visible checks for ``bytes_per_rank``, and the measurement.

The contract is the docstring of ``bytes_per_rank`` in
solutions/02_dp_ddp_fsdp/memory_per_rank.nb.py (students:
exercises/02_dp_ddp_fsdp/memory_per_rank.ipynb).

The reference is a measurement, never a formula. Each case is a
:class:`~ddpcourse.grading.checks.Case`: every rank asks the student's function for its own
prediction (no process group exists, so the prediction cannot peek) and reports it as data; the
judge, which never runs the student's code, compares it with what ranks that run only the
grader's code hold after one Adam step under each strategy, counted tensor by tensor. A DTensor
counts its local shard (``to_local()``), the elements the rank owns; FSDP2 keeps that shard in a
buffer padded to ``ceil(dim0 / world_size)`` rows, and the padding is not counted. Adam's state
is every tensor in ``optimizer.state`` (``exp_avg``, ``exp_avg_sq`` and the per-parameter
``step`` counter).

The measurement yields the answer of any model, so it is not in this module (the ranks import
it): the hidden checks (autograder/hidden/memory_per_rank.py) measure on the grader's side, and
the visible case's measured bytes are written out (:data:`VISIBLE_MEASURED`), held to a fresh
measurement by tests/test_grading_memory_per_rank.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, judge_each_rank, observed, run_student,
                                      type_name)
from ddpcourse.grading.salted_inputs import DTYPES  # a case names its dtype

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
KEYS = ("params", "grads", "adam_state")
STRATEGIES = ("ddp", "fsdp")

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


_MAX_TEXT = 300  # of a text a rank reports, in a message
_MAX_ENTRIES = 20  # of a returned dict, what a rank reports


def _text(value: Any, limit: int = _MAX_TEXT) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


# What ranks that run only the grader's code hold after one Adam step, for the visible case:
# per rank, {"MODEL/STRATEGY": {"params": ..., "grads": ..., "adam_state": ...}}, keyed by (the
# models' names, the strategies, the world size).
VISIBLE_MEASURED: dict[tuple, list[dict[str, dict[str, int]]]] = {
    (("even",), ("ddp", "fsdp"), 2): [
        {"even/ddp": {"params": 1264, "grads": 1264, "adam_state": 2552},
         "even/fsdp": {"params": 632, "grads": 632, "adam_state": 1288}},
        {"even/ddp": {"params": 1264, "grads": 1264, "adam_state": 2552},
         "even/fsdp": {"params": 632, "grads": 632, "adam_state": 1288}},
    ],
}


def written_out_bytes(specs, strategies, world_size: int) -> list[dict[str, dict[str, int]]]:
    key = (tuple(spec[0] for spec in specs), tuple(strategies), world_size)
    if key not in VISIBLE_MEASURED:
        raise LookupError(f"grader bug: no written-out measurement for {key}: add it to "
                          "VISIBLE_MEASURED, or judge the case with the hidden checks")
    return [{k: dict(held) for k, held in per_rank.items()} for per_rank in VISIBLE_MEASURED[key]]


# --- in the ranks: the predictions, recorded as data ---------------------------------------------


def describe_call(fn, args: tuple) -> dict:
    """What ``fn(*args)`` did, as data: the exception it raised (NotImplementedError, a stub's,
    propagates), or its result: its type, its repr (cut), and for a dict its entries (key, the
    value's type, the value when it is exactly an int)."""
    try:
        result = fn(*args)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - described as data, judged outside the ranks
        return {"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                "message": _text(exc, 500)}
    described = {"raised": None, "type": type_name(result), "repr": _text(repr(result), 500),
                 "entries": None}
    if isinstance(result, dict):
        described["entries"] = [
            [key if type(key) is str else repr(key)[:100], type_name(value),
             value if type(value) is int else None]
            for key, value in list(result.items())[:_MAX_ENTRIES]]
    return described


def observe_memory(rank, world_size, bytes_per_rank, specs, strategies):
    """The rank's predictions, one per model and strategy, each for a fresh copy of the model
    (it may not reuse ours). No process group exists here."""
    return {"predictions": {f"{spec[0]}/{strategy}": describe_call(
        bytes_per_rank, (build_model(spec), world_size, rank, strategy))
        for spec in specs for strategy in strategies}}


def reported_prediction(described: Any, what: str) -> dict[str, int]:
    """The prediction a rank reported, if it is a dict of exactly KEYS with int values."""
    raised = observed(described, "raised", (str, type(None)))
    if raised is not None:
        raise CheckFailed(f"{what} raised {_text(raised)}: "
                          f"{_text(observed(described, 'message', str))}")
    kind, text = observed(described, "type", str), observed(described, "repr", str)
    entries = observed(described, "entries", (list, type(None)))
    if entries is None:
        raise CheckFailed(f"{what}: expected a dict with keys {list(KEYS)}, got "
                          f"{_text(kind)}: {_text(text)}")
    if not all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
               and isinstance(e[1], str) for e in entries):
        raise CheckFailed(f"{what}: the rank's report of the returned dict is malformed")
    keys = [key for key, _, _ in entries]
    if sorted(keys) != sorted(KEYS):
        raise CheckFailed(f"{what}: expected exactly the keys {list(KEYS)}, got "
                          f"{_text(sorted(keys))}")
    wrong_type = {key: _text(kind, 50) for key, kind, value in entries
                  if kind != "int" or type(value) is not int}
    if wrong_type:
        raise CheckFailed(f"{what}: every value must be an int (bytes), got types {wrong_type}")
    return {key: value for key, _, value in entries}


def compare(spec, strategy: str, world_size: int, measured: dict, predicted: dict) -> list[str]:
    wrong = [k for k in KEYS if measured[k] != predicted[k]]
    if not wrong:
        return []
    detail = "; ".join(f"{k}: measured {measured[k]}, you predicted {predicted[k]}"
                       for k in wrong)
    return [f"{strategy}, world size {world_size}, {describe(spec)}: {detail}"]


def judge_memory(observations, world_size, specs, strategies):
    """The visible case's judge: its measurement is written out."""
    judge_memory_with(written_out_bytes, observations, world_size, specs, strategies)


def judge_memory_with(measured_bytes, observations, world_size, specs, strategies):
    """``measured_bytes(specs, strategies, world_size)``: per rank, what it holds."""
    measured = measured_bytes(specs, strategies, world_size)

    def judge_rank(rank, observation):
        predictions = observed(observation, "predictions", dict)
        problems = []
        for spec in specs:
            for strategy in strategies:
                what = (f"bytes_per_rank({spec[0]!r} model, world_size={world_size}, "
                        f"rank={rank}, {strategy!r})")
                key = f"{spec[0]}/{strategy}"
                predicted = reported_prediction(observed(predictions, key, dict), what)
                problems += compare(spec, strategy, world_size, measured[rank][key], predicted)
        if problems:
            raise CheckFailed("\n  ".join(["bytes held after one Adam step differ from the "
                                           "measurement:"] + problems))

    judge_each_rank(observations, judge_rank)


MEMORY = Case(observe_memory, judge_memory)


def run_memory(bytes_per_rank, world_size: int, specs, strategies=STRATEGIES, case=MEMORY,
               **kwargs):
    return run_student(case, world_size, bytes_per_rank, tuple(specs), tuple(strategies),
                       init_process_group=False, **kwargs)


def observe_errors(rank, world_size, bytes_per_rank, cases):
    """What each call with bad arguments did (it should raise ValueError)."""
    return {"calls": [describe_call(bytes_per_rank, (build_model(EVEN), ws, r, strategy))
                      for ws, r, strategy in cases]}


def judge_errors(observations, world_size, cases):
    def judge_rank(rank, observation):
        calls = observed(observation, "calls", list)
        if len(calls) != len(cases):
            raise CheckFailed(f"the rank's report has {len(calls)} calls, not {len(cases)}")
        for (ws, r, strategy), described in zip(cases, calls):
            what = f"bytes_per_rank(model, world_size={ws}, rank={r}, strategy={strategy!r})"
            raised = observed(described, "raised", (str, type(None)))
            if raised is None:
                raise CheckFailed(f"{what}: expected ValueError, got "
                                  f"{_text(observed(described, 'repr', str))}")
            message = observed(described, "message", str)
            if observed(described, "value_error", bool) is not True:
                raise CheckFailed(f"{what}: expected ValueError, got {_text(raised)}: "
                                  f"{_text(message)}")

    judge_each_rank(observations, judge_rank)


ERRORS = Case(observe_errors, judge_errors)
VISIBLE_ERRORS = [(2, 0, "zero3"), (2, 2, "ddp"), (2, -1, "fsdp")]


def check_bytes_per_rank_even_model(bytes_per_rank) -> None:
    """Two ranks, every dim 0 divisible by 2: DDP and FSDP2, measured."""
    run_memory(bytes_per_rank, 2, [EVEN])


def check_bytes_per_rank_rejects_bad_arguments(bytes_per_rank) -> None:
    run_student(ERRORS, 1, bytes_per_rank, VISIBLE_ERRORS, init_process_group=False)
