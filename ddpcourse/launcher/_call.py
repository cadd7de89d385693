"""One :func:`ddpcourse.launcher.run_ranks` call: fork the ranks, watch them, report, clean up.

The parent's loop: once the rank server is ready, ask it to fork each rank, then, until every rank
has exited or the deadline passed, collect the server's fork and exit events and relay the ranks'
output. A rank that did not return stops the others at once; at the deadline the stuck ranks dump
their Python stacks first. Whatever happens, every rank requested (and whatever it started) is
killed and reaped before returning, a Ctrl-C included: it may end a wait at any moment, but not the
recording of an event nor the clean-up (see :mod:`ddpcourse.launcher._interrupts`).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from typing import Any

from ddpcourse.launcher._interrupts import interrupts_deferred, reached
from ddpcourse.launcher._job import JobFiles, JobSpec
from ddpcourse.launcher._output import RankOutput
from ddpcourse.launcher._server_client import RankServer
from ddpcourse.launcher.errors import RankError, RankFailure, RankTimeoutError, describe_exit
from ddpcourse.launcher.processes import kill_process_group

STACK_DUMP_GRACE_S = 0.5
REAP_GRACE_S = 5.0


class Call:
    """One ``run_ranks`` call: fork the ranks, watch them, report, clean up."""

    def __init__(self, server: RankServer, files: JobFiles, spec: JobSpec, relay: bool,
                 max_output_bytes: int):
        self.server = server
        self.files = files
        self.spec = spec
        self.requested = 0  # ranks asked of the server; each is reported forked, then exited
        self.pids: dict[int, int] = {}  # rank -> pid
        self.exitcodes: dict[int, int] = {}  # rank -> exit code
        self.outputs = [
            RankOutput(files.output(r), r, max_output_bytes, relay) for r in range(spec.world_size)
        ]

    def run(self) -> list[Any]:
        world_size = self.spec.world_size
        deadline = time.monotonic() + self.spec.timeout_s
        try:
            self._wait_for_ready_server(deadline)
            with interrupts_deferred():
                for rank in range(world_size):
                    self.server.fork(self.files.dir, rank)
                    self.requested += 1
            reached("ranks starting")
            while True:
                self._collect_events(min(0.05, max(0.0, deadline - time.monotonic())))
                for out in self.outputs:
                    out.pump()
                failed = [r for r, code in self.exitcodes.items() if not self._returned(r, code)]
                if failed:
                    raise self._failure_error()
                if len(self.exitcodes) == world_size:
                    return [self._load_result(r) for r in range(world_size)]
                if time.monotonic() >= deadline:
                    raise self._timeout_error()
        finally:
            with interrupts_deferred():
                self._stop_all()
                for out in self.outputs:
                    out.pump(final=True)

    def _wait_for_ready_server(self, deadline: float) -> None:
        """A server still importing torch has not read its requests yet; sent now, they could not
        be taken back if the call were interrupted, and it would fork ranks for a call that is
        gone. So requests go to a ready server only, which forks them at once."""
        while not self.server.ready:
            if time.monotonic() >= deadline:
                raise self._timeout_error()
            self._collect_events(min(0.05, max(0.0, deadline - time.monotonic())))

    def _collect_events(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the server's events, then record them. A Ctrl-C may end the
        wait but not the recording: an event read and dropped would leave a rank whose pid the
        call never learns, so it could not be killed."""
        self.server.wait_for_events(timeout)
        with interrupts_deferred():
            try:
                events = self.server.events(0.0)
            except EOFError:
                raise RankError(
                    [RankFailure(r, "stopped") for r in range(self.spec.world_size)],
                    self.spec.world_size,
                    self.spec.backend,
                    intro="the rank server died unexpectedly",
                ) from None
            rank_of = {pid: rank for rank, pid in self.pids.items()}
            for event in events:
                if event["ev"] == "forked" and event["job"] == self.files.dir:
                    self.pids[event["rank"]] = event["pid"]
                    rank_of[event["pid"]] = event["rank"]
                elif event["ev"] == "exit" and event["pid"] in rank_of:
                    self.exitcodes[rank_of[event["pid"]]] = event["code"]

    def _returned(self, rank: int, exitcode: int) -> bool:
        return exitcode == 0 and os.path.exists(self.files.result(rank))

    def _load_result(self, rank: int) -> Any:
        with open(self.files.result(rank), "rb") as f:
            return pickle.load(f)

    def _read_error(self, rank: int) -> dict | None:
        try:
            with open(self.files.error(rank), "rb") as f:
                return pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None

    def _describe(self, rank: int, kind_if_running: str) -> RankFailure:
        report = self._read_error(rank)
        tail = self.outputs[rank].tail()
        if report is not None:
            return RankFailure(
                rank,
                "raised",
                exitcode=self.exitcodes.get(rank),
                exc_type=report["exc_type"],
                message=(report["message"] if report["stage"] == "running the function"
                         else f"{report['message']} (while {report['stage']})"),
                traceback=report["traceback"],
                output_tail=tail,
                exception_bytes=report["exception"],
            )
        if rank in self.exitcodes:
            stack = self._read_stacks(rank) if self.exitcodes[rank] < 0 else ""
            return RankFailure(rank, "exited", exitcode=self.exitcodes[rank], stack=stack,
                               output_tail=tail, message=describe_exit(self.exitcodes[rank]))
        return RankFailure(rank, kind_if_running, output_tail=tail)

    def _failure_error(self) -> RankError:
        # The rank whose error came first is listed first: it is usually the cause, and the
        # others failed because it left (e.g. "Connection closed by peer").
        failed = [r for r, code in self.exitcodes.items() if not self._returned(r, code)]
        failures = [self._describe(r, "stopped") for r in failed]
        order = {r: (self._read_error(r) or {}).get("time", float("inf")) for r in failed}
        failures.sort(key=lambda f: (order[f.rank], f.rank))
        stopped = [
            RankFailure(r, "stopped")
            for r in range(self.spec.world_size)
            if r not in self.exitcodes
        ]
        return RankError(failures + stopped, self.spec.world_size, self.spec.backend)

    def _timeout_error(self) -> RankTimeoutError:
        unfinished = [r for r in range(self.spec.world_size) if r not in self.exitcodes]
        stuck = [r for r in unfinished if not os.path.exists(self.files.result(r))]
        for rank in stuck:
            if rank in self.pids:
                try:
                    os.kill(self.pids[rank], signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        self._wait_for_stacks(stuck)
        failures = [
            RankFailure(rank, "timeout", output_tail=self.outputs[rank].tail(),
                        stack=self._read_stacks(rank) or "(no stack: the rank had not started)")
            for rank in stuck
        ]
        finished = [r for r in range(self.spec.world_size) if r not in stuck]
        intro = (
            f"rank(s) {stuck} did not finish within {self.spec.timeout_s:g} s"
            + (f"; rank(s) {finished} returned" if finished else "")
            + ". Typical causes: a deadlock (mismatched collectives, a recv with no send), an"
            " endless loop, a long sleep"
        )
        return RankTimeoutError(failures, self.spec.world_size, self.spec.backend, intro=intro)

    def _wait_for_stacks(self, ranks: list[int]) -> None:
        give_up = time.monotonic() + STACK_DUMP_GRACE_S
        while time.monotonic() < give_up:
            if all(os.path.getsize(self.files.stacks(r)) > 0 for r in ranks
                   if os.path.exists(self.files.stacks(r))):
                time.sleep(0.02)  # let the dump of the last threads land
                return
            time.sleep(0.01)

    def _read_stacks(self, rank: int) -> str:
        try:
            with open(self.files.stacks(rank)) as f:
                text = f.read()
        except OSError:
            return ""
        return _strip_launcher_frames(text)

    def _stop_all(self) -> None:
        """Kill every rank that has not exited, then wait (bounded) until the server has reaped
        them, so the caller never returns with live ranks. A rank requested but not reported
        forked yet is waited for too: the server is ready, so it forks it within moments."""
        killed: set[int] = set()
        give_up = time.monotonic() + REAP_GRACE_S
        while True:
            for rank, pid in self.pids.items():
                if rank not in self.exitcodes and rank not in killed:
                    kill_process_group(pid, signal.SIGKILL)
                    killed.add(rank)
            if len(self.exitcodes) == self.requested or time.monotonic() >= give_up:
                break
            try:
                self._collect_events(0.05)
            except RankError:
                break
        # A rank's children (DataLoader workers, subprocesses) share its process group.
        for pid in self.pids.values():
            kill_process_group(pid, signal.SIGKILL, group_only=True)


_LAUNCHER_FILES = (
    "ddpcourse/launcher/_rank_server.py", "ddpcourse/launcher/_rank_child.py", "<frozen runpy>",
    # the frames of a process whose server was forked from it (fork_server_now), under which
    # that server's ranks run
    "ddpcourse/launcher/_server_client.py", "ddpcourse/launcher/__init__.py",
    "ddpcourse/launcher/kernel_with_server.py", "ddpcourse/grading/observation_host.py",
)


def _strip_launcher_frames(stacks: str) -> str:
    """faulthandler prints the innermost frame first; drop the launcher's own outer frames."""
    kept = []
    for line in stacks.splitlines():
        if any(part in line for part in _LAUNCHER_FILES):
            continue
        kept.append(line)
    return "\n".join(kept)
