"""What the grading tests share to hold a visible module's written-out values to the hidden
reference (ddpcourse/grading/written_out.py)."""

from __future__ import annotations

import math

# A written-out digest is the reference's on the machine that wrote it; another machine's float32
# training may round a few ulps differently.
DIGEST_RTOL, DIGEST_ATOL = 1e-6, 1e-7


def assert_digests_close(written: dict, reference: dict) -> None:
    """Every tensor's written-out digest is the reference's (same names, numbers close)."""
    assert set(written) == set(reference), (sorted(written), sorted(reference))
    for name, numbers in written.items():
        assert len(numbers) == len(reference[name]), name
        for got, want in zip(numbers, reference[name]):
            assert math.isclose(got, want, rel_tol=DIGEST_RTOL, abs_tol=DIGEST_ATOL), \
                (name, numbers, reference[name])
