"""The errors :func:`ddpcourse.launcher.run_ranks` raises, written to be read by a student.

A failed multi-process run must say *which* rank failed, *how* (raised, exited, crashed, hung),
and *where* (the rank's own traceback or its Python stack at the deadline) - never a bare
"process exited".
"""

from __future__ import annotations

import pickle
import signal
from dataclasses import dataclass, field


@dataclass
class RankFailure:
    """What went wrong in one rank.

    ``kind`` is one of ``"raised"`` (an exception escaped, ``traceback`` holds it), ``"exited"``
    (the process ended without returning: ``os._exit``, a signal, a segfault; see ``exitcode``),
    ``"timeout"`` (still running at the deadline; ``stack`` holds its Python stacks), or
    ``"stopped"`` (killed by the launcher because another rank had already failed).
    """

    rank: int
    kind: str
    exitcode: int | None = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    stack: str = ""
    output_tail: str = ""
    exception_bytes: bytes | None = field(default=None, repr=False)

    @property
    def exception(self) -> BaseException | None:
        """The rank's exception object, rebuilt in this process when it could be pickled."""
        if self.exception_bytes is None:
            return None
        try:
            return pickle.loads(self.exception_bytes)
        except Exception:
            return None

    def headline(self) -> str:
        if self.kind == "raised":
            return f"rank {self.rank} raised {self.exc_type}: {self.message}"
        if self.kind == "timeout":
            return f"rank {self.rank} did not finish before the deadline"
        if self.kind == "stopped":
            return f"rank {self.rank} was stopped by the launcher after another rank failed"
        return f"rank {self.rank} {describe_exit(self.exitcode)}"

    def details(self) -> str:
        parts = [self.headline()]
        if self.traceback:
            parts.append(_indent(self.traceback))
        if self.stack:
            parts.append(_indent("Python stack at the deadline:\n" + self.stack))
        if self.output_tail and self.kind != "stopped":
            parts.append(_indent("last output:\n" + self.output_tail))
        return "\n".join(parts)


def describe_exit(exitcode: int | None) -> str:
    """'exited with code 3', 'was killed by signal SIGSEGV (-11)', ..."""
    if exitcode is None:
        return "ended without reporting an exit code"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode}) without returning"
    return f"exited with code {exitcode} without returning"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


class RankError(RuntimeError):
    """One or more ranks failed. ``failures`` lists every rank that did not return, the rank that
    failed first leading."""

    def __init__(self, failures: list[RankFailure], world_size: int, backend: str, intro: str = ""):
        self.failures = failures
        self.world_size = world_size
        self.backend = backend
        ranks = [f.rank for f in failures if f.kind != "stopped"]
        intro = intro or f"rank(s) {ranks} failed"
        body = "\n".join(f.details() for f in failures)
        super().__init__(f"{intro} (world_size={world_size}, backend={backend})\n{body}")

    @property
    def failed_ranks(self) -> list[int]:
        return [f.rank for f in self.failures if f.kind != "stopped"]


class RankTimeoutError(RankError):
    """At least one rank was still running at the deadline (deadlock, endless loop, long sleep)."""
