"""How the suite runs: how many test processes ``-n auto`` starts, which tests need a GPU (the
``gpu`` marker), and in which order the test files start. ``tests/conftest.py`` applies them."""

from __future__ import annotations

import os
import re

import pytest
import suite_profile

from ddpcourse.launcher import usable_cores

# A test process with its work running keeps about two cores busy (most tests launch two ranks,
# a kernel whose cells launch two ranks, or torchrun with two workers) and holds up to ~3 GiB
# (its two rank servers, a kernel, torch in each rank). Three on 2 cores gained little and cost
# a deadline: a fresh clone's .ci/run took 1274 s (2404 busy core-seconds) against 1314 s and
# 1269 s with two (2276 and 2231), the quiet runs just before and after it; and a graded torchrun
# job with a killed worker missed its 90 s deadline. Two stay.
CORES_PER_WORKER = 2
GIB_PER_WORKER = 3
MAX_WORKERS = 8


def auto_workers(cores: int, memory_gib: float) -> int:
    """Test processes for ``-n auto``: two at least (most tests wait on ranks, kernels and
    launchers, so two overlap well even on 2 cores), then one per two cores and per three GiB,
    at most eight (past that the longest test file alone sets the run's length)."""
    return max(2, min(cores // CORES_PER_WORKER, int(memory_gib // GIB_PER_WORKER), MAX_WORKERS))


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover (not POSIX)
        return 4.0


def this_machines_workers() -> int:
    """:func:`auto_workers` here; ``PYTEST_XDIST_AUTO_NUM_WORKERS`` decides where it is set."""
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return auto_workers(usable_cores(), memory_gib())


# A test that needs a GPU says so in its skip reason ("needs 2 CUDA GPUs ...", "needs one CUDA
# GPU per rank", "need at least one CUDA GPU"); a test of the CPU path ("checks the CPU-only
# path", "this machine has GPUs") does not.
NEEDS_A_GPU = re.compile(r"\bneeds?\b[^;]*\b(?:GPUs?|CUDA)\b", re.IGNORECASE)


def needs_a_gpu(item: pytest.Item) -> bool:
    """Whether one of ``item``'s skipif marks skips it for want of a GPU."""
    return any(NEEDS_A_GPU.search(str(mark.kwargs.get("reason", "")))
               for mark in item.iter_markers("skipif"))


# Files whose tests read what the rest of the run made (the site shows the lessons the notebook
# tests executed): they start after every other file, and wait for what they need.
READ_THE_RUN = ("tests/test_site.py",)


# A file whose tests keep less than half a core busy, on average, mostly waits: on deliberate
# timeouts (a fake class's deadlocked student), on SLURM's scheduler, on ranks that hang on
# purpose. Two such files side by side leave the cores idle (the quiet run of 8826d39 had ~1 of
# its 2 cores idle for 4 minutes while test_autograder.py, test_autograder_regrade.py,
# test_grading_gaming.py and test_slurm_cluster.py ran together).
WAITING_BELOW = 0.5


def longest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests, file by file, in the order the workers should take the files (with
    ``--dist loadfile`` and ``--no-loadscope-reorder``, pyproject.toml). From the committed
    profile, the files fall in two lanes, those that keep the cores busy and those that mostly
    wait (:data:`WAITING_BELOW`), each longest first; the order takes the next file from the lane
    given less wall time so far, so a waiting file runs beside a busy one, not beside another
    waiting one, and no long file starts last. A file not profiled yet counts as the longest,
    and busy; the files of :data:`READ_THE_RUN` come last. Within a file the order is kept."""
    recorded = suite_profile.recorded_file_seconds()
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    longest = max((wall for wall, _ in recorded.values()), default=0.0)
    lanes: dict[bool, list[tuple[float, str]]] = {True: [], False: []}  # waiting? -> files
    for name in files:
        if name not in READ_THE_RUN:
            wall, cpu = recorded.get(name, (longest + 1, longest + 1))
            lanes[wall > 0 and cpu / wall < WAITING_BELOW].append((wall, name))
    for lane in lanes.values():
        lane.sort(key=lambda entry: -entry[0])
    order, given = [], {True: 0.0, False: 0.0}
    while lanes[True] or lanes[False]:
        waiting = bool(lanes[True]) and (not lanes[False] or given[True] < given[False])
        wall, name = lanes[waiting].pop(0)
        given[waiting] += wall
        order.append(name)
    order += [name for name in files if name in READ_THE_RUN]
    return [item for name in order for item in files[name]]
