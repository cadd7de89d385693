"""How a chapter script reports the claims it checked on its own run.

Every script of a chapter checks what its docstring claims, on the run it just made, and its exit
code says whether all claims held (the tests launch each script and read that code).
"""

from __future__ import annotations


def report_checks(problems: list[str]) -> int:
    """Print ``checks: passed``, or ``checks: FAILED`` and one line per claim that failed; return
    the exit code (0 or 1)."""
    print("checks:", "FAILED" if problems else "passed")
    for problem in problems:
        print("  -", problem)
    return 1 if problems else 0
