"""Expected tensors written out as digests, for visible judges that must not compute them.

A visible checks module ships to students and is importable in the ranks, so it may not hold a
function that computes a case's answer (a one-process reference run, say): the expected tensors
of its visible cases are written out instead, and the hidden checks (autograder/hidden/) judge
their own cases with the reference itself. A model's whole state written out would be long, so a
visible module writes each tensor's :func:`digest`: a few numbers (its sum and three fixed signed
sums) that a test computes from the reference (tests/test_grading_SLUG.py), and a judge compares
with :func:`expect_digest`.

The comparison keeps the judge's tolerance: a tensor within ``atol + rtol * |w|`` of the
expected one, element by element, moves each signed sum by at most the sum of those allowances,
so a right answer never fails; a wrong one fails when its error does not cancel out in all four
sums (a weight off by more than the allowance of the whole tensor always shows).
"""

from __future__ import annotations

import pprint
from typing import Callable

import torch

from ddpcourse.grading.checks import CheckFailed

# Float64 rounding of the digest itself, relative to the sum of |w| (a float32 tensor of a few
# thousand elements sums with an error far below this).
_ROUNDING = 1e-12
_SIGN_SEEDS = (1, 2, 3)


def _signs(numel: int) -> torch.Tensor:
    """Three fixed rows of +-1 per length (the same on every machine: torch's CPU generator)."""
    rows = [torch.randint(0, 2, (numel,), generator=torch.Generator().manual_seed(seed),
                          dtype=torch.int64) * 2 - 1 for seed in _SIGN_SEEDS]
    return torch.stack([torch.ones(numel, dtype=torch.int64)] + rows).double()


def digest(tensor: torch.Tensor) -> tuple[float, ...]:
    """The sum of the tensor's elements and three signed sums, in float64."""
    flat = tensor.detach().reshape(-1).double()
    return tuple(float(v) for v in _signs(flat.numel()) @ flat)


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[float, ...]]:
    """:func:`digest` of every tensor of a state, by name (what a visible module writes out)."""
    return {name: digest(tensor) for name, tensor in tensors.items()}


def differs_from(tensor: torch.Tensor, written: tuple[float, ...], rtol: float,
                 atol: float) -> float | None:
    """How far ``tensor``'s digest is from ``written`` beyond what ``atol + rtol * |w|`` per
    element allows (None: within it)."""
    flat = tensor.detach().reshape(-1).double()
    got = _signs(flat.numel()) @ flat
    want = torch.tensor(written, dtype=torch.float64)
    scale = flat.abs().sum().item() + want.abs().max().item()
    allowed = atol * flat.numel() + rtol * flat.abs().sum().item() + _ROUNDING * scale
    excess = ((got - want).abs() - allowed).max().item()
    return None if excess <= 0 else excess + allowed


def expect_digest(tensor: torch.Tensor, written: tuple[float, ...], what: str, rtol: float,
                  atol: float, hint: str = "") -> None:
    """CheckFailed unless ``tensor`` matches the written-out digest within the tolerance; the
    message is ``what`` (the tensor, and what it must equal), then the numbers, then ``hint``."""
    if len(written) != len(_SIGN_SEEDS) + 1:
        raise LookupError(f"grader bug: a written-out digest has {len(written)} numbers")
    if not torch.isfinite(tensor).all():
        raise CheckFailed(f"{what}: it holds inf or NaN{hint}")
    difference = differs_from(tensor, written, rtol, atol)
    if difference is not None:
        raise CheckFailed(f"{what}: its sum is "
                          f"{float(tensor.double().sum()):.6g}, expected {written[0]:.6g} "
                          f"(a signed sum is off by {difference:.3g}; allowed "
                          f"{atol:g} + {rtol:g} * |w| per element){hint}")


# --- tables of written-out truths (chapter 09's labs) --------------------------------------------


def sum_and_norm(tensor: torch.Tensor) -> list[float]:
    """The shorter digest chapter 09's tables write for a tensor: its sum and its 2-norm
    (float64); their judges bound the difference by what the element-wise tolerance allows."""
    t = tensor.detach().double()
    return [t.sum().item(), t.norm().item()]


def table_lookup(table: dict[str, dict[str, dict]], lab: str,
                 key: Callable[..., str]) -> Callable[..., dict]:
    """The visible cases' truth for ``lab``: a function of a case's situation arguments that
    returns ``table[lab][key(*situation)]``, and refuses (a grader bug, never the student's) a
    situation the table does not hold."""
    def truth(*situation) -> dict:
        name = key(*situation)
        if name not in table.get(lab, {}):
            raise RuntimeError(f"no written-out truth for {lab} in {name}: judge it with the "
                               "grader's hidden checks")
        return table[lab][name]
    return truth


def table_literal(truths: dict) -> str:
    """``truths`` as the Python literal a visible module holds (``WRITTEN_OUT: ... = {...}``),
    one line per list of numbers: what ``python -m autograder.hidden.SLUG`` prints."""
    def literal(value, indent: int) -> str:
        if isinstance(value, dict):
            inner = " " * (indent + 4)
            items = [f"{inner}{key!r}: {literal(item, indent + 4)}," for key, item in value.items()]
            return "{\n" + "\n".join(items) + "\n" + " " * indent + "}"
        if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
            inner = " " * (indent + 4)
            items = [f"{inner}{literal(item, indent + 4)}," for item in value]
            return "[\n" + "\n".join(items) + "\n" + " " * indent + "]"
        return pprint.pformat(value, width=10_000)
    return "WRITTEN_OUT: dict[str, dict[str, dict]] = " + literal(truths, 0)
