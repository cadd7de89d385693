"""The relay backend and its broker (autograder/broker.py, ddpcourse/grading/relay.py).

Ranks are real processes forked from this one (torch is already imported: a fork costs
milliseconds), each holding only its own end of the broker; one test starts a rank as a fresh
interpreter the way a grader does (``pass_fds`` and ``DDPCOURSE_RELAY_FD``). Others speak the
protocol by hand to show what the broker does with a hostile rank.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autograder.broker import Broker
from ddpcourse.grading import relay
from ddpcourse.grading.relay import ENV_FD, MAX_HEADER_BYTES, PREFIX, frame
from ddpcourse.launcher.processes import set_parent_death_signal

REPO = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.float64, torch.int64)


# -- launching ranks ---------------------------------------------------------------------------

def _report(pipe, outcome):
    buffer = io.BytesIO()
    torch.save(outcome, buffer)  # tensors as bytes, not as shared-memory handles
    pipe.send_bytes(buffer.getvalue())
    pipe.close()


def _rank_main(rank, world_size, fn, backend, broker, store_path, raw, results):
    set_parent_death_signal()
    torch.set_num_threads(1)
    if broker is not None:
        broker.close_in_child(rank)
        fd = broker.rank_fd(rank)
        if raw is not None:
            _report(results, ("ok", raw(socket.socket(fileno=fd))))
            return
        relay.init_relay_process_group(fd, rank, world_size)
    else:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=30))
    try:
        outcome = ("ok", fn(rank, world_size))
    except Exception as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    _report(results, outcome)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def launch(fn, world_size, backend="relay", timeout=10.0, deadline=40.0, raw=None, **caps):
    """Run ``fn(rank, world_size)`` in forked ranks; ([("ok", value) | ("error", message) |
    ("died", exit code)] per rank, the closed broker or None). ``raw``: rank -> fn(socket),
    a rank that speaks to the broker by hand."""
    ctx = multiprocessing.get_context("fork")
    broker = Broker(world_size, timeout=timeout, **caps) if backend == "relay" else None
    store_dir = tempfile.TemporaryDirectory()
    procs, pipes = [], []
    try:
        for rank in range(world_size):
            receive, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, daemon=True,
                               args=(rank, world_size, fn, backend, broker,
                                     os.path.join(store_dir.name, "store"),
                                     (raw or {}).get(rank), send))
            proc.start()
            send.close()
            procs.append(proc)
            pipes.append(receive)
        if broker is not None:
            broker.start()
        give_up = time.monotonic() + deadline
        outcomes = []
        for proc, pipe in zip(procs, pipes):
            outcome = None
            if pipe.poll(max(0.0, give_up - time.monotonic())):
                try:
                    outcome = torch.load(io.BytesIO(pipe.recv_bytes()), weights_only=True)
                except EOFError:
                    pass
            proc.join(max(0.1, give_up - time.monotonic()))
            if outcome is None:
                outcome = ("died", proc.exitcode)
            outcomes.append(outcome)
        if broker is not None:
            broker.wait_disconnected(5)
        return outcomes, broker
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        for pipe in pipes:
            pipe.close()
        if broker is not None:
            broker.close()
        store_dir.cleanup()


def values(outcomes):
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    return [value for _, value in outcomes]


# -- every op and dtype, against gloo and exact values -----------------------------------------

def _base(rank, dtype):
    return (torch.arange(6) + 1 + 6 * rank).to(dtype)


def _every_op(rank, world_size, gloo=False):
    out = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        base = _base(rank, dtype)
        ops = ["SUM", "MIN", "MAX", "PRODUCT"] + (["AVG"] if dtype.is_floating_point else [])
        for op in ops:
            if gloo and op == "AVG":
                continue  # gloo has no AVG; checked against exact values only
            t = base.clone()
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"{name} all_reduce {op}"] = t
        t = base.clone()
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        out[f"{name} all_reduce async"] = t
        t = base.clone()
        dist.broadcast(t, src=1)
        out[f"{name} broadcast"] = t
        gathered = [torch.zeros_like(base) for _ in range(world_size)]
        dist.all_gather(gathered, base)
        out[f"{name} all_gather"] = torch.stack(gathered)
        flat = torch.zeros(6 * world_size, dtype=dtype)
        dist.all_gather_into_tensor(flat, base)
        out[f"{name} all_gather_into_tensor"] = flat
        scattered = torch.zeros(2, dtype=dtype)
        dist.reduce_scatter_tensor(scattered, (torch.arange(2 * world_size) * (rank + 1)).to(dtype))
        out[f"{name} reduce_scatter_tensor"] = scattered
        t = base.clone()
        dist.reduce(t, dst=world_size - 1, op=dist.ReduceOp.MAX)
        if rank == world_size - 1:  # other ranks' tensors are unspecified after a reduce
            out[f"{name} reduce"] = t
        into = [torch.zeros_like(base) for _ in range(world_size)] if rank == 0 else None
        dist.gather(base, into, dst=0)
        if rank == 0:
            out[f"{name} gather"] = torch.stack(into)
        piece = torch.zeros(3, dtype=dtype)
        chunks = [(torch.arange(3) + 10 * r).to(dtype) for r in range(world_size)]
        dist.scatter(piece, chunks if rank == 0 else None, src=0)
        out[f"{name} scatter"] = piece
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        incoming = torch.zeros_like(base)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, base, right),
                                           dist.P2POp(dist.irecv, incoming, left)]):
            req.wait()
        out[f"{name} batch_isend_irecv"] = incoming
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"rank": rank})  # pickles on the ranks, bytes in between
    out["all_gather_object"] = torch.tensor([g["rank"] for g in gathered])
    received = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_to_all(received, [torch.tensor([10 * rank + r]) for r in range(world_size)])
    out["all_to_all"] = torch.cat(received)
    received = torch.zeros(world_size, dtype=torch.int64)
    dist.all_to_all_single(received, torch.arange(world_size) + 10 * rank)
    out["all_to_all_single"] = received
    scattered = torch.zeros(2)
    dist.reduce_scatter(scattered, [torch.full((2,), float(rank + r)) for r in range(world_size)])
    out["reduce_scatter"] = scattered
    if rank == 0:  # recv from any source: the sender is reported
        senders = []
        for _ in range(world_size - 1):
            t = torch.zeros(1, dtype=torch.int64)
            src = dist.recv(t)
            senders.append((src, int(t)))
        out["any source"] = torch.tensor(sorted(senders))
    else:
        dist.send(torch.tensor([100 + rank]), dst=0)
    dist.barrier()
    return out


def _every_op_gloo(rank, world_size):
    return _every_op(rank, world_size, gloo=True)


def _expected(rank, world_size):
    out = {}
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        bases = torch.stack([_base(r, dtype) for r in range(world_size)])
        out[f"{name} all_reduce SUM"] = bases.sum(0)
        out[f"{name} all_reduce MIN"] = bases.min(0).values
        out[f"{name} all_reduce MAX"] = bases.max(0).values
        out[f"{name} all_reduce PRODUCT"] = bases.prod(0)
        if dtype.is_floating_point:
            out[f"{name} all_reduce AVG"] = bases.sum(0) / world_size
        out[f"{name} all_reduce async"] = bases.sum(0)
        out[f"{name} broadcast"] = bases[1]
        out[f"{name} all_gather"] = bases
        out[f"{name} all_gather_into_tensor"] = bases.reshape(-1)
        total = sum(r + 1 for r in range(world_size))
        out[f"{name} reduce_scatter_tensor"] = (torch.arange(2 * rank, 2 * rank + 2)
                                                * total).to(dtype)
        if rank == world_size - 1:
            out[f"{name} reduce"] = bases.max(0).values
        if rank == 0:
            out[f"{name} gather"] = bases
        out[f"{name} scatter"] = (torch.arange(3) + 10 * rank).to(dtype)
        out[f"{name} batch_isend_irecv"] = bases[(rank - 1) % world_size]
    out["all_gather_object"] = torch.arange(world_size)
    out["all_to_all"] = torch.arange(world_size) * 10 + rank
    out["all_to_all_single"] = torch.arange(world_size) * 10 + rank
    out["reduce_scatter"] = torch.full((2,), float(sum(r + rank for r in range(world_size))))
    if rank == 0:
        out["any source"] = torch.tensor([(r, 100 + r) for r in range(1, world_size)])
    return out


def test_every_op_gives_gloos_and_the_exact_results(no_orphans):
    world_size = 3
    relayed, broker = launch(_every_op, world_size)
    relayed = values(relayed)
    glooed = values(launch(_every_op_gloo, world_size, backend="gloo")[0])
    for rank in range(world_size):
        expected = _expected(rank, world_size)
        assert sorted(relayed[rank]) == sorted(expected)
        for key, value in expected.items():
            got = relayed[rank][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (rank, key, got, value)
        for key, value in glooed[rank].items():
            assert torch.equal(relayed[rank][key], value), (rank, key)
    ops = broker.ops(0)
    for op in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather",
               "scatter", "all_to_all", "send", "recv", "barrier"):
        assert op in ops
    assert all(entry["status"] == "ok" for r in range(world_size) for entry in broker.log(r))
    assert broker.failure is None


# -- the audit the relay exists for ------------------------------------------------------------

def _ring_allreduce(rank, world_size):
    tensor = torch.arange(4.0 * world_size) + 100 * rank
    chunks, sent = list(tensor.chunk(world_size)), 0
    right, left = (rank + 1) % world_size, (rank - 1) % world_size

    def exchange(send_index, recv_index, accumulate):
        nonlocal sent
        request = dist.isend(chunks[send_index].clone(), right)
        sent += chunks[send_index].numel() * chunks[send_index].element_size()
        incoming = torch.empty_like(chunks[recv_index])
        dist.recv(incoming, left)
        request.wait()
        if accumulate:
            chunks[recv_index] += incoming
        else:
            chunks[recv_index].copy_(incoming)

    for step in range(world_size - 1):
        exchange((rank - step) % world_size, (rank - step - 1) % world_size, True)
    for step in range(world_size - 1):
        exchange((rank + 1 - step) % world_size, (rank - step) % world_size, False)
    return tensor, sent


def test_ring_allreduce_is_counted_to_the_byte(no_orphans):
    world_size = 3
    outcomes, broker = launch(_ring_allreduce, world_size)
    expected = sum(torch.arange(4.0 * world_size) + 100 * r for r in range(world_size))
    nbytes = expected.numel() * 4
    for rank, (result, sent) in enumerate(values(outcomes)):
        assert torch.equal(result, expected)
        assert broker.collectives(rank) == []
        assert broker.ops(rank).count("send") == broker.ops(rank).count("recv") == 2 * (
            world_size - 1)
        assert broker.bytes_sent(rank) == sent == 2 * (world_size - 1) * nbytes // world_size
        assert broker.bytes_received(rank) == sent
        peers = {e["peer"] for e in broker.log(rank)}
        assert peers == {(rank + 1) % world_size, (rank - 1) % world_size}


# -- rendezvous: a send completes only once received ------------------------------------------

def _send_first_ring(rank, world_size):
    """Each rank sends (dist.send) to its right, then receives from its left."""
    incoming = torch.empty(4)
    dist.send(torch.full((4,), float(rank)), (rank + 1) % world_size)
    dist.recv(incoming, (rank - 1) % world_size)
    return incoming


def _isend_first_ring(rank, world_size):
    incoming = torch.empty(4)
    work = dist.isend(torch.full((4,), float(rank)), (rank + 1) % world_size)
    dist.recv(incoming, (rank - 1) % world_size)
    work.wait()
    return incoming


def test_a_send_first_ring_deadlocks_under_rendezvous_only_and_the_circle_is_named(no_orphans):
    expected = [torch.full((4,), float(r)) for r in (2, 0, 1)]  # from the left neighbour
    for fn, rendezvous in [(_send_first_ring, False), (_isend_first_ring, True)]:
        outcomes, broker = launch(fn, 3, rendezvous=rendezvous)
        assert all(map(torch.equal, values(outcomes), expected)) and broker.failure is None
    outcomes, broker = launch(_send_first_ring, 3, rendezvous=True, deadlock_grace_s=0.2)
    circle = ("relay: deadlock: rank 0 is blocked in send to rank 1 (tag 0, float32[4]); rank 1 "
              "is blocked in send to rank 2 (tag 0, float32[4]); rank 2 is blocked in send to "
              "rank 0 (tag 0, float32[4]). Each waits for the next, so none of them can go on. "
              "A blocking send (dist.send) completes only once its receiver has posted the "
              "matching recv, as with gloo and NCCL: post the send with dist.isend before the "
              "blocking recv, and wait for it afterwards.")
    assert broker.failure == circle  # at once, not at the deadline (it would say "timed out")
    assert outcomes == [("error", f"RelayError: {circle}")] * 3
    assert [broker.ops(r) for r in range(3)] == [["send"]] * 3  # the recvs were never reached


def _isend_waits_for_its_recv(rank, world_size):
    """Rank 0's isend returns at once; it completes only once rank 1 receives it (tag 0), which
    rank 1 does only after rank 0's blocking send (tag 1) met its recv."""
    if rank == 0:
        work = dist.isend(torch.ones(2), 1, tag=0)
        time.sleep(0.3)
        before = work.is_completed()
        dist.send(torch.zeros(1), 1, tag=1)
        work.wait()
        return before
    dist.recv(torch.empty(1), 0, tag=1)
    dist.recv(torch.empty(2), 0, tag=0)
    return None


