"""Chapter 00, setup: visible checks for ``bus_bandwidth`` and ``all_reduce_self_test``.

The contract is the docstrings of ``bus_bandwidth`` and ``all_reduce_self_test`` in
solutions/00_setup/health_check.nb.py (students: exercises/00_setup/health_check.ipynb).

* ``bus_bandwidth`` must be the student's own arithmetic: the check runs it in a fresh rank with a
  profiler hook that fails it if any function of the ``ddpcourse`` package (``ddpcourse.doctor``
  computes the same figures) runs during the call.
* ``all_reduce_self_test`` runs on every rank of the default group: the check runs it once as is,
  then with the all-reduce corrupted inside the ranks (:class:`CorruptAllReduce`), and wants False
  on exactly the ranks whose result was wrong.
"""

from __future__ import annotations

import contextlib
import io
import math
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import ddpcourse
from ddpcourse.grading.checks import CheckFailed, group_problem, run_student
from ddpcourse.grading.forbidden import call_watching

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


def _own_code_call(bus_bandwidth, args):
    """Call the student's function, output dropped; return (result, exception).

    Fails the check if any function of the ``ddpcourse`` package runs during the call:
    ``ddpcourse.doctor`` computes these figures, and importing it is not the exercise."""
    watched = call_watching(bus_bandwidth, args, {}, _PACKAGE_DIR)
    if watched.forbidden_calls:
        raise CheckFailed(f"bus_bandwidth{args} called {sorted(watched.forbidden_calls)} from the "
                          "course's package: write the formulas yourself (ddpcourse.doctor "
                          "computes them; using it is not the exercise)")
    if watched.hook_removed:
        raise CheckFailed(f"bus_bandwidth{args} changed the profile hook (sys.setprofile) the "
                          "check watches with: leave it alone")
    return watched.result, watched.exception


def bandwidth_cases_case(rank, world_size, bus_bandwidth, cases, errors):
    """In a fresh process: each case ``(collective, nbytes, seconds, n)`` must give nccl-tests'
    (algbw, busbw) in GB/s; each ``(args, what)`` in ``errors`` must raise ValueError."""
    for args in cases:
        got, exc = _own_code_call(bus_bandwidth, args)
        expected = reference_bandwidth(*args)
        shown = f"bus_bandwidth{args}"
        if exc is not None:
            raise CheckFailed(f"{shown}: expected (algbw, busbw) = ({expected[0]:.6g}, "
                              f"{expected[1]:.6g}) GB/s, but it raised {type(exc).__name__}: {exc}")
        if (not isinstance(got, tuple) or len(got) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in got)):
            raise CheckFailed(f"{shown}: expected a tuple of two floats (algbw, busbw), got "
                              f"{got!r} ({type(got).__name__})")
        for name, value, want in zip(("algbw", "busbw"), got, expected):
            if not math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-12):
                hint = ""
                if math.isclose(value, want * 1e9, rel_tol=1e-9):
                    hint = " (that is bytes/s: the unit is GB/s = 1e9 bytes/s)"
                elif math.isclose(value, want * 1e9 / 2**30, rel_tol=1e-9):
                    hint = " (that is GiB/s: nccl-tests' GB/s is 1e9 bytes/s)"
                raise CheckFailed(f"{shown}: expected {name} = {want:.6g} GB/s, got "
                                  f"{value!r}{hint}")
    for args, what in errors:
        got, exc = _own_code_call(bus_bandwidth, args)
        if exc is None:
            raise CheckFailed(f"bus_bandwidth{args} ({what}): expected ValueError, got {got!r}")
        if not isinstance(exc, ValueError):
            raise CheckFailed(f"bus_bandwidth{args} ({what}): expected ValueError, got "
                              f"{type(exc).__name__}: {exc}")
    return len(cases) + len(errors)


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
    run_student(bandwidth_cases_case, 1, bus_bandwidth, ALL_REDUCE_CASES, [],
                init_process_group=False)


