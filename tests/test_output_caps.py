"""Output caps enforced by the grading process, not the student's kernel: nbgrader's autograde
executes with ``autograder.capped_execute.CappedExecute``, which stores at most ~200 kB of output
per cell and ~2 MB per notebook however the kernel produced it (``os.write`` to its file
descriptors, a subprocess, display data, tracebacks) without changing any grade; and the grading
command keeps each worker's log under ~1 MB (``autograder.grade.CappedLog``).

The notebooks run in real kernels, without the locked setup cell, whose in-kernel cap the
student controls anyway. One flood notebook, and one small notebook run with and without the caps.
"""

from __future__ import annotations

import ast
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook
from nbgrader.converters import Autograde
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import Execute
from nbgrader.utils import determine_grade
from traitlets.utils.importstring import import_item

from autograder import grade
from autograder.capped_execute import CappedExecute, output_size
from autograder.nbgrader_api import AUTOGRADER_DIR, load_config
from ddpcourse.kernels import ipc_kernel_config

pytestmark = pytest.mark.timeout(300)

NOTEBOOK_LIMIT = 3_000_000  # what the flood notebook may weigh on disk, 50+ MB of output sent

FLOODS = {
    "fd 1": 'import os\nos.write(1, b"y" * 50_000_000)',
    "fd 2": 'import os\nos.write(2, b"y" * 10_000_000)',
    "subprocess": 'import subprocess\nsubprocess.run(["sh", "-c", "yes | head -c 30000000"])',
    "html": 'from IPython.display import HTML, display\ndisplay(HTML("<b>x</b>" * 1_000_000))',
    "repr": 'class Huge:\n    def _repr_html_(self):\n        return "z" * 2_000_000\nHuge()',
    "traceback": 'def deeper(n):\n    return deeper(n + 1)\ndeeper(0)',
    "update": ('from IPython.display import HTML, display\n'
               'handle = display(HTML("small"), display_id=True)\n'
               'handle.update(HTML("u" * 1_000_000))'),
}
DROPPED_AT_LEAST = {"fd 1": 49_000_000, "fd 2": 9_000_000, "subprocess": 29_000_000,
                    "html": 7_000_000, "repr": 1_900_000, "traceback": 10_000,
                    "update": 1_000_000}


def _notebook(cells: list[str], graded: set[int] = frozenset()) -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_code_cell(source) for source in cells],
                      metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                               "language": "python"}})
    for index in graded:
        nb.cells[index].metadata["nbgrader"] = {"grade": True, "solution": False, "locked": True,
                                                "points": 1, "grade_id": f"test-{index}",
                                                "schema_version": 3}
    return nb


@contextlib.contextmanager
def _as_when_grading():
    """Start kernels as the grading worker does: ipykernel forwards what reaches its file
    descriptors only when it does not see pytest, and echoes it to its own stdout and stderr,
    which would be this test's (the worker's log, see the last tests)."""
    pytest_test = os.environ.pop("PYTEST_CURRENT_TEST", None)
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)
        if pytest_test is not None:
            os.environ["PYTEST_CURRENT_TEST"] = pytest_test


def _execute(nb, tmp_path: Path, preprocessor=CappedExecute, **options) -> nbformat.NotebookNode:
    with tempfile.TemporaryDirectory(prefix="caps-kernel-") as socket_dir, _as_when_grading():
        executor = preprocessor(config=ipc_kernel_config(socket_dir), timeout=120, **options)
        executor.preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    return nb


def _notices(cell) -> list[str]:
    return [o.data["text/plain"] for o in cell.outputs
            if o.output_type == "display_data" and "[output cut:" in o.data.get("text/plain", "")]


def _stream(cell, name: str = "stdout") -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == name)


def _dropped(notice: str) -> int:
    return int(notice.split("[output cut: ")[1].split(" bytes")[0].replace(",", ""))


def test_autograde_executes_with_the_capped_preprocessor_and_the_course_settings(tmp_path):
    config = load_config(tmp_path, cell_timeout=33)
    configured = [import_item(p) for p in Autograde(config=config).autograde_preprocessors]
    assert configured == [CappedExecute if p is Execute else p
                          for p in Autograde().autograde_preprocessors]
    # What autograde builds from it (nbgrader's Autograde.start and convert_single_notebook).
    autograde = Autograde(coursedir=CourseDirectory(config=config), config=config)
    autograde.exporter = autograde.exporter_class(parent=autograde, config=config)
    autograde._sanitizing = False
    autograde._init_preprocessors()
    executor = autograde.exporter._preprocessors[0]
    assert type(executor) is CappedExecute and executor.enabled
    assert (executor.timeout, executor.interrupt_on_timeout) == (33, True)
    assert (executor.max_cell_output_bytes, executor.max_notebook_output_bytes) == (200_000,
                                                                                    2_000_000)
    assert executor.max_cell_output_bytes == _kernel_cap()


