"""Run a student's function in clean ranks, compare with a trusted reference, explain failures.

The student's function is pickled by value in the notebook's kernel and rebuilt inside each rank
only after the rank's check has set up its audit, so whatever it calls resolves in a process that
never ran the rest of the notebook. Failures are turned into one :class:`CheckFailed` whose message
says, per rank, what was expected and what came back. Hidden checks pass ``hide_internals=True``
so their own code never shows up in a student's feedback.

Two kinds of case. The older kind, a plain ``rank_check(rank, world_size, student_fn, *args)``,
judges inside the rank, after the student's function ran there. A :class:`Case` splits the work:
its ``observe`` runs in the rank around the student's call and returns only *data* (tensors,
numbers, strings, lists, dicts), and its ``judge`` compares that data with a reference it computes
itself. In a notebook both run here, as before. When the course grades a class, the student's
function arrives as a :class:`RemoteFunction`: the observations are made in sandboxed ranks and
only the data comes back, so the verdict is computed in a process that never ran student code
(see autograder/trusted.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import HIDDEN_PACKAGE
from ddpcourse.launcher import RankError, RankFailure, pickle_by_value, run_ranks

# Seconds one check's ranks may take. Correct solutions need well under 1 s; graders of large
# classes on loaded machines may raise it, CI lowers it to fail hanging submissions faster.
CHECK_TIMEOUT_S = float(os.environ.get("DDPCOURSE_CHECK_TIMEOUT_S", "15"))


class CheckFailed(AssertionError):
    """A check found a wrong result; the message is written for the student."""


@dataclass(frozen=True)
class Case:
    """A graded situation whose verdict does not depend on anything the student's code can touch.

    ``observe(rank, world_size, student_fn, *args)`` runs in each rank: it sets up the inputs,
    calls the student's function and returns what it can see afterwards, as plain data (no objects
    of the student's). ``judge(observations, world_size, *args)`` gets every rank's data, indexed
    by rank, recomputes the reference on its own and raises :class:`CheckFailed` when they differ.
    Both must be module-level functions of ``ddpcourse.grading.exercises`` (the sandboxed ranks
    import ``observe`` by name).

    ``audit_traffic``: the case judges the ranks' communication. Its ``observe`` returns a dict
    whose ``"traffic"`` entry is what :func:`audited_traffic` saw in the rank, which is
    trustworthy only in the student's own notebook: a
    thread or a C++ process-group object escapes it. When a class is graded, each rank runs in a
    sandbox of its own whose only link to the others is the grader's broker, and the grader
    replaces ``"traffic"`` with what the broker carried (autograder/relayed.py).

    ``rendezvous`` (audited cases only): the broker completes a blocking send only once the
    receiver has posted the matching recv, as gloo and NCCL do, so a rank that sends before it
    receives in a ring deadlocks here too, and the case fails naming the ranks blocked in a
    circle. For the cases whose contract says deadlock-free. (Unaudited cases run on gloo, whose
    sends already block so.) By default the broker keeps a sent message until it is received.
    """

    observe: Callable[..., Any]
    judge: Callable[..., None]
    audit_traffic: bool = False
    rendezvous: bool = False

    def __post_init__(self):
        if self.rendezvous and not self.audit_traffic:
            raise ValueError("rendezvous is a mode of the grader's broker: only for cases with "
                             "audit_traffic=True (the others run on gloo, whose sends block "
                             "until received)")


@contextlib.contextmanager
def audited_traffic():
    """``with audited_traffic() as seen: ...``: afterwards ``seen`` holds a case's ``"traffic"``
    entry: the collectives the block called (names, sorted, no repeats), the bytes it sent
    point to point, and ``collective_calls``, every collective in call order as ``[name,
    bytes]``, from an in-rank :class:`~ddpcourse.grading.comm_audit.CommAudit`, which also sees
    the all-reduces DDP's C++ reducer launches. Names are the public ones the grader's broker
    also uses (:mod:`ddpcourse.grading.collective_names`: ``"all_reduce"``, ``"all_gather"``).
    On the relay backend nothing is audited here: the grader's broker does it, for the whole case
    (construction too), and replaces the entry."""
    seen: dict = {}
    if dist.is_initialized() and dist.get_backend() == "relay":
        yield seen
        return
    from ddpcourse.grading.comm_audit import CommAudit

    with CommAudit() as audit:
        yield seen
    seen.update(collectives=sorted(set(audit.record.collectives)),
                bytes_sent=audit.record.bytes_sent,
                collective_calls=[[name, nbytes] for name, nbytes in audit.record.collective_calls])


class RemoteFunction:
    """A student's function that must not be loaded in this process (the trusted grader).

    :func:`run_student` hands a :class:`Case`'s ``observe`` to :meth:`observe`, which runs it with
    the function in ranks elsewhere and returns their observations as validated data, or raises
    :class:`~ddpcourse.launcher.RankError` with each failed rank's report.
    """

    __name__ = "the submitted function"

    def observe(self, observe: Callable[..., Any], world_size: int, args: tuple, timeout: float,
                init_process_group: bool, audit_traffic: bool = False,
                rendezvous: bool = False) -> list[Any]:
        raise NotImplementedError

    def together_with(self, *others: RemoteFunction) -> RemoteFunction:
        """This function and ``others`` as one, which the ranks rebuild as a tuple."""
        raise NotImplementedError


class UnpickledTogether:
    """Several pickled functions as one payload: it unpickles, in the rank, as their tuple (so
    the trusted grader joins submitted functions without ever unpickling one)."""

    def __init__(self, payloads: tuple[bytes, ...]):
        self.payloads = payloads

    def __reduce__(self):
        return unpickle_each, (self.payloads,)


def unpickle_each(payloads: tuple[bytes, ...]) -> tuple:
    return tuple(pickle.loads(payload) for payload in payloads)


def together(*functions: Callable) -> Any:
    """Several of the student's functions (``save_checkpoint`` and ``load_checkpoint``) as the one
    ``student_fn`` of :func:`run_student`: a case's ``observe`` receives them as a tuple."""
    if all(isinstance(fn, RemoteFunction) for fn in functions):
        return functions[0].together_with(*functions[1:])
    if any(isinstance(fn, RemoteFunction) for fn in functions):
        raise TypeError("cannot mix submitted functions with the notebook's own")
    for fn in functions:
        if not callable(fn):
            raise CheckFailed(f"expected a function, got {type(fn).__name__}")
    return tuple(functions)


