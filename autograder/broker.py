"""The trusted end of the "relay" backend: route, compute and log every message of every rank.

Why: the autograder audits a student's communication ("only send/recv, 2(N-1)/N of the tensor per
rank") where the student's code cannot interfere. Each rank's only channel to the others is one
socket to this broker (the rank's side is :mod:`ddpcourse.grading.relay`); the broker matches each
send to the recv with the same (source, destination, tag) in order, performs a collective once
every rank has called it, and logs each operation per rank in the order the rank issued it,
whatever thread it came from.

How a grader starts ranks against it::

    broker = Broker(world_size, timeout=30.0)
    for rank in range(world_size):
        fd = broker.rank_fd(rank)
        subprocess.Popen([...], pass_fds=[fd],
                         env={**env, "DDPCOURSE_RELAY_FD": str(fd), "RANK": str(rank),
                              "WORLD_SIZE": str(world_size)})
    broker.start()          # closes this process's copies of the ranks' ends, starts routing
    ...                     # wait for the ranks (with a deadline of your own)
    broker.close()
    broker.log(rank), broker.bytes_sent(rank), broker.collectives(rank), broker.failure

(A rank forked from this process must first call ``broker.close_in_child(rank)``.) In the rank,
``ddpcourse.grading.relay.init_relay_process_group()`` makes the group from those variables.

Checking a request and computing a collective's results are in :mod:`autograder.broker_requests`;
this module reads, routes, logs and keeps the deadlines. The broker never hangs and trusts nothing
a rank sends: frames are checked against size caps
before anything is allocated, headers are JSON checked field by field, tensors are raw bytes of
known dtypes (nothing is unpickled), and each rank may hold only so many bytes and requests in the
broker. A rank that breaks these rules is cut off: its socket is closed, and the others' operations
that need it fail with a message naming it, as they do when a rank exits or dies. An operation
still waiting at ``timeout`` seconds, or collectives that disagree (rank 0 all_reduce, rank 1
broadcast), fail the whole group: every rank's pending and later operations raise that message.

Sends. By default the broker keeps a sent message until it is received, so a send completes at
once, whatever the receiver does. With ``rendezvous=True`` a send completes only when its receiver
has posted the matching recv, as gloo's and NCCL's do: ``dist.send`` (``isend`` and ``wait``)
blocks until then, ``dist.isend`` returns at once and its ``wait`` blocks. A rank tells the broker
when it blocks in ``wait`` on a send or recv (``{"op": "wait", "id": ...}``, sent only when the
greeting says ``rendezvous``); ranks blocked in a circle, each on a send to or a recv from the
next, with no word from any of them for ``deadlock_grace_s``, fail the whole group at once with a
message that names each rank and the call it is blocked in (a send-first ring: every rank blocked
sending to its right neighbour) instead of at the deadline.
"""

from __future__ import annotations

import copy
import math
import selectors
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from autograder.broker_requests import (INT32, Request, Violation, blocked_call,
                                        check_collective, check_recv, check_send,
                                        collective_replies, describe, int_field, nbytes,
                                        parse_header, shape_text, tensor_specs, wait_cycle)
from ddpcourse.grading.collective_names import COLLECTIVES, POINT_TO_POINT
from ddpcourse.grading.relay import (MAX_HEADER_BYTES, PREFIX, PROTOCOL, frame, tensor_bytes,
                                     tensors_from)

# The operations a rank may ask for (COLLECTIVES, POINT_TO_POINT) are named by their public
# names, which the in-rank audit records too (ddpcourse/grading/collective_names.py): a judge
# and its message read one name per call, whichever audit counted it.
_READ_BUDGET = 8 << 20  # bytes read from one rank per wake-up, so one rank cannot starve others


def contribution_sq(req: Request) -> float | None:
    """The sum of squares of the tensors a rank handed to a collective, in float64 (None for
    integer tensors): what a judge compares with the gradient it expects that rank to reduce."""
    tensors = tensors_from(req.payload, req.tensors)
    if not tensors or not all(t.is_floating_point() for t in tensors):
        return None
    return float(sum(t.double().square().sum() for t in tensors))