def _blocked_in_send_and_recv(rank, world_size):
    if rank == 0:
        dist.send(torch.ones(2), 1, tag=0)
    else:
        dist.recv(torch.empty(3), 0, tag=5)


def test_under_rendezvous_isend_stays_asynchronous_and_a_mixed_circle_is_named(no_orphans):
    assert [v for v in values(launch(_isend_waits_for_its_recv, 2)[0])] == [True, None]
    outcomes, broker = launch(_isend_waits_for_its_recv, 2, rendezvous=True,
                              deadlock_grace_s=0.2)
    assert values(outcomes) == [False, None]
    outcomes, broker = launch(_blocked_in_send_and_recv, 2, rendezvous=True,
                              deadlock_grace_s=0.2)
    assert broker.failure.startswith(
        "relay: deadlock: rank 0 is blocked in send to rank 1 (tag 0, float32[2]); rank 1 is "
        "blocked in recv from rank 0 (tag 5, float32[3]). Each waits for the next"), broker.failure


def _all_reduce_in_a_thread(rank, world_size):
    from torch.distributed import all_reduce as hidden_name
    box = {}

    def worker():
        t = torch.tensor([rank + 1.0])
        hidden_name(t)
        box["t"] = t

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(20)
    return box["t"]


def test_an_all_reduce_from_a_thread_the_rank_starts_is_logged(no_orphans):
    outcomes, broker = launch(_all_reduce_in_a_thread, 2)
    assert [t.item() for t in values(outcomes)] == [3.0, 3.0]
    for rank in range(2):
        assert broker.collectives(rank) == ["all_reduce"]
        (entry,) = broker.log(rank)
        assert (entry["dtype"], entry["shape"], entry["bytes_sent"]) == ("float32", [1], 4)


