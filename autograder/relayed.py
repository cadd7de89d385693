"""Run the ranks of a communication-audited case each in a sandbox of its own, linked by a broker.

An audit inside a rank (``CommAudit``) sees only what the rank's own thread dispatches: a
collective from another thread, or from a process group the student builds from torch's C++
objects, escapes it. Here nothing can escape. Rank ``r`` of a case runs in host ``r``, an
``observation_host`` in its own sandbox: its own network (loopback only, shared with no other
rank), its own ``/tmp`` and ``/dev/shm``, its own process IDs, and a file system it cannot write
outside its own folder. Its one link to the other ranks is a Unix socket to the
:class:`~autograder.broker.Broker` in this process, which carries, performs and logs every
operation, from whatever thread. A torch collective therefore either goes through the broker and
is logged, or cannot reach the other ranks at all.

For each case: one listening socket per rank, in a folder only that rank's sandbox sees
(read-only); every host is asked to run its rank; once each rank has connected, a broker takes the
connections. The observations come back from the hosts; their ``"traffic"`` entry (what the rank
says it saw) is replaced by the broker's record, which is what the case's judge reads. A case with
``rendezvous=True`` (:class:`~ddpcourse.grading.checks.Case`) gets a broker in rendezvous mode: a
blocking send completes only once matched, and ranks blocked in a circle fail the case at once.
"""

from __future__ import annotations

import dataclasses
import selectors
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from autograder.broker import COLLECTIVES, Broker
from autograder.trusted import HOST_MARGIN_S, HostFailed, ObservationHost
from ddpcourse.launcher import RankError, RankFailure, RankTimeoutError

BROKER_GRACE_S = 5.0  # the broker fails a waiting operation after the ranks' own deadline


def traffic_of(broker: Broker, rank: int) -> dict:
    """What ``rank`` did on the wire, in the form of :func:`ddpcourse.grading.checks.audited_traffic`:
    the collectives it called, the bytes it sent point to point, and every collective in order
    with the bytes it handed over; and, where it all-reduced, ``all_reduce_contributions``, the
    sum of squares of what the rank handed to each all_reduce, in order (None: integer tensors,
    or a call that never completed), which only the broker can see: judges of gradient synchronisation compare it
    with the gradients they expect, so that a dummy of zeros does not count as one."""
    log = broker.log(rank)
    traffic = {"collectives": sorted({e["op"] for e in log if e["op"] in COLLECTIVES}),
               "bytes_sent": sum(e["bytes_sent"] for e in log if e["op"] == "send"),
               "collective_calls": [[e["op"], e["bytes_sent"]] for e in log
                                    if e["op"] in COLLECTIVES]}
    contributions = [e.get("contribution_sq") for e in log if e["op"] == "all_reduce"]
    if contributions:  # only then: the traffic of a case without all-reduces is as it was
        traffic["all_reduce_contributions"] = contributions
    return traffic


