"""Grade ONE student's submission in a private course directory (run by autograder/grade.py).

    python -m autograder.worker JOB.json

Steps: copy the source assignment and the submission into the work folder; scan the submission
for tampering (from outside the kernel); put the locked setup cell back in first place if it was
moved; ``generate_assignment`` (gradebook entries and checksums), ``autograde``,
``generate_feedback``, ``nbgrader export``. If nbgrader dropped the submission (its kernel died
or could not be interrupted), find out where (from where its execution stopped, else by executing
it once more), and write a feedback page that says so, so no student silently disappears. Each
step's seconds go to the log and the result. The result goes to ``result.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from traitlets.config import Config

from autograder import capped_execute, late_penalty, sandbox, trusted
from autograder.nbgrader_api import REPO, api_for, check, load_config
from autograder.notices import write_notice
from autograder.relayed import RelayedRanks
from autograder.sandboxed_kernel import SandboxedKernelManager
from autograder.tamper_scan import locked_ids_of, scan_notebook
from ddpcourse.grading.exercises import CHECKS_PACKAGE
from ddpcourse.grading.notebook_guard import GRADED_FUNCTIONS, GRADED_FUNCTIONS_DIR
from ddpcourse.kernels import RankServerKernelManager

SETUP_ID = "setup"
TIMING = "[timing] "  # the start of each line of the log that says how long a step took


class Steps:
    """Seconds spent in each step of grading one submission, for the log (one ``[timing]`` line
    per step as it ends) and for the result (``summary.json``: where an instructor sees what a
    slow class spends its time on)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 2)
            print(f"{TIMING}{name}: {took:.2f} s", flush=True)


def seconds_since_process_start() -> float | None:
    """How long ago this process started (Linux: /proc), so the interpreter's start-up and
    imports count among the steps; None where that is not known."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - started / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _setup_first(path: Path) -> bool:
    """Move the locked setup cell before every other code cell; True if it had been moved."""
    nb = nbformat.read(path, as_version=4)
    setup = [i for i, c in enumerate(nb.cells)
             if c.metadata.get("nbgrader", {}).get("grade_id") == SETUP_ID]
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if not setup or not code or setup[0] == code[0]:
        return False
    cell = nb.cells.pop(setup[0])
    nb.cells.insert(code[0], cell)
    nbformat.write(nb, path)
    return True


def _scores(config, assignment: str, student: str) -> tuple[float, float, dict, dict | None]:
    """The submission's score after its late penalty (as ``nbgrader export``'s ``score``), the
    maximum, each cell's [score, maximum], and how late it was ({seconds, penalty}; None: not)."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(config.CourseDirectory.db_url) as gb:
        try:
            submission = gb.find_submission(assignment, student)
        except MissingEntry:
            return 0.0, float(gb.find_assignment(assignment).max_score), {}, None
        cells = {}
        for notebook in submission.notebooks:
            for grade in notebook.grades:
                cells[grade.name] = [float(grade.score or 0.0), float(grade.max_score)]
        penalty = float(submission.late_submission_penalty or 0.0)
        late = ({"seconds": submission.total_seconds_late, "penalty": round(penalty, 4)}
                if submission.total_seconds_late > 0 else None)
        return (float(submission.score or 0.0) - penalty, float(submission.max_score), cells,
                late)


def _set_due_date(db_url: str, assignment: str, duedate: str) -> None:
    """The course's due date on this worker's gradebook, where autograde computes penalties."""
    from nbgrader.api import Gradebook
    from nbgrader.utils import parse_utc

    with Gradebook(db_url) as gb:
        gb.update_or_create_assignment(assignment, duedate=parse_utc(duedate))


def _export(config, assignment: str, student: str, dest: Path) -> None:
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    plugin = CsvExportPlugin(to=str(dest), assignment=[assignment], student=[student])
    with Gradebook(config.CourseDirectory.db_url) as gb:
        plugin.export(gb)