def _ddp_steps(rank, world_size, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if world_size > 1:
        if rank == 1:  # DDP's construction must broadcast rank 0's weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4 * 2, 4, generator=torch.Generator().manual_seed(1))
    target = torch.randn(4 * 2, 2, generator=torch.Generator().manual_seed(2))
    mine = slice(rank, None, world_size)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data[mine]), target[mine]).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_ddp_on_the_relay_matches_ddp_on_gloo_and_is_logged(no_orphans):
    import torch._dynamo  # noqa: F401  DDP imports it; once here, not in every forked rank

    relayed, broker = launch(_ddp_steps, 2)
    relayed = values(relayed)
    glooed = values(launch(_ddp_steps, 2, backend="gloo")[0])
    alone = _ddp_steps(0, 1)  # one process, the whole batch: the same mean gradient
    for rank in range(2):
        for mine, theirs, single in zip(relayed[rank], glooed[rank], alone):
            assert torch.equal(mine, theirs)
            torch.testing.assert_close(mine, single)
    param_bytes = sum(p.numel() * 4 for p in alone)
    for rank in range(2):
        reduces = [e for e in broker.log(rank) if e["op"] == "all_reduce"]
        assert len(reduces) == 3  # one bucket per step
        assert all(e["bytes_sent"] == param_bytes and e["status"] == "ok" for e in reduces)
        assert "broadcast" in broker.collectives(rank)


