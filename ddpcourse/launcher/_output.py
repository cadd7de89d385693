"""Relay what ranks print to the caller's ``sys.stdout``, prefixed ``[rank R]``, while they run.

In a notebook the ranks' own stdout is the kernel's terminal, which the student never sees; this
copies each rank's log into the cell instead. A cap per rank keeps a runaway ``print`` loop from
flooding the caller (or an autograder's feedback file); the tail of the log is still available for
error reports.
"""

from __future__ import annotations

import os
import sys


class RankOutput:
    def __init__(self, path: str, rank: int, max_bytes: int, relay: bool):
        self.path = path
        self.prefix = f"[rank {rank}] "
        self.max_bytes = max_bytes
        self.relay = relay
        self.read = 0
        self.partial = ""
        self.truncated = False

    def pump(self, final: bool = False) -> None:
        if not self.relay or self.truncated:
            return
        try:
            with open(self.path, "rb") as f:
                f.seek(self.read)
                chunk = f.read(self.max_bytes - self.read + 1)
        except FileNotFoundError:
            return
        if len(chunk) > self.max_bytes - self.read:
            chunk = chunk[: self.max_bytes - self.read]
            self.truncated = True
        self.read += len(chunk)
        text = self.partial + chunk.decode("utf-8", errors="replace")
        *lines, self.partial = text.split("\n")
        if (final or self.truncated) and self.partial:
            lines.append(self.partial)
            self.partial = ""
        if lines:
            sys.stdout.write("".join(f"{self.prefix}{line}\n" for line in lines))
        if self.truncated:
            sys.stdout.write(
                f"{self.prefix}... output truncated: only the first {self.max_bytes} bytes "
                "are shown\n"
            )
        sys.stdout.flush()

    def tail(self, max_bytes: int = 2000) -> str:
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - max_bytes))
                text = f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return text if size <= max_bytes else "..." + text
