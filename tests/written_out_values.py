"""What the grading tests share to hold a visible module's written-out values to the hidden
reference (ddpcourse/grading/written_out.py)."""

from __future__ import annotations

import math

# A written-out digest is the reference's on the machine that wrote it; another machine's float32
# kernels round differently (up to ~2e-6 relative on a digest, measured on an AMD EPYC against
# digests written on another machine). Half the tightest judge's tolerance on a digest (atol 1e-6,
# rtol 1e-5 per element) leaves the other half to the student's own rounding, so a visible
# verdict is the reference's on any machine.
DIGEST_RTOL, DIGEST_ATOL = 5e-6, 5e-7


def assert_digests_close(written: dict, reference: dict) -> None:
    """Every tensor's written-out digest is the reference's (same names, numbers close)."""
    assert set(written) == set(reference), (sorted(written), sorted(reference))
    for name, numbers in written.items():
        assert len(numbers) == len(reference[name]), name
        # a digest's numbers are sums over the tensor: their rounding follows the size of what
        # was summed, not of the result (a sum can cancel), so the absolute floor scales with
        # the digest's largest number
        scale = max([1.0, *(abs(x) for x in reference[name])])
        for got, want in zip(numbers, reference[name]):
            assert math.isclose(got, want, rel_tol=DIGEST_RTOL, abs_tol=DIGEST_ATOL * scale), \
                (name, numbers, reference[name])
