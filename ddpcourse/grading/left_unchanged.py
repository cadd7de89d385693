"""A shared judge: what the grader handed in is left as it was, bit for bit.

Several contracts say "leave the input alone": average_gradients changes the gradients, never
the parameters; an evaluation leaves the model's parameters and buffers as they were; a
tensor-parallel layer copies its shard of the dense layer it is given; a fit must not modify the
rows it is given. The verdict is the same in each: the rank reports what it holds after the
student's call (plain data), and the judge compares it with what the grader handed in, rebuilt on
its own side from the case's arguments (:func:`judge_left_unchanged`); nothing here knows the
exercise's answer, only the input. Where the judge cannot rebuild the input (a model some earlier
step changed), the rank keeps a copy before the call (:func:`copy_of`) and reports whether the
input is :func:`identical` to it afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddpcourse.grading.checks import CheckFailed, cut_text, type_name

_MAX_TEXT = 300


def copy_of(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached clones of named tensors (a model's ``named_parameters()``, its ``state_dict()``):
    what a rank keeps or reports instead of the tensors the student's code can still reach."""
    return {name: t.detach().clone() for name, t in dict(named).items()}


def identical(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same data: tensors of one dtype, shape and values (NaN where
    the other has NaN), lists, tuples and dicts of identical items, other values equal. Never
    raises: a value whose comparison fails is not identical."""
    try:
        if a is b:
            return True
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.dtype == b.dtype and a.shape == b.shape
                    and bool(torch.equal(a, b) or (a.dtype.is_floating_point and torch.equal(
                        a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0),
                                                              b.nan_to_num(0.0)))))
        if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
            return (type(a) is type(b) and len(a) == len(b)
                    and all(identical(x, y) for x, y in zip(a, b)))
        if isinstance(a, dict) or isinstance(b, dict):
            return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                    and all(identical(a[k], b[k]) for k in a))
        if type(a) is float and type(b) is float and a != a and b != b:
            return True  # NaN, as left
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - something put there refuses comparison
        return False


def judge_left_unchanged(reported: Any, handed_in: Mapping[str, torch.Tensor], what: str,
                         whose: str, kind: str, rule: str) -> None:
    """CheckFailed unless ``reported`` (a rank's report, after the student's call, of the named
    tensors the grader handed in; untrusted) holds exactly the names of ``handed_in`` (the
    tensors as the grader handed them in, rebuilt by the judge), each a dense CPU tensor
    identical to the one handed in. Messages: ``what`` names the call, ``whose`` and ``kind``
    the tensors ("the model's", "parameters and buffers"), ``rule`` says what to do instead."""
    if not isinstance(reported, dict):
        raise CheckFailed(f"{what}: the rank's report of {whose} {kind} is a "
                          f"{type_name(reported)}")
    if set(reported) != set(handed_in):
        raise CheckFailed(f"{what}: after the call, {whose} {kind} are "
                          f"{cut_text(sorted(map(str, reported)), _MAX_TEXT)}, expected "
                          f"{sorted(handed_in)}")
    for name, want in handed_in.items():
        got, want = reported[name], want.detach()
        if (not isinstance(got, torch.Tensor) or got.layout != torch.strided
                or got.device.type != "cpu" or got.shape != want.shape
                or got.dtype != want.dtype):
            raise CheckFailed(f"{what}: after the call, {name!r} is not a {want.dtype} tensor "
                              f"of shape {tuple(want.shape)} (the report has {type_name(got)})")
        if not identical(got, want):
            raise CheckFailed(f"{what}: the call changed {whose} {name!r}; {rule}")