@dataclass
class _Conn:
    rank: int
    sock: socket.socket
    buf: bytearray = field(default_factory=lambda: bytearray(PREFIX.size))
    got: int = 0
    phase: str = "prefix"
    payload_len: int = 0
    header: dict | None = None
    greeted: bool = False
    closed: bool = False
    doomed: str | None = None  # to be cut off once the current event is handled
    out: deque = field(default_factory=deque)
    out_bytes: int = 0
    held_bytes: int = 0  # payloads and bookkeeping of its requests the broker keeps waiting
    held_count: int = 0
    logged_tensors: int = 0  # its log's size: one per operation and one per tensor
    heard: float = 0.0  # when its last frame arrived
    waiting: Request | None = None  # the send or recv it last said it is blocked on


class Broker:
    """Routes, performs and logs the communication of ``world_size`` relay ranks.

    The broker makes one socket pair per rank (:meth:`rank_fd`), unless ``sockets`` gives it
    rank ``r``'s already connected socket at index ``r`` (ranks that connected to a listening
    socket of the caller's, from sandboxes of their own).

    ``timeout``: seconds an operation may wait for its peers before the group fails.
    ``max_message_bytes``: largest payload of one request. ``max_held_bytes`` and
    ``max_held_requests``: what one rank may keep waiting in the broker at once (unmatched sends,
    its part of unfinished collectives, pending receives). ``max_logged``: operations plus tensors
    one rank may ask for in all (its log's size). A rank that goes past a limit is cut off.
    ``rendezvous``: a send completes only once a recv matches it (the module's docstring);
    ``deadlock_grace_s``: how long ranks blocked in a circle stay silent before the group fails.
    """

    def __init__(self, world_size: int, timeout: float = 60.0, *,
                 max_message_bytes: int = 64 << 20, max_held_bytes: int = 256 << 20,
                 max_held_requests: int = 10_000, max_logged: int = 1_000_000,
                 sockets: list[socket.socket] | None = None, rendezvous: bool = False,
                 deadlock_grace_s: float = 1.0):
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        if sockets is not None and len(sockets) != world_size:
            raise ValueError(f"{len(sockets)} sockets for {world_size} ranks")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.max_message_bytes = max_message_bytes
        self.max_held_bytes = max_held_bytes
        self.max_held_requests = max_held_requests
        self.max_logged = max_logged
        self.rendezvous = rendezvous
        self.deadlock_grace_s = float(deadlock_grace_s)
        self._max_out_bytes = max_held_bytes + world_size * max_message_bytes
        if sockets is None:
            pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                     for _ in range(world_size)]
        else:  # connections the caller accepted, one per rank (ranks in sandboxes of their own)
            pairs = [(sock, None) for sock in sockets]
        self._conns = [_Conn(rank, ours) for rank, (ours, _) in enumerate(pairs)]
        self._rank_ends: list[socket.socket | None] = [theirs for _, theirs in pairs]
        for theirs in self._rank_ends:
            if theirs is not None:
                theirs.set_inheritable(True)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._close_lock = threading.Lock()

        self._logs: list[list[dict]] = [[] for _ in range(world_size)]
        self._order = 0
        self._failure: str | None = None
        self._gone: dict[int, str] = {}
        self._cut_off: dict[int, str] = {}
        self._sends: dict[int, list[Request]] = {r: [] for r in range(world_size)}  # by dst
        self._recvs: dict[int, list[Request]] = {r: [] for r in range(world_size)}  # by dst
        self._next_seq = [0] * world_size
        self._collectives: dict[int, dict[int, Request]] = {}

    # -- life cycle ---------------------------------------------------------------------------

    def rank_fd(self, rank: int) -> int:
        """The file descriptor of ``rank``'s end (inheritable), for ``pass_fds`` or a fork."""
        end = self._rank_ends[rank]
        if end is None:
            raise RuntimeError("the ranks' ends are closed here once the broker has started")
        return end.fileno()

    def close_in_child(self, rank: int) -> None:
        """In a process forked from the broker's: keep only ``rank``'s own end open."""
        for conn in self._conns:
            conn.sock.close()
        for other, end in enumerate(self._rank_ends):
            if end is not None and other != rank:
                end.close()
        self._wake_r.close()
        self._wake_w.close()
        self._selector.close()

    def start(self) -> None:
        """Close this process's copies of the ranks' ends (so a rank's exit reads as EOF here) and
        start routing in a background thread. Start the rank processes first."""
        with self._close_lock:
            if self._closed or self._thread is not None:
                return
            for rank, end in enumerate(self._rank_ends):
                if end is not None:
                    end.close()
                    self._rank_ends[rank] = None
            self._wake_r.setblocking(False)
            self._selector.register(self._wake_r, selectors.EVENT_READ, None)
            for conn in self._conns:
                conn.sock.setblocking(False)
                self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            self._thread = threading.Thread(target=self._run, name="relay-broker", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop routing and close every connection (the ranks' pending operations fail).
        Idempotent; returns within seconds whatever the ranks do."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            thread = self._thread
        if thread is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
            thread.join(timeout=10)
        with self._lock:
            for conn in self._conns:
                self._close_conn(conn)
            for rank, end in enumerate(self._rank_ends):
                if end is not None:
                    end.close()
                    self._rank_ends[rank] = None
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_disconnected(self, timeout: float) -> bool:
        """Wait until every rank has closed its connection (or been cut off); False at timeout."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._gone) < self.world_size:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    return len(self._gone) == self.world_size
                self._changed.wait(min(left, 0.1))
        return True

    # -- what the grader reads ----------------------------------------------------------------

    def log(self, rank: int) -> list[dict]:
        """Every operation ``rank`` asked for, in the order it asked: op, peer, tag, root,
        reduce_op, collective (its number), dtype, shape(s), bytes_sent, bytes_received, status
        (pending/ok/error), error; and for an all_reduce that completed, ``contribution_sq``: the
        sum of squares of what the rank handed over (float64; None for integer tensors), so that
        a judge can tell a gradient from a dummy of zeros of the same size."""
        with self._lock:
            return copy.deepcopy(self._logs[rank])

    def ops(self, rank: int) -> list[str]:
        return [entry["op"] for entry in self.log(rank)]

    def collectives(self, rank: int) -> list[str]:
        return [op for op in self.ops(rank) if op in COLLECTIVES]

    def bytes_sent(self, rank: int, op: str | None = None) -> int:
        """Payload bytes ``rank`` handed over (all operations, or only ``op``)."""
        return sum(e["bytes_sent"] for e in self.log(rank) if op is None or e["op"] == op)

    def bytes_received(self, rank: int, op: str | None = None) -> int:
        return sum(e["bytes_received"] for e in self.log(rank) if op is None or e["op"] == op)

    @property
    def failure(self) -> str | None:
        """The error that failed the whole group (timeout, mismatch), if any."""
        with self._lock:
            return self._failure

    def disconnected(self) -> dict[int, str]:
        """rank -> why its connection is closed (it closed it, or the broker cut it off)."""
        with self._lock:
            return dict(self._gone)

    def cut_off(self) -> dict[int, str]:
        """rank -> the protocol violation it was cut off for."""
        with self._lock:
            return dict(self._cut_off)

    # -- the loop -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                events = self._selector.select(self._select_timeout())
                with self._changed:
                    for key, mask in events:
                        conn = key.data
                        if conn is None:
                            self._drain_wakeups()
                            continue
                        if mask & selectors.EVENT_READ:
                            self._guarded(conn, self._read)
                        if mask & selectors.EVENT_WRITE:
                            self._guarded(conn, self._flush)
                    self._expire(time.monotonic())
                    self._find_deadlock(time.monotonic())
                    for conn in self._conns:
                        if conn.doomed and not conn.closed:
                            self._cut(conn, conn.doomed)
                    self._changed.notify_all()
        except Exception as exc:  # the last line of defence: fail everything, never hang
            with self._changed:
                self._break(f"relay: the broker failed: {exc!r}")
                self._changed.notify_all()
        finally:
            with self._changed:
                for conn in self._conns:
                    self._close_conn(conn)
                    self._gone.setdefault(conn.rank, "the broker stopped")
                self._changed.notify_all()

    def _drain_wakeups(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _select_timeout(self) -> float:
        with self._lock:
            deadlines = [r.deadline for q in self._recvs.values() for r in q]
            deadlines += [r.deadline for g in self._collectives.values() for r in g.values()]
            if self.rendezvous:
                deadlines += [r.deadline for q in self._sends.values() for r in q
                              if r.entry["status"] == "pending"]
                deadlines += [c.heard + self.deadlock_grace_s for c in self._conns
                              if c.waiting is not None and c.waiting.entry["status"] == "pending"]
        if not deadlines:
            return 0.5
        return min(0.5, max(0.0, min(deadlines) - time.monotonic()))

    def _guarded(self, conn: _Conn, step) -> None:
        if conn.closed or conn.doomed:
            return
        try:
            step(conn)
        except Violation as exc:
            self._cut(conn, str(exc))
        except Exception as exc:  # anything unexpected while handling one rank: cut that rank
            self._cut(conn, f"its request made the broker fail ({exc!r})")

    # -- reading and checking -----------------------------------------------------------------

    def _read(self, conn: _Conn) -> None:
        budget = _READ_BUDGET
        while budget > 0 and not conn.closed and not conn.doomed:
            want = len(conn.buf) - conn.got
            try:
                n = conn.sock.recv_into(memoryview(conn.buf)[conn.got:], min(want, budget))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._disconnect(conn, f"rank {conn.rank}'s connection failed ({exc})")
                return
            if n == 0:
                middle = conn.phase != "prefix" or conn.got
                self._disconnect(conn, f"rank {conn.rank} closed its connection"
                                       + (" in the middle of a message" if middle else "")
                                       + " (its process exited or died)")
                return
            conn.got += n
            budget -= n
            if conn.got == len(conn.buf):
                self._advance(conn)

    def _advance(self, conn: _Conn) -> None:
        if conn.phase == "prefix":
            header_len, payload_len = PREFIX.unpack(conn.buf)
            if not 2 <= header_len <= MAX_HEADER_BYTES:
                raise Violation(f"sent a message header of {header_len} bytes "
                                 f"(limit {MAX_HEADER_BYTES})")
            if payload_len > self.max_message_bytes:
                raise Violation(f"sent a message of {payload_len} bytes "
                                 f"(limit {self.max_message_bytes})")
            if conn.held_bytes + payload_len > self.max_held_bytes:
                raise Violation(f"would keep more than {self.max_held_bytes} bytes waiting "
                                 "in the broker")
            if conn.held_count >= self.max_held_requests:
                raise Violation(f"kept more than {self.max_held_requests} requests waiting")
            conn.phase, conn.payload_len = "header", payload_len
            conn.buf, conn.got = bytearray(header_len), 0
        elif conn.phase == "header":
            conn.header = parse_header(conn.buf)
            if conn.payload_len:
                conn.phase, conn.buf, conn.got = "payload", bytearray(conn.payload_len), 0
            else:
                self._next_frame(conn, bytearray())
        else:
            self._next_frame(conn, conn.buf)

    def _next_frame(self, conn: _Conn, payload: bytearray) -> None:
        header = conn.header
        conn.phase, conn.buf, conn.got, conn.header = "prefix", bytearray(PREFIX.size), 0, None
        conn.heard = time.monotonic()
        self._dispatch(conn, header, payload)

    def _dispatch(self, conn: _Conn, header: dict, payload: bytearray) -> None:
        op = header.get("op")
        if not conn.greeted:
            self._hello(conn, header)
            return
        if op == "wait":
            self._on_wait(conn, header)
            return
        if op not in COLLECTIVES and op not in POINT_TO_POINT:
            raise Violation(f"asked for an unknown operation {str(op)[:40]!r}")
        request_id = int_field(header, "id", 0, 2**53)
        tensors, expect = tensor_specs(header, "tensors", self.max_message_bytes), tensor_specs(header, "expect", self.max_message_bytes)
        if nbytes(tensors) != len(payload):
            raise Violation(f"sent {len(payload)} payload bytes for tensors of "
                             f"{nbytes(tensors)} bytes")
        if len({s["dtype"] for s in tensors + expect}) > 1:
            raise Violation("mixed dtypes in one request")
        shapes = [s["shape"] for s in (tensors or expect)]
        entry = {"index": len(self._logs[conn.rank]), "order": self._order, "op": op,
                 "peer": None, "tag": None, "root": None, "reduce_op": None, "collective": None,
                 "dtype": (tensors or expect)[0]["dtype"] if tensors or expect else None,
                 "shape": shapes[0] if len(shapes) == 1 else None, "shapes": shapes,
                 "bytes_sent": len(payload), "bytes_received": 0, "status": "pending",
                 "error": None}
        request = Request(conn.rank, request_id, op, payload, tensors, expect, entry,
                           time.monotonic() + self.timeout)
        if op == "send":
            check_send(request, header, self.world_size)
        elif op == "recv":
            check_recv(request, header, self.world_size)
        else:
            check_collective(request, header, self.world_size)
        if conn.held_bytes + self._cost(request) > self.max_held_bytes:
            raise Violation(f"would keep more than {self.max_held_bytes} bytes waiting "
                             "in the broker")
        conn.logged_tensors += 1 + len(shapes)
        if conn.logged_tensors > self.max_logged:
            raise Violation(f"asked for more than {self.max_logged} operations and tensors")
        self._order += 1
        self._logs[conn.rank].append(entry)
        if self._failure is not None:
            self._fail(request, self._failure)
        elif op == "send":
            self._on_send(request)
        elif op == "recv":
            self._on_recv(request)
        else:
            self._on_collective(request)

    def _hello(self, conn: _Conn, header: dict) -> None:
        if header.get("op") != "hello":
            raise Violation("did not start with a greeting")
        rank = int_field(header, "rank", 0, INT32)
        world_size = int_field(header, "world_size", 1, INT32)
        if header.get("protocol") != PROTOCOL:
            raise Violation(f"speaks protocol {str(header.get('protocol'))[:20]}, "
                             f"not {PROTOCOL}")
        if (rank, world_size) != (conn.rank, self.world_size):
            raise Violation(f"says it is rank {rank} of {world_size}, but this connection "
                             f"belongs to rank {conn.rank} of {self.world_size}")
        conn.greeted = True
        self._send_frame(conn, {"id": 0, "ok": True, "timeout": self.timeout,
                                "max_message_bytes": self.max_message_bytes,
                                "rank": conn.rank, "world_size": self.world_size,
                                "rendezvous": self.rendezvous}, [])

    # -- point to point -----------------------------------------------------------------------

    @staticmethod
    def _accepts(recv: Request, send: Request) -> bool:
        return (recv.entry["tag"] == send.entry["tag"]
                and recv.src in (None, send.rank))

    def _on_send(self, req: Request) -> None:
        dst = req.entry["peer"]
        if dst in self._gone:
            self._fail(req, f"relay: send from rank {req.rank} to rank {dst} cannot complete: "
                            f"{self._gone[dst]}")
            return
        recv = next((r for r in self._recvs[dst] if self._accepts(r, req)), None)
        if recv is not None:
            self._recvs[dst].remove(recv)
            self._release(recv)
            self._deliver(req, recv)
        else:
            self._sends[dst].append(req)
            self._hold(req)
            if not self.rendezvous:
                self._reply(req, [], [])  # the broker holds the data: the send is done

    def _on_recv(self, req: Request) -> None:
        me, src = req.rank, req.src
        send = next((s for s in self._sends[me] if self._accepts(req, s)), None)
        if send is not None:
            self._sends[me].remove(send)
            self._release(send)
            self._deliver(send, req)
        elif src is not None and src in self._gone:
            self._fail(req, f"relay: recv by rank {me} from rank {src} cannot complete: "
                            f"{self._gone[src]}")
        else:
            self._recvs[me].append(req)
            self._hold(req)

    def _deliver(self, send: Request, recv: Request) -> None:
        """Hand ``send``'s data to ``recv``, and complete the send if it still waits for that."""
        sent, wanted = send.tensors[0], recv.expect[0]
        recv.entry["peer"] = send.rank
        if sent["dtype"] != wanted["dtype"] or math.prod(sent["shape"]) != math.prod(
                wanted["shape"]):
            self._break(f"relay: rank {recv.rank} receives {shape_text(wanted)} from rank "
                        f"{send.rank} (tag {send.entry['tag']}), which sent "
                        f"{shape_text(sent)}", also=[recv, send])
            return
        self._reply(recv, [wanted], [send.payload], src=send.rank)
        if send.entry["status"] == "pending":
            self._reply(send, [], [])

    def _on_wait(self, conn: _Conn, header: dict) -> None:
        """The rank blocks on its send or recv ``id``: remember it for :meth:`_find_deadlock`."""
        request_id = int_field(header, "id", 1, 2**53)
        if not self.rendezvous:
            return
        mine = [r for r in self._recvs[conn.rank] if r.id == request_id]
        mine += [r for q in self._sends.values() for r in q
                 if r.rank == conn.rank and r.id == request_id]
        if mine and mine[0].entry["status"] == "pending":
            conn.waiting = mine[0]

    def _find_deadlock(self, now: float) -> None:
        """Fail the group if ranks are blocked in a circle, each on a send to or a recv from the
        next, and none of them has said anything for ``deadlock_grace_s`` (a rank's other thread
        might still act; with a single thread, a circle is a deadlock at once)."""
        if not self.rendezvous or self._failure is not None:
            return
        blocked: dict[int, Request] = {}
        for conn in self._conns:
            req = conn.waiting
            if (req is None or req.entry["status"] != "pending" or conn.closed
                    or now - conn.heard < self.deadlock_grace_s):
                continue
            peer = req.entry["peer"] if req.op == "send" else req.src
            if peer is not None:
                blocked[conn.rank] = req
        cycle = wait_cycle({rank: (req.entry["peer"] if req.op == "send" else req.src)
                            for rank, req in blocked.items()})
        if cycle is None:
            return
        calls = "; ".join(f"rank {rank} is blocked in {blocked_call(blocked[rank])}"
                          for rank in cycle)
        advice = ("A blocking send (dist.send) completes only once its receiver has posted the "
                  "matching recv, as with gloo and NCCL: post the send with dist.isend before "
                  "the blocking recv, and wait for it afterwards."
                  if any(blocked[rank].op == "send" for rank in cycle) else "")
        self._break(f"relay: deadlock: {calls}. Each waits for the next, so none of them can "
                    f"go on. {advice}".rstrip())

    # -- collectives --------------------------------------------------------------------------

    def _on_collective(self, req: Request) -> None:
        seq = req.seq = self._next_seq[req.rank]
        self._next_seq[req.rank] += 1
        req.entry["collective"] = seq
        if self._gone:
            why = next(iter(self._gone.values()))
            self._fail(req, f"relay: rank {req.rank}'s {describe(req)} (collective #{seq})"
                            f" cannot complete: {why}")
            return
        group = self._collectives.setdefault(seq, {})
        group[req.rank] = req
        self._hold(req)
        if any(other.signature != req.signature for other in group.values()):
            calls = "; ".join(f"rank {r} called {describe(group[r])}" for r in sorted(group))
            self._break(f"relay: collective #{seq} differs between ranks: {calls}")
            return
        if len(group) == self.world_size:
            del self._collectives[seq]
            for member in group.values():
                self._release(member)
            try:
                if req.op == "all_reduce":
                    for member in group.values():
                        member.entry["contribution_sq"] = contribution_sq(member)
                replies = collective_replies([group[r] for r in range(self.world_size)],
                                             self.world_size)
                for member, specs, parts in replies:
                    self._reply(member, specs, parts)
            except Exception as exc:
                self._break(f"relay: {describe(req)} (collective #{seq}) failed in the "
                            f"broker: {exc}", also=list(group.values()))

    # -- deadlines, failures, disconnections ----------------------------------------------------

    def _last_call(self, rank: int) -> str:
        if rank in self._gone:
            return self._gone[rank]
        if not self._logs[rank]:
            return f"rank {rank} has not asked for anything"
        entry = self._logs[rank][-1]
        what = entry["op"] + (f" with rank {entry['peer']}" if entry["peer"] is not None else "")
        if entry["collective"] is not None:
            what += f" (collective #{entry['collective']})"
        state = {"pending": "still waiting", "ok": "done", "error": "failed"}[entry["status"]]
        return f"rank {rank}'s last call: {what}, {state}"

    def _expire(self, now: float) -> None:
        for seq, group in sorted(self._collectives.items()):
            if any(r.deadline <= now for r in group.values()):
                called = "; ".join(f"rank {r} called {describe(group[r])}"
                                   for r in sorted(group))
                missing = [r for r in range(self.world_size) if r not in group]
                never = "; ".join(f"rank {r} did not call it ({self._last_call(r)})"
                                  for r in missing)
                self._break(f"relay: collective #{seq} timed out after {self.timeout:g} s: "
                            f"{called}; {never}")
                return
        for queue in self._sends.values():
            for send in queue:
                if send.entry["status"] == "pending" and send.deadline <= now:
                    dst = send.entry["peer"]
                    self._break(f"relay: send from rank {send.rank} to rank {dst} (tag "
                                f"{send.entry['tag']}, {shape_text(send.tensors[0])}) timed out "
                                f"after {self.timeout:g} s: rank {dst} posted no matching recv "
                                f"({self._last_call(dst)})")
                    return
        for queue in self._recvs.values():
            for recv in queue:
                if recv.deadline <= now:
                    src = recv.src
                    source = f"rank {src}" if src is not None else "any rank"
                    blame = (self._last_call(src) if src is not None
                             else "no rank sent anything matching")
                    self._break(f"relay: recv by rank {recv.rank} from {source} (tag "
                                f"{recv.entry['tag']}, {shape_text(recv.expect[0])}) timed out "
                                f"after {self.timeout:g} s: nothing matching was sent ({blame})")
                    return

    def _break(self, message: str, also: list[Request] = ()) -> None:
        """Fail the whole group: every waiting and later operation of any rank gets ``message``."""
        if self._failure is None:
            self._failure = message
        waiting = list(also) + [r for q in self._recvs.values() for r in q]
        waiting += [r for g in self._collectives.values() for r in g.values()]
        waiting += [r for q in self._sends.values() for r in q]  # pending in rendezvous mode
        for queue in (*self._recvs.values(), *self._sends.values()):
            queue.clear()
        self._collectives.clear()
        for req in waiting:
            self._release(req)
            self._fail(req, self._failure)

    def _disconnect(self, conn: _Conn, reason: str) -> None:
        """``conn``'s rank is gone: fail what needs it; operations among the others go on."""
        if conn.rank in self._gone:
            return
        self._close_conn(conn)
        rank = conn.rank
        self._gone[rank] = reason
        self._recvs[rank].clear()
        failing = [(req, f"relay: send from rank {req.rank} to rank {rank} cannot complete: "
                         f"{reason}") for req in self._sends[rank]]  # nobody will receive these
        self._sends[rank].clear()
        for dst, queue in self._recvs.items():
            for req in [r for r in queue if r.src == rank]:
                queue.remove(req)
                failing.append((req, f"relay: recv by rank {dst} from rank {rank} cannot "
                                     f"complete: {reason}"))
        for seq, group in sorted(self._collectives.items()):
            failing += [(req, f"relay: rank {req.rank}'s {describe(req)} (collective "
                              f"#{seq}) cannot complete: {reason}")
                        for req in group.values() if req.rank != rank]
        self._collectives.clear()
        for req, message in failing:
            self._release(req)
            self._fail(req, message)

    def _cut(self, conn: _Conn, violation: str) -> None:
        self._cut_off[conn.rank] = violation
        message = f"rank {conn.rank} was cut off by the broker: it {violation}"
        if not conn.out and not conn.closed and not conn.doomed:
            try:  # a last word, if it fits at once; never wait for a hostile reader
                conn.sock.send(frame({"id": None, "ok": False, "fatal": message}))
            except OSError:
                pass
        self._disconnect(conn, message)

    def _close_conn(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        conn.out.clear()
        conn.out_bytes = 0

    # -- replies --------------------------------------------------------------------------------

    @staticmethod
    def _cost(req: Request) -> int:
        """What keeping ``req`` waiting costs: its payload, and a generous price for the rest."""
        return len(req.payload) + 1024 * (1 + len(req.tensors) + len(req.expect))

    def _hold(self, req: Request) -> None:
        if not req.held:
            req.held = True
            conn = self._conns[req.rank]
            conn.held_bytes += self._cost(req)
            conn.held_count += 1

    def _release(self, req: Request) -> None:
        if req.held:
            req.held = False
            conn = self._conns[req.rank]
            conn.held_bytes -= self._cost(req)
            conn.held_count -= 1

    def _reply(self, req: Request, specs: list[dict], parts: list, **extra) -> None:
        views = [p if isinstance(p, (bytes, bytearray)) else tensor_bytes(p) for p in parts]
        req.entry["status"] = "ok"
        req.entry["bytes_received"] = sum(len(v) for v in views)
        self._send_frame(self._conns[req.rank],
                         {"id": req.id, "ok": True, "tensors": specs, **extra}, views)

    def _fail(self, req: Request, message: str) -> None:
        if req.entry["status"] != "pending":
            return
        req.entry["status"], req.entry["error"] = "error", message
        self._send_frame(self._conns[req.rank], {"id": req.id, "ok": False, "error": message}, [])

    # Sending never disconnects on the spot (it runs in the middle of other ranks' bookkeeping):
    # a rank whose replies pile up or whose socket fails is cut off after the current event.

    def _send_frame(self, conn: _Conn, header: dict, parts: list) -> None:
        if conn.closed or conn.doomed:
            return
        total = sum(len(p) for p in parts)
        pieces = [frame(header, total)] + [memoryview(p).cast("B") for p in parts if len(p)]
        conn.out.extend(pieces)
        conn.out_bytes += sum(len(p) for p in pieces)
        if conn.out_bytes > self._max_out_bytes:
            conn.doomed = f"let more than {self._max_out_bytes} bytes of replies pile up unread"
            return
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        while conn.out and not conn.closed and not conn.doomed:
            piece = conn.out[0]
            try:
                n = conn.sock.send(piece)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                conn.doomed = f"broke its connection ({exc})"
                return
            conn.out_bytes -= n
            if n == len(piece):
                conn.out.popleft()
            else:
                conn.out[0] = piece[n:]
        if not conn.closed:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
            self._selector.modify(conn.sock, events, conn)

