"""The launcher inside a real Jupyter kernel: the case every graded exercise depends on.

A function defined in a notebook cell lives in the kernel's ``__main__``; plain pickling cannot send
it to another process. These tests execute real notebooks with nbclient and check the cells'
outputs.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from ddpcourse.kernels import execute_notebook, with_rank_server

CELLS = [
    "import torch, torch.distributed as dist\n"
    "from ddpcourse.launcher import run_ranks, RankError",
    # helpers, a global and a class, each in its own cell, as a student would write them
    "SCALE = 10.0\n\ndef helper(x):\n    return x * SCALE",
    "class Accumulator:\n"
    "    def __init__(self):\n        self.total = 0.0\n"
    "    def add(self, value):\n        self.total += value\n        return self",
    "def in_ranks(rank, world_size):\n"
    "    t = torch.tensor([helper(rank + 1)])\n"
    "    dist.all_reduce(t)\n"
    "    return Accumulator().add(t.item()).total\n\n"
    "print('RESULTS', run_ranks(in_ranks, 2))",
    "SCALE = 100.0  # a changed global is seen by the next call\n"
    "print('RESULTS', run_ranks(in_ranks, 2))",
    "def broken(rank, world_size):\n"
    "    if rank == 1:\n"
    "        raise KeyError('raised-in-a-cell')\n\n"
    "try:\n    run_ranks(broken, 2)\nexcept RankError as err:\n    print('CAUGHT', err)",
    "def talk(rank, world_size):\n    print('hello from rank', rank)\n\nrun_ranks(talk, 2)",
]


def execute(cells: list[str], **client_options) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    options = {"timeout": 120, "allow_errors": False}
    options.update(client_options)
    return execute_notebook(nb, Path.cwd(), **options)


def stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


@pytest.fixture(scope="module")
def executed():
    return execute(CELLS)


def test_a_function_from_a_cell_runs_in_ranks_with_helpers_globals_and_classes(executed):
    assert "RESULTS [30.0, 30.0]" in stream_text(executed.cells[3])
    assert "RESULTS [300.0, 300.0]" in stream_text(executed.cells[4])


def test_a_rank_error_shows_the_cells_own_source_line(executed):
    text = stream_text(executed.cells[5])
    assert "CAUGHT" in text and "rank 1 raised KeyError" in text
    assert "raise KeyError('raised-in-a-cell')" in text


def test_what_ranks_print_appears_in_the_cell(executed):
    text = stream_text(executed.cells[6])
    assert "[rank 0] hello from rank 0" in text and "[rank 1] hello from rank 1" in text


def test_a_cell_timeout_interrupts_the_kernel_and_leaves_no_rank_behind():
    """nbgrader interrupts a cell that runs past its timeout; the ranks must die with the call."""
    cells = [
        "import time\nfrom ddpcourse.launcher import run_ranks\n"
        "def sleepy(rank, world_size):\n    time.sleep(600)",
        "run_ranks(sleepy, 2, timeout=600)",
        "import time\n"
        "from ddpcourse.launcher import rank_server_pids\n"
        "from ddpcourse.launcher.processes import live_descendants\n"
        "time.sleep(0.5)\n"
        "print('LEFT', sorted(live_descendants() - rank_server_pids()))",
    ]
    # Only the hanging cell times out; the first import of torch may take a while.
    nb = execute(cells, timeout_func=lambda cell: 8 if "sleepy, 2" in cell.source else 120,
                 interrupt_on_timeout=True, allow_errors=True)
    errors = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert errors and errors[0].ename == "KeyboardInterrupt"
    assert "LEFT []" in stream_text(nb.cells[2])


def test_the_kernel_forks_its_one_rank_server_before_it_starts():
    """The course's headless kernels (ddpcourse.kernels.RankServerKernelManager) start through
    ddpcourse.launcher.kernel_with_server: one warm server, forked from the kernel before it ran
    a thread, serves the notebook's calls (a started one would import torch a second time, and a
    lesson's prestart() would start a fast one too)."""
    nb = execute([
        "from ddpcourse.launcher import prestart, run_ranks\n"
        "from ddpcourse.launcher._server_client import pool\n"
        "prestart()\n"
        "run_ranks(lambda rank, world_size: rank, 2)\n"
        "print('SERVERS', pool.fast is None, type(pool.warm.process).__name__)"])
    assert "SERVERS True ForkedServerProcess" in stream_text(nb.cells[0])


def test_only_ipykernels_own_launcher_is_replaced():
    python = ["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    assert with_rank_server(python) == [
        "/usr/bin/python3", "-m", "ddpcourse.launcher.kernel_with_server", "-f",
        "{connection_file}"]
    other = ["/usr/bin/R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"]
    assert with_rank_server(other) == other
