"""Run graded cases in ranks for the trusted grader, from inside a submission's sandbox.

    python -m ddpcourse.grading.observation_host READ_FD WRITE_FD [--one-rank]

The autograder starts this process in the sandbox of one submission and sends it requests on
``READ_FD``: which case's ``observe`` to run (a function of ``ddpcourse.grading.exercises``, named
by module and qualified name), in how many ranks, with which arguments, and the student's
function as pickled bytes. It runs them with :func:`ddpcourse.grading.checks.run_observation`
(fresh ranks, each rebuilds the student's function) and answers on ``WRITE_FD`` with every rank's
observation, or with each failed rank's report, as plain data (see :mod:`ddpcourse.grading.frames`).
A request with ``"relay"`` runs one rank only (this sandbox holds nothing else), connected to the
grader's broker through the socket it names (autograder/relayed.py).
Nothing here judges: the verdict is computed by the grader, outside the sandbox.
"""

from __future__ import annotations

import importlib
import sys

from ddpcourse.grading.exercises import CHECKS_PACKAGE
from ddpcourse.grading.frames import (FrameError, read_frame, tensors_from_bytes,
                                      tensors_to_bytes, write_frame)
from ddpcourse.grading.relayed_rank import observe_as_rank
from ddpcourse.launcher import RankError, RankTimeoutError, fork_server_now, wait_until_ready

MAX_REQUEST_BYTES = 256 << 20
FAILURE_FIELDS = ("rank", "kind", "exitcode", "exc_type", "message", "traceback", "stack",
                  "output_tail")


def observe_function(name: str):
    module_name, _, qualname = name.partition(":")
    if not module_name.startswith(CHECKS_PACKAGE + "."):
        raise ValueError(f"{name!r} is not a case of {CHECKS_PACKAGE}")
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def answer(request: dict, body: bytes) -> tuple[dict, bytes]:
    if request.get("ping"):  # read only once warm: the grader waits for this before a case
        return {"status": "ready"}, b""
    args_size = int(request["args_bytes"])
    encoded_args, payload = body[:args_size], body[args_size:]
    relay = request.get("relay")
    try:
        if relay is not None:  # one rank of a case whose ranks each have a sandbox of their own
            return {"status": "ok"}, observe_as_rank(
                str(request["observe"]), int(relay["rank"]), int(request["world_size"]),
                str(relay["socket"]), payload, encoded_args, float(request["timeout"]))
        from ddpcourse.grading.checks import run_observation

        observations = run_observation(observe_function(request["observe"]),
                                       int(request["world_size"]), payload,
                                       tuple(tensors_from_bytes(encoded_args)),
                                       float(request["timeout"]),
                                       bool(request["init_process_group"]))
    except RankError as err:
        failures = [{name: getattr(failure, name) for name in FAILURE_FIELDS}
                    for failure in err.failures]
        return {"status": "failed", "timed_out": isinstance(err, RankTimeoutError),
                "backend": err.backend, "failures": failures}, b""
    return {"status": "ok"}, tensors_to_bytes(observations)


def serve(read_fd: int, write_fd: int, one_rank: bool = False, dynamo: bool = False) -> int:
    # The first case must not pay for importing torch._dynamo in its ranks. A host of one rank of
    # communication-audited cases needs it only when its ranks build DDP or an optimizer (which
    # import it): on the relay they run no in-rank audit.
    dynamo = not one_rank or dynamo
    # torch first (this process needs it anyway: it starts ranks and rebuilds their tensors),
    # then the rank server forked from this fresh process, rather than one that imports it again
    import torch  # noqa: F401

    fork_server_now(dynamo)
    wait_until_ready(dynamo=dynamo)
    if not one_rank:
        import ddpcourse.grading.checks  # noqa: F401
    while True:
        try:
            request, body = read_frame(read_fd, MAX_REQUEST_BYTES)
        except FrameError:
            return 0  # the grader closed the channel: done
        try:
            header, reply = answer(request, body)
        except Exception as exc:  # noqa: BLE001 - reported to the grader, which decides
            header, reply = {"status": "error", "message": f"{type(exc).__name__}: {exc}"}, b""
        write_frame(write_fd, header, reply)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2]), one_rank="--one-rank" in sys.argv[3:],
                   dynamo="--dynamo" in sys.argv[3:]))
