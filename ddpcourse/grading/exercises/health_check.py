"""Chapter 00, setup: visible checks for ``bus_bandwidth`` and ``all_reduce_self_test``.

The contract is the docstrings of ``bus_bandwidth`` and ``all_reduce_self_test`` in
solutions/00_setup/health_check.nb.py (students: exercises/00_setup/health_check.ipynb).

Every check runs :class:`~ddpcourse.grading.checks.Case` s: the ranks only record, the judge
recomputes the reference and decides.

* ``bus_bandwidth`` must be the student's own arithmetic: the rank runs it in a fresh process with
  a profiler hook that records any function of the ``ddpcourse`` package (``ddpcourse.doctor``
  computes the same figures) that runs during the call, and reports the returned numbers (or the
  exception) as data; the judge recomputes nccl-tests' figures from the arguments it chose. No
  timing is measured here: the seconds are arguments, so the reference is exact.
* ``all_reduce_self_test`` runs on every rank of the default group: the check runs it once as is,
  then with the all-reduce corrupted inside the ranks (:class:`CorruptAllReduce`); the rank reports
  what the function returned, what it printed, how many all-reduces it made and a real
  all-reduce's result after it, and the judge, knowing which corruption it asked for, wants False
  on exactly the ranks whose result it made wrong.

The forbidden calls seen, whether the profile hook was removed and the number of all-reduces are
facts of the rank's own process: they are reported by the rank and so could be forged by a
determined student (whose code ran in that process). The judge still recomputes every value it
can: the bandwidths from the arguments, which ranks' results were damaged from the corruption.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import ddpcourse
from ddpcourse.grading.checks import (Case, CheckFailed, judge_each_rank, observed, run_student,
                                      type_name)
from ddpcourse.grading.collective_names import public_name
from ddpcourse.grading.forbidden import call_watching

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
_MAX_TEXT = 300  # of a text a rank reports, in a message


def _text(value: Any, limit: int = _MAX_TEXT) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- bus_bandwidth ----------------------------------------------------------------------------

BUS_FACTORS = {  # nccl-tests doc/PERFORMANCE.md, "Summary"
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
_PACKAGE_DIR = os.path.dirname(os.path.abspath(ddpcourse.__file__)) + os.sep


def reference_bandwidth(collective: str, nbytes: int, seconds: float, world_size: int):
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * BUS_FACTORS[collective](world_size)


def _number(value: Any) -> int | float | None:
    """A returned number as plain data (None for anything else, bools included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if isinstance(value, float) else int(value)


def observe_bandwidth_call(bus_bandwidth, args) -> dict:
    """One call, watched, its output dropped: what it returned or raised, and which functions of
    the ``ddpcourse`` package ran during it (``ddpcourse.doctor`` computes these figures)."""
    watched = call_watching(bus_bandwidth, args, {}, _PACKAGE_DIR)
    got, exc = watched.result, watched.exception
    pair = isinstance(got, tuple) and len(got) == 2
    return {"forbidden_calls": [_text(name, 200) for name in watched.forbidden_calls[:20]],
            "hook_removed": bool(watched.hook_removed),
            "raised": None if exc is None else type(exc).__name__,
            "value_error": isinstance(exc, ValueError),
            "message": "" if exc is None else _text(exc, 500),
            "type": type_name(got), "repr": _text(repr(got), 500) if exc is None else "",
            "values": [_number(v) for v in got] if pair else None}


def observe_bandwidth(rank, world_size, bus_bandwidth, cases, errors):
    """In a fresh process: every case's and every error case's call, as data."""
    return {"cases": [observe_bandwidth_call(bus_bandwidth, tuple(args)) for args in cases],
            "errors": [observe_bandwidth_call(bus_bandwidth, tuple(args)) for args, _ in errors]}


def expect_own_code(call: Any, shown: str) -> dict:
    """The rank's report of one call, when it shows no forbidden shortcut (reported by the rank,
    see the module's docstring)."""
    forbidden = observed(call, "forbidden_calls", list)
    if forbidden:
        raise CheckFailed(f"{shown} called {_text(sorted(map(str, forbidden)))} from the "
                          "course's package: write the formulas yourself (ddpcourse.doctor "
                          "computes them; using it is not the exercise)")
    if observed(call, "hook_removed", bool):
        raise CheckFailed(f"{shown} changed the profile hook (sys.setprofile) the check watches "
                          "with: leave it alone")
    return call


def judge_bandwidth(observations, world_size, cases, errors):
    """Each case ``(collective, nbytes, seconds, n)`` must give nccl-tests' (algbw, busbw) in
    GB/s, recomputed here; each ``(args, what)`` in ``errors`` must raise ValueError."""

    def judge_rank(rank, observation):
        calls = observed(observation, "cases", list)
        failures = observed(observation, "errors", list)
        if len(calls) != len(cases) or len(failures) != len(errors):
            raise CheckFailed("the rank's report does not have one entry per call")
        for args, call in zip(cases, calls):
            shown = f"bus_bandwidth{tuple(args)}"
            expect_own_code(call, shown)
            expected = reference_bandwidth(*args)
            raised = observed(call, "raised", (str, type(None)))
            if raised is not None:
                raise CheckFailed(f"{shown}: expected (algbw, busbw) = ({expected[0]:.6g}, "
                                  f"{expected[1]:.6g}) GB/s, but it raised {_text(raised)}: "
                                  f"{_text(observed(call, 'message', str))}")
            values = observed(call, "values", (list, type(None)))
            if (values is None or len(values) != 2 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
                raise CheckFailed(f"{shown}: expected a tuple of two floats (algbw, busbw), got "
                                  f"{_text(observed(call, 'repr', str))} "
                                  f"({_text(observed(call, 'type', str))})")
            for name, value, want in zip(("algbw", "busbw"), values, expected):
                if not math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12):
                    hint = ""
                    if math.isclose(value, want * 1e9, rel_tol=1e-9):
                        hint = " (that is bytes/s: the unit is GB/s = 1e9 bytes/s)"
                    elif math.isclose(value, want * 1e9 / 2**30, rel_tol=1e-9):
                        hint = " (that is GiB/s: nccl-tests' GB/s is 1e9 bytes/s)"
                    raise CheckFailed(f"{shown}: expected {name} = {want:.6g} GB/s, got "
                                      f"{value!r}{hint}")
        for (args, what), call in zip(errors, failures):
            shown = f"bus_bandwidth{tuple(args)}"
            expect_own_code(call, shown)
            raised = observed(call, "raised", (str, type(None)))
            if raised is None:
                raise CheckFailed(f"{shown} ({what}): expected ValueError, got "
                                  f"{_text(observed(call, 'repr', str))}")
            message = observed(call, "message", str)
            if observed(call, "value_error", bool) is not True:
                raise CheckFailed(f"{shown} ({what}): expected ValueError, got {_text(raised)}: "
                                  f"{_text(message)}")

    judge_each_rank(observations, judge_rank)


BANDWIDTH = Case(observe_bandwidth, judge_bandwidth)


ALL_REDUCE_CASES = [
    ("all_reduce", 4 * 2**20, 5e-3, 2),
    ("all_reduce", 4 * 2**20, 5e-3, 4),
    ("all_reduce", 10**9, 0.25, 8),
    ("all_reduce", 2**26, 1e-2, 1),  # one rank: nothing crosses a link, busbw 0
]
OTHER_CASES = [
    ("reduce_scatter", 2**24, 2e-3, 4),
    ("all_gather", 2**24, 2e-3, 4),
    ("broadcast", 2**24, 2e-3, 4),
    ("reduce", 2**24, 2e-3, 4),
]
ERROR_CASES = [
    (("gather", 2**20, 1e-3, 2), "a collective nccl-tests' summary does not define"),
    (("all_reduce", 2**20, 1e-3, 0), "world_size 0"),
    (("all_reduce", 2**20, 0.0, 2), "zero seconds"),
    (("all_reduce", -1, 1e-3, 2), "negative bytes"),
]


def check_bus_bandwidth_all_reduce(bus_bandwidth) -> None:
    run_student(BANDWIDTH, 1, bus_bandwidth, ALL_REDUCE_CASES, [], init_process_group=False)


def check_bus_bandwidth_other_collectives(bus_bandwidth) -> None:
    run_student(BANDWIDTH, 1, bus_bandwidth, OTHER_CASES, ERROR_CASES, init_process_group=False)


# --- all_reduce_self_test ---------------------------------------------------------------------

CORRUPTIONS = {
    "no-op": "the all-reduce does nothing (every rank keeps its own values)",
    "average": "the all-reduce averages instead of summing",
    "one-rank": "the result is wrong in one element on the last rank only",
    "last-element": "the result is wrong in its last element on every rank",
    "rank-0-dropped": "rank 0's contribution is missing from the sum",
    "shifted": "the right values arrive one position off (rolled by one element)",
}


def _perturb(value: torch.Tensor) -> torch.Tensor:
    """A clearly different value: changes by at least 1 and by half its size."""
    if value.dtype == torch.bool:
        return ~value
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return value + 1 + value.abs() / 2
    return value + 1 + value.abs() // 2


class CorruptAllReduce(TorchDispatchMode):
    """Inside ``with CorruptAllReduce(kind):`` every all-reduce of this rank really runs, then its
    result is damaged as :data:`CORRUPTIONS` says. Every API reaches the dispatcher as a ``c10d``
    or ``_c10d_functional`` operator (see comm_audit), so ``dist.all_reduce``, ``from
    torch.distributed import all_reduce``, ``async_op=True`` and the functional collectives are
    all caught. ``calls`` counts the all-reduces."""

    def __init__(self, kind: str | None):
        super().__init__()
        if kind is not None and kind not in CORRUPTIONS:
            raise ValueError(kind)
        self.kind = kind
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, op = str(func).split(".")[:2]
        all_reduce = public_name(op) == "all_reduce"  # every operator of an all-reduce
        is_c10d = namespace == "c10d" and all_reduce
        is_functional = namespace == "_c10d_functional" and all_reduce
        if not (is_c10d or is_functional):
            return func(*args, **(kwargs or {}))
        self.calls += 1
        inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        before = [t.detach().clone() for t in inputs]
        result = func(*args, **(kwargs or {}))
        if is_c10d:
            outputs = list(result[0])
            result[1].wait()  # gloo works asynchronously: let the real sum land first
        else:
            outputs = list(result) if isinstance(result, (list, tuple)) else [result]
            for t in outputs:
                torch.ops._c10d_functional.wait_tensor(t)
        if self.kind is not None:
            for output, own in zip(outputs, before):
                self._damage(output, own)
        return result

    def _damage(self, output: torch.Tensor, own: torch.Tensor) -> None:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        flat = output.view(-1)
        if self.kind == "no-op":
            output.copy_(own)
        elif self.kind == "average":
            if output.dtype.is_floating_point or output.dtype.is_complex:
                output.div_(world_size)
            else:
                output.copy_(torch.div(output, world_size, rounding_mode="trunc"))
        elif self.kind == "one-rank":
            if rank == world_size - 1 and flat.numel():
                middle = flat.numel() // 2
                flat[middle] = _perturb(flat[middle])
        elif self.kind == "last-element":
            if flat.numel():
                flat[-1] = _perturb(flat[-1])
        elif self.kind == "rank-0-dropped":
            first = own.clone()
            dist.broadcast(first, src=0)  # the mode is off in here: a real, uncorrupted call
            output.sub_(first)
        elif self.kind == "shifted":
            flat.copy_(flat.roll(1))



def corruption_affects(corruption: str | None, rank: int, world_size: int) -> bool:
    """Whether this corruption makes this rank's result wrong (for honest test values): what the
    judge knows from the corruption it asked for, whatever the rank reports."""
    if corruption == "one-rank":
        return rank == world_size - 1
    return corruption is not None


def probe_group(rank: int) -> torch.Tensor | str:
    """A real all-reduce after the student's call: its result, or what it raised (a rank that
    skipped or added a collective leaves its peers out of step). Only recorded: judged later."""
    probe = torch.arange(4, dtype=torch.float64) + rank
    try:
        dist.all_reduce(probe)
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        return _text(f"{type(exc).__name__}: {exc}", 500)
    return probe


def observe_self_test(rank, world_size, all_reduce_self_test, corruption=None):
    """Run the student's self-test (with the all-reduce corrupted, if asked); record what it
    returned, what it printed, how many all-reduces it made, and a real all-reduce after it."""
    mode = CorruptAllReduce(corruption)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        with mode:
            result = all_reduce_self_test()
    lines = printed.getvalue().splitlines()
    # Every rank reaches this all-reduce, also one whose answer was wrong: a rank that left
    # early would leave the others waiting for it.
    return {"result": result if isinstance(result, bool) else None,
            "type": type_name(result), "repr": _text(repr(result), 200),
            "lines": len(lines), "first_lines": [_text(line, 200) for line in lines[:3]],
            "all_reduces": mode.calls, "group_after": probe_group(rank)}


def judge_self_test(observations, world_size, corruption=None):
    def judge_rank(rank, observation):
        what = (f"all_reduce_self_test() on rank {rank} of {world_size}"
                + (f", when {CORRUPTIONS[corruption]}" if corruption else ""))
        lines = observed(observation, "lines", int)
        first = [_text(line, 200) for line in observed(observation, "first_lines", list)[:3]]
        kind, shown = observed(observation, "type", str), observed(observation, "repr", str)
        if lines > 1:
            raise CheckFailed(f"{what}: printed {lines} lines; at most one line per rank, please "
                              f"(first ones: {first})")
        if observed(observation, "all_reduces", int) == 0:
            raise CheckFailed(f"{what}: made no all_reduce at all (the tests corrupt the "
                              "all-reduce to see whether your check notices; use "
                              "dist.all_reduce)")
        result = observed(observation, "result", (bool, type(None)))
        if result is None:
            raise CheckFailed(f"{what}: must return a Python bool (True/False), got "
                              f"{_text(kind)}: {_text(shown)}")
        wrong = corruption_affects(corruption, rank, world_size)
        if wrong and result:
            raise CheckFailed(f"{what}: this rank's all-reduce result was WRONG, but your "
                              "function returned True. A health check that cannot fail is "
                              "useless: compare every element with the exact sum you expect")
        if not wrong and not result:
            raise CheckFailed(f"{what}: this rank's all-reduce result was right"
                              + (" (only another rank's was damaged)" if corruption else "")
                              + ", but your function returned False")
        expect_usable_group(observed(observation, "group_after", (str, torch.Tensor)),
                            world_size, what)

    judge_each_rank(observations, judge_rank)


SELF_TEST = Case(observe_self_test, judge_self_test)


def expect_usable_group(probe: Any, world_size: int, what: str) -> None:
    if isinstance(probe, str):
        raise CheckFailed(f"after {what}, the process group is unusable: a real all_reduce "
                          f"raised {_text(probe)}")
    expected = (world_size * torch.arange(4, dtype=torch.float64)
                + world_size * (world_size - 1) / 2)
    if probe.layout != torch.strided or probe.device.type != "cpu":
        raise CheckFailed(f"after {what}, the rank's report of a real all_reduce is not a plain "
                          "tensor")
    if (probe.shape != expected.shape or probe.dtype != expected.dtype
            or not torch.equal(probe, expected)):
        raise CheckFailed(f"after {what}, a real all_reduce gave {_text(probe.tolist())} "
                          f"instead of {expected.tolist()}: is a collective of yours still "
                          "pending?")


def observe_single_rank(rank, world_size, all_reduce_self_test):
    """What the self-test did in a group of one rank: returned what, or raised what."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = all_reduce_self_test()
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - described as data, judged outside the ranks
        return {"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                "repr": ""}
    return {"raised": None, "value_error": False, "repr": _text(repr(result), 200)}


def judge_single_rank(observations, world_size):
    def judge_rank(rank, observation):
        raised = observed(observation, "raised", (str, type(None)))
        shown = observed(observation, "repr", str)
        if observed(observation, "value_error", bool) is not True:
            done = (f"returned {_text(shown)}" if raised is None
                    else f"raised {_text(raised)}")
            raise CheckFailed(f"all_reduce_self_test() in a group of ONE rank {done}; it "
                              "must raise ValueError: an all-reduce over one rank moves nothing "
                              "and tests nothing (the article's world_size=1 check)")

    judge_each_rank(observations, judge_rank)


SINGLE_RANK = Case(observe_single_rank, judge_single_rank)


def check_self_test_passes_on_a_healthy_group(all_reduce_self_test) -> None:
    for world_size in (2, 3, 4):
        run_student(SELF_TEST, world_size, all_reduce_self_test)
    run_student(SINGLE_RANK, 1, all_reduce_self_test)


def check_self_test_catches_a_broken_all_reduce(all_reduce_self_test) -> None:
    for corruption in ("no-op", "one-rank"):
        run_student(SELF_TEST, 3, all_reduce_self_test, corruption)
