"""Every lesson notebook executes top to bottom on CPU, and the pictures it draws render.

Notebooks are committed without outputs (tests/test_notebooks.py checks that too); here each is
executed in a fresh kernel from its own folder, as a student would open it. This is the run's one
execution of each lesson: its executed copy is kept at ``build/executed/<path>.ipynb`` (e.g.
``build/executed/chapters/05_allreduce/05_allreduce.ipynb``) for whatever reads a lesson's
outputs after the suite (the course site), and only when the notebook passed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import nbformat
import pytest
from course_layout import LESSONS

from ddpcourse.kernels import KERNEL_WITH_SERVER, execute_notebook
from ddpcourse.launcher.processes import live_descendants, process_table

ROOT = Path(__file__).resolve().parent.parent
EXECUTED = ROOT / "build" / "executed"
CELL_TIMEOUT_S = 300
# A lesson takes under a minute here, two on a loaded machine; one still running at this point is
# stuck, and is made to say where before pytest-timeout (300 s) ends the test without that.
STUCK_AFTER_S = 240


def kernel_faulthandler(stacks: Path) -> str:
    """The kernel argument that arms the kernel's own faulthandler: on SIGABRT it writes its
    threads' stacks to ``stacks``. (Not PYTHONFAULTHANDLER, which every process the lesson starts
    would inherit, changing what its cells print; and not the kernel's stderr, a pipe of
    ipykernel's that dies with it.)"""
    return f"--IPKernelApp.exec_lines=__import__('faulthandler').enable(open({str(stacks)!r}, 'w'))"


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _forked_copies_above(pid: int, command_lines: dict[int, str], table) -> int:
    """How many of ``pid``'s closest ancestors have its very command line (forks of forks)."""
    count, parent = 0, table[pid][0]
    while command_lines.get(parent) == command_lines[pid]:
        count, parent = count + 1, table[parent][0]
    return count


def _abort(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)


def make_the_stuck_say_where(done: threading.Event) -> None:
    """Make this test's stuck processes tell where they are: first its ranks get SIGABRT (a
    rank's faulthandler writes its stack, and ``run_ranks`` reports a rank that died so, with
    that stack, as the cell's error); 10 s later, unless ``done`` is set by then, the kernel too
    (:func:`kernel_faulthandler`)."""
    table = process_table()
    below = {pid: _command_line(pid) for pid in live_descendants(table=table)}
    copies = {pid: _forked_copies_above(pid, below, table) for pid in below}
    # A rank server is started (its module on its command line) or forked from its kernel
    # (ddpcourse.launcher.kernel_with_server: the kernel's command line, one fork below it);
    # its ranks are its forks.
    servers = {pid for pid, line in below.items() if "launcher._rank_server" in line
               or (KERNEL_WITH_SERVER in line and copies[pid] == 1)}
    ranks = [pid for pid in below if table[pid][0] in servers]
    print(f"the notebook is stuck; aborting ranks {ranks}", flush=True)
    _abort(ranks)
    if done.wait(10):
        return
    kernels = [pid for pid, line in below.items()
               if ("ipykernel_launcher" in line or KERNEL_WITH_SERVER in line) and not copies[pid]]
    print(f"the kernel still runs; aborting it: {kernels}", flush=True)
    _abort(kernels)


@contextlib.contextmanager
def stacks_if_stuck(after_s: float):
    """If the notebook still runs after ``after_s``, :func:`make_the_stuck_say_where`."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(after_s):
            make_the_stuck_say_where(done)

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        done.set()



def executed_copy(path: Path) -> Path:
    """Where the run keeps the executed copy of the lesson ``path``."""
    return EXECUTED / path.relative_to(ROOT)


def test_lesson_notebooks_are_committed_without_outputs():
    for path in LESSONS:
        nb = nbformat.read(path, as_version=4)
        dirty = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and (c.outputs or c.execution_count)]
        assert not dirty, f"{path.relative_to(ROOT)}: cells {dirty} carry outputs; strip them"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_lesson_notebook_executes_and_draws_its_figures(path, tmp_path):
    kept = executed_copy(path)
    kept.unlink(missing_ok=True)  # no stale copy survives a failing run
    nb = nbformat.read(path, as_version=4)
    stacks = tmp_path / "kernel-stacks.txt"
    try:
        with stacks_if_stuck(STUCK_AFTER_S):
            execute_notebook(nb, path.parent, CELL_TIMEOUT_S,
                             extra_arguments=[kernel_faulthandler(stacks)])
    finally:
        if stacks.exists() and stacks.stat().st_size:
            print(f"The kernel's stacks when it was aborted:\n{stacks.read_text()}")
    draws = [c for c in nb.cells if c.cell_type == "code" and "plt." in c.source]
    for cell in draws:
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert images, f"a cell that plots shows no figure:\n{cell.source[:300]}"
    kept.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, kept)


def test_a_stuck_lesson_says_where_its_ranks_are_stuck(tmp_path, monkeypatch):
    """make_the_stuck_say_where, once a cell's two ranks are asleep: the cell fails with a rank's
    stack that points at the line it was stuck on, long before the call's own deadline."""
    (tmp_path / "stuck.py").write_text(
        "import pathlib, time\n\n\ndef nap(rank, world_size, folder):\n"
        "    pathlib.Path(folder, f'asleep-{rank}').touch()\n"
        "    time.sleep(600)\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from ddpcourse.launcher import run_ranks\nfrom stuck import nap\n"
        f"run_ranks(nap, 2, {str(tmp_path)!r}, timeout=600)")])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(tmp_path), os.environ.get("PYTHONPATH")])))  # the ranks import stuck.py too
    done = threading.Event()

    def once_asleep() -> None:
        give_up = time.monotonic() + 200
        while not done.is_set() and time.monotonic() < give_up:
            if all((tmp_path / f"asleep-{rank}").exists() for rank in (0, 1)):
                make_the_stuck_say_where(done)
                return
            time.sleep(0.1)

    threading.Thread(target=once_asleep, daemon=True).start()
    try:
        with pytest.raises(Exception, match=r"(?s)SIGABRT.*stuck\.py\", line 6 in nap"):
            execute_notebook(nb, tmp_path, 240)
    finally:
        done.set()
