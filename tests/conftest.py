"""Shared fixtures: a warm rank server for the whole session, an orphan check per test, and the
integrity snapshot the grading tests take as an exercise's locked setup cell does.

Every test of a chapter's lesson, scripts, exercises or grading is marked with its chapter, so
``pytest -m ch05`` runs chapter 05 alone (see :func:`course_layout.chapter_of`); every test that
needs a CUDA GPU is marked ``gpu``, so ``pytest -m gpu`` runs them all on a GPU machine.

The suite records where its time goes (``tests/suite_profile.py``) and uses the committed record
to order the test files: longest first, a mostly waiting file beside a busy one
(``tests/suite_plan.py``, ``benchmarks/results/suite_profile_*.json``)."""

from __future__ import annotations

import signal
import time

import chapter_launch
import pytest
import suite_plan
import suite_profile
from course_layout import CHAPTER_NUMBERS, chapter_of

from ddpcourse.launcher import prestart, rank_server_pids
from ddpcourse.launcher.processes import live_descendants


def pytest_xdist_auto_num_workers(config):
    """What ``-n auto`` (pyproject's addopts) means for the repository's tests: two test
    processes on a small machine, more on a larger one (:func:`suite_plan.auto_workers`)."""
    return suite_plan.this_machines_workers()


def pytest_configure(config):
    # Ctrl-C as at a terminal, however pytest was started: a shell without job control starts a
    # background command (`pytest &` in a script, `nohup pytest &`) with SIGINT ignored, which
    # Python then leaves ignored, and so would every process the tests start. The tests that send
    # a Ctrl-C (to run_ranks, a grading command, a chapter script) would see it lost.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    suite_profile.register(config)  # where the time goes: build/suite_profile/last/
    if not hasattr(config, "workerinput"):  # the run's controller, or a run without workers
        chapter_launch.forget_earlier_runs()  # launches shared within a run: build/launches/
    for number in CHAPTER_NUMBERS:
        config.addinivalue_line("markers", f"ch{number}: a test of chapter {number}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        number = chapter_of(item.nodeid)
        if number:
            item.add_marker(f"ch{number}")
        if suite_plan.needs_a_gpu(item):
            item.add_marker("gpu")
    items[:] = suite_plan.longest_files_first(items)


def pytest_sessionstart(session):
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config,
                                                                            "workerinput"):
        return  # the pytest-xdist controller runs no tests; its workers start their own servers
    prestart()  # the rank servers import torch while pytest collects


def leftover_processes(grace_s: float = 3.0, earlier: frozenset[int] = frozenset()) -> set[int]:
    """Descendants of this test process other than the rank servers and ``earlier``, after a
    short grace for those still exiting. (A child that outlives every test, such as the resource
    tracker that multiprocessing starts once per process, is among ``earlier``: it must not make
    each later test wait out the grace.)"""
    give_up = time.monotonic() + grace_s
    while True:
        left = live_descendants() - rank_server_pids() - earlier
        if not left or time.monotonic() > give_up:
            return left
        time.sleep(0.05)


@pytest.fixture
def no_orphans():
    """Fail the test if it leaves any process running behind it."""
    before = frozenset(live_descendants() - rank_server_pids())
    yield
    left = leftover_processes(earlier=before)
    assert not left, f"processes left running after the test: {sorted(left)}"


@pytest.fixture
def integrity_snapshot():
    """What an exercise's locked setup cell does before any student code: record the protected
    objects, which every check compares against (``integrity.assert_untampered``). Only the first
    snapshot of a process counts; the tests of each exercise ask for it all the same."""
    from ddpcourse.grading import integrity

    integrity.snapshot()


@pytest.fixture(scope="module")
def host():
    """One host of sandbox-side ranks for a test module, as the autograder starts per student
    (unsandboxed here: the tests' own functions are trusted)."""
    from autograder import trusted  # here: ranks that rebuild a test's function must not import it

    with trusted.ObservationHost() as observation_host:
        yield observation_host