# -- failures end quickly, with a message ------------------------------------------------------

def _mismatched(rank, world_size):
    start = time.monotonic()
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            dist.broadcast(torch.ones(4), src=0)
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_mismatched_collectives_fail_every_rank_at_once(no_orphans):
    outcomes, broker = launch(_mismatched, 2, timeout=30.0)
    for message, seconds in values(outcomes):
        assert "rank 0 called all_reduce(float32[4], op=sum)" in message, message
        assert "rank 1 called broadcast(float32[4], root=0)" in message, message
        assert seconds < 10
    assert "differs between ranks" in broker.failure


def _one_rank_late(rank, world_size):
    start = time.monotonic()
    if rank == world_size - 1:
        time.sleep(2.5)  # busy elsewhere past the deadline, then too late
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_rank_that_never_calls_the_collective_is_named_at_the_deadline(no_orphans):
    outcomes, broker = launch(_one_rank_late, 3, timeout=1.5)
    for rank, (message, seconds) in enumerate(values(outcomes)):
        assert "collective #0 timed out after 1.5 s" in message, message
        assert "rank 0 called all_reduce(float32[2], op=sum)" in message, message
        assert "rank 2 did not call it (rank 2 has not asked for anything)" in message, message
        if rank < 2:
            assert 1.4 < seconds < 2.4, seconds
    assert broker.log(2)[0]["status"] == "error"  # its late call failed at once