def run_student(case: Case | Callable[..., Any], world_size: int, student_fn: Callable, *args,
                timeout: float = CHECK_TIMEOUT_S, hide_internals: bool = False,
                init_process_group: bool = True) -> list[Any]:
    """Run a case in ``world_size`` ranks with the student's function and judge it.

    ``case`` is a :class:`Case` (observe in the ranks, judge here) or an older ``rank_check(rank,
    world_size, student_fn, *args)`` that judges inside the ranks. ``init_process_group=False``:
    processes with torchrun's variables but no group yet. Returns the ranks' observations (or
    their return values).
    """
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    if isinstance(student_fn, RemoteFunction) and not isinstance(case, Case):
        raise TypeError(f"{getattr(case, '__name__', case)} judges inside the ranks: a submitted "
                        "function can only be graded by a Case")
    if isinstance(case, Case) and isinstance(student_fn, RemoteFunction):
        try:
            observations = student_fn.observe(case.observe, world_size, args, timeout,
                                              init_process_group, case.audit_traffic,
                                              rendezvous=case.rendezvous)
        except RankError as err:
            raise CheckFailed(explain(err, hide_internals, timeout)) from None
        case.judge(observations, world_size, *args)
        return observations
    integrity.assert_untampered()
    if not callable(student_fn) and not (isinstance(student_fn, tuple)
                                         and all(map(callable, student_fn))):
        raise CheckFailed(f"expected a function, got {type(student_fn).__name__}")
    try:
        payload = pickle_by_value(student_fn)
    except Exception as exc:
        raise CheckFailed(
            f"{getattr(student_fn, '__name__', 'your function')} cannot be sent to the ranks "
            f"({type(exc).__name__}: {exc}); it must not use locks, open files or sockets "
            "created outside it"
        ) from None
    observe = case.observe if isinstance(case, Case) else case
    try:
        results = run_observation(observe, world_size, payload, args, timeout, init_process_group)
    except RankError as err:
        raise CheckFailed(explain(err, hide_internals, timeout)) from None
    wrong = [(rank, r.message) for rank, r in enumerate(results)
             if isinstance(r, _WrongResult) and r.message != _PEER_FAILED]
    if wrong:
        raise CheckFailed(by_rank(wrong))
    if isinstance(case, Case):
        case.judge(results, world_size, *args)
    return results