def _sandboxes(work: Path, autograded: Path, kernel_dir: Path, functions_dir: Path,
               host_dir: Path, kernel_runs_hidden_checks: bool
               ) -> tuple[sandbox.Sandbox, sandbox.Sandbox]:
    """The student's kernel may write its own notebook folder, its sockets and the functions it
    leaves behind; the ranks' host only its own folder. Both see neither the grader-only folders
    (solutions, hidden checks, the repository's history) nor any student's work but their own.

    An exercise not yet graded outside the kernel runs its hidden checks in the kernel, which
    must then import them: for its assignment the hidden checks stay visible (and the CSV says so).
    """
    hidden = (REPO / "solutions", REPO / ".git", work.parent.parent,
              *(() if kernel_runs_hidden_checks else (REPO / "autograder" / "hidden",)))
    environment = {"IPYTHONDIR": str(kernel_dir / "ipython"), "MPLCONFIGDIR": str(kernel_dir),
                   # the kernel's parent is the sandbox's init (pid 1), not the grader: no parent
                   # polling (the sandbox dies with the grader anyway)
                   "JPY_PARENT_PID": "1"}
    kernel = sandbox.Sandbox(writable=(kernel_dir, autograded, functions_dir), hidden=hidden,
                             env=environment)
    host = sandbox.Sandbox(writable=(host_dir,), hidden=hidden, env={"MPLCONFIGDIR": str(host_dir)})
    return kernel, host


def _sandboxed_kernel_config(box: sandbox.Sandbox | None, kernel_dir: Path) -> Config:
    config = Config()
    config.NotebookClient.kernel_manager_class = (RankServerKernelManager if box is None
                                                  else SandboxedKernelManager)
    if box is not None:
        config.SandboxedKernelManager.sandbox_prefix = box.command([])
        config.SandboxedKernelManager.connection_dir = str(kernel_dir)
    return config


STOPPED_BECAUSE = {"blocked": "it blocked the kernel, which could not be interrupted",
                   "died": "the notebook's kernel died while running it"}


def _why_dropped(notebook: Path, cell_timeout: int, kernel_dir: Path,
                 box: sandbox.Sandbox | None) -> str:
    """The cell that killed or blocked the kernel of a notebook nbgrader dropped: where its
    execution stopped during autograde (capped_execute.STOPS), or, if that was not recorded,
    found by executing the submission once more."""
    stop = capped_execute.STOPS.get(notebook.stem)
    if stop is None:
        return _diagnose_dropped(notebook, cell_timeout, kernel_dir, box)
    what = STOPPED_BECAUSE.get(stop.why, f"running it failed: {stop.error}")
    return _report(stop.cell_index, stop.cells, stop.source, what)


def _diagnose_dropped(notebook: Path, cell_timeout: int, kernel_dir: Path,
                      box: sandbox.Sandbox | None) -> str:
    """Execute the (sanitised) submission once more to find the cell that killed its kernel."""
    import tempfile

    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from ddpcourse.kernels import ipc_client

    nb = nbformat.read(notebook, as_version=4)
    executed = [-1]

    def remember(cell, cell_index, **_):
        executed[0] = cell_index

    try:
        with tempfile.TemporaryDirectory(prefix="diagnose-", dir=kernel_dir) as socket_dir:
            client = ipc_client(nb, socket_dir, notebook.parent, cell_timeout,
                                config=_sandboxed_kernel_config(box, kernel_dir), allow_errors=True,
                                interrupt_on_timeout=False)
            client.on_cell_execute = remember
            client.execute()
    except DeadKernelError:
        return _cell_report(nb, executed[0], STOPPED_BECAUSE["died"])
    except CellTimeoutError:
        return _cell_report(nb, executed[0], STOPPED_BECAUSE["blocked"])
    except Exception as exc:  # noqa: BLE001 - anything that stops execution is the answer
        return _cell_report(nb, executed[0], f"running it failed: {type(exc).__name__}: {exc}")
    return "the notebook ran to the end when re-executed; nbgrader's log has the details"


def _cell_report(nb, index: int, what: str) -> str:
    if index < 0:
        return what
    return _report(index, len(nb.cells), nb.cells[index].source, what)


def _report(index: int, cells: int, source: str, what: str) -> str:
    head = "\n".join(source.splitlines()[:12])
    return f"code cell {index + 1} (of the notebook's {cells} cells): {what}.\n\n{head}"


MAX_FUNCTION_BYTES = 16 << 20


def _open_with_warning(notebook: Path, warning: str) -> None:
    """Put ``warning`` first in a graded notebook, so its feedback page opens with it."""
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(f"**{warning}**"))
    nbformat.write(nb, notebook)


def _graded_functions(folder: Path) -> dict[str, bytes]:
    """The functions the student's kernel left behind, as bytes (never loaded here)."""
    return {path.stem: path.read_bytes() for path in sorted(folder.glob("*.pickle"))
            if path.is_file() and not path.is_symlink()
            and path.stat().st_size <= MAX_FUNCTION_BYTES}


