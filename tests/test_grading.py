"""The grading machinery every exercise relies on: the communication audit, the integrity
snapshot, the static tamper scan, and the notebook guard in a real kernel. (Each exercise's own
checks: tests/test_grading_<slug>.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from autograder.tamper_scan import SETUP_NAMES, _Scanner
from ddpcourse.grading import integrity
import ddpcourse.grading.checks as checks_module
from ddpcourse.grading.checks import (CHECK_TIMEOUT_S, CheckFailed, expect_close, explain,
                                      run_student)
from ddpcourse.grading.comm_audit import CommAudit
from ddpcourse.grading.exercises import allreduce_by_hand
from ddpcourse.kernels import execute_notebook
from ddpcourse.launcher import RankError, RankFailure, run_ranks


def collectives_seen(rank, world_size):
    import torch.distributed._functional_collectives as functional
    from torch.distributed import all_reduce as imported_all_reduce

    t = torch.ones(4)
    out = torch.empty(8)
    seen = {}
    calls = {
        "all_reduce": lambda: dist.all_reduce(t),
        "imported all_reduce": lambda: imported_all_reduce(t),
        "broadcast": lambda: dist.broadcast(t, 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, t),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(t, out),
        "functional all_reduce": lambda: functional.wait_tensor(
            functional.all_reduce(t, "sum", dist.group.WORLD)),
        "barrier": lambda: dist.barrier(),
    }
    for name, call in calls.items():
        with CommAudit() as audit:
            call()
        seen[name] = audit.record.collectives
    with CommAudit() as audit:
        if rank == 0:
            dist.send(torch.ones(10), 1)
            dist.isend(torch.ones(5, dtype=torch.float64), 1).wait()
        else:
            dist.recv(torch.empty(10), 0)
            dist.irecv(torch.empty(5, dtype=torch.float64), 0).wait()
    return seen, audit.record.bytes_sent, audit.record.bytes_received, audit.record.collectives


def test_the_audit_sees_every_kind_of_collective_and_counts_point_to_point_bytes():
    (seen, sent, received, p2p_collectives), (_, sent1, received1, _) = run_ranks(
        collectives_seen, 2)
    assert all(seen[name] for name in seen), {n: c for n, c in seen.items() if not c}
    assert (sent, received) == (40 + 40, 0) and (sent1, received1) == (0, 80)
    assert p2p_collectives == []


def test_integrity_notices_a_replaced_function_and_accepts_the_original():
    integrity.snapshot()
    integrity.assert_untampered()
    original = dist.all_reduce
    try:
        dist.all_reduce = lambda *a, **k: None
        with pytest.raises(integrity.TamperingError, match="torch.distributed.all_reduce"):
            integrity.assert_untampered()
    finally:
        dist.all_reduce = original
    original_check = allreduce_by_hand.check_ring_allreduce_two_ranks
    try:
        allreduce_by_hand.check_ring_allreduce_two_ranks = lambda fn: None
        with pytest.raises(integrity.TamperingError, match="check_ring_allreduce_two_ranks"):
            integrity.assert_untampered()
    finally:
        allreduce_by_hand.check_ring_allreduce_two_ranks = original_check
    integrity.assert_untampered()


def scan(source: str) -> list[str]:
    scanner = _Scanner(0, set(SETUP_NAMES))
    scanner.visit(ast.parse(source))
    return [f.what for f in scanner.findings]


@pytest.mark.parametrize("source", [
    "dist.all_reduce = lambda t: None",
    "import ddpcourse.launcher as L\nL.run_ranks = print",
    "from ddpcourse.grading import checks\nchecks.run_student = print",
    "setattr(checks, 'check_ring_allreduce_two_ranks', print)",
    "import sys\nsys.modules['ddpcourse.launcher'] = None",
    "exec('dist.all_reduce = None')",
    "import builtins",
    "torch.equal = lambda a, b: True",
    "integrity.assert_untampered = lambda: None",
    "import sys as s\nm = s.modules['ddpcourse.grading.exercises.global_metrics']",
    "import os\nos.sys.modules",
    "from os import sys as system\nsystem.modules",
    "from sys import modules",
    "import sys\ngetattr(sys, 'modu' + 'les')",
    "import sys\nvars(sys)",
    "import sys\nalias = sys\nalias.modules",
    "torch.sys.modules",
    "def f(e):\n    return e.__traceback__.tb_frame.f_back.f_locals",
    "import sys\nsys._getframe(1)",
    "import traceback\nfor frame, line in traceback.walk_stack(None):\n    pass",
    "def g():\n    yield\ng().gi_frame.f_back",
    "import inspect\ninspect.stack()",
], ids=lambda source: source.replace("\n", "; ")[:50])
def test_the_static_scan_flags_tampering(source):
    assert scan(source)


def test_the_static_scan_accepts_every_public_nn_module_method():
    """``modules`` is flagged only on ``sys``: ``net.modules()`` and every other public method of
    ``nn.Module`` (called on a model, a wrapper's ``.module``, ``self``) is ordinary PyTorch."""
    names = [name for name in dir(torch.nn.Module) if not name.startswith("_")]
    assert "modules" in names and "named_modules" in names
    for name in names:
        for source in (f"def f(net):\n    return net.{name}", f"def f(model):\n    return "
                       f"model.module.{name}", f"x = self.net.{name}()"):
            assert scan(source) == [], source


def test_the_static_scan_accepts_ordinary_uses_of_sys():
    assert scan("import sys\nprint('x', file=sys.stderr)\nsys.stdout.flush()") == []


def test_the_static_scan_accepts_ordinary_solutions():
    for source in ['''
def ring_allreduce(tensor):
    chunks = list(tensor.view(-1).tensor_split(dist.get_world_size()))
    chunks[0] += 1
    tensor[0] = chunks[0][0]
    buffer = torch.empty(3)
    buffer[:] = 0
''', '''
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
''', '''
def evaluate(model, dataset, batch_size):
    net = model.module if isinstance(model, DDP) else model
    modes = {m: m.training for m in net.modules()}
    net.eval()
    try:
        pass
    finally:
        for m, training in modes.items():
            m.train(training)
''']:
        assert scan(source) == [], source


GUARD_CELLS = [
    "from ddpcourse.grading import setup_notebook\nimport torch.distributed as dist\n"
    "setup_notebook(\"allreduce_by_hand\")",
    "try:\n    dist.init_process_group('gloo', init_method='tcp://127.0.0.1:1', rank=0, "
    "world_size=2)\nexcept RuntimeError as e:\n    print('REFUSED', type(e).__name__)",
    "import os\ntry:\n    os._exit(3)\nexcept RuntimeError as e:\n    print('REFUSED', type(e).__name__)",
    "print('x' * 10_000_000)",
    "print('STILL ALIVE')",
]


def test_the_setup_cell_guards_the_kernel_against_blocking_killing_and_flooding():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in GUARD_CELLS])
    execute_notebook(nb, Path.cwd(), 120)
    texts = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert "REFUSED KernelGuardError" in texts[1]
    assert "REFUSED KernelGuardError" in texts[2]
    assert len(texts[3]) < 300_000 and "cut at" in texts[3]
    assert "STILL ALIVE" in texts[4]


