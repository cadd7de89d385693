# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise 00: a health check for a new machine
#
# The source article's environment check calls `init_process_group("nccl", ..., world_size=1)`,
# prints `OK` under the comment *"test NCCL bandwidth (should be above 12 GB/s)"*, and that is all.
# With one rank nobody sends a byte to anybody, and no collective runs: the check can only pass.
# Chapter 00 showed it (`chapters/00_setup/one_rank_all_reduce.py`). Here you write the two pieces
# of a check that means something: the bandwidth figures NVIDIA's `nccl-tests` report, and an
# all-reduce self-test that **fails when the all-reduce is wrong**.
#
# **How your code runs.** The tests call your functions in fresh processes started by the
# course's launcher. `all_reduce_self_test` is called on every rank of a real process group
# (gloo), like a function you give to `run_ranks(fn, world_size)`: use the default group
# (`dist.get_rank()`, `dist.all_reduce(...)`), never `init_process_group` in this notebook.
#
# **Self-check** from the repository root: `pytest exercises/00_setup`. Hidden tests (edge cases)
# run when the notebook is graded. Keep function names and signatures exactly as given, and do not
# reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import health_check as checks
from ddpcourse.launcher import run_ranks

setup_notebook("health_check")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-bus-bandwidth", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 1. `bus_bandwidth(collective, nbytes, seconds, world_size) -> (algbw, busbw)` (3 points)
#
# NVIDIA's `nccl-tests` print two figures for every collective they time: the algorithm bandwidth
# and the bus bandwidth, defined in their
# [doc/PERFORMANCE.md](https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).
# Implement `bus_bandwidth` as its docstring below says: the definitions, each collective's factor,
# what raises `ValueError`, and what you may not call.
#
# Why the factor: an all-reduce needs `2(n-1)` transfers per element spread over `n` links, so
# `busbw` is comparable to a link's rated speed whatever `n` is. For `n = 1` the all-reduce factor
# is 0: a one-rank all-reduce moves nothing, exactly what is wrong with the article's check.