def check_bus_bandwidth_other_collectives(bus_bandwidth) -> None:
    run_student(bandwidth_cases_case, 1, bus_bandwidth, OTHER_CASES, ERROR_CASES,
                init_process_group=False)


# --- all_reduce_self_test ---------------------------------------------------------------------

CORRUPTIONS = {
    "no-op": "the all-reduce does nothing (every rank keeps its own values)",
    "average": "the all-reduce averages instead of summing",
    "one-rank": "the result is wrong in one element on the last rank only",
    "last-element": "the result is wrong in its last element on every rank",
    "rank-0-dropped": "rank 0's contribution is missing from the sum",
    "shifted": "the right values arrive one position off (rolled by one element)",
}
_C10D_ALL_REDUCES = {"allreduce_", "allreduce_coalesced_"}
_FUNCTIONAL_ALL_REDUCES = {"all_reduce", "all_reduce_", "all_reduce_coalesced",
                           "all_reduce_coalesced_"}


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
        is_c10d = namespace == "c10d" and op in _C10D_ALL_REDUCES
        is_functional = namespace == "_c10d_functional" and op in _FUNCTIONAL_ALL_REDUCES
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

    def affects(self, rank: int, world_size: int) -> bool:
        """Whether this corruption makes this rank's result wrong (for honest test values)."""
        if self.kind == "one-rank":
            return rank == world_size - 1
        return self.kind is not None


def self_test_case(rank, world_size, all_reduce_self_test, corruption=None):
    """Run the student's self-test (with the all-reduce corrupted, if asked); it must return True
    exactly where the result was right, print at most one line, and leave the group usable."""
    mode = CorruptAllReduce(corruption)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        with mode:
            result = all_reduce_self_test()
    what = (f"all_reduce_self_test() on rank {rank} of {world_size}"
            + (f", when {CORRUPTIONS[corruption]}" if corruption else ""))
    problem = _judge(result, mode, printed.getvalue(), rank, world_size, corruption, what)
    # Every rank reaches this all-reduce, also one whose answer was wrong: a rank that left
    # early would leave the others waiting for it.
    unusable = group_problem(rank, world_size, what)
    if problem or unusable:
        raise CheckFailed(problem or unusable)
    return result


def _judge(result, mode, printed, rank, world_size, corruption, what) -> str | None:
    lines = printed.splitlines()
    if len(lines) > 1:
        return (f"{what}: printed {len(lines)} lines; at most one line per rank, please "
                f"(first ones: {lines[:3]})")
    if mode.calls == 0:
        return (f"{what}: made no all_reduce at all (the tests corrupt the all-reduce to see "
                "whether your check notices; use dist.all_reduce)")
    if not isinstance(result, bool):
        return (f"{what}: must return a Python bool (True/False), got "
                f"{type(result).__name__}: {result!r}")
    wrong = mode.affects(rank, world_size)
    if wrong and result:
        return (f"{what}: this rank's all-reduce result was WRONG, but your function returned "
                "True. A health check that cannot fail is useless: compare every element with "
                "the exact sum you expect")
    if not wrong and not result:
        return (f"{what}: this rank's all-reduce result was right"
                + (" (only another rank's was damaged)" if corruption else "")
                + ", but your function returned False")
    return None


def single_rank_case(rank, world_size, all_reduce_self_test):
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = all_reduce_self_test()
    except ValueError:
        return "ValueError"
    raise CheckFailed(f"all_reduce_self_test() in a group of ONE rank returned {result!r}; it "
                      "must raise ValueError: an all-reduce over one rank moves nothing and "
                      "tests nothing (the article's world_size=1 check)")


def check_self_test_passes_on_a_healthy_group(all_reduce_self_test) -> None:
    for world_size in (2, 3, 4):
        run_student(self_test_case, world_size, all_reduce_self_test)
    run_student(single_rank_case, 1, all_reduce_self_test)


def check_self_test_catches_a_broken_all_reduce(all_reduce_self_test) -> None:
    for corruption in ("no-op", "one-rank"):
        run_student(self_test_case, 3, all_reduce_self_test, corruption)
