"""The "relay" ``torch.distributed`` backend: every message of a rank goes through a trusted broker.

Why: the autograder must audit what a student's ranks communicate ("your ring all-reduce used only
send/recv, and each rank sent 2(N-1)/N of the tensor") in a way the student's code cannot bypass.
An in-process audit (:mod:`ddpcourse.grading.comm_audit`) misses a collective called from another
thread, an alias, or the C++ process-group objects. Here each rank runs in its own sandbox and its
only channel to the others is one connected socket to :class:`autograder.broker.Broker` in the
grader's process, which routes point-to-point messages, performs the collectives and logs every
operation per rank. This module is the rank's side, and it is untrusted: whatever it sends, the
broker checks.

Starting a rank against a broker (the broker's docstring shows the grader's side)::

    from ddpcourse.grading.relay import init_relay_process_group
    init_relay_process_group()   # socket fd from DDPCOURSE_RELAY_FD, RANK and WORLD_SIZE from env
    dist.all_reduce(t)           # ... and the rest of torch.distributed, DDP included, on CPU

Wire format, both directions: a frame is ``PREFIX`` (header length, payload length), a UTF-8 JSON
header, then the payload: the raw bytes of the tensors the header lists as ``{"dtype": NAME,
"shape": [...]}``, back to back, all of one dtype. Nothing is ever pickled. A request names its
``op``, the ``tensors`` it uploads and the ``expect``-ed tensors of the reply; the reply carries the
request's ``id`` and either ``"ok": true`` with its ``tensors`` or ``"ok": false`` with an
``error`` to raise. When the broker's greeting says ``"rendezvous": true`` (a send then completes
only once a recv matches it), a rank that blocks in ``wait`` on a send or recv says so once,
``{"op": "wait", "id": ...}`` (no reply), so that the broker can name ranks blocked in a circle.

It is a Python subclass of ``torch.distributed.ProcessGroup``, as torch's own ``ProcessLocalGroup``
(torch/testing/_internal/distributed/multi_threaded_pg.py) and test/distributed/test_c10d_pypg.py
do it: ``torch.distributed`` calls its methods directly, and C++ callers (DDP's reducer, its
parameter check and broadcast) reach the same methods through torch's ``PyProcessGroup``
trampoline. Its ``Work`` is a Python subclass of the public ``torch.distributed.Work``.

Supported, CPU tensors only: send, recv (also from any source), isend/irecv, batch_isend_irecv,
all_reduce (SUM, AVG on floating point, MIN, MAX, PRODUCT, BAND/BOR/BXOR on integers),
all_reduce_coalesced, broadcast, barrier, all_gather, all_gather_into_tensor, reduce_scatter,
reduce_scatter_tensor, reduce, gather, scatter, all_to_all, all_to_all_single, and what
DistributedDataParallel needs. Not supported: ``dist.new_group`` (one group per connection),
PREMUL_SUM, tensors of other dtypes or on other devices, mixed dtypes in one call.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND = "relay"
ENV_FD = "DDPCOURSE_RELAY_FD"
PROTOCOL = 1
PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 64 * 1024
MAX_TENSORS = 1024
MAX_DIMS = 16

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")

# A reply should come within the broker's deadline; past it plus this grace, the broker is gone.
_REPLY_GRACE_S = 10.0


class RelayError(RuntimeError):
    """A relay operation failed: the broker's message, or a local misuse."""


def frame(header: dict, payload_len: int = 0) -> bytes:
    """The prefix and header of one frame; the caller sends ``payload_len`` bytes after it."""
    data = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(data), payload_len) + data


def spec(tensor: torch.Tensor) -> dict:
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise RelayError(f"relay: tensors of dtype {tensor.dtype} are not supported "
                         f"(supported: {', '.join(DTYPES)})")
    if tensor.device.type != "cpu":
        raise RelayError(f"relay: CPU tensors only, got one on {tensor.device}")
    return {"dtype": name, "shape": list(tensor.shape)}


