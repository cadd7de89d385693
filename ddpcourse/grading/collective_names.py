"""One name per communication call, whichever audit counted it: the in-rank audit or the broker.

Two audits count what a rank communicates. In a notebook, the in-rank audit
(:class:`~ddpcourse.grading.comm_audit.CommAudit`) sees the dispatcher's operators:
``c10d.allgather_`` for ``dist.all_gather``, ``c10d._allgather_base_`` for
``dist.all_gather_into_tensor``, ``_c10d_functional.all_gather_into_tensor`` for the functional
one. When a class is graded, the grader's broker (autograder/broker.py) sees the relay backend's
requests, one per ``torch.distributed`` function family: ``all_gather``. A judge reads whichever
of the two ran, and a message names what it read, so both record under the one public name of
this table (``torch.distributed``'s own names: :data:`COLLECTIVES`, :data:`POINT_TO_POINT`): a
judge counts ``"all_gather"`` in either, and a student reads the same word in a notebook's
feedback and in the graded class's.

:func:`reported_collective_calls` reads a case's ``collective_calls`` (every collective in call
order as ``[name, bytes]``, as both audits write them) as the untrusted data it is.
"""

from __future__ import annotations

from typing import Any

from ddpcourse.grading.checks import CheckFailed, observed

# The public names: the broker's request ops (autograder/broker.py), torch.distributed's functions.
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce", "gather",
               "scatter", "all_to_all", "barrier")
POINT_TO_POINT = ("send", "recv")

# Every communication operator of the dispatcher (namespaces c10d, _c10d_functional and
# _c10d_functional_autograd; torch 2.13's list: torch/distributed/_tools/fake_collectives.py),
# under its public name. Coalesced and "_base" forms are the same collective on several tensors
# or on one flat tensor; the relay backend sends them to the broker under the same name.
OPERATORS = {
    **dict.fromkeys(("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_",
                     "all_reduce_coalesced", "all_reduce_coalesced_"), "all_reduce"),
    **dict.fromkeys(("broadcast_", "broadcast"), "broadcast"),
    **dict.fromkeys(("allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                     "_allgather_base_", "all_gather_into_tensor", "all_gather_into_tensor_out",
                     "all_gather_into_tensor_coalesced"), "all_gather"),
    **dict.fromkeys(("reduce_scatter_", "_reduce_scatter_base_",
                     "reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor",
                     "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced"),
                    "reduce_scatter"),
    "reduce_": "reduce",
    "gather_": "gather",
    "scatter_": "scatter",
    **dict.fromkeys(("alltoall_", "alltoall_base_", "all_to_all_single"), "all_to_all"),
    **dict.fromkeys(("barrier", "monitored_barrier_"), "barrier"),
    **dict.fromkeys(("send", "isend"), "send"),
    **dict.fromkeys(("recv_", "recv_any_source_", "irecv"), "recv"),
}
# Operators of those namespaces that communicate nothing themselves (waiting for a result).
NOT_COMMUNICATION = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


def public_name(op: str) -> str:
    """The public name of a dispatcher operator (``"allgather_"`` -> ``"all_gather"``) or of a
    broker request (already public). An operator this table does not know (a newer torch's)
    keeps its own name: it is still counted, as a collective, under a name a message can show."""
    return OPERATORS.get(op, op)


def reported_collective_calls(traffic: Any, what: str) -> list[tuple[str, int]]:
    """A case's ``traffic["collective_calls"]`` (a rank's report, or the broker's record) as
    ``(name, bytes)`` pairs, in call order (see :func:`read_collective_calls`)."""
    return read_collective_calls(observed(traffic, "collective_calls", list), what)


def read_collective_calls(entries: Any, what: str) -> list[tuple[str, int]]:
    """``[[name, bytes], ...]`` as a rank reported it, as ``(name, bytes)`` pairs; CheckFailed
    naming ``what`` when it is not a list of ``[str, int]``."""
    if not isinstance(entries, list):
        raise CheckFailed(f"{what}: the rank's communication record is malformed")
    calls = []
    for entry in entries:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or type(entry[1]) is not int):
            raise CheckFailed(f"{what}: the rank's communication record is malformed")
        calls.append((entry[0], entry[1]))
    return calls


def all_reduce_bytes(calls: list[tuple[str, int]]) -> list[int]:
    """The bytes of each all-reduce among ``calls`` (see :func:`reported_collective_calls`)."""
    return [nbytes for name, nbytes in calls if name == "all_reduce"]
