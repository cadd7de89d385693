"""How a chapter script reports the claims it checked on its own run.

Every script of a chapter checks what its docstring claims, on the run it just made, and its exit
code says whether all claims held (the tests launch each script and read that code).
"""

from __future__ import annotations

from typing import Callable


def report_checks(problems: list[str], echo: Callable[..., None] = print,
                  label: str = "checks") -> int:
    """Print ``checks: passed``, or ``checks: FAILED`` and one line per claim that failed; return
    the exit code (0 or 1).

    ``echo`` prints (``ctx.print0`` in a script where only rank 0 speaks); ``label`` names what
    was checked when a file has more than one report."""
    echo(f"{label}:", "FAILED" if problems else "passed")
    for problem in problems:
        echo("  -", problem)
    return 1 if problems else 0