def test_a_timed_out_check_names_the_deadline_it_was_given(integrity_snapshot):
    def waits_forever():
        import time
        while True:
            time.sleep(0.1)

    def call_it(rank, world_size, student_fn):
        student_fn()

    with pytest.raises(CheckFailed) as info:
        run_student(call_it, 2, waits_forever, timeout=2.5)
    message = str(info.value)
    assert "did not finish within 2.5 s" in message, message
    assert f"within {CHECK_TIMEOUT_S:g} s" not in message


def test_a_function_that_cannot_travel_to_the_ranks_is_refused_before_any_launch(integrity_snapshot):
    import threading

    lock = threading.Lock()

    def holds_a_lock():
        with lock:
            pass

    with pytest.raises(CheckFailed, match="holds_a_lock cannot be sent to the ranks"):
        run_student(lambda rank, world_size, fn: fn(), 2, holds_a_lock)


# --- what a failure says: no grader frames, the grader's own waits told apart, hints ----------

GRADER = checks_module.__file__
TORCH_C10D = str(Path(torch.distributed.__file__).parent / "distributed_c10d.py")


def stack(*frames: tuple[str, int, str]) -> str:
    """A faulthandler stack of the main thread, innermost frame first."""
    return "Current thread 0x00007f00 (most recent call first):\n" + "\n".join(
        f'  File "{path}", line {line} in {function}' for path, line, function in frames)


def test_a_timeout_names_the_students_frames_and_not_the_graders():
    stuck_in_student = stack((TORCH_C10D, 2799, "recv"), ("/tmp/ipykernel_7/1.py", 8,
                             "ring_allreduce"), (GRADER, 262, "_in_rank"))
    done_waiting_for_peers = stack((TORCH_C10D, 2900, "all_reduce"),
                                   (GRADER, 230, "probe_group"), (GRADER, 262, "_in_rank"))
    message = explain(RankError([RankFailure(0, "timeout", stack=stuck_in_student),
                                 RankFailure(1, "timeout", stack=done_waiting_for_peers)],
                                2, "gloo"), False, 7)
    rank0, rank1 = message.split("\nrank 1: ")
    assert rank0.startswith("rank 0: did not finish within 7 s") and "in ring_allreduce" in rank0
    assert 'torch/distributed/distributed_c10d.py", line 2799 in recv' in rank0
    assert GRADER not in message and "_in_rank" not in message and "Current thread" not in message
    assert rank1.startswith("did not finish within 7 s, but not in your code") and \
        "the check's own all_reduce (probe_group)" in rank1
    assert "a collective that not every rank calls (e.g. one inside `if rank == 0`)" in message


def test_a_raised_exception_shows_the_students_frames_only():
    traceback_text = (
        "Traceback (most recent call last):\n"
        f'  File "{GRADER}", line 262, in _in_rank\n'
        "    return rank_check(rank, world_size, student_fn, *args)\n"
        '  File "/tmp/ipykernel_7/2.py", line 3, in average_gradients\n'
        "    return {}['x']\n"
        "KeyError: 'x'\n")
    message = explain(RankError([RankFailure(0, "raised", exc_type="KeyError", message="'x'",
                                             traceback=traceback_text)], 1, "gloo"), False, 7)
    assert "line 3, in average_gradients" in message and message.endswith("KeyError: 'x'")
    assert GRADER not in message and "rank_check(rank, world_size" not in message


def test_a_sum_where_a_mean_was_due_asks_whether_the_sum_was_divided():
    expected = torch.tensor([0.5, -1.25, 3.0])
    with pytest.raises(CheckFailed, match="exactly 3 times the expected value, and 3 is the "
                                          "world size: did you divide the sum"):
        expect_close(expected * 3, expected, "grad", world_size=3)
    with pytest.raises(CheckFailed) as other:
        expect_close(expected * 2, expected, "grad", world_size=3)
    assert "divide" not in str(other.value)
