"""The shared judges and inputs of ddpcourse/grading/ that several exercises use: one name per
collective in both audits (collective_names, comm_audit, the broker), "point to point only",
"the input is left unchanged", and the salted per-rank inputs with their dtype and tolerance
tables. Each is tested directly: a right observation passes, each wrong one fails with its own
message. No ranks are launched: the audits are fed operators by hand, and the one live
comparison runs a group of one rank in this process (gloo, then the relay and its broker)."""

from __future__ import annotations

import os
import re
import socket
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpcourse.grading import collective_names, relay
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.collective_names import (COLLECTIVES, NOT_COMMUNICATION, POINT_TO_POINT,
                                                all_reduce_bytes, public_name,
                                                read_collective_calls, reported_collective_calls)
from ddpcourse.grading.comm_audit import CommAudit
from ddpcourse.grading.left_unchanged import copy_of, identical, judge_left_unchanged
from ddpcourse.grading.point_to_point import judge_point_to_point_only
from ddpcourse.grading.salted_inputs import (DTYPES, SALT_BITS, TOLERANCES, fresh_salt,
                                             rank_generator, reported_salts, salted_tensor,
                                             tolerance)

ROOT = Path(__file__).resolve().parents[1]
GRADING = ROOT / "ddpcourse" / "grading"


# --- one name per collective ------------------------------------------------------------------


def test_every_communication_operator_of_the_installed_torch_has_a_public_name():
    from torch.distributed._tools import fake_collectives  # torch's own list of the operators

    for operator in fake_collectives.collective_ops:
        namespace, op = str(operator).split(".")[:2]
        if namespace == "_dtensor" or op in NOT_COMMUNICATION or op == "batch_p2p_ops":
            continue  # DTensor's own; waiting; a batch is counted op by op (below)
        assert op in collective_names.OPERATORS, f"{namespace}.{op} has no public name"
        assert public_name(op) in COLLECTIVES + POINT_TO_POINT


@pytest.mark.parametrize("op, name", [
    ("allreduce_", "all_reduce"), ("allreduce_coalesced_", "all_reduce"),
    ("all_reduce", "all_reduce"), ("allgather_", "all_gather"), ("_allgather_base_", "all_gather"),
    ("all_gather_into_tensor", "all_gather"), ("_reduce_scatter_base_", "reduce_scatter"),
    ("alltoall_base_", "all_to_all"), ("broadcast_", "broadcast"), ("monitored_barrier_",
                                                                    "barrier"),
    ("send", "send"), ("isend", "send"), ("recv_", "recv"), ("recv_any_source_", "recv"),
    ("irecv", "recv"), ("all_gather", "all_gather"),  # a broker's name is already public
    ("some_new_collective_", "some_new_collective_"),  # unknown: counted under its own name
])
def test_an_operator_is_named_as_the_broker_names_the_call(op, name):
    assert public_name(op) == name


def test_the_broker_and_the_relay_speak_the_public_names():
    from autograder import broker

    assert broker.COLLECTIVES is COLLECTIVES and broker.POINT_TO_POINT is POINT_TO_POINT
    source = (GRADING / "relay.py").read_text()
    asked = set(re.findall(r'_collective\(\s*"(\w+)"', source))
    asked |= set(re.findall(r'\{"op": "(\w+)"', source)) - {"hello", "wait"}
    assert asked and asked <= set(COLLECTIVES + POINT_TO_POINT), asked


def test_no_exercise_names_a_dispatcher_operator():
    """Judges read public names only: an operator's name in a judge would count nothing when a
    class is graded (the broker never says "allreduce_")."""
    private = {op for op, name in collective_names.OPERATORS.items()
               if op != name and not hasattr(dist, op)}  # dist.isend is a function's name
    for path in sorted((GRADING / "exercises").glob("*.py")) + sorted(
            (ROOT / "autograder" / "hidden").glob("*.py")):
        literals = set(re.findall(r'"(\w+)"', path.read_text()))
        assert not literals & private, f"{path.relative_to(ROOT)}: {sorted(literals & private)}"