def spec_nbytes(item: dict) -> int:
    return math.prod(item["shape"]) * DTYPES[item["dtype"]].itemsize


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, copied now if it is not contiguous (a later change to it is not sent)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def tensors_from(payload: bytearray, specs: list[dict]) -> list[torch.Tensor]:
    """Views of ``payload`` as the tensors ``specs`` lists, which must account for every byte."""
    total = sum(spec_nbytes(item) for item in specs)
    if total != len(payload):
        raise RelayError(f"relay: {len(payload)} payload bytes for tensors of {total} bytes")
    tensors, offset = [], 0
    for item in specs:
        dtype, shape = DTYPES[item["dtype"]], item["shape"]
        numel = math.prod(shape)
        if numel == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            tensors.append(torch.frombuffer(payload, dtype=dtype, count=numel,
                                            offset=offset).view(shape))
        offset += numel * dtype.itemsize
    return tensors


def _seconds(timeout) -> float | None:
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return float(timeout) if timeout else None  # torch passes 0 for "no timeout"


class RelayWork(dist.Work):
    """One request in flight: ``wait`` raises the broker's error; DDP uses ``get_future``."""

    def __init__(self, what: str, outputs, wait_limit_s: float):
        super().__init__()
        self._what = what
        self._outputs = outputs
        self._deadline = time.monotonic() + wait_limit_s
        self._done = threading.Event()
        self._error: str | None = None
        self._source = -1
        self._future = torch.futures.Future()
        self._on_block = None  # tells the broker this rank blocks on it (rendezvous mode)

    def _finish(self, error: str | None = None) -> None:
        if self._done.is_set():
            return
        self._error = error
        self._done.set()
        if error is None:
            self._future.set_result(self._outputs)
        else:
            self._future.set_exception(RelayError(error))

    def wait(self, timeout=None) -> bool:
        if not self._done.is_set():
            on_block, self._on_block = self._on_block, None
            if on_block is not None:
                on_block()
        limit = self._deadline - time.monotonic()
        asked = _seconds(timeout)
        if asked is not None:
            limit = min(limit, asked)
        if not self._done.wait(max(limit, 0.0)):
            raise RelayError(f"relay: {self._what}: no answer from the broker in time")
        if self._error is not None:
            raise RelayError(self._error)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return RelayError(self._error) if self._error is not None else None

    def result(self):
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return self._source

    _source_rank = source_rank


