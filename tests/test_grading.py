"""The pieces the graded tests rely on: the communication audit, the integrity snapshot, the
traffic bounds, the static tamper scan, and the notebook guard in a real kernel."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from autograder.tamper_scan import SETUP_NAMES, _Scanner
from ddpcourse.grading import ch05, integrity
from ddpcourse.grading.checks import CheckFailed, ring_traffic_bounds
from ddpcourse.grading.comm_audit import CommAudit
from ddpcourse.kernels import execute_notebook
from ddpcourse.launcher import run_ranks


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


@pytest.mark.parametrize("numel, world_size", [(1000, 4), (999, 3), (7, 4), (2, 4), (10, 2)])
def test_a_ring_fits_the_traffic_bounds_and_sending_everything_does_not(numel, world_size):
    lower, upper = ring_traffic_bounds(numel, world_size, 4)
    chunks = [len(c) for c in torch.arange(numel).tensor_split(world_size)]
    for skipped in chunks:  # a ring sends every chunk but one, twice
        assert lower <= 2 * (numel - skipped) * 4 <= upper
    naive = (world_size - 1) * numel * 4
    if world_size >= 3 and numel >= 100:
        assert naive > upper
    assert ring_traffic_bounds(numel, 1, 4) == (0, 0)


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
    original_check = ch05.check_ring_allreduce_two_ranks
    try:
        ch05.check_ring_allreduce_two_ranks = lambda fn: None
        with pytest.raises(integrity.TamperingError, match="check_ring_allreduce_two_ranks"):
            integrity.assert_untampered()
    finally:
        ch05.check_ring_allreduce_two_ranks = original_check
    integrity.assert_untampered()


def test_a_check_explains_per_rank_what_was_expected_and_what_came_back():
    integrity.snapshot()

    def off_by_one(tensor):
        tensor += 1  # not an all-reduce at all

    with pytest.raises(CheckFailed) as info:
        ch05.check_ring_allreduce_two_ranks(off_by_one)
    message = str(info.value)
    assert "rank 0:" in message and "rank 1:" in message and "expected [" in message


def scan(source: str) -> list[str]:
    scanner = _Scanner(0, set(SETUP_NAMES))
    scanner.visit(ast.parse(source))
    return [f.what for f in scanner.findings]


@pytest.mark.parametrize("source", [
    "dist.all_reduce = lambda t: None",
    "import ddpcourse.launcher as L\nL.run_ranks = print",
    "from ddpcourse.grading import checks\nchecks.run_student = print",
    "setattr(ch05, 'check_ring_allreduce_two_ranks', print)",
    "import sys\nsys.modules['ddpcourse.launcher'] = None",
    "exec('dist.all_reduce = None')",
    "import builtins",
    "torch.equal = lambda a, b: True",
    "integrity.assert_untampered = lambda: None",
])
def test_the_static_scan_flags_tampering(source):
    assert scan(source)


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


def defaults_to_zero(env):
    """The article's bug, as a function: a missing variable silently becomes rank 0."""
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1))


def falls_back_to_slurm(env):
    """Right for complete environments, but mixes launchers when torchrun's are half set."""
    for names in (("RANK", "LOCAL_RANK", "WORLD_SIZE"),
                  ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")):
        if all(n in env for n in names):
            return tuple(int(env[n]) for n in names)
    raise ValueError("missing RANK LOCAL_RANK WORLD_SIZE SLURM_PROCID SLURM_LOCALID SLURM_NTASKS")


def test_ranks_from_env_checks_catch_the_rank_zero_default_and_the_silent_fallback():
    from autograder.hidden import ch04 as hidden
    from ddpcourse.grading import ch04

    integrity.snapshot()
    with pytest.raises(CheckFailed, match="empty environment: expected ValueError"):
        ch04.check_ranks_from_env_never_defaults(defaults_to_zero)
    ch04.check_ranks_from_env_reads_torchrun_and_slurm(falls_back_to_slurm)
    with pytest.raises(CheckFailed, match="half a torchrun environment"):
        hidden.check_ranks_from_env(falls_back_to_slurm)