def run_observation(observe: Callable[..., Any], world_size: int, payload: bytes, args: tuple,
                    timeout: float, init_process_group: bool = True) -> list[Any]:
    """``observe(rank, world_size, student_fn, *args)`` in fresh ranks, the student's function
    rebuilt from ``payload`` in each rank; every rank's result, or RankError."""
    # gloo also on GPU machines: the checks build CPU tensors, which NCCL cannot reduce.
    return run_ranks(_in_rank, world_size, observe, payload, args, timeout=timeout, seed=0,
                     max_output_bytes=20_000, backend="gloo",
                     init_process_group=init_process_group)


_PEER_FAILED = "(stopped: another rank's check failed)"


def agree(problem: str | None) -> None:
    """Make a failed check end the case on EVERY rank, not only on the rank that noticed.

    Call it at the same point on every rank, outside the student's code: a rank that stopped
    alone would leave its peers waiting forever in their next collective (and the student would
    read "deadlock" instead of what was wrong). Needs the default process group.
    """
    failed = torch.tensor([0 if problem is None else 1])
    dist.all_reduce(failed)
    if problem is not None:
        raise CheckFailed(problem)
    if failed.item():
        raise CheckFailed(_PEER_FAILED)


def agree_on(check: Callable[..., Any], *args) -> None:
    """Run ``check(*args)`` (which raises CheckFailed when wrong), then :func:`agree`."""
    try:
        check(*args)
    except CheckFailed as failed:
        agree(str(failed))
    else:
        agree(None)


def group_problem(rank, world_size, what) -> str | None:
    """A real all-reduce after the student's call: None if the group still works, else what
    went wrong (a rank that skipped or added a collective leaves its peers out of step)."""
    probe = torch.arange(4, dtype=torch.float64) + rank
    try:
        dist.all_reduce(probe)
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        return (f"after {what}, the process group is unusable: a real all_reduce raised "
                f"{type(exc).__name__}: {exc}")
    expected = world_size * torch.arange(4, dtype=torch.float64) + world_size * (world_size - 1) / 2
    if not torch.equal(probe, expected):
        return (f"after {what}, a real all_reduce gave {probe.tolist()} instead of "
                f"{expected.tolist()}: is a collective of yours still pending?")
    return None


class _WrongResult:
    """A rank's failed check, returned (not raised) so that every rank gets to report."""

    def __init__(self, message: str):
        self.message = message


def _in_rank(rank: int, world_size: int, rank_check, payload: bytes, args: tuple):
    student_fn = pickle.loads(payload)
    try:
        return rank_check(rank, world_size, student_fn, *args)
    except CheckFailed as failed:
        return _WrongResult(str(failed))


def explain(err: RankError, hide_internals: bool, timeout: float) -> str:
    """What each failed rank did, for the student; ``timeout`` is the deadline the ranks had.

    Frames of the grader's own code (this package, the autograder, the launcher) are left out of
    every traceback and stack, visible checks' and hidden ones' alike (``hide_internals`` is
    kept for the callers that pass it): their paths, line numbers and arguments say nothing about
    the student's code. A rank that timed out while waiting in the check's own collective, after
    the student's function had returned, is said to be so, not blamed for the hang."""
    failures = [failure for failure in err.failures if failure.kind != "stopped"]
    if not failures:  # every rank "stopped": the launcher ended them all (its deadline)
        return "\n".join(failure.headline() for failure in err.failures)
    text = by_rank([(failure.rank, _explain_one(failure, timeout)) for failure in failures])
    if any(failure.kind == "timeout" for failure in failures):
        text += "\n" + TIMEOUT_HINT
    return text