class Operator:
    """Stands in for a dispatcher operator: its name, as ``str(func)`` gives it."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self):
        return self.name

    def __call__(self, *args, **kwargs):
        return None


def audit_of(*calls, squares=False):
    audit = CommAudit(squares=squares)
    for name, args in calls:
        audit.__torch_dispatch__(Operator(name), (), args)
    return audit.record


def test_the_in_rank_audit_records_public_names_and_counts_bytes():
    """Names as the broker's; bytes handed over as the broker counts them (a gather's input, not
    its output; a barrier's dummy tensor is none)."""
    t = torch.ones(4)  # 16 bytes
    record = audit_of(("c10d.allgather_.default", ([[t, t]], [t])),
                      ("c10d._allgather_base_.default", (torch.ones(8), t)),
                      ("c10d.barrier.default", (torch.ones(1),)),
                      ("_c10d_functional.all_reduce.default", (t, "sum", "0")),
                      ("_c10d_functional.wait_tensor.default", (t,)),
                      ("aten.add.Tensor", (t, t)),
                      ("c10d.send.default", ([t], 1, 0)),
                      ("_c10d_functional.isend.default", (t, 1, 0, "0")),
                      ("c10d.recv_.default", ([t, t], 0, 0)),
                      ("_c10d_functional.batch_p2p_ops.default",
                       (["isend", "irecv"], [1, 1], [0, 0], [t, torch.ones(2)], "0")),
                      squares=True)
    assert record.ops == ["all_gather", "all_gather", "barrier", "all_reduce", "send", "send",
                          "recv", "send", "recv"]
    assert record.collectives == ["all_gather", "all_gather", "barrier", "all_reduce"]
    assert record.collective_calls == [("all_gather", 16), ("all_gather", 16), ("barrier", 0),
                                       ("all_reduce", 16)]
    assert record.calls_of("all_gather") == [16, 16] and record.calls_of("allgather_") == []
    assert (record.bytes_sent, record.bytes_received) == (48, 40)
    assert record.all_reduce_squares == [4.0]


@pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")  # the _tensor forms
def test_the_in_rank_audit_and_the_broker_name_the_same_calls():
    """The same calls in a group of one rank, on gloo under the in-rank audit, then on the relay
    backend through the grader's broker: one list of names."""
    def calls():
        t, out = torch.ones(3), torch.empty(3)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather([out], t)
        dist.all_gather_into_tensor(out, t)
        dist.reduce_scatter_tensor(out, t)
        dist.reduce(t, 0)
        dist.gather(t, [out], 0)
        dist.scatter(out, [t], 0)
        dist.all_to_all_single(out, t)
        dist.barrier()

    expected = ["all_reduce", "broadcast", "all_gather", "all_gather", "reduce_scatter", "reduce",
                "gather", "scatter", "all_to_all", "barrier"]
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), 1),
                                rank=0, world_size=1, timeout=timedelta(seconds=20))
        try:
            with CommAudit() as audit:
                calls()
        finally:
            dist.destroy_process_group()
    assert audit.record.ops == expected
    in_rank = audit.record.collective_calls

    from autograder.broker import Broker

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    broker = Broker(1, timeout=20.0, sockets=[ours])
    broker.start()
    try:
        relay.init_relay_process_group(os.dup(theirs.fileno()), 0, 1, timeout=20.0)
        try:
            calls()
        finally:
            dist.destroy_process_group()
        assert broker.ops(0) == expected and broker.failure is None
        assert in_rank == [(e["op"], e["bytes_sent"]) for e in broker.log(0)]  # bytes alike
    finally:
        theirs.close()
        broker.close()


def test_collective_calls_are_read_as_untrusted_data():
    traffic = {"collective_calls": [["all_reduce", 16], ["broadcast", 4], ["all_reduce", 8]]}
    calls = reported_collective_calls(traffic, "f")
    assert calls == [("all_reduce", 16), ("broadcast", 4), ("all_reduce", 8)]
    assert all_reduce_bytes(calls) == [16, 8]
    for bad in (["all_reduce", 16], [("all_reduce", 16)], [["all_reduce", "16"]],
                [["all_reduce", True]], [[3, 16]], [["all_reduce", 16, 0]]):
        with pytest.raises(CheckFailed, match=r"^f: the rank's communication record is "
                                              r"malformed$"):
            reported_collective_calls({"collective_calls": bad}, "f")
    with pytest.raises(CheckFailed, match="lacks 'collective_calls'"):
        reported_collective_calls({}, "f")
    with pytest.raises(CheckFailed, match="'collective_calls' of type str"):
        reported_collective_calls({"collective_calls": "calls"}, "f")
    with pytest.raises(CheckFailed, match="malformed"):
        read_collective_calls({"all_reduce": 16}, "f")