def _dies_early(rank, world_size):
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_rank_that_dies_fails_its_peers_with_its_name(no_orphans):
    outcomes, broker = launch(_dies_early, 3, timeout=30.0)
    assert outcomes[1] == ("died", 3)
    for message, seconds in (outcomes[0][1], outcomes[2][1]):
        assert "rank 1 closed its connection" in message, message
        assert seconds < 10
    assert set(broker.disconnected()) == {0, 1, 2}


def _garbage_then_listen(sock):
    sock.sendall(PREFIX.pack(2**31, 0))  # a header of 2 GiB
    sock.settimeout(10)
    heard = b""
    while chunk := sock.recv(65536):
        heard += chunk
    return heard


def _honest_beside_a_hostile_rank(rank, world_size):
    if rank == 0:
        dist.send(torch.tensor([5.0]), dst=2)
        result = None
    else:
        result = torch.zeros(1)
        dist.recv(result, src=0)
    try:
        dist.barrier()
    except RuntimeError as exc:
        return result, str(exc)
    return result, "no error"


def test_a_rank_sending_garbage_is_cut_off_and_the_others_go_on(no_orphans):
    outcomes, broker = launch(_honest_beside_a_hostile_rank, 3, timeout=30.0,
                              raw={1: _garbage_then_listen})
    (_, zero), heard, (got, two) = values(outcomes)
    assert b"was cut off by the broker" in heard
    assert torch.equal(got, torch.tensor([5.0]))
    for message in (zero, two):
        assert "rank 1 was cut off by the broker: it sent a message header of 2147483648" in message
    assert list(broker.cut_off()) == [1]
    assert [e["status"] for e in broker.log(0)] == ["ok", "error"]
    assert broker.log(1) == []


