"""Grade a submission's functions in a process that never runs student code.

The notebook's own test cells run in the student's kernel, which the student controls (input
transformers, patched functions, threads...), so their verdicts are only a courtesy. The grade
comes from here:

1. the kernel runs the student's cells, but its test cells are stand-ins
   (:func:`stand_in_test_cells`), and it leaves each graded function behind as pickled bytes
   (``setup_notebook`` does it after every cell when the worker asks); this process never
   unpickles them;
2. :class:`ObservationHost` starts ``ddpcourse.grading.observation_host`` in the submission's
   sandbox: it runs a case's ``observe`` in fresh ranks with the student's function and sends back
   every rank's observations as plain data;
3. the test cells of the *trusted* source notebook (solutions/, which the student never edits) say
   which checks each graded cell runs on which function: ``checks.check_x(fn)`` and, in hidden
   blocks, ``hidden.check_y(fn)``. Each check runs here, on a :class:`SubmittedFunction`, and its
   cases' ``judge`` turns the observations into the verdict.

Hidden checks live only here: the sandbox sees the visible ``observe`` functions and the
arguments of each case, never the hidden modules or the solutions.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import nbformat

from autograder.cell_grammar import CellGrammarError, CheckCall, parse_graded_cell
from autograder.notices import GRADER_NOTE
from ddpcourse.grading.checks import CheckFailed, RemoteFunction, UnpickledTogether
from ddpcourse.grading.exercises import CHECKS_PACKAGE
from ddpcourse.grading.frames import (FrameError, read_frame, tensors_from_bytes,
                                      tensors_to_bytes, write_frame)
from ddpcourse.launcher import RankError, RankFailure, RankTimeoutError
from ddpcourse.launcher.processes import kill_process_group

MAX_OBSERVATION_BYTES = 64 << 20
HOST_MARGIN_S = 60.0  # the host starts ranks and reports on top of the ranks' own deadline
FAILURE_KINDS = ("raised", "exited", "timeout", "stopped")
_TEXT_LIMIT = 20_000


class HostFailed(RuntimeError):
    """The sandboxed host died, answered nonsense, or did not answer in time."""


class ObservationHost:
    """One ``observation_host`` process for one submission, started with ``wrap(argv)`` (the
    sandbox's command line; identity when grading unsandboxed). Restarted after a failure.

    Start it from a thread that outlives it (the main thread): the sandbox dies with the thread
    that started it (bwrap's ``--die-with-parent`` is the parent-death signal, which follows the
    parent thread)."""

    def __init__(self, wrap: Callable[[list[str]], list[str]] = list, env: dict | None = None,
                 log_path: Path | None = None, one_rank: bool = False, dynamo: bool = False):
        self.wrap, self.env, self.log_path = wrap, env, log_path
        self.one_rank = one_rank  # hosts one rank of communication-audited cases (relayed.py)
        self.dynamo = dynamo  # a one-rank host whose ranks build DDP or an optimizer: preload it
        self.process: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> None:
        to_host_r, self.to_host = os.pipe()
        self.from_host, from_host_w = os.pipe()
        argv = [sys.executable, "-m", "ddpcourse.grading.observation_host", str(to_host_r),
                str(from_host_w), *(["--one-rank"] if self.one_rank else []),
                *(["--dynamo"] if self.dynamo else [])]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(self.wrap(argv), pass_fds=(to_host_r, from_host_w),
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        finally:
            os.close(to_host_r)
            os.close(from_host_w)
            if self.log_path:
                log.close()

    def start(self) -> None:
        """Start the host now, so it imports torch and warms its ranks while the caller does
        something else (the first case would otherwise wait for it)."""
        with self.lock:
            self._start_if_needed()

    def wait_ready(self, timeout: float = HOST_MARGIN_S) -> None:
        """Start the host if needed and wait until it is warm (it answers a ping only then);
        HostFailed if it does not answer within ``timeout``."""
        with self.lock:
            self._start_if_needed()
            header, _ = self._ask({"ping": True}, b"", timeout)
        if header.get("status") != "ready":
            raise HostFailed(f"the sandboxed ranks' host answered {str(header)[:200]} to a ping")

    def _start_if_needed(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.close()
            self._start()

    def observe(self, observe, world_size: int, args: tuple, payload: bytes, timeout: float,
                init_process_group: bool, relay: dict | None = None) -> list:
        """Every rank's observation. With ``relay`` ({"rank": r, "socket": path}) the host runs
        only rank ``r`` and answers for it alone (a list of one; failures say rank 0)."""
        name = f"{observe.__module__}:{observe.__qualname__}"
        if not name.startswith(CHECKS_PACKAGE + "."):
            raise ValueError(f"{name} is not a case of {CHECKS_PACKAGE}")
        encoded_args = tensors_to_bytes(args)
        request = {"observe": name, "world_size": world_size, "timeout": timeout,
                   "init_process_group": init_process_group, "args_bytes": len(encoded_args)}
        if relay is not None:
            request["relay"] = relay
        ranks_here = 1 if relay is not None else world_size
        with self.lock:
            self._start_if_needed()
            reply = self._ask(request, encoded_args + payload, timeout + HOST_MARGIN_S)
        header, body = reply
        status = header.get("status")
        if status == "ok":
            observations = tensors_from_bytes(body)
            if not isinstance(observations, list) or len(observations) != ranks_here:
                raise HostFailed(f"the sandbox sent {type(observations).__name__} instead of "
                                 f"{ranks_here} observations")
            return observations
        if status == "failed":
            raise rebuild_rank_error(header, ranks_here)
        raise HostFailed(f"the sandbox could not run the case: {str(header.get('message'))[:2000]}")

    def _ask(self, request: dict, body: bytes, deadline_s: float) -> tuple[dict, bytes]:
        answer: list = []

        def exchange():
            try:
                write_frame(self.to_host, request, body)
                answer.append(read_frame(self.from_host, MAX_OBSERVATION_BYTES))
            except (FrameError, OSError) as exc:
                answer.append(exc)

        talker = threading.Thread(target=exchange, daemon=True)
        talker.start()
        talker.join(deadline_s)
        if talker.is_alive() or not answer or isinstance(answer[0], Exception):
            why = ("did not answer within "
                   f"{deadline_s:g} s" if talker.is_alive() or not answer else str(answer[0]))
            self.close()  # unblocks the talker: its pipes close
            talker.join(5)
            raise HostFailed(f"the sandboxed ranks' host {why}")
        return answer[0]

    def close(self) -> None:
        if self.process is not None:
            kill_process_group(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None
        for name in ("to_host", "from_host"):
            fd = self.__dict__.pop(name, None)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def rebuild_rank_error(header: dict, world_size: int) -> RankError:
    """The RankError the host reported, rebuilt from its fields only (checked, truncated)."""
    failures = []
    for raw in header.get("failures") or []:
        if not isinstance(raw, dict):
            continue
        rank, kind = raw.get("rank"), raw.get("kind")
        if not isinstance(rank, int) or not 0 <= rank < world_size or kind not in FAILURE_KINDS:
            continue
        exitcode = raw.get("exitcode")
        failures.append(RankFailure(
            rank=rank, kind=kind, exitcode=exitcode if isinstance(exitcode, int) else None,
            exc_type=_text(raw.get("exc_type"), 200) or None, message=_text(raw.get("message")),
            traceback=_text(raw.get("traceback")), stack=_text(raw.get("stack")),
            output_tail=_text(raw.get("output_tail"))))
    if not failures:
        failures = [RankFailure(rank=0, kind="exited", message="the ranks failed without a report")]
    error = RankTimeoutError if header.get("timed_out") is True else RankError
    return error(failures, world_size, _text(header.get("backend"), 20) or "gloo")


def _text(value, limit: int = _TEXT_LIMIT) -> str:
    return value[:limit] if isinstance(value, str) else ""


class SubmittedFunction(RemoteFunction):
    """A student's function as the kernel left it (pickled bytes), run only in the sandbox.

    Cases that audit the ranks' communication run in ``relayed`` (one sandbox per rank, a broker
    here); grading one without it is an error, not a quieter audit."""

    def __init__(self, name: str, payload: bytes, host: ObservationHost, relayed=None):
        self.__name__, self.payload, self.host, self.relayed = name, payload, host, relayed

    def together_with(self, *others: SubmittedFunction) -> SubmittedFunction:
        """One payload that the ranks unpickle as the tuple of every function's; built without
        unpickling any of them here."""
        functions = (self, *others)
        joined = pickle.dumps(UnpickledTogether(tuple(f.payload for f in functions)))
        return SubmittedFunction(" and ".join(f.__name__ for f in functions), joined, self.host,
                                 self.relayed)

    def observe(self, observe, world_size, args, timeout, init_process_group,
                audit_traffic=False, rendezvous=False):
        try:
            if audit_traffic:
                if self.relayed is None:
                    raise ValueError(f"{observe.__qualname__} audits communication: grade it with "
                                     "relayed ranks (autograder.relayed.RelayedRanks)")
                return self.relayed.observe(observe, world_size, args, self.payload, timeout,
                                            rendezvous=rendezvous)
            return self.host.observe(observe, world_size, args, self.payload, timeout,
                                     init_process_group)
        except HostFailed as exc:
            raise RankError([RankFailure(rank=0, kind="exited", message=str(exc))], world_size,
                            "gloo", intro=str(exc)) from None


# --- which checks each graded cell runs ----------------------------------------------------------


@dataclass(frozen=True)
class GradedCell:
    grade_id: str
    points: float
    calls: tuple[CheckCall, ...]


def graded_cells(source_notebook: Path) -> list[GradedCell]:
    """The graded cells of a trusted source notebook, with the check calls each makes, read by
    :mod:`autograder.cell_grammar`; CellGrammarError for a cell it cannot read or a check its
    module does not have (the grader's problem: found before any student code runs)."""
    slug = source_notebook.stem
    cells = []
    for cell in nbformat.read(source_notebook, as_version=4).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade"):
            continue
        where = f"{source_notebook.name}, cell {meta.get('grade_id')}"
        calls = parse_graded_cell(cell.source, slug, where)
        for call in calls:
            if not callable(getattr(importlib.import_module(call.module), call.check, None)):
                raise CellGrammarError(f"{where}: {call.module} has no {call.check}")
        cells.append(GradedCell(meta["grade_id"], float(meta.get("points", 0)), calls))
    return cells


def graded_names(cells: Sequence[GradedCell]) -> list[str]:
    """The notebook's functions the checks are given (what the kernel must leave behind)."""
    return sorted({name for cell in cells for call in cell.calls for name in call.names})


MAX_PRINTED_CHARS = 20_000  # of what a cell's checks print when they pass, in its feedback


@dataclass
class CellVerdict:
    grade_id: str
    points: float
    score: float
    message: str  # empty when passed
    printed: str = ""  # what the checks printed on a pass (e.g. an explanation the lab reveals)
    grader_fault: bool = False  # the grader, not the student, failed: the instructor must know


def grade_cells(cells: Sequence[GradedCell], payloads: dict[str, bytes],
                host: ObservationHost, relayed=None) -> list[CellVerdict]:
    """Run every graded cell's checks on the submitted functions; a cell scores its points only
    if all of its checks pass. ``relayed``: the submission's
    :class:`~autograder.relayed.RelayedRanks`, for the cases that audit communication."""
    verdicts = []
    for cell in cells:
        message, printed, fault = "", io.StringIO(), False
        for call in cell.calls:
            missing = [name for name in call.names if name not in payloads]
            if missing:
                message = (f"{', '.join(missing)} was not defined when the notebook finished (or "
                           "could not be sent to the ranks)")
                break
            functions = [submitted(argument, payloads, host, relayed)
                         for argument in call.arguments]
            check = getattr(importlib.import_module(call.module), call.check)
            try:
                with contextlib.redirect_stdout(printed):
                    check(*functions)
            except CheckFailed as failed:
                message = str(failed)
                break
            except Exception as exc:  # noqa: BLE001 - the grader's own failure, not the student's
                message, fault = grader_fault_message(
                    f"could not run {call.check}: {type(exc).__name__}: {exc}"), True
                break
        verdicts.append(CellVerdict(cell.grade_id, cell.points, 0.0 if message else cell.points,
                                    message, "" if message else
                                    printed.getvalue()[:MAX_PRINTED_CHARS], fault))
    return verdicts


def submitted(names: tuple[str, ...], payloads: dict[str, bytes], host: ObservationHost,
              relayed=None) -> SubmittedFunction:
    """One argument of a check: a function, or several given together (``together(a, b)``)."""
    first, *others = (SubmittedFunction(name, payloads[name], host, relayed) for name in names)
    return first.together_with(*others) if others else first


def grader_fault_message(what: str) -> str:
    """A cell's message when the grader itself failed: the student is told it is not their
    doing, and that the instructor has been told (``grade`` exits non-zero, naming it)."""
    return (f"The grader failed here, not your code: it {what}. Your instructor has been told "
            "(the grading command reports it) and will grade this notebook again.")


def grader_error_verdicts(source_notebook: Path, why: str) -> list[CellVerdict]:
    """Zero, with the grader's reason, for every graded cell of a notebook the grader could not
    prepare (read from its nbgrader metadata alone, which needs nothing that failed)."""
    verdicts = []
    for cell in nbformat.read(source_notebook, as_version=4).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("grade"):
            verdicts.append(CellVerdict(meta["grade_id"], float(meta.get("points", 0)), 0.0,
                                        grader_fault_message(f"could not read this notebook's "
                                                             f"tests: {why}"),
                                        grader_fault=True))
    return verdicts


# --- what the worker does with them --------------------------------------------------------

STAND_IN = 'print("graded outside this notebook: the grader\'s verdict is above")'


def graded_here(slug: str) -> bool:
    """Whether an exercise's verdicts come from here: its checks module says every check runs
    :class:`~ddpcourse.grading.checks.Case` s (``TRUSTED_VERDICTS = True``)."""
    module = importlib.import_module(f"{CHECKS_PACKAGE}.{slug}")
    return getattr(module, "TRUSTED_VERDICTS", False) is True


def stand_in_test_cells(notebook_path: Path) -> None:
    """Keep only the leading comments of every test cell of a source notebook, then a stand-in
    line: the checks run here, so neither they nor the hidden ones are sent to the student's
    kernel, where their verdict could not be trusted anyway."""
    notebook = nbformat.read(notebook_path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type != "code" or not cell.metadata.get("nbgrader", {}).get("grade"):
            continue
        lines = cell.source.splitlines()
        comments = next((lines[:i] for i, line in enumerate(lines)
                         if not line.startswith("#")), lines)
        cell.source = "\n".join([*comments, STAND_IN])
    nbformat.write(notebook, notebook_path)


def record_verdicts(gradebook_url: str, assignment: str, slug: str, student: str,
                    verdicts: Sequence[CellVerdict]) -> None:
    """Put the verdicts in nbgrader's gradebook as the cells' automatic scores."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(gradebook_url) as gradebook:
        for verdict in verdicts:
            try:
                grade = gradebook.find_grade(verdict.grade_id, slug, assignment, student)
            except MissingEntry:
                continue  # the notebook was not handed in
            grade.auto_score = verdict.score
        gradebook.db.commit()


def annotate(notebook_path: Path, verdicts: Sequence[CellVerdict]) -> None:
    """Open each graded cell's output with the grader's verdict."""
    by_id = {verdict.grade_id: verdict for verdict in verdicts}
    notebook = nbformat.read(notebook_path, as_version=4)
    for cell in notebook.cells:
        verdict = by_id.get(cell.metadata.get("nbgrader", {}).get("grade_id"))
        if verdict is None or cell.cell_type != "code":
            continue
        outcome = (f"passed ({verdict.score:g} of {verdict.points:g} points)" if not
                   verdict.message else f"FAILED (0 of {verdict.points:g} points):\n"
                   f"{verdict.message}")
        note = (f"{GRADER_NOTE}Graded outside your notebook, by the grader's own run of your "
                f"functions: {outcome}\n")
        if verdict.printed.strip():
            note += f"\n{verdict.printed.rstrip()}\n"
        cell.outputs.insert(0, nbformat.v4.new_output("stream", name="stdout", text=note))
    nbformat.write(notebook, notebook_path)