# --- point to point only ------------------------------------------------------------------------


def test_a_case_that_called_no_collective_passes():
    judge_point_to_point_only({"collectives": [], "bytes_sent": 96}, "case", "ring_allreduce")
    record = audit_of(("c10d.send.default", ([torch.ones(2)], 1, 0)),
                      ("c10d.recv_.default", ([torch.ones(2)], 1, 0)))
    judge_point_to_point_only({"collectives": sorted(set(record.collectives))}, "case", "ring")


def test_a_collective_fails_the_case_named_as_both_audits_name_it():
    in_rank = audit_of(("c10d.allreduce_.default", ([torch.ones(2)],)),
                       ("c10d._allgather_base_.default", (torch.ones(2), torch.ones(1))))
    message = (r"^tensor of shape \(8,\): ring_allreduce must use point-to-point calls only "
               r"\(send/recv/isend/irecv\), but it called \['all_gather', 'all_reduce'\]$")
    for collectives in (sorted(set(in_rank.collectives)), ["all_reduce", "all_gather"]):
        with pytest.raises(CheckFailed, match=message):  # the in-rank audit; the broker
            judge_point_to_point_only({"collectives": collectives}, "tensor of shape (8,)",
                                      "ring_allreduce")


@pytest.mark.parametrize("traffic, message", [
    ({}, "lacks 'collectives'"), ({"collectives": "all_reduce"}, "'collectives' of type str"),
    (None, "lacks 'collectives'"), ({"collectives": ["x" * 10_000]}, r"x\.\.\.'\]$"),
])
def test_a_malformed_traffic_report_fails_the_case(traffic, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        judge_point_to_point_only(traffic, "case", "ring_allreduce")
    assert len(str(failed.value)) < 500


# --- the input left unchanged -------------------------------------------------------------------


def handed_in():
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor([3])}


def judge(reported):
    judge_left_unchanged(reported, handed_in(), "evaluate(model)", "the model's",
                         "parameters and buffers", "leave them as they were")


def test_an_input_left_as_handed_in_passes():
    judge(copy_of(handed_in()))
    nan = {"w": torch.tensor([float("nan"), 1.0])}
    judge_left_unchanged(copy_of(nan), nan, "f", "its", "inputs", "")


def nudged():
    state = handed_in()
    state["w"][1, 2] = torch.nextafter(state["w"][1, 2], torch.tensor(100.0))  # one ulp
    return state


@pytest.mark.parametrize("reported, message", [
    ("state", r"^evaluate\(model\): the rank's report of the model's parameters and buffers is "
              r"a str$"),
    ({"w": handed_in()["w"]}, r"^evaluate\(model\): after the call, the model's parameters and "
                              r"buffers are \['w'\], expected \['n', 'w'\]$"),
    ({**handed_in(), "extra": torch.zeros(1)}, r"are \['extra', 'n', 'w'\], expected"),
    ({**handed_in(), "w": [[0, 1, 2], [3, 4, 5]]},
     r"^evaluate\(model\): after the call, 'w' is not a torch.float32 tensor of shape \(2, 3\) "
     r"\(the report has list\)$"),
    ({**handed_in(), "w": handed_in()["w"].double()}, r"'w' is not a torch.float32 tensor"),
    ({**handed_in(), "w": handed_in()["w"].reshape(3, 2)}, r"of shape \(2, 3\)"),
    ({**handed_in(), "w": handed_in()["w"].to_sparse()}, r"'w' is not a torch.float32 tensor"),
    (nudged(), r"^evaluate\(model\): the call changed the model's 'w'; leave them as they "
               r"were$"),
    ({**handed_in(), "n": torch.tensor([4])}, r"the call changed the model's 'n'"),
])
def test_each_way_to_change_the_input_is_named(reported, message):
    with pytest.raises(CheckFailed, match=message):
        judge(reported)