def by_rank(messages: Sequence[tuple[int, str]]) -> str:
    """``rank R: why`` for each rank's message, where ranks with the same message share one
    line (``ranks 0 and 1: why``), in the order of their first rank: a student reads each
    failure once, and still sees whether one rank or all of them went wrong."""
    ranks: dict[str, list[int]] = {}
    for rank, message in messages:
        ranks.setdefault(message, []).append(rank)
    return "\n".join(f"{_ranks_text(same)}: {message}" for message, same in ranks.items())


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


TIMEOUT_HINT = (
    "A deadlock? Every send needs a matching recv on the peer, and every rank must make the same "
    "collectives in the same order: a collective that not every rank calls (e.g. one inside "
    "`if rank == 0`) waits forever. Or an endless loop.")


def _explain_one(failure: RankFailure, timeout: float) -> str:
    """What one rank did, without its "rank R: " (see :func:`by_rank`)."""
    if failure.kind == "raised" and failure.exc_type in ("CheckFailed", "TamperingError"):
        return failure.message
    if failure.kind == "raised":
        return (f"your code raised {failure.exc_type}: {failure.message}\n"
                f"{without_grader_frames(failure.traceback)}")
    if failure.kind == "timeout":
        waiting_in = grader_collective_waited_in(failure.stack)
        if waiting_in:
            return (f"did not finish within {timeout:g} s, but not in your code: your "
                    f"function had returned, and it was waiting in the check's own "
                    f"{waiting_in}, which every rank makes after your function, for the ranks "
                    "still in your code (or for a collective your code left pending)")
        stack = without_grader_frames(_CURRENT_THREAD.sub("", failure.stack))
        if not ran_student_code(failure.stack):
            return (f"did not finish within {timeout:g} s, and was not in your code: it "
                    "had not reached your function yet (starting up on a busy machine?). Where "
                    f"it was (innermost frame first):\n{stack}")
        return (f"did not finish within {timeout:g} s. Where it was (innermost frame "
                f"first):\n{stack}")
    return failure.message or failure.headline()


# --- the grader's frames, told apart from the student's and the libraries' -----------------------

_COURSE_ROOT = Path(__file__).resolve().parents[2]
_GRADER_DIRS = tuple(str(_COURSE_ROOT / part) + os.sep for part in ("ddpcourse", "autograder"))
# The grader's broker stands in for gloo when a class is graded: its frames are communication.
_COMMUNICATION_FILES = (os.path.join("torch", "distributed") + os.sep,
                        os.path.join("ddpcourse", "grading", "relay.py"))
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "purelib",
                                                                          "platlib")})
_HIDDEN_PATH_MARK = HIDDEN_PACKAGE.replace(".", os.sep) + os.sep  # wherever they are installed
_CURRENT_THREAD = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):\n",
                             re.MULTILINE)
_FRAME = re.compile(r'^(\s*)File "([^"]+)", line (\d+)(,? in .*)$')


def _frame_kind(path: str) -> str:
    """"communication", "grader", "library" or "student" (anything else: a notebook cell, or a
    module the student wrote)."""
    if any(part in path for part in _COMMUNICATION_FILES):
        return "communication"
    if path.startswith(_GRADER_DIRS) or _HIDDEN_PATH_MARK in path:
        return "grader"
    if path.startswith(_LIBRARY_DIRS) or path.startswith("<frozen"):
        return "library"
    return "student"


def _short_path(path: str) -> str:
    """A library's file relative to where it is installed (``torch/distributed/...``)."""
    for directory in sorted(_LIBRARY_DIRS, key=len, reverse=True):
        if path.startswith(directory):
            return path[len(directory):]
    return path


