"""Digests of written-out tensors (ddpcourse/grading/written_out.py): a tensor within the judge's
tolerance of the expected one, element by element, always passes its digest; an error larger than
the whole tensor's allowance always fails it, and so does one of the errors the checks look for."""

from __future__ import annotations

import pytest
import torch

from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.written_out import differs_from, digest, expect_digest

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("seed", range(20))
def test_anything_within_the_tolerance_passes(seed):
    generator = torch.Generator().manual_seed(seed)
    want = torch.randn(7, 5, generator=generator)
    # every element moved by almost its whole allowance, in random directions
    signs = torch.randint(0, 2, want.shape, generator=generator) * 2 - 1
    got = want + signs * 0.99 * (ATOL + RTOL * want.abs())
    assert torch.allclose(got, want, rtol=RTOL, atol=ATOL)
    expect_digest(got, digest(want), "w", RTOL, ATOL)


def test_an_error_beyond_the_allowance_fails_and_is_said():
    want = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    allowance = ATOL * want.numel() + RTOL * want.abs().sum().item()
    got = want.clone()
    got[2, 1] += 1.5 * allowance
    assert differs_from(got, digest(want), RTOL, ATOL) is not None
    with pytest.raises(CheckFailed, match=r"^'w' is off: its sum is .*expected .*allowed"):
        expect_digest(got, digest(want), "'w' is off", RTOL, ATOL)
    with pytest.raises(CheckFailed, match="inf or NaN"):
        expect_digest(torch.full((2,), float("nan")), digest(want[0, :2]), "w", RTOL, ATOL)


def test_errors_that_cancel_in_the_sum_show_in_a_signed_sum():
    want = torch.zeros(8)
    got = want.clone()
    got[0], got[1] = 0.1, -0.1  # the sum is unchanged
    assert digest(got)[0] == digest(want)[0]
    assert differs_from(got, digest(want), RTOL, ATOL) is not None