# %% nbgrader={"grade": false, "grade_id": "bus-bandwidth", "locked": false, "schema_version": 3, "solution": true, "task": false}
def bus_bandwidth(collective: str, nbytes: int, seconds: float,
                  world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) by nccl-tests' definitions.

    The two figures `nccl-tests` prints for one collective of `nbytes` bytes that took `seconds` on
    `world_size` ranks, by the definitions of its doc/PERFORMANCE.md:

    * algorithm bandwidth `algbw = S / t`, with `S = nbytes`, `t = seconds`;
    * bus bandwidth `busbw = algbw * factor(n)`, `n = world_size`, with the factor of its summary:

      | `collective`              | factor     | what `nbytes` (`S`) is                       |
      |---------------------------|------------|----------------------------------------------|
      | `"all_reduce"`            | `2(n-1)/n` | the tensor being reduced                     |
      | `"reduce_scatter"`        | `(n-1)/n`  | the whole input (n times each rank's output) |
      | `"all_gather"`            | `(n-1)/n`  | the whole output (n times each rank's input) |
      | `"broadcast"`, `"reduce"` | `1`        | the tensor sent from / reduced to the root   |
      | `"all_to_all"`            | `(n-1)/n`  | each rank's whole send buffer (n blocks)     |

    Write the arithmetic yourself: `ddpcourse.doctor` computes the all-reduce figures, and the tests
    run this function with a profiler hook and fail it if any function of the `ddpcourse` package
    runs during the call, however it was imported.

    Args:
        collective: exactly one of the six names in the table.
        nbytes: `S`, as the table says for `collective`; `nbytes = 0` is allowed (0 GB/s).
        seconds: `t`, how long the collective took; positive.
        world_size: `n`, the number of ranks; at least 1.

    Returns:
        `(algbw, busbw)`, a tuple of two floats in GB/s = 10^9 bytes/s (not GiB/s). Values are
        compared with a relative tolerance of 1e-9.

    Raises:
        ValueError: for any other `collective` name, `world_size < 1`, `seconds <= 0` or
            `nbytes < 0`.
    """
    ### BEGIN SOLUTION
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, not {seconds}")
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, not {nbytes}")
    n = world_size
    if collective == "all_reduce":
        factor = 2 * (n - 1) / n  # 2(n-1) transfers per element over n links
    elif collective in ("reduce_scatter", "all_gather", "all_to_all"):
        factor = (n - 1) / n  # half an all-reduce; S is the whole (n-block) buffer
    elif collective in ("broadcast", "reduce"):
        factor = 1.0  # everything leaves / reaches the root through its one link
    else:
        raise ValueError(f"unknown collective {collective!r}")
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * factor
    ### END SOLUTION


# %%
# Try it: 4 MiB all-reduced in 5 ms on 1, 2, 4 and 8 ranks.
for n in (1, 2, 4, 8):
    print(n, bus_bandwidth("all_reduce", 4 * 2**20, 5e-3, n))

# %% nbgrader={"grade": true, "grade_id": "test-bus-bandwidth-all-reduce", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): all_reduce on 1, 2, 4 and 8 ranks, in GB/s.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import health_check as checks
integrity.assert_untampered()
checks.check_bus_bandwidth_all_reduce(bus_bandwidth)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-bus-bandwidth-other-collectives", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): reduce_scatter, all_gather, broadcast, reduce; ValueError for bad input.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import health_check as checks
integrity.assert_untampered()
checks.check_bus_bandwidth_other_collectives(bus_bandwidth)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-bus-bandwidth-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) all_to_all, one rank for every collective, edge values, misspelt names.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import health_check as hidden
hidden.check_bus_bandwidth(bus_bandwidth)
print("passed")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-all-reduce-self-test", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 2. `all_reduce_self_test() -> bool` (4 points)
#
# The article's check prints `OK` whatever happens. This one runs a real all-reduce and checks its
# result, so that a broken all-reduce shows: implement `all_reduce_self_test` as its docstring below
# says. The tests break the all-reduce in several ways and expect your function to notice each
# time. A health check that cannot fail is useless.
#
# Hint: integers or exactly representable floats make "exactly right" exact.

# %% nbgrader={"grade": false, "grade_id": "all-reduce-self-test", "locked": false, "schema_version": 3, "solution": true, "task": false}
def all_reduce_self_test() -> bool:
    """All-reduce a known pattern; True iff this rank's result is exactly the expected sum.

    Called on every rank of an initialised process group (the default group). Do one real
    all-reduce (SUM) with `dist.all_reduce` of a tensor whose correct sum this rank can compute by
    itself, and decide from this rank's result only: do not ask the other ranks.

    * Use values that differ per rank and per element, over several elements, so that a missing
      rank, a shifted or a half-wrong result changes something you look at. (The popular
      `ones * rank` lets rank 0 contribute zeros, so a rank 0 that sends nothing goes unnoticed.)
    * Print at most one line per rank, and leave the group usable (the tests run a real all-reduce
      after yours).

    Returns:
        A Python `bool`, not a tensor: `True` if and only if this rank's result is exactly right.
        On 2, 3 and 4 ranks it must be `True` everywhere. When the tests corrupt the all-reduce
        inside the ranks (whichever way you call it) after the real one has run - it does nothing,
        averages instead of sums, is wrong on one rank only, is wrong in the last element only,
        leaves out rank 0's contribution, or delivers the right values one position off - it must
        be `False` on exactly the ranks whose result was damaged, `True` on the others.

    Raises:
        ValueError: with a world size below 2: the all-reduce would test nothing.
    """
    ### BEGIN SOLUTION
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < 2:
        raise ValueError(f"a self-test needs at least 2 ranks, this group has {world_size}")
    pattern = torch.arange(1, 17, dtype=torch.float64)  # 1..16: exact in float64
    tensor = (rank + 1) * pattern
    dist.all_reduce(tensor)
    expected = world_size * (world_size + 1) // 2 * pattern
    return torch.equal(tensor, expected)
    ### END SOLUTION


# %%
# Try it: every rank should say True.
def try_self_test(rank, world_size):
    return all_reduce_self_test()

run_ranks(try_self_test, 3, timeout=15, backend="gloo")  # CPU tensors: gloo, also on GPUs

# %% nbgrader={"grade": true, "grade_id": "test-self-test-healthy-group", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): True on every rank of 2, 3 and 4; ValueError on a group of one.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import health_check as checks
integrity.assert_untampered()
checks.check_self_test_passes_on_a_healthy_group(all_reduce_self_test)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-self-test-broken-all-reduce", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 3 ranks: an all-reduce that does nothing; one wrong on one rank only.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import health_check as checks
integrity.assert_untampered()
checks.check_self_test_catches_a_broken_all_reduce(all_reduce_self_test)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-self-test-hidden", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (2 points) every corruption on 2 and 4 ranks, output, and a usable group afterwards.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import health_check as hidden
hidden.check_all_reduce_self_test(all_reduce_self_test)
print("passed")
### END HIDDEN TESTS