@dataclasses.dataclass
class _Prepared:
    """One submission, ready for nbgrader: its folders, configuration and what the scan found."""

    student: str
    assignment: str
    work: Path
    config: Config
    graded_outside: dict  # slug -> the graded cells of a notebook graded outside the kernel
    in_kernel: list[str]  # slugs still graded in the kernel
    grader_errors: dict  # slug -> why the grader could not prepare that notebook (its fault)
    flags: list[str]
    moved: list[str]
    sandbox_warning: str | None
    kernel_box: sandbox.Sandbox | None
    host_box: sandbox.Sandbox | None
    started: float
    kernel_dir: Path  # the kernel's sockets, connection file and settings (short_kernel_dir)
    duedate: str | None = None  # the course gradebook's, for nbgrader's late penalties
    cleared_flag: str | None = None  # why the instructor cleared this student's tamper flag
    steps: Steps = dataclasses.field(default_factory=Steps)

    @property
    def submitted(self) -> Path:
        return self.work / "submitted" / self.student / self.assignment

    @property
    def autograded(self) -> Path:
        return self.work / "autograded" / self.student / self.assignment



# A Unix socket's path has at most 107 bytes (sun_path); the kernel's IPC sockets are named
# ``{kernel_dir}/ipc-{port}``. Under OUT/work/{student}/ they exceeded it with a long student id
# (an e-mail address) and a long output folder ("ZMQError: File name too long"), and nbgrader
# dropped the submission. So the kernel's folder is a fresh one in the temporary folder, whatever
# the names.
MAX_KERNEL_DIR_CHARS = 48


def short_kernel_dir() -> Path:
    """A new private folder with a short path for a kernel's sockets: in ``$TMPDIR`` when that is
    short, else in ``/tmp``."""
    parent = tempfile.gettempdir()
    if len(parent) > MAX_KERNEL_DIR_CHARS - 20:
        parent = "/tmp"
    return Path(tempfile.mkdtemp(prefix="kernel-", dir=parent))


def _prepare(job: dict) -> _Prepared:
    started = time.monotonic()
    student, assignment = job["student"], job["assignment"]
    work = Path(job["work"])
    if work.exists():
        shutil.rmtree(work)
    source = work / "source" / assignment
    shutil.copytree(REPO / "solutions" / assignment, source)
    submitted = work / "submitted" / student / assignment
    shutil.copytree(job["submission"], submitted)
    config = load_config(work, cell_timeout=job.get("cell_timeout"), source_directory="source",
                         submitted_directory="submitted", autograded_directory="autograded",
                         feedback_directory="feedback", release_directory="release")
    if job.get("empty_gradebook"):  # rather than nbgrader making a new one (grade.empty_gradebook)
        shutil.copyfile(job["empty_gradebook"],
                        config.CourseDirectory.db_url.removeprefix("sqlite:///"))

    policy = os.environ.get(sandbox.POLICY_VARIABLE, "require")
    use_sandbox, sandbox_warning = sandbox.resolve(policy)
    autograded = work / "autograded" / student / assignment
    kernel_dir, functions_dir, host_dir = (short_kernel_dir(), work / "graded_functions",
                                           work / "host")
    for folder in (kernel_dir, functions_dir, host_dir, autograded):
        folder.mkdir(parents=True, exist_ok=True)
    graded_outside, in_kernel, grader_errors = _read_trusted_sources(source, assignment)
    # nbgrader deletes and remakes the student's autograded folder: bind its parent, which stays.
    kernel_box, host_box = (_sandboxes(work, autograded.parent.parent, kernel_dir, functions_dir,
                                       host_dir, bool(in_kernel))
                            if use_sandbox else (None, None))
    config.KernelManager.ip = str(kernel_dir / "ipc")
    config.merge(_sandboxed_kernel_config(kernel_box, kernel_dir))

    locked = set().union(*(locked_ids_of(p) for p in source.glob("*.ipynb")))
    flags = [str(f) for nb in sorted(submitted.glob("*.ipynb")) for f in scan_notebook(nb, locked)]
    moved = [nb.name for nb in sorted(submitted.glob("*.ipynb")) if _setup_first(nb)]

    for slug in (*graded_outside, *grader_errors):
        trusted.stand_in_test_cells(source / f"{slug}.ipynb")
    os.environ[GRADED_FUNCTIONS_DIR] = str(functions_dir)
    os.environ[GRADED_FUNCTIONS] = ",".join(
        sorted({name for cells in graded_outside.values() for name in trusted.graded_names(cells)}))
    return _Prepared(student, assignment, work, config, graded_outside, in_kernel, grader_errors,
                     flags, moved, sandbox_warning, kernel_box, host_box, started, kernel_dir,
                     job.get("duedate"), job.get("cleared_flag"))