def _unsupported(rank, world_size):
    errors = []
    for call in (lambda: dist.all_reduce(torch.zeros(2, dtype=torch.uint16)),
                 lambda: dist.new_group([0, 1]),
                 lambda: dist.broadcast(torch.zeros(300), src=0),  # 1200 bytes, limit 1024
                 lambda: dist.all_reduce(torch.zeros(2, dtype=torch.int64), op=dist.ReduceOp.AVG)):
        try:
            call()
            errors.append("no error")
        except RuntimeError as exc:
            errors.append(str(exc))
    return errors


def test_what_the_relay_does_not_support_fails_with_a_clear_error(no_orphans):
    outcomes, broker = launch(_unsupported, 2, max_message_bytes=1024)
    for dtype, group, too_large, average in values(outcomes):
        assert "dtype torch.uint16 are not supported" in dtype
        assert "dist.new_group is not supported" in group
        assert "the broker takes at most 1024 bytes in one call" in too_large
        assert "AVG needs floating-point tensors" in average  # every rank is told, at once
    assert broker.ops(0) == ["all_reduce"]  # the first three were refused on the rank
    assert broker.cut_off() == {}


# -- a hostile rank, by hand -------------------------------------------------------------------

class _Client:
    """One rank's end, spoken to by hand."""

    def __init__(self, sock, rank, world_size):
        self.sock, self.rank, self.world_size = sock, rank, world_size
        sock.settimeout(5)

    def raw(self, data: bytes):
        self.sock.sendall(data)

    def reply(self):
        prefix = self._exact(PREFIX.size)
        if prefix is None:
            return None, b""
        header_len, payload_len = PREFIX.unpack(prefix)
        return json.loads(self._exact(header_len)), self._exact(payload_len) or b""

    def _exact(self, n):
        data = b""
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except ConnectionResetError:  # closed with our bytes unread: EOF after its last word
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def hello(self):
        self.raw(frame({"op": "hello", "id": 0, "rank": self.rank,
                        "world_size": self.world_size, "protocol": relay.PROTOCOL}))
        return self.reply()[0]

    def request(self, header, payload=b""):
        self.raw(frame(header, len(payload)) + payload)
        return self.reply()


def _f32(n):
    return {"dtype": "float32", "shape": [n]}


def _hello(rank=1, world_size=2, **change):
    return {"op": "hello", "id": 0, "rank": rank, "world_size": world_size,
            "protocol": relay.PROTOCOL, **change}


def _send(**change):
    return {"op": "send", "id": 1, "dst": 0, "tag": 0, "tensors": [_f32(1)], "expect": [],
            **change}