def without_grader_frames(text: str) -> str:
    """A traceback (``File "...", line N, in f`` and its source line) or a faulthandler stack
    (``File "...", line N in f``) without the grader's frames, library paths shortened."""
    kept, skipping = [], False
    for line in text.splitlines():
        match = _FRAME.match(line)
        if match:
            indent, path, number, rest = match.groups()
            skipping = _frame_kind(path) == "grader"
            line = f'{indent}File "{_short_path(path)}", line {number}{rest}'
        elif not line.startswith((" ", "\t")):
            skipping = False  # a thread's header, "Traceback ...", or the exception's own line
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def ran_student_code(stack: str) -> bool:
    """Whether any thread of a stack is in the student's code, or the stack is unknown (then
    the rank is not said to be elsewhere)."""
    frames = [_FRAME.match(line) for line in stack.splitlines()]
    paths = [match.group(2) for match in frames if match]
    return not paths or any(_frame_kind(path) == "student" for path in paths)


def grader_collective_waited_in(stack: str) -> str | None:
    """The collective a timed-out rank was waiting in (``all_reduce (probe_group)``: the
    collective, and the grader's function that made it) when that wait was the grader's own,
    after the student's function had returned: the main thread's innermost frames are
    communication, and the first frame outside the libraries is the grader's. None otherwise
    (the rank was in the student's code, or starting)."""
    main_thread = stack.split("\nThread 0x")[0]
    collective = None
    for line in main_thread.splitlines():  # innermost first
        match = _FRAME.match(line)
        if not match:
            continue
        path, function = match.group(2), match.group(4).split(" in ", 1)[-1].strip()
        kind = _frame_kind(path)
        if kind == "communication":
            if not function.startswith("_") and function not in ("wrapper", "wait"):
                collective = function
        elif kind == "grader":
            return f"{collective} ({function})" if collective else None
        elif kind == "student":
            return None
    return None


def observed(observation: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    """``observation[key]`` when it is of ``kind``; CheckFailed otherwise. Observations of a graded
    class come from ranks that ran the student's code, so a judge reads them only through this."""
    if not isinstance(observation, dict) or key not in observation:
        raise CheckFailed(f"the rank's report lacks {key!r} (did the code replace the check's own "
                          "functions?)")
    value = observation[key]
    if not isinstance(value, kind):
        raise CheckFailed(f"the rank's report has {key!r} of type {type(value).__name__}")
    return value


def reported_tensors(state: dict, want: dict[str, torch.Tensor], whose: str) -> dict:
    """A rank's report of named tensors (a model's parameters and buffers, say), read as untrusted
    data: exactly the names of ``want``, each a dense CPU tensor of its dtype and shape.
    ``whose`` starts each message, e.g. "2 ranks, step 3: the head's"."""
    if set(state) != set(want):
        raise CheckFailed(f"{whose} state holds {cut_text(sorted(map(str, state)), 300)}, "
                          f"expected {sorted(want)}")
    for name, expected in want.items():
        got = state[name]
        if (not isinstance(got, torch.Tensor) or got.layout != torch.strided
                or got.device.type != "cpu" or got.shape != expected.shape
                or got.dtype != expected.dtype):
            raise CheckFailed(f"{whose} {name!r} is not a {expected.dtype} tensor of shape "
                              f"{tuple(expected.shape)} (the rank's report has {type_name(got)})")
    return state


def judge_each_rank(observations: Sequence[Any], judge_rank: Callable[[int, Any], None]) -> None:
    """Call ``judge_rank(rank, observation)`` for every rank; one CheckFailed listing every rank
    that failed (:func:`by_rank`), so a student sees whether one rank or all of them went wrong."""
    wrong = []
    for rank, observation in enumerate(observations):
        try:
            judge_rank(rank, observation)
        except CheckFailed as failed:
            wrong.append((rank, str(failed)))
    if wrong:
        raise CheckFailed(by_rank(wrong))


def cut_text(text: Any, limit: int) -> str:
    """``str(text)`` with at most ``limit`` characters (and "..." when cut)."""
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def safe_text(make: Callable[[], Any], limit: int) -> str:
    """``make()`` as text, or why not: str() and repr() of a student's object run its code."""
    try:
        return cut_text(make(), limit)
    except Exception as exc:  # noqa: BLE001 - the text is only shown
        return f"(cannot be shown: {type(exc).__name__})"


def reported_calls(observation: Any, count: int) -> list:
    """The ``calls`` a rank reported, which must be ``count``: one per call the case made."""
    calls = observed(observation, "calls", list)
    if len(calls) != count:
        raise CheckFailed(f"the rank's report has {len(calls)} calls instead of {count} (did the "
                          "code replace the check's own functions?)")
    return calls


def every_ranks_calls(observations: Sequence[Any], count: int) -> list[list[dict]]:
    """Every rank's ``calls`` (see :func:`reported_calls`), each a dict, indexed ``[rank][call]``;
    one CheckFailed naming every rank whose report is not that."""
    reports: list = []

    def read(rank, observation):
        calls = reported_calls(observation, count)
        for call in calls:
            if not isinstance(call, dict):
                raise CheckFailed(f"the rank's report of a call is a {type_name(call)}")
        reports.append(calls)

    judge_each_rank(observations, read)
    return reports


def type_name(value: Any) -> str:
    """How an observation names a returned value (never the object itself: it could be the
    student's)."""
    return "None" if value is None else type(value).__name__


def expect_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-5,
                 atol: float = 1e-6, world_size: int | None = None) -> None:
    """Raise CheckFailed saying where and by how much ``actual`` differs from ``expected``.

    ``expected`` a mean over ``world_size`` ranks: a result that is exactly ``world_size`` times
    it (a sum) is said to be so, with the question the student should ask."""
    if actual.shape != expected.shape:
        raise CheckFailed(f"{what}: expected shape {tuple(expected.shape)}, got "
                          f"{tuple(actual.shape)}")
    if actual.dtype != expected.dtype:
        raise CheckFailed(f"{what}: expected dtype {expected.dtype}, got {actual.dtype}")
    if expected.dtype.is_floating_point:
        ok = torch.allclose(actual, expected, rtol=rtol, atol=atol)
    else:
        ok = torch.equal(actual, expected)
    if not ok:
        diff = (actual.double() - expected.double()).abs()
        worst = int(diff.reshape(-1).argmax())
        raise CheckFailed(
            f"{what}: expected {_preview(expected)}, got {_preview(actual)} (largest difference "
            f"{diff.reshape(-1)[worst].item():.3g} at flat index {worst})"
            + (divide_hint(world_size) if is_multiple(actual, expected, world_size, rtol, atol)
               else "")
        )