class RelayedRanks:
    """One host per rank, started when a case first needs that many ranks; ``make_host(rank,
    relay_dir)`` makes rank ``rank``'s host, whose sandbox must see ``relay_dir`` (and no other
    rank's). The submission's own host may serve rank 0 (``adopt_rank0``), which saves starting
    one (torch's imports cost seconds of CPU); it runs nothing that rank 1 and up can reach."""

    def __init__(self, make_host: Callable[[int, Path], ObservationHost]):
        self.make_host = make_host
        # short: a Unix socket's path has at most 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="relay-"))
        self.relay_dir(0).mkdir()
        self.hosts: list[ObservationHost] = []
        self.adopted: ObservationHost | None = None
        self.cases = 0

    def adopt_rank0(self, host: ObservationHost) -> None:
        """Let ``host`` (whose sandbox sees ``relay_dir(0)``; closed by its owner) serve rank 0."""
        if self.hosts:
            raise RuntimeError("rank 0 already has a host")
        self.adopted = host
        self.hosts.append(host)

    def relay_dir(self, rank: int) -> Path:
        return self.root / f"rank{rank}"

    def _host(self, rank: int) -> ObservationHost:
        while len(self.hosts) <= rank:
            folder = self.relay_dir(len(self.hosts))
            folder.mkdir(exist_ok=True)
            self.hosts.append(self.make_host(len(self.hosts), folder))
        return self.hosts[rank]

    def observe(self, observe, world_size: int, args: tuple, payload: bytes,
                timeout: float, rendezvous: bool = False) -> list:
        """Every rank's observation with its ``"traffic"`` as the broker saw it, or RankError.
        ``rendezvous``: the broker's mode (autograder/broker.py), the case's ``rendezvous``."""
        self.cases += 1
        listeners, paths = [], []
        for rank in range(world_size):
            # (re)started from this thread: a sandbox dies with the thread that started it
            self._host(rank).start()
        for rank in range(world_size):
            # all warm first: a rank that starts early would wait for a cold peer past its deadline
            try:
                self._host(rank).wait_ready()
            except HostFailed as exc:
                raise RankError([RankFailure(rank=rank, kind="exited", message=str(exc))],
                                world_size, "relay") from None
        for rank in range(world_size):
            path = self.relay_dir(rank) / f"{self.cases}.sock"
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            listener.listen(1)
            listeners.append(listener)
            paths.append(path)
        answers: list = [None] * world_size
        runners = [threading.Thread(target=self._run_rank, daemon=True,
                                    args=(answers, rank, observe, world_size, args, payload,
                                          timeout, str(paths[rank])))
                   for rank in range(world_size)]
        for runner in runners:
            runner.start()
        broker = None
        try:
            connections = _accept_each(listeners, runners, timeout + HOST_MARGIN_S)
            _close_listeners(listeners, paths)  # a rank still connecting now fails at once
            if connections is not None:
                broker = Broker(world_size, timeout + BROKER_GRACE_S, sockets=connections,
                                rendezvous=rendezvous)
                broker.start()
            for runner in runners:
                runner.join(timeout + 2 * HOST_MARGIN_S)
        finally:
            _close_listeners(listeners, paths)
            if broker is not None:
                broker.close()
        return _combine(answers, world_size, broker)

    def _run_rank(self, answers: list, rank: int, observe, world_size: int, args: tuple,
                  payload: bytes, timeout: float, path: str) -> None:
        try:
            [answers[rank]] = self._host(rank).observe(
                observe, world_size, args, payload, timeout, False,
                relay={"rank": rank, "socket": path})
        except RankError as err:
            answers[rank] = err
        except HostFailed as exc:
            answers[rank] = RankError([RankFailure(rank=0, kind="exited", message=str(exc))], 1,
                                      "relay")
        except Exception as exc:  # noqa: BLE001 - a thread must hand back what went wrong
            answers[rank] = RankError([RankFailure(rank=0, kind="exited",
                                                   message=f"{type(exc).__name__}: {exc}")],
                                      1, "relay")

    def close(self) -> None:
        for host in self.hosts:
            if host is not self.adopted:
                host.close()
        self.hosts = []
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_listeners(listeners: list[socket.socket], paths: list[Path]) -> None:
    for listener, path in zip(listeners, paths):
        listener.close()
        path.unlink(missing_ok=True)


def _accept_each(listeners: list[socket.socket], runners: list[threading.Thread],
                 deadline_s: float) -> list[socket.socket] | None:
    """Rank r's connection on ``listeners[r]``, for every rank; None when a rank's host gave up
    (or the deadline passed) before its rank connected: then no broker starts, and the ranks that
    did connect read EOF and fail."""
    connections: list[socket.socket | None] = [None] * len(listeners)
    selector = selectors.DefaultSelector()
    for rank, listener in enumerate(listeners):
        selector.register(listener, selectors.EVENT_READ, rank)
    end = time.monotonic() + deadline_s
    try:
        while None in connections:
            waiting = [r for r, c in enumerate(connections) if c is None]
            if any(not runners[r].is_alive() for r in waiting) or time.monotonic() > end:
                for connection in connections:
                    if connection is not None:
                        connection.close()
                return None
            for key, _ in selector.select(0.2):
                rank = key.data
                connections[rank], _ = listeners[rank].accept()
                selector.unregister(listeners[rank])
        return connections
    finally:
        selector.close()


def _combine(answers: list, world_size: int, broker: Broker | None) -> list:
    failures, timed_out = [], False
    for rank, answer in enumerate(answers):
        if answer is None:
            answer = RankError([RankFailure(rank=0, kind="timeout",
                                            message="its sandbox did not answer in time")], 1,
                               "relay")
        if isinstance(answer, RankError):
            timed_out |= isinstance(answer, RankTimeoutError) or any(
                f.kind == "timeout" for f in answer.failures)
            failures += [dataclasses.replace(f, rank=rank) for f in answer.failures]
    if not failures and broker is None:  # cannot happen with our ranks: they connect first
        failures = [RankFailure(rank=0, kind="exited", message="the ranks never reached the "
                                "grader's broker")]
    if failures:
        error = RankTimeoutError if timed_out else RankError
        raise error(failures, world_size, "relay")
    observations = list(answers)
    for rank, observation in enumerate(observations):
        if isinstance(observation, dict):
            observation["traffic"] = traffic_of(broker, rank)
    return observations
