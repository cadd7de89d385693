"""Communication-audited cases graded the way the autograder does it (autograder/relayed.py): each
rank in its own host, linked only by the grader's broker, whose log is what the judge reads.

The attacks of the grading-integrity issue that an audit inside the rank cannot see: a collective
from another thread (with dummy point-to-point traffic of a ring's size), and a process group of
the student's own, built from torch's C++ objects. The whole class, a "threader" included, is
graded in tests/test_autograder.py.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autograder import sandbox, trusted
from autograder.relayed import RelayedRanks
from autograder.sources import solution_code
from ddpcourse.grading.checks import CheckFailed, run_student
from ddpcourse.grading.exercises import allreduce_by_hand as checks
from fake_class.hostile import RING_BEHIND_THE_AUDIT
from trusted_path import submitted

SOLUTION = Path(__file__).resolve().parents[1] / "solutions/05_allreduce/allreduce_by_hand.ipynb"
needs_bwrap = pytest.mark.skipif(sandbox.bwrap_problem() is not None,
                                 reason=f"no sandbox here: {sandbox.bwrap_problem()}")


def ring_allreduce(tensor):
    """A correct ring: reduce-scatter then all-gather, chunk by chunk, send/recv only."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for phase in ("reduce", "gather"):
        for step in range(world_size - 1):
            offset = 1 if phase == "gather" else 0
            send_index = (rank - step + offset) % world_size
            recv_index = (rank - step - 1 + offset) % world_size
            incoming = torch.empty_like(chunks[recv_index])
            request = dist.isend(chunks[send_index].clone(), right)
            dist.recv(incoming, left)
            request.wait()
            if phase == "reduce":
                chunks[recv_index] += incoming
            else:
                chunks[recv_index].copy_(incoming)


def the_solution():
    """``ring_allreduce`` as the solution notebook defines it."""
    namespace = {"torch": torch, "dist": dist}
    exec(compile(solution_code(SOLUTION, "ring-allreduce"), "<student notebook>", "exec"),
         namespace)
    return namespace["ring_allreduce"]


def send_first_ring(tensor):
    """A correct ring but for one thing: each rank sends (dist.send, blocking) before it receives.
    On gloo and NCCL every rank then waits in its send for a recv nobody posts."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    for phase in ("reduce", "gather"):
        for step in range(world_size - 1):
            offset = 1 if phase == "gather" else 0
            recv_index = (rank - step - 1 + offset) % world_size
            incoming = torch.empty_like(chunks[recv_index])
            dist.send(chunks[(rank - step + offset) % world_size].contiguous(), right)
            dist.recv(incoming, left)
            if phase == "reduce":
                chunks[recv_index] += incoming
            else:
                chunks[recv_index].copy_(incoming)


def _dummy_ring_traffic(tensor):
    """Point-to-point messages of exactly a ring's size, carrying nothing useful."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for chunk in list(tensor.view(-1).tensor_split(world_size))[1:] * 2:  # 2(N-1) chunks
        request = dist.isend(torch.zeros_like(chunk), (rank + 1) % world_size)
        dist.recv(torch.empty_like(chunk), (rank - 1) % world_size)
        request.wait()


def all_reduce_from_a_thread(tensor):
    """The issue's attack: the sum comes from a collective called in a thread the rank starts."""
    worker = threading.Thread(target=dist.all_reduce, args=(tensor,))
    worker.start()
    worker.join()
    _dummy_ring_traffic(tensor)


def hostile_ring():
    """The fake class's "threader": a process group of its own from torch's C++ objects
    (rendezvous through an allowed send), and where that cannot connect, dist.all_reduce from a
    thread with dummy point-to-point traffic of a ring's size."""
    namespace = {"__name__": "threaders_notebook", "dist": dist, "torch": torch}
    exec(RING_BEHIND_THE_AUDIT, namespace)
    return namespace["ring_allreduce"]