def divide_hint(world_size: int) -> str:
    return (f"; that is exactly {world_size} times the expected value, and {world_size} is the "
            "world size: did you divide the sum?")


def is_multiple(actual: torch.Tensor, expected: torch.Tensor, factor: int | None, rtol: float,
                atol: float) -> bool:
    """Whether ``actual`` is ``factor`` times ``expected`` (floats, to the given tolerance)
    while differing from it: a sum where a mean was due."""
    if not factor or factor < 2 or not expected.dtype.is_floating_point:
        return False
    scaled = expected.double() * factor
    return (not torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=atol)
            and torch.allclose(actual.double(), scaled, rtol=rtol, atol=atol * factor))


def _preview(t: torch.Tensor, n: int = 6) -> str:
    flat = t.reshape(-1)
    values = ", ".join(f"{v:.4g}" if t.dtype.is_floating_point else str(int(v))
                       for v in flat[:n].tolist())
    return f"[{values}{', ...' if flat.numel() > n else ''}]"


def ring_traffic_bounds(numel: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """Bytes one rank may send in a bandwidth-optimal all-reduce of ``numel`` elements.

    A ring sends every chunk but one in reduce-scatter and again in all-gather:
    2 * (numel - one chunk) elements, i.e. about 2(N-1)/N of the tensor. The upper bound allows
    25% over that ideal plus one element per step for uneven chunks; sending the whole tensor to
    each of N-1 peers, (N-1)/(2(N-1)/N) = N/2 times the ideal, exceeds it from N = 3 on (at N = 2
    the two are the same thing).
    """
    if world_size == 1:
        return 0, 0
    ideal = 2 * (world_size - 1) / world_size * numel * itemsize
    lower = 2 * (numel - math.ceil(numel / world_size)) * itemsize
    upper = int(1.25 * ideal) + 2 * (world_size - 1) * itemsize
    return lower, upper