def _kernel_cap() -> int:
    """notebook_guard.MAX_CELL_OUTPUT_BYTES, read without importing torch."""
    guard = ast.parse((AUTOGRADER_DIR.parent / "ddpcourse/grading/notebook_guard.py").read_text())
    return next(ast.literal_eval(node.value) for node in guard.body
                if isinstance(node, ast.Assign) and node.targets[0].id == "MAX_CELL_OUTPUT_BYTES")


def test_plain_nbgrader_finds_the_capped_preprocessor_from_any_folder(tmp_path):
    """`nbgrader autograde --JupyterApp.config_file=autograder/nbgrader_config` runs a script whose
    folder, not the repository, is on sys.path: the config file must make autograder/
    importable."""
    probe = ("import importlib.util\n"
             "from traitlets.config.loader import PyFileConfigLoader\n"
             f"c = PyFileConfigLoader('nbgrader_config.py', path={str(AUTOGRADER_DIR)!r})"
             ".load_config()\n"
             "module, name = c.Autograde.autograde_preprocessors[0].rsplit('.', 1)\n"
             "print(name, importlib.util.find_spec(module).origin)\n")
    done = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["CappedExecute", str(AUTOGRADER_DIR / "capped_execute.py")], (
        done.stderr)


def test_a_flood_from_the_kernel_file_descriptors_is_cut_where_it_arrives(tmp_path, no_orphans):
    nb = _execute(_notebook(list(FLOODS.values())), tmp_path)
    path = tmp_path / "flooded.ipynb"
    nbformat.write(nb, path)
    assert path.stat().st_size < NOTEBOOK_LIMIT
    for (name, _), cell in zip(FLOODS.items(), nb.cells):
        notices = _notices(cell)
        assert len(notices) == 1, (name, cell.outputs)
        assert _dropped(notices[0]) >= DROPPED_AT_LEAST[name], (name, notices)
        assert output_size(cell.outputs) < 200_000 + 5_000, name
    fd1, fd2, yes = _stream(nb.cells[0]), _stream(nb.cells[1], "stderr"), _stream(nb.cells[2])
    assert 190_000 < len(fd1) <= 200_000 and set(fd1) == {"y"}
    assert 190_000 < len(fd2) <= 200_000 and set(fd2) == {"y"}
    assert 15_000 < len(yes) and set(yes) == {"y", "\n"} and yes.startswith("y\ny\n")
    html, huge = nb.cells[3].outputs[0], nb.cells[4].outputs[0]  # only their text/plain is kept
    assert (html.output_type, list(html.data)) == ("display_data", ["text/plain"])
    assert (huge.output_type, list(huge.data)) == ("execute_result", ["text/plain"])
    assert huge.data["text/plain"].startswith("<__main__.Huge at 0x")
    error = nb.cells[5].outputs[0]
    assert error.output_type == "error" and error.ename == "RecursionError"
    assert "RecursionError" in error.traceback[-1] and "traceback cut" in error.traceback[0]
    assert nb.cells[6].outputs[0].data["text/html"] == "small"  # the update did not fit


PRINT_KB = 'print("{0}" * {1} * 1000)'
SMALL_CELLS = [
    'print("hello")\nimport sys\nprint("careful", file=sys.stderr)',
    'from IPython.display import HTML, display\ndisplay(HTML("<i>fine</i>" * 1000))\n6 * 7',
    'print("\\n".join(f"line {i}" for i in range(5000)))',
    'raise ValueError("an ordinary mistake")',
]
# What follows the ordinary cells uses up the notebook's cap (~300 kB here), and then the grade
# cells must score exactly as they would without any cap.
FILLERS = [PRINT_KB.format("a", 150), PRINT_KB.format("b", 150), PRINT_KB.format("c", 150),
           'raise ValueError("no room left for this error")']
GRADE_CELLS = [
    'print("passed")',
    'assert False, "wrong answer " * 20_000',
    'import sys\nprint("x" * 500_000)\nprint("a warning", file=sys.stderr)',
    '0.5',
    'import time\ntime.sleep(60)',  # times out: nbgrader adds the reply's error itself
]


def _timeout(cell) -> int:
    return 1 if "sleep" in cell.source else 120


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("small")
    cells = SMALL_CELLS + FILLERS + GRADE_CELLS
    graded = set(range(len(SMALL_CELLS) + len(FILLERS), len(cells)))
    capped = _execute(_notebook(cells, graded), tmp, max_notebook_output_bytes=300_000,
                      timeout_func=_timeout)
    plain = _execute(_notebook(cells, graded), tmp, preprocessor=Execute, timeout_func=_timeout)
    return capped, plain, sorted(graded)


def _comparable(cell):
    return [{k: v for k, v in o.items() if k != "execution_count"} for o in cell.outputs]


