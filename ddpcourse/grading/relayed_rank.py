"""One rank of a communication-audited case, run by its sandboxed host (autograder/relayed.py).

The host of such a rank holds nothing but that rank, so it does no work of its own: it hands the
request to a fresh process (:func:`ddpcourse.launcher.run_ranks`, one rank) and passes the
answer back as bytes. Everything that needs torch happens in that process: decoding the
arguments, connecting to the grader's broker, making the relay process group this rank's
default group, running the case's ``observe`` with the student's function, and encoding the
observation. This module imports no torch, so neither does the host (its import costs seconds).
"""

from __future__ import annotations

import os
import pickle
import socket

from ddpcourse.launcher import run_ranks


def observe_as_rank(observe_name: str, rank: int, world_size: int, socket_path: str,
                    payload: bytes, encoded_args: bytes, timeout: float) -> bytes:
    """Rank ``rank`` of ``world_size``, alone in a fresh process; its observation, in a list of
    one, as :func:`~ddpcourse.grading.frames.tensors_to_bytes` writes it. RankError if it fails."""
    [encoded] = run_ranks(_rank, 1, observe_name, rank, world_size, socket_path, payload,
                          encoded_args, timeout, timeout=timeout, seed=rank,
                          max_output_bytes=20_000, init_process_group=False)
    if not isinstance(encoded, bytes):
        raise TypeError(f"the rank answered {type(encoded).__name__}, not bytes")
    return encoded


def _rank(_alone: int, _one: int, observe_name: str, rank: int, world_size: int,
          socket_path: str, payload: bytes, encoded_args: bytes, timeout: float) -> bytes:
    from ddpcourse.grading.frames import tensors_from_bytes, tensors_to_bytes
    from ddpcourse.grading.observation_host import observe_function
    from ddpcourse.grading.relay import init_relay_process_group

    broker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    broker.connect(socket_path)  # first: the grader waits for every rank to connect
    observe = observe_function(observe_name)
    args = tuple(tensors_from_bytes(encoded_args))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    init_relay_process_group(broker.detach(), rank, world_size, timeout=timeout)
    student_fn = pickle.loads(payload)  # after the group exists: nothing of it runs before
    return tensors_to_bytes([observe(rank, world_size, student_fn, *args)])
