"""Per-rank inputs that no rank can compute for another: drawn with a salt each rank keeps.

Why: a case whose expected answer combines every rank's input (a sum, a mean of gradients) must
not let a rank rebuild the other ranks' inputs from the grader's own generators, or a submission
could skip the communication it is graded on (tests/test_grading_gaming.py tries exactly that).
So each rank draws a fresh salt (:func:`fresh_salt`) and seeds its input's generator with the
case's seed, its rank and that salt (:func:`rank_generator`); it reports the salt with its
observation, and the judge, once every rank has reported, rebuilds every input from the reported
salts (:func:`reported_salts`). The expected value is then an invariant of the observations (the
sum of what the ranks held before the call), never a reference implementation.

:data:`DTYPES` names the dtypes a case may ask for (a case's arguments are plain data);
:data:`TOLERANCES` is how close a sum or mean of a few ranks' values must come, per dtype
(integers: exactly).
"""

from __future__ import annotations

import secrets
from typing import Any, Sequence

import torch

from ddpcourse.grading.checks import CheckFailed, judge_each_rank, observed

SALT_BITS = 31
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
# (rtol, atol) of a sum or mean over a few ranks, whose order of additions the ranks choose
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


def fresh_salt() -> int:
    """A salt a rank draws for its own input: unknown to every other rank."""
    return secrets.randbits(SALT_BITS)


def reported_salts(observations: Sequence[Any]) -> list[int]:
    """Every rank's ``"salt"``, read as untrusted data (one CheckFailed naming every rank whose
    report has none, or one out of range)."""
    salts: list[int] = []

    def read(rank, observation):
        salt = observed(observation, "salt", int)
        if not 0 <= salt < 2**SALT_BITS:
            raise CheckFailed(f"the rank's report has a salt out of range: {salt}")
        salts.append(salt)

    judge_each_rank(observations, read)
    return salts


def rank_generator(seed: int, rank: int, salt: int) -> torch.Generator:
    """The generator of rank ``rank``'s input (seeded by the case, the rank and its salt)."""
    return torch.Generator().manual_seed((seed * 1009 + rank) * 2**SALT_BITS + salt)


def salted_tensor(rank: int, shape: Sequence[int], dtype: torch.dtype, seed: int,
                  salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input tensor: normal values for floating dtypes, integers in
    [-1000, 1000) otherwise, drawn from :func:`rank_generator`."""
    generator = rank_generator(seed, rank, salt)
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=generator, dtype=dtype)
    return torch.randint(-1000, 1000, tuple(shape), generator=generator, dtype=dtype)


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for ``dtype`` (:data:`TOLERANCES`; exact for integers)."""
    return TOLERANCES.get(dtype, (0.0, 0.0))