class RelayProcessGroup(dist.ProcessGroup):
    """A process group of ``world_size`` ranks whose only channel is ``sock``, a broker connection.

    Any thread may call it: requests go out one at a time under a lock, and one reader thread
    matches the broker's replies to them by id.
    """

    def __init__(self, sock: socket.socket, rank: int, world_size: int,
                 hello_timeout_s: float = 60.0):
        super().__init__(rank, world_size)
        self._rank, self._world_size = rank, world_size
        self._sock = sock
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pending: dict[int, tuple[RelayWork, object]] = {}
        self._next_id = 1
        self._closed: str | None = None
        greeting = self._hello(hello_timeout_s)
        self._wait_limit_s = float(greeting["timeout"]) + _REPLY_GRACE_S
        self._max_message_bytes = int(greeting["max_message_bytes"])
        self._rendezvous = greeting.get("rendezvous") is True
        # Blocking from now on: shutdown() wakes the reader, and the broker always reads.
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read_replies, name="relay-reader",
                                        daemon=True)
        self._reader.start()

    # -- the connection -----------------------------------------------------------------------

    def _hello(self, timeout_s: float) -> dict:
        self._sock.settimeout(timeout_s)
        try:
            self._sock.sendall(frame({"op": "hello", "id": 0, "rank": self._rank,
                                      "world_size": self._world_size, "protocol": PROTOCOL}))
            header, _ = self._read_frame()
        except (OSError, ValueError) as exc:
            raise RelayError(f"relay: rank {self._rank} could not reach the broker: {exc}") from exc
        if header is None or not header.get("ok"):
            why = "it closed the connection" if header is None else header.get("fatal")
            raise RelayError(f"relay: the broker refused rank {self._rank}: {why}")
        return header

    def _recv_exact(self, n: int) -> bytearray | None:
        buf, got = bytearray(n), 0
        view = memoryview(buf)
        while got < n:
            k = self._sock.recv_into(view[got:], n - got)
            if k == 0:
                return None
            got += k
        return buf

    def _read_frame(self) -> tuple[dict | None, bytearray]:
        prefix = self._recv_exact(PREFIX.size)
        if prefix is None:
            return None, bytearray()
        header_len, payload_len = PREFIX.unpack(prefix)
        if header_len > MAX_HEADER_BYTES:
            raise OSError(f"a reply header of {header_len} bytes")
        header_bytes = self._recv_exact(header_len)
        payload = self._recv_exact(payload_len) if payload_len else bytearray()
        if header_bytes is None or payload is None:
            return None, bytearray()
        return json.loads(header_bytes), payload

    def _read_replies(self) -> None:
        reason = "the broker closed the connection"
        try:
            while True:
                header, payload = self._read_frame()
                if header is None:
                    break
                if header.get("fatal"):
                    reason = f"the broker cut this rank off: {header['fatal']}"
                    break
                with self._state_lock:
                    work, on_reply = self._pending.pop(header.get("id"), (None, None))
                if work is None:
                    continue
                if not header.get("ok"):
                    work._finish(str(header.get("error")))
                    continue
                try:
                    if on_reply is not None:
                        on_reply(work, header, tensors_from(payload, header.get("tensors", [])))
                    work._finish()
                except Exception as exc:  # a reply that does not fit: fail this op, not the rank
                    work._finish(f"relay: {work._what}: unusable reply from the broker: {exc}")
        except Exception as exc:  # whatever breaks the reader, no request may wait forever
            reason = f"lost the connection to the broker ({exc!r})"
        self._fail_all(self._closed or f"relay: rank {self._rank}: {reason}")

    def _fail_all(self, reason: str) -> None:
        with self._state_lock:
            if self._closed is None:
                self._closed = reason
            pending, self._pending = self._pending, {}
        for work, _ in pending.values():
            work._finish(reason)

    def _request(self, what: str, header: dict, upload, expect, outputs, on_reply=None):
        """Send one request; the returned work finishes when its reply has been applied."""
        work = RelayWork(what, outputs, self._wait_limit_s)
        specs = [spec(t) for t in upload] + [spec(t) for t in expect]
        if len(upload) > MAX_TENSORS or len(expect) > MAX_TENSORS:
            raise RelayError(f"relay: {what}: more than {MAX_TENSORS} tensors in one call")
        if len({item["dtype"] for item in specs}) > 1:
            raise RelayError(f"relay: {what}: all tensors of one call must share a dtype")
        sizes = [spec_nbytes(item) for item in specs]
        if sum(sizes[:len(upload)]) > self._max_message_bytes or any(
                size > self._max_message_bytes for size in sizes):
            raise RelayError(f"relay: {what}: the broker takes at most "
                             f"{self._max_message_bytes} bytes in one call")
        header = {**header, "tensors": specs[:len(upload)], "expect": specs[len(upload):]}
        parts = [tensor_bytes(t) for t in upload]
        with self._send_lock:
            with self._state_lock:
                closed = self._closed
                if closed is None:
                    header["id"] = request_id = self._next_id
                    self._next_id += 1
                    self._pending[request_id] = (work, on_reply)
                    if self._rendezvous and header["op"] in ("send", "recv"):
                        work._on_block = lambda: self._say_blocked(request_id)
            if closed is not None:
                work._finish(closed)
                return work
            try:
                self._sock.sendall(frame(header, sum(p.nbytes for p in parts)))
                for part in parts:
                    self._sock.sendall(part)
            except OSError as exc:
                self._fail_all(f"relay: rank {self._rank} lost the connection to the broker "
                               f"while sending {what} ({exc})")
        return work

    def _say_blocked(self, request_id: int) -> None:
        """Tell the broker this rank now blocks on request ``request_id`` (no reply comes)."""
        with self._send_lock:
            if self._closed is None:
                try:
                    self._sock.sendall(frame({"op": "wait", "id": request_id}))
                except OSError:
                    pass  # the reader sees the broken connection and fails what is pending

    def _collective(self, op: str, what: str, fields: dict, upload, expect, outputs, deliver=None):
        def on_reply(work, header, received):
            if deliver is not None:
                deliver(received)
        return self._request(what, {"op": op, **fields}, upload, expect, outputs, on_reply)

    # -- point to point -----------------------------------------------------------------------

    def _single(self, tensors, what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise RelayError(f"relay: {what} takes exactly one tensor, got {len(tensors)}")
        return tensors[0]

    def send(self, tensors, dstRank, tag):
        tensor = self._single(tensors, "send")
        return self._request(f"send to rank {dstRank}", {"op": "send", "dst": dstRank, "tag": tag},
                             [tensor], [], tensors)

    def _recv(self, tensors, src, tag):
        tensor = self._single(tensors, "recv")

        def on_reply(work, header, received):
            work._source = int(header.get("src", src if src is not None else -1))
            tensor.copy_(received[0].view(tensor.shape))

        where = f"rank {src}" if src is not None else "any rank"
        return self._request(f"recv from {where}", {"op": "recv", "src": src, "tag": tag},
                             [], [tensor], tensors, on_reply)

    def recv(self, tensors, srcRank, tag):
        return self._recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag):
        return self._recv(tensors, None, tag)

    # -- collectives --------------------------------------------------------------------------

    @staticmethod
    def _reduce_op(opts) -> str:
        name = opts.reduceOp.op.name.lower()
        if name not in REDUCE_OPS:
            raise RelayError(f"relay: reduce op {name.upper()} is not supported")
        return name

    @staticmethod
    def _copy_into(targets):
        def deliver(received):
            for target, value in zip(targets, received):
                target.copy_(value.view(target.shape))
        return deliver

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._collective("all_reduce", "all_reduce", {"reduce_op": self._reduce_op(opts)},
                                tensors, [], tensors, self._copy_into(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts or dist.AllreduceCoalescedOptions())

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        tensor, root = self._single(tensors, "broadcast"), opts.rootRank
        is_root = root == self._rank
        return self._collective("broadcast", f"broadcast from rank {root}", {"root": root},
                                [tensor] if is_root else [], [] if is_root else [tensor], tensors,
                                None if is_root else self._copy_into([tensor]))

    def allgather(self, output_tensors, input_tensors, opts=None):
        tensor = self._single(input_tensors, "all_gather")
        outputs = self._single(output_tensors, "all_gather")
        self._check_count(outputs, "all_gather output list")
        for out in outputs:
            self._check_numel(out, tensor.numel(), "all_gather: every output tensor")
        return self._collective("all_gather", "all_gather", {}, [tensor], [], output_tensors,
                                self._copy_into(outputs))

    def all_gather_single(self, output, input, opts=None):
        self._check_numel(output, input.numel() * self._world_size,
                          "all_gather_into_tensor: the output tensor")

        def deliver(received):
            output.copy_(torch.cat([r.reshape(-1) for r in received]).view(output.shape))
        return self._collective("all_gather", "all_gather_into_tensor", {}, [input], [], output,
                                deliver)

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        output = self._single(output_tensors, "reduce_scatter")
        inputs = self._single(input_tensors, "reduce_scatter")
        self._check_count(inputs, "reduce_scatter input list")
        for chunk in inputs:
            self._check_numel(chunk, output.numel(), "reduce_scatter: every input tensor")
        return self._collective("reduce_scatter", "reduce_scatter",
                                {"reduce_op": self._reduce_op(opts)},
                                [c.reshape(output.shape) for c in inputs], [], output_tensors,
                                self._copy_into([output]))

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        self._check_numel(input, output.numel() * self._world_size,
                          "reduce_scatter_tensor: the input tensor")
        chunks = [c.view(output.shape) for c in input.detach().reshape(-1).split(output.numel())]
        return self._collective("reduce_scatter", "reduce_scatter_tensor",
                                {"reduce_op": self._reduce_op(opts)}, chunks, [], output,
                                self._copy_into([output]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        tensor, root = self._single(tensors, "reduce"), opts.rootRank
        is_root = root == self._rank
        return self._collective("reduce", f"reduce to rank {root}",
                                {"root": root, "reduce_op": self._reduce_op(opts)}, [tensor], [],
                                tensors, self._copy_into([tensor]) if is_root else None)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        tensor, root = self._single(input_tensors, "gather"), opts.rootRank
        outputs = []
        if root == self._rank:
            outputs = self._single(output_tensors, "gather")
            self._check_count(outputs, "gather output list")
            for out in outputs:
                self._check_numel(out, tensor.numel(), "gather: every output tensor")
        return self._collective("gather", f"gather to rank {root}", {"root": root}, [tensor], [],
                                output_tensors, self._copy_into(outputs))

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        output, root = self._single(output_tensors, "scatter"), opts.rootRank
        inputs = []
        if root == self._rank:
            inputs = self._single(input_tensors, "scatter")
            self._check_count(inputs, "scatter input list")
            for chunk in inputs:
                self._check_numel(chunk, output.numel(), "scatter: every input tensor")
            inputs = [c.reshape(output.shape) for c in inputs]
        return self._collective("scatter", f"scatter from rank {root}", {"root": root}, inputs,
                                [] if inputs else [output], output_tensors,
                                self._copy_into([output]))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check_count(output_tensors, "all_to_all output list")
        self._check_count(input_tensors, "all_to_all input list")
        return self._collective("all_to_all", "all_to_all", {}, input_tensors, output_tensors,
                                output_tensors, self._copy_into(output_tensors))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        def pieces(tensor, sizes):
            if not sizes:
                if tensor.shape[0] % self._world_size:
                    raise RelayError("relay: all_to_all_single: dim 0 does not split evenly")
                sizes = [tensor.shape[0] // self._world_size] * self._world_size
            return list(tensor.split(list(sizes)))
        outputs = pieces(output, output_split_sizes)
        return self._collective("all_to_all", "all_to_all_single", {},
                                pieces(input, input_split_sizes), outputs, output,
                                self._copy_into(outputs))

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._collective("barrier", "barrier", {}, [], [], [])

    def _check_count(self, tensors, what: str) -> None:
        if len(tensors) != self._world_size:
            raise RelayError(f"relay: {what} must hold {self._world_size} tensors, "
                             f"got {len(tensors)}")

    @staticmethod
    def _check_numel(tensor, numel: int, what: str) -> None:
        if tensor.numel() != numel:
            raise RelayError(f"relay: {what} must have {numel} elements, has {tensor.numel()}")

    # -- the rest of the ProcessGroup interface -----------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def shutdown(self) -> None:
        self._fail_all(f"relay: rank {self._rank}'s process group was shut down")
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=5)
        self._sock.close()

    abort = shutdown

    def __repr__(self) -> str:
        return f"RelayProcessGroup(rank={self._rank}, world_size={self._world_size})"


_handoff: dict = {}
_used = False


def _create_relay_group(store, rank: int, world_size: int, timeout) -> RelayProcessGroup:
    """The creator ``init_process_group`` calls; ``store`` is not used (the broker is the store)."""
    global _used
    if _used:
        raise RelayError("relay: one process group per process: dist.new_group is not supported")
    fd = _handoff.pop("fd", None)
    if fd is None:
        fd = os.environ.pop(ENV_FD, None)
    if fd is None:
        raise RelayError(f"relay: no broker connection: call init_relay_process_group(fd, ...) "
                         f"or set {ENV_FD}")
    sock = socket.socket(fileno=int(fd))
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise RelayError(f"relay: fd {fd} is not a connected Unix stream socket")
    _used = True
    return RelayProcessGroup(sock, rank, world_size, _seconds(timeout) or 60.0)


def init_relay_process_group(sock_fd: int | None = None, rank: int | None = None,
                             world_size: int | None = None,
                             timeout: float = 60.0) -> RelayProcessGroup:
    """Make a relay group on the broker connection ``sock_fd`` this process's default group.

    Unset arguments come from the environment: ``DDPCOURSE_RELAY_FD``, ``RANK``, ``WORLD_SIZE``.
    ``timeout`` bounds the wait for the broker's greeting; each operation's deadline is the
    broker's. The rendezvous store is a local ``HashStore``: the ranks need no network.
    """
    if sock_fd is not None:
        _handoff["fd"] = sock_fd
        os.environ.pop(ENV_FD, None)
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    return dist.group.WORLD


dist.Backend.register_backend(BACKEND, _create_relay_group, devices=["cpu"])
