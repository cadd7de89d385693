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
# (its two rank servers, a kernel, torch in each rank). Three on 2 cores (measured: cores 97 %
# busy against 85 %, the suite 6 % sooner in one quiet run) made the tests that time a Ctrl-C
# (tests/test_launcher.py, test_chapter_10_throttled_network.py) fail in the next: two stay.
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


def longest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests, file by file, the files in the order of their wall time in the committed
    profile, longest first (a file not profiled yet counts as long): with ``--dist loadfile``
    and ``--no-loadscope-reorder`` (pyproject.toml) the workers take the files in this order, so
    no long file starts last and keeps one worker busy while the others idle. Within a file the
    order is kept. The files of :data:`READ_THE_RUN` come last."""
    seconds = suite_profile.recorded_file_seconds()
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files, key=lambda name: (name in READ_THE_RUN,
                                            -seconds.get(name, float("inf")) if seconds else 0))
    return [item for name in order for item in files[name]]