def test_output_under_the_caps_is_kept_exactly(small_runs):
    capped, plain, _ = small_runs
    for index in range(len(SMALL_CELLS)):
        assert _comparable(capped.cells[index]) == _comparable(plain.cells[index]), index
        assert not _notices(capped.cells[index])
    assert [o.output_type for o in capped.cells[1].outputs] == ["display_data", "execute_result"]


def test_the_notebook_cap_cuts_later_cells(small_runs):
    capped, _, graded = small_runs
    first, second, third, error = (capped.cells[len(SMALL_CELLS) + i] for i in range(4))
    assert _stream(first) == "a" * 150_000 + "\n" and not _notices(first)
    assert _stream(second).startswith("bbb") and _notices(second)
    assert [o.output_type for o in third.outputs] == ["display_data"]
    assert _dropped(_notices(third)[0]) == 150_001
    assert [o.output_type for o in error.outputs] == ["display_data"]  # not a grade cell
    assert output_size([c.outputs for c in capped.cells]) < 400_000 + 10_000 * len(graded)


def test_the_caps_never_change_a_grade(small_runs):
    capped, plain, graded = small_runs
    scores = [determine_grade(capped.cells[i])[0] for i in graded]
    assert scores == [determine_grade(plain.cells[i])[0] for i in graded]
    assert scores == [1, 0, 0, 0.5, 0]
    failed = capped.cells[graded[1]].outputs[0]
    assert failed.output_type == "error" and failed.ename == "AssertionError"
    assert output_size(failed) < 3_000
    timed_out = [o.ename for o in capped.cells[graded[4]].outputs if o.output_type == "error"]
    assert "CellTimeoutError" in timed_out


def _fake_worker(tmp_path: Path, monkeypatch, script: str) -> grade._Worker:
    """A grade._Worker whose process is ``script`` (sh) instead of autograder.worker."""
    program = tmp_path / "worker.sh"
    program.write_text("#!/bin/sh\n" + script)
    program.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(program))
    return grade._Worker("mallory", tmp_path, "05_allreduce", tmp_path / "out", None, 60)


def _log_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("log ")]


def _finish(worker: grade._Worker, within_s: float) -> dict:
    give_up = time.monotonic() + within_s
    while (result := worker.poll()) is None:
        assert time.monotonic() < give_up, "the worker did not finish"
        time.sleep(0.05)
    return result


def test_the_grader_log_keeps_its_first_and_last_bytes_under_the_cap(tmp_path, monkeypatch,
                                                                      no_orphans):
    last_words = b"Traceback: the worker broke\n"
    worker = _fake_worker(tmp_path, monkeypatch, "head -c 20000000 /dev/zero | tr '\\0' y\n"
                                                 f"echo '{last_words.decode().strip()}' >&2\n"
                                                 "exit 3\n")
    result = _finish(worker, 30)
    log = worker.log_path.read_bytes()
    assert len(log) < grade.MAX_LOG_BYTES + 200
    assert log.startswith(b"y" * 100_000) and log.endswith(b"y" * 1_000 + last_words)
    dropped = 20_000_000 + len(last_words) - grade.MAX_LOG_BYTES
    assert f"[... {dropped:,} bytes dropped here".encode() in log
    assert result["status"] == "grader error" and "the worker broke" in result["notes"][0]
    assert not _log_threads()


def test_the_grader_does_not_wait_for_a_leftover_process_that_keeps_writing(tmp_path,
                                                                            monkeypatch):
    worker = _fake_worker(tmp_path, monkeypatch, "yes &\nexit 0\n")
    started = time.monotonic()
    try:
        _finish(worker, 10)
        assert time.monotonic() - started < 5
        assert not _log_threads()
        assert worker.log_path.stat().st_size < grade.MAX_LOG_BYTES + 200
    finally:
        grade.kill_process_group(worker.process.pid, grade.signal.SIGKILL, group_only=True)


def test_headless_runs_do_not_mirror_output_widgets(tmp_path):
    """Neither the grader's preprocessor nor the course's notebook client mirrors Output widgets
    (ddpcourse.kernels.without_output_widget_mirror: the mirror writes to the kernel's shell while
    a cell runs, and a widget cell under ipykernel 7 then sometimes never got its reply). What an
    Output widget captures comes back as the cell's own output instead."""
    import nbformat

    from autograder.capped_execute import CappedExecute
    from ddpcourse.kernels import execute_notebook

    pytest.importorskip("ipywidgets")
    assert CappedExecute().widget_registry == {}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import ipywidgets\nout = ipywidgets.Output()\ndisplay(out)\n"
        "with out:\n    print('captured by the widget')")])
    execute_notebook(nb, tmp_path, 60)
    streams = [o for o in nb.cells[0].outputs if o.output_type == "stream"]
    assert [o.text for o in streams] == ["captured by the widget\n"]