def test_a_copy_is_what_the_tensors_were_when_it_was_taken():
    model = torch.nn.Linear(2, 2)
    before = copy_of(dict(model.named_parameters()))
    assert identical(before, copy_of(dict(model.named_parameters())))
    assert not before["weight"].requires_grad
    with torch.no_grad():
        model.bias.add_(1)
    assert not identical(before, copy_of(dict(model.named_parameters())))


class RefusesComparison:
    def __eq__(self, other):
        raise RuntimeError("no")


@pytest.mark.parametrize("a, b, same", [
    ([{"count": 4, "time_us": [1.5, float("nan")]}], [{"count": 4, "time_us": [1.5, float("nan")]}],
     True),
    ((1, [2, 3]), (1, [2, 3]), True),
    ((1, [2, 3]), (1, (2, 3)), False),
    ({"a": 1}, {"a": 1, "b": 2}, False),
    ({"a": 1}, {"a": 1.0}, False),  # a row whose int became a float was modified
    (torch.zeros(2), torch.zeros(2, dtype=torch.float64), False),
    (torch.zeros(2), torch.zeros(1, 2), False),
    (torch.tensor([float("nan")]), torch.tensor([float("nan")]), True),
    (torch.zeros(2), [0.0, 0.0], False),
    (RefusesComparison(), RefusesComparison(), False),
])
def test_identical_compares_data_exactly_and_never_raises(a, b, same):
    assert identical(a, b) is same


# --- salted per-rank inputs -----------------------------------------------------------------------


def test_a_salt_is_fresh_and_in_range():
    salts = {fresh_salt() for _ in range(8)}
    assert len(salts) > 1 and all(0 <= s < 2**SALT_BITS for s in salts)


def test_a_rank_input_depends_on_the_case_the_rank_and_the_salt():
    shape, dtype = (3, 4), torch.float32
    first = salted_tensor(1, shape, dtype, seed=7, salt=12345)
    assert torch.equal(first, salted_tensor(1, shape, dtype, seed=7, salt=12345))
    for other in [(0, 7, 12345), (1, 8, 12345), (1, 7, 12346), (1, 7, 0)]:
        rank, seed, salt = other
        assert not torch.equal(first, salted_tensor(rank, shape, dtype, seed, salt)), other
    assert torch.equal(torch.randn(2, generator=rank_generator(7, 1, 5)),
                       torch.randn(2, generator=rank_generator(7, 1, 5)))
    ints = salted_tensor(0, (1000,), torch.int64, seed=1, salt=fresh_salt())
    assert ints.dtype == torch.int64 and -1000 <= ints.min() and ints.max() < 1000


def test_reported_salts_are_read_as_untrusted_data():
    assert reported_salts([{"salt": 5}, {"salt": 2**SALT_BITS - 1}]) == [5, 2**SALT_BITS - 1]
    with pytest.raises(CheckFailed, match=r"^rank 1: the rank's report lacks 'salt'"):
        reported_salts([{"salt": 5}, {}])
    with pytest.raises(CheckFailed, match=r"^ranks 0 and 1: the rank's report has a salt out of "
                                          r"range: -1$"):
        reported_salts([{"salt": -1}, {"salt": -1}])
    with pytest.raises(CheckFailed, match=r"rank 0: the rank's report has 'salt' of type str"):
        reported_salts([{"salt": "5"}])
    with pytest.raises(CheckFailed, match="out of range"):
        reported_salts([{"salt": 2**SALT_BITS}])


def test_the_dtype_and_tolerance_tables():
    assert DTYPES == {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
    assert tolerance(torch.int64) == (0.0, 0.0)
    assert tolerance(torch.float32) == TOLERANCES[torch.float32] == (1e-5, 1e-5)
    assert tolerance(torch.float64) == (1e-12, 1e-12)


def test_the_exercises_share_these_instead_of_copies():
    from ddpcourse.grading import salted_inputs
    from ddpcourse.grading.exercises import allreduce_by_hand, bucketed_ddp, memory_per_rank

    assert allreduce_by_hand.fresh_salt is salted_inputs.fresh_salt
    assert allreduce_by_hand.make_rank_tensor is salted_inputs.salted_tensor
    assert bucketed_ddp.DTYPES is memory_per_rank.DTYPES is salted_inputs.DTYPES