HOSTILE = {  # what rank 1 sends -> why the broker cuts it off
    "oversized header": (PREFIX.pack(MAX_HEADER_BYTES + 1, 0), "message header of 65537"),
    "oversized payload": (PREFIX.pack(10, 2**32 - 1), "message of 4294967295 bytes"),
    "not JSON": (PREFIX.pack(4, 0) + b"\xff{[\x00", "not JSON"),
    "deeply nested JSON": (PREFIX.pack(60000, 0) + b"[" * 30000 + b"]" * 30000, "not JSON"),
    "not an object": (frame([1, 2]), "not a JSON object"),
    "no greeting": (frame(_send()) + b"\0" * 4, "did not start with a greeting"),
    "another rank's greeting": (frame(_hello(rank=0)), "says it is rank 0 of 2"),
    "unknown op": (frame(_hello()) + frame({"op": "exec", "id": 1}), "unknown operation"),
    "unknown dtype": (frame(_hello()) + frame(_send(tensors=[{"dtype": "object", "shape": [1]}])),
                      "unknown dtype"),
    "bool for an int": (frame(_hello()) + frame(_send(dst=True), 4) + b"\0" * 4, "bad 'dst'"),
    "peer out of range": (frame(_hello()) + frame(_send(dst=7), 4) + b"\0" * 4, "bad 'dst'"),
    "negative dim": (frame(_hello()) + frame(_send(tensors=[{"dtype": "float32", "shape": [-1]}])),
                     "bad tensor shape"),
    "huge tensor": (frame(_hello()) + frame(_send(tensors=[_f32(2**39)])), "larger than"),
    "payload of the wrong size": (frame(_hello()) + frame(_send(), 8) + b"\0" * 8,
                                  "8 payload bytes for tensors of 4"),
    "bad wait": (frame(_hello()) + frame({"op": "wait", "id": True}), "bad 'id'"),
    "too many waiting requests": (frame(_hello()) + b"".join(
        frame({"op": "recv", "id": i, "src": 0, "tag": 0, "expect": [_f32(1)]})
        for i in range(1, 6)), "more than 4 requests"),
    "does not read its replies": (frame(_hello()) + b"".join(
        frame(_send(id=2 * i, dst=1, tag=i, tensors=[_f32(250)]), 1000) + b"\0" * 1000
        + frame({"op": "recv", "id": 2 * i + 1, "src": 1, "tag": i, "expect": [_f32(250)]})
        for i in range(600)), "replies pile up unread"),
    "too many held bytes": (frame(_hello()) + b"".join(
        frame(_send(id=i, tensors=[_f32(250)]), 1000) + b"\0" * 1000 for i in range(1, 6)),
        "more than 8192 bytes"),
    "too many operations": (frame(_hello()) + b"".join(
        frame(_send(id=2 * i, dst=1, tag=i), 4) + b"\0" * 4
        + frame({"op": "recv", "id": 2 * i + 1, "src": 1, "tag": i, "expect": [_f32(1)]})
        for i in range(30)), "more than 100 operations and tensors"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_broker_cuts_off_a_hostile_rank_and_serves_the_others(case):
    data, why = HOSTILE[case]
    broker = Broker(2, timeout=5.0, max_message_bytes=1024, max_held_bytes=8192,
                    max_held_requests=4, max_logged=100 if case == "too many operations" else 10_000)
    honest = _Client(socket.socket(fileno=os.dup(broker.rank_fd(0))), 0, 2)
    hostile = _Client(socket.socket(fileno=os.dup(broker.rank_fd(1))), 1, 2)
    try:
        broker.start()
        assert honest.hello()["ok"]
        try:
            hostile.raw(data)
        except OSError:
            pass  # cut off before it finished writing
        heard = []
        while True:
            header, _ = hostile.reply()
            if header is None:
                break
            heard.append(header)
        if case != "does not read its replies":  # (its last word could not get through)
            assert heard and "fatal" in heard[-1], heard  # the reason, then EOF
        assert why in broker.cut_off()[1], broker.cut_off()
        header, _ = honest.request({"op": "barrier", "id": 1, "tensors": [], "expect": []})
        assert not header["ok"] and "rank 1 was cut off by the broker" in header["error"]
        one = b"\x00\x00\x80\x3f"  # 1.0f
        header, _ = honest.request({"op": "send", "id": 2, "dst": 0, "tag": 3,
                                    "tensors": [_f32(1)], "expect": []}, one)
        assert header["ok"], header
        header, payload = honest.request({"op": "recv", "id": 3, "src": 0, "tag": 3,
                                          "tensors": [], "expect": [_f32(1)]})
        assert header["ok"] and payload == one and header["src"] == 0
    finally:
        start = time.monotonic()
        broker.close()
        broker.close()
        assert time.monotonic() - start < 5
        honest.sock.close()
        hostile.sock.close()


def test_a_recv_that_nothing_matches_fails_the_group_at_the_deadline():
    with Broker(2, timeout=0.5) as broker:
        waiting = _Client(socket.socket(fileno=os.dup(broker.rank_fd(0))), 0, 2)
        idle = _Client(socket.socket(fileno=os.dup(broker.rank_fd(1))), 1, 2)
        broker.start()
        assert waiting.hello()["ok"] and idle.hello()["ok"]
        start = time.monotonic()
        header, _ = waiting.request({"op": "recv", "id": 1, "src": 1, "tag": 4,
                                     "expect": [_f32(3)]})
        assert 0.45 < time.monotonic() - start < 3
        assert header["error"] == ("relay: recv by rank 0 from rank 1 (tag 4, float32[3]) timed "
                                   "out after 0.5 s: nothing matching was sent (rank 1 has not "
                                   "asked for anything)")
        late, _ = idle.request({"op": "barrier", "id": 1})
        assert late["error"] == header["error"] == broker.failure
        waiting.sock.close()
        idle.sock.close()


def test_under_rendezvous_a_send_that_nothing_receives_fails_at_the_deadline():
    with Broker(2, timeout=0.5, rendezvous=True) as broker:
        sending = _Client(socket.socket(fileno=os.dup(broker.rank_fd(0))), 0, 2)
        idle = _Client(socket.socket(fileno=os.dup(broker.rank_fd(1))), 1, 2)
        broker.start()
        assert sending.hello()["rendezvous"] is True and idle.hello()["ok"]
        start = time.monotonic()
        header, _ = sending.request({"op": "send", "id": 1, "dst": 1, "tag": 4,
                                     "tensors": [_f32(1)]}, b"\0" * 4)
        assert 0.45 < time.monotonic() - start < 3
        assert header["error"] == broker.failure == (
            "relay: send from rank 0 to rank 1 (tag 4, float32[1]) timed out after 0.5 s: rank 1 "
            "posted no matching recv (rank 1 has not asked for anything)")
        sending.sock.close()
        idle.sock.close()


# -- the way a grader starts its ranks ---------------------------------------------------------

_SANDBOXED_RANK = """
import torch, torch.distributed as dist
from ddpcourse.grading.relay import init_relay_process_group
init_relay_process_group()
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(int(t.item()))
dist.destroy_process_group()
"""


def _plain_all_reduce(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return int(t.item())


def test_a_fresh_interpreter_started_with_pass_fds_joins_the_group(no_orphans):
    # Rank 0 is started as a grader starts a sandboxed rank; rank 1 is forked (saves an import).
    broker = Broker(2, timeout=30.0)
    fd = broker.rank_fd(0)
    env = {**os.environ, ENV_FD: str(fd), "RANK": "0", "WORLD_SIZE": "2"}
    fresh = subprocess.Popen([sys.executable, "-c", _SANDBOXED_RANK], cwd=REPO, env=env,
                             pass_fds=[fd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    forked = multiprocessing.get_context("fork").Process(
        target=_rank_main, daemon=True,
        args=(1, 2, _plain_all_reduce, "relay", broker, None, None, send))
    try:
        forked.start()
        send.close()
        broker.start()
        out, err = fresh.communicate(timeout=60)
        assert receive.poll(30)
        other = torch.load(io.BytesIO(receive.recv_bytes()), weights_only=True)
    finally:
        if fresh.poll() is None:
            fresh.kill()
        fresh.wait(5)
        if forked.is_alive():
            forked.kill()
        forked.join(5)
        receive.close()
        broker.close()
    assert (out.strip(), other) == ("3", ("ok", 3)), (out, err)
    assert broker.collectives(0) == broker.collectives(1) == ["all_reduce"]
