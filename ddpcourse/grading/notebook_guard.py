"""The locked setup cell of every exercise notebook calls :func:`setup_notebook`.

It protects the grading of a whole class from a few honest mistakes that would otherwise make
nbgrader drop a submission entirely (see shared GRADING_NOTES): code that blocks or kills the
notebook's own kernel. In the kernel (never in the ranks):

* ``torch.distributed.init_process_group`` raises at once instead of waiting forever for peers
  that do not exist: a process group belongs inside a function run with ``run_ranks``;
* ``os._exit`` called from a notebook cell raises instead of killing the kernel;
* each cell's printed output is capped, so a runaway print loop cannot produce 100 MB;
* the rank servers start (and the call waits until the warm one is ready), and the integrity snapshot is taken before any student code runs;
* when the autograder asks (``DDPCOURSE_GRADED_FUNCTIONS_DIR`` and ``DDPCOURSE_GRADED_FUNCTIONS``,
  set only for a graded run), after every cell the graded functions are left in that folder's
  subfolder named by the exercise, as pickled bytes, which the grader runs in sandboxed ranks and judges outside this kernel
  (autograder/trusted.py): the kernel's own test verdicts are not what is graded.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddpcourse import launcher
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import hidden_checks

MAX_CELL_OUTPUT_BYTES = 200_000


class KernelGuardError(RuntimeError):
    """Raised instead of an action that would block or kill the notebook's kernel."""


def _refuse_init_process_group(*args, **kwargs):
    raise KernelGuardError(
        "init_process_group() in the notebook's own kernel would wait forever for ranks that do "
        "not exist. Create process groups inside a function that you run with "
        "run_ranks(fn, world_size): it starts the ranks and their process group for you."
    )


def _is_cell_code(filename: str) -> bool:
    return filename.startswith("<ipython-input") or "ipykernel_" in filename


def _guarded_exit(real_exit):
    def _exit(code: int = 0):
        caller = sys._getframe(1).f_code.co_filename
        if _is_cell_code(caller):
            raise KernelGuardError(f"os._exit({code}) in a notebook cell would kill the kernel")
        real_exit(code)

    return _exit


class _CappedStream:
    """Wraps the kernel's stdout/stderr; drops output past the cap until the next cell."""

    def __init__(self, stream, cap: int):
        self._stream = stream
        self._cap = cap
        self.written = 0
        self.warned = False

    def write(self, text):
        remaining = self._cap - self.written
        if len(text) > remaining:
            if remaining > 0:
                self._stream.write(text[:remaining])
            self.written = self._cap
            if not self.warned:
                self.warned = True
                self._stream.write(f"\n... output of this cell cut at {self._cap} bytes ...\n")
            return len(text)
        self.written += len(text)
        return self._stream.write(text)

    def reset(self, *_unused):
        self.written = 0
        self.warned = False

    def __getattr__(self, name):
        return getattr(self._stream, name)


GRADED_FUNCTIONS_DIR = "DDPCOURSE_GRADED_FUNCTIONS_DIR"
GRADED_FUNCTIONS = "DDPCOURSE_GRADED_FUNCTIONS"


def leave_graded_functions(namespace: dict, folder: Path, names: list[str]) -> None:
    """Write each graded function of ``namespace`` to ``folder/NAME.pickle`` (by value, as the
    ranks get it); remove the file of one that is gone or cannot be pickled."""
    for name in names:
        target = folder / f"{name}.pickle"
        try:
            payload = launcher.pickle_by_value(namespace[name])
        except Exception:  # noqa: BLE001 - undefined or unpicklable: the grader reports it
            target.unlink(missing_ok=True)
            continue
        partial = target.with_suffix(".partial")
        partial.write_bytes(payload)
        os.replace(partial, target)


def setup_notebook(exercise: str, max_cell_output_bytes: int = MAX_CELL_OUTPUT_BYTES) -> None:
    """Make this kernel safe to grade (see the module docstring). Idempotent.

    ``exercise`` is the exercise's slug: its grader-only checks are imported now when they exist -
    they do only where the notebook is graded - so that the integrity snapshot covers them too.
    """
    try:
        importlib.import_module(hidden_checks(exercise))
    except ModuleNotFoundError:
        pass
    try:
        ipython = get_ipython()  # noqa: F821 - defined inside IPython only
    except NameError:
        ipython = None
    if ipython is not None and not getattr(setup_notebook, "_done", False):
        dist.init_process_group = _refuse_init_process_group
        c10d.init_process_group = _refuse_init_process_group
        os._exit = _guarded_exit(os._exit)
        for name in ("stdout", "stderr"):
            capped = _CappedStream(getattr(sys, name), max_cell_output_bytes)
            setattr(sys, name, capped)
            ipython.events.register("pre_run_cell", capped.reset)
        folder, names = os.environ.get(GRADED_FUNCTIONS_DIR), os.environ.get(GRADED_FUNCTIONS)
        if folder and names:
            target = Path(folder) / exercise
            target.mkdir(parents=True, exist_ok=True)
            ipython.events.register("post_run_cell", lambda *_: leave_graded_functions(
                ipython.user_ns, target, names.split(",")))
        setup_notebook._done = True
    # Grading must not depend on timing: wait (~2 s, once) for the rank server that has every
    # lazy torch import done, so no check's ranks pay for importing torch._dynamo themselves.
    launcher.wait_until_warm()
    integrity.snapshot()
