"""How a chapter script reports the claims it checked on its own run.

Every script of a chapter checks what its docstring claims, on the run it just made, and its exit
code says whether all claims held (the tests launch each script and read that code).
:func:`report_checks` reports one list of contradicted claims; :func:`report_checks_of_every_rank`
is for a script whose ranks each check their own run: it gathers every rank's list, rank 0 prints
one report, and every rank returns the same exit code.
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


def report_checks_of_every_rank(problems: list[str], group=None,
                                echo: Callable[..., None] = print, label: str = "checks") -> int:
    """Every rank calls this with the claims its own run contradicted (a collective of ``group``,
    which must be able to send Python objects: a gloo group, or NCCL with a current device).

    Rank 0 reports them all with :func:`report_checks`, each claim once, led by the ranks that
    found it (``ranks 0, 1: ...``); the other ranks print nothing. Every rank returns the same
    exit code, 1 if any rank found a problem."""
    import torch.distributed as dist  # here only: report_checks itself needs no torch

    every: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, list(problems), group=group)
    finders: dict[str, list[int]] = {}
    for rank, found in enumerate(every):
        for problem in found:
            finders.setdefault(problem, []).append(rank)
    lines = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {problem}"
             for problem, ranks in finders.items()]
    if dist.get_rank(group) != 0:
        return 1 if lines else 0
    return report_checks(lines, echo=echo, label=label)