def _read_trusted_sources(source: Path, assignment: str) -> tuple[dict, list[str], dict]:
    """Each notebook's graded cells as the trusted source says (slug -> cells), the notebooks
    still graded in the kernel, and the notebooks the grader could not prepare (slug -> why).

    One notebook the grader cannot read (a test cell outside :mod:`autograder.cell_grammar`, a
    check its module lacks, a checks module that fails to import) is the grader's problem: the
    assignment's other notebooks are graded all the same, and that one is reported."""
    graded_outside, in_kernel, grader_errors = {}, [], {}
    for notebook in sorted(source.glob("*.ipynb")):
        slug = notebook.stem
        try:
            if trusted.graded_here(slug):
                graded_outside[slug] = trusted.graded_cells(
                    REPO / "solutions" / assignment / notebook.name)
            else:
                in_kernel.append(slug)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is the grader's, not theirs
            grader_errors[slug] = f"{type(exc).__name__}: {exc}"
    return graded_outside, in_kernel, grader_errors


def _rank_host(prepared: _Prepared, rank: int, relay_dir: Path) -> trusted.ObservationHost:
    """The host of rank ``rank`` of communication-audited cases: a sandbox of its own (own
    network, /tmp and processes; its own folder the only one it writes), which sees the folder of
    its broker socket and no other rank's."""
    folder = prepared.work / f"rank{rank}"
    folder.mkdir(exist_ok=True)
    box = prepared.host_box
    if box is not None:
        box = dataclasses.replace(box, writable=(folder,), env={"MPLCONFIGDIR": str(folder)},
                                  readable=(*box.readable, relay_dir))
    return trusted.ObservationHost(wrap=box.command if box else list,
                                   log_path=prepared.work / f"rank{rank}.log", one_rank=True,
                                   dynamo=_audited_cases_build_ddp(prepared.graded_outside))


def _audited_cases_build_ddp(slugs) -> bool:
    """Whether an exercise's communication-audited cases build DDP (an exercise module's
    ``AUDITED_CASES_BUILD_DDP``): then each rank's host preloads torch._dynamo once, rather than
    every rank of every case importing it."""
    return any(getattr(importlib.import_module(f"{CHECKS_PACKAGE}.{slug}"),
                       "AUDITED_CASES_BUILD_DDP", False) for slug in slugs)


def grade_one(job: dict, steps: Steps | None = None) -> dict:
    steps = steps or Steps()
    with steps("prepare"):
        prepared = _prepare(job)
    prepared.steps = steps
    try:
        result = _grade_prepared(prepared)
    finally:
        shutil.rmtree(prepared.kernel_dir, ignore_errors=True)
    result["steps"] = dict(steps.seconds)
    return result


def _grade_prepared(prepared: _Prepared) -> dict:
    with RelayedRanks(functools.partial(_rank_host, prepared)) as relayed:
        box = prepared.host_box
        if box is not None:  # it also hosts rank 0 of the communication-audited cases
            box = dataclasses.replace(box, readable=(*box.readable, relayed.relay_dir(0)))
        with trusted.ObservationHost(wrap=box.command if box else list,
                                     log_path=prepared.work / "host.log") as host:
            relayed.adopt_rank0(host)
            if prepared.graded_outside:
                host.start()  # imports torch and warms its ranks while the kernel runs
            return _grade(prepared, host, relayed)