@pytest.fixture(scope="module")
def relayed():
    """Relayed ranks without sandboxes: every message still goes through the broker, but the
    ranks share one network (as when an instructor grades with ``--sandbox off``)."""
    with RelayedRanks(lambda rank, relay_dir: trusted.ObservationHost(one_rank=True)) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory):
    """Relayed ranks as the autograder starts them: one sandbox per rank."""
    root = tmp_path_factory.mktemp("ranks")

    def rank_host(rank, relay_dir):
        folder = root / f"rank{rank}"
        folder.mkdir()
        box = sandbox.Sandbox(writable=(folder,), readable=(*sandbox.Sandbox().readable, relay_dir))
        return trusted.ObservationHost(wrap=box.command, one_rank=True)

    with RelayedRanks(rank_host) as ranks:
        yield ranks


def test_a_ring_passes_and_its_traffic_is_counted_by_the_broker(host, relayed):
    fn = submitted(ring_allreduce, host, relayed)
    checks.check_ring_allreduce_two_ranks(fn)
    [observation] = run_student(checks.RING_ALLREDUCE, 1, fn, (5,))
    assert observation["traffic"] == {"collectives": [], "bytes_sent": 0, "collective_calls": []}
    observations = run_student(checks.RING_ALLREDUCE, 4, fn, (1000,), "float32", 0, True)
    assert [o["traffic"]["bytes_sent"] for o in observations] == [2 * 3 * 250 * 4] * 4


def test_a_send_first_ring_deadlocks_in_the_graded_run_and_the_solution_passes(host, relayed):
    """The ring's cases run with the broker in rendezvous mode (a blocking send completes only
    once received, as on gloo and NCCL): a ring that sends before it receives deadlocks there as
    it would on real hardware, and fails at once, naming each rank and the send it is stuck in."""
    assert checks.RING_ALLREDUCE.rendezvous
    checks.check_ring_allreduce_two_ranks(submitted(the_solution(), host, relayed))
    send_first = submitted(send_first_ring, host, relayed)
    with pytest.raises(CheckFailed) as info:
        checks.check_ring_allreduce_two_ranks(send_first)
    message = str(info.value)
    for rank in (0, 1):
        assert (f"rank {rank} is blocked in send to rank {1 - rank} (tag 0, float32[4])"
                in message), message
    assert "post the send with dist.isend" in message, message
    # what the grader's broker let pass before: it held every message until it was received
    keeps_messages = dataclasses.replace(checks.RING_ALLREDUCE, rendezvous=False)
    run_student(keeps_messages, 2, send_first, (8,))


def test_a_collective_from_a_thread_is_caught_whatever_the_point_to_point_traffic(host, relayed):
    with pytest.raises(CheckFailed, match=r"point-to-point calls only .*'all_reduce'"):
        checks.check_ring_allreduce_is_bandwidth_optimal(
            submitted(all_reduce_from_a_thread, host, relayed))


def test_without_sandboxes_a_group_of_its_own_would_escape_the_broker(host, relayed):
    """Why each rank needs its own sandbox: on a shared network the attack works."""
    checks.check_ring_allreduce_two_ranks(submitted(hostile_ring(), host, relayed))


@needs_bwrap
def test_in_sandboxes_a_group_of_its_own_cannot_reach_the_other_ranks(host, sandboxed):
    # its group cannot connect, so it falls back to the thread, which the broker sees
    with pytest.raises(CheckFailed, match=r"point-to-point calls only .*'all_reduce'"):
        checks.check_ring_allreduce_two_ranks(submitted(hostile_ring(), host, sandboxed))
    checks.check_ring_allreduce_world_sizes(submitted(ring_allreduce, host, sandboxed))


def test_an_audited_case_is_never_graded_by_the_in_rank_audit(host):
    with pytest.raises(ValueError, match="relayed ranks"):
        checks.check_ring_allreduce_two_ranks(submitted(ring_allreduce, host))


def test_a_rank_that_fails_is_named_and_its_peers_do_not_hang(host, relayed):
    def only_rank_one_raises(tensor):
        if dist.get_rank() == 1:
            raise ValueError("rank 1 gives up")
        dist.recv(torch.empty_like(tensor), 1)  # waits for a rank that is gone

    with pytest.raises(CheckFailed, match="rank 1: your code raised ValueError: rank 1 gives up"):
        run_student(checks.RING_ALLREDUCE, 2, submitted(only_rank_one_raises, host, relayed),
                    timeout=10.0)