def _grade(prepared: _Prepared, host: trusted.ObservationHost, relayed: RelayedRanks) -> dict:
    student, assignment, config = prepared.student, prepared.assignment, prepared.config
    submitted, autograded, kernel_dir = prepared.submitted, prepared.autograded, prepared.kernel_dir
    step = prepared.steps
    api = api_for(config)
    with step("generate_assignment"):
        check(api.generate_assignment(assignment, force=True, create=True), "generate_assignment")
        if prepared.duedate:
            _set_due_date(config.CourseDirectory.db_url, assignment, prepared.duedate)
    with step("autograde (the student's kernel)"):
        autograde = api.autograde(assignment, student, force=True, create=True)
    status, notes = "graded", [prepared.sandbox_warning] if prepared.sandbox_warning else []
    if prepared.in_kernel:
        notes.append(f"{', '.join(prepared.in_kernel)}: scores from the student's kernel (its "
                     "hidden checks were readable there)")
    if prepared.moved:
        notes.append(f"the setup cell had been moved; it was put back first in {prepared.moved}")
    feedback_dir = prepared.work / "feedback" / student / assignment
    grader_errors = dict(prepared.grader_errors)
    for slug, cells in prepared.graded_outside.items():
        notebook = autograded / f"{slug}.ipynb"
        if notebook.exists():
            functions = _graded_functions(prepared.work / "graded_functions" / slug)
            with step(f"checks of {slug} (outside the kernel)"):
                verdicts = trusted.grade_cells(cells, functions, host, relayed)
            trusted.record_verdicts(config.CourseDirectory.db_url, assignment, slug, student,
                                    verdicts)
            trusted.annotate(notebook, verdicts)
            notes.append(f"{slug}: scores computed outside the notebook")
            faults = [f"{v.grade_id}: {v.message}" for v in verdicts if v.grader_fault]
            if faults:
                grader_errors[slug] = "; ".join(faults)
    for slug, why in prepared.grader_errors.items():
        notebook = autograded / f"{slug}.ipynb"
        if notebook.exists():  # its stand-in cells passed in the kernel: they score nothing
            verdicts = trusted.grader_error_verdicts(REPO / "solutions" / assignment /
                                                     f"{slug}.ipynb", why)
            trusted.record_verdicts(config.CourseDirectory.db_url, assignment, slug, student,
                                    verdicts)
            trusted.annotate(notebook, verdicts)
            _open_with_warning(notebook, f"This notebook was not graded: the grader failed "
                                         f"({why}). That is not your doing; your instructor "
                                         "has been told and will grade it again.")
    notes[:0] = [f"GRADER ERROR in {slug} (the grader's fault, not the student's: its cells "
                 f"score 0 until it is fixed and graded again): {why}"
                 for slug, why in sorted(grader_errors.items())]
    late_penalty.reassess(config, assignment, student)
    if prepared.sandbox_warning:
        for notebook in sorted(autograded.glob("*.ipynb")):
            _open_with_warning(notebook, prepared.sandbox_warning)
    if autograded.exists() and any(autograded.glob("*.ipynb")):
        with step("generate_feedback"):
            check(api.generate_feedback(assignment, student, force=True), "generate_feedback")
    else:
        status = "dropped by nbgrader"
        timeout = config.Execute.timeout
        box = prepared.kernel_box
        with step("why nbgrader dropped it"):
            reasons = [f"{nb.name}: {_why_dropped(nb, timeout, kernel_dir, box)}"
                       for nb in sorted(submitted.glob("*.ipynb"))]
        notes.extend(reasons)
        for nb in sorted(submitted.glob("*.ipynb")):
            write_notice(feedback_dir / f"{nb.stem}.html", student, assignment,
                          "could not be graded",
                          "nbgrader could not grade this notebook: its kernel died or could "
                          "not be interrupted, so no test ran to completion.\n\n"
                          + "\n\n".join(reasons) + "\n\nnbgrader's log:\n"
                          + (autograde.get("log") or "")[-4000:])
    score, max_score, cells, late = _scores(config, assignment, student)
    if late:
        notes.append(f"late by {late_penalty.lateness(late['seconds'])}: "
                     f"-{late['penalty']:g} points")
    flags = prepared.flags
    cleared = prepared.cleared_flag
    if flags and cleared:
        notes.append(f"the static scan's findings, cleared by the instructor ({cleared}): "
                     + "; ".join(flags))
    elif flags:
        status, score = "flagged for tampering", 0.0
        notes.append("tampering found by the static scan: " + "; ".join(flags))
        for page in feedback_dir.glob("*.html"):
            page.unlink()
        for nb in sorted(submitted.glob("*.ipynb")):
            write_notice(feedback_dir / f"{nb.stem}.html", student, assignment,
                          "flagged for review",
                          "The notebook changes functions that the tests rely on, so its "
                          "test results cannot be trusted; it scores 0 until your instructor "
                          "has reviewed it.\n\n" + "\n".join(flags))
    with step("export"):
        _export(config, assignment, student, prepared.work / "grades.csv")
    return {"student": student, "assignment": assignment, "status": status, "score": score,
            "max_score": max_score, "cells": cells, "flags": flags, "notes": notes, "late": late,
            "grader_errors": grader_errors,
            "feedback": str(feedback_dir),
            "seconds": round(time.monotonic() - prepared.started, 1)}


def main() -> int:
    steps = Steps()
    start_up = seconds_since_process_start()
    if start_up is not None:  # the interpreter, nbgrader's and the grader's imports
        steps.seconds["start-up"] = round(start_up, 2)
        print(f"{TIMING}start-up: {start_up:.2f} s", flush=True)
    job = json.loads(Path(sys.argv[1]).read_text())
    result = grade_one(job, steps)
    Path(job["result"]).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
