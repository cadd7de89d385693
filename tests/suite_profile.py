"""Where the suite's time goes: a pytest plugin that records, for every test, wall seconds and
CPU seconds, and how much of the wall time was spent executing notebooks, launching torchrun,
grading (the autograder or nbgrader as a program) and launching ranks (``run_ranks``).

It is on in every run (``tests/conftest.py`` registers it; ``DDPCOURSE_SUITE_PROFILE=0`` turns it
off) and costs a read of /proc before and after each test. Each test process appends one JSON
line per test to ``build/suite_profile/last/<process>.jsonl``; ``python benchmarks/suite_profile.py``
turns the folder into the committed summary.

What the CPU figures count, honestly:

* ``cpu_self_s``: this test process (user + system), from ``resource.getrusage(RUSAGE_SELF)``.
* ``cpu_children_s``: everything the test started that ran on a CPU while the test ran: the
  change in ``RUSAGE_CHILDREN`` (children that ended and were reaped) plus the change in the
  user + system time, own and reaped children's (``/proc/PID/stat`` fields 14-17), of every
  descendant still in the process table (the rank servers, which live all session, and the
  ranks they fork and reap; kernels still running). A child that was running before the test
  counts only with what it used during the test.
* Not counted: a process that left the tree (double-forked, re-parented to init) before it
  was reaped, and a descendant's children that it never reaps. Work a module-scoped fixture
  does is counted to the first test that asks for it (its setup), as pytest runs it there.
* With xdist, each worker counts its own tests; the controller runs none. Two workers on two
  cores share the CPUs, so per-test wall times are longer than in a one-process run while the
  CPU seconds stay close: compare CPU seconds across runs on a loaded machine.

Categories are wall seconds, attributed to the outermost of grading > notebook > torchrun >
ranks when they nest (a grading run executes notebooks whose cells launch ranks: it is
grading time); the rest of a test's wall time is "other".
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROFILE_DIR = ROOT / "build" / "suite_profile" / "last"
CATEGORIES = ("grading", "notebook", "torchrun", "ranks")  # outermost first
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


RESULTS = ROOT / "benchmarks" / "results"
# the committed profiles, the one to trust first
COMMITTED = (RESULTS / "suite_profile_after.json", RESULTS / "suite_profile_before.json")


def recorded_file_seconds() -> dict[str, tuple[float, float]]:
    """(wall seconds, CPU seconds) per test file (``tests/test_x.py``) in the newest committed
    profile; empty if there is none."""
    for path in COMMITTED:
        if path.exists():
            return {entry["file"]: (entry["wall_s"], entry["cpu_s"])
                    for entry in json.loads(path.read_text())["files"]}
    return {}


def enabled() -> bool:
    return os.environ.get("DDPCOURSE_SUITE_PROFILE", "1") != "0"


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's), from /proc/PID/task/TID/children."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
    except OSError:
        pass  # gone meanwhile
    return found


def _stat_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of ``pid`` (stat fields 14-17), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return 0
    fields = text[text.rindex(b")") + 2:].split()  # fields[0] is stat field 3
    return sum(int(v) for v in fields[11:15])


def _descendant_cpu_s() -> float:
    """User + system seconds (own and reaped children's) of every descendant of this process
    still in the process table, zombies included (their time is not yet in RUSAGE_CHILDREN).
    Walks the tree from this process down (a few files per test, not the whole of /proc)."""
    total, stack = 0, _children(os.getpid())
    while stack:
        pid = stack.pop()
        total += _stat_ticks(pid)
        stack.extend(_children(pid))
    return total / _CLOCK_TICKS


def _rusage_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class _Intervals:
    """The (start, end) spans of each category, in this process, since the last ``take``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, list[list[float]]] = {c: [] for c in CATEGORIES}

    def begin(self, category: str) -> list[float]:
        span = [time.monotonic(), float("nan")]
        with self.lock:
            self.spans[category].append(span)
        return span

    @staticmethod
    def end(span: list[float]) -> None:
        if span[1] != span[1]:  # still open (nan)
            span[1] = time.monotonic()

    def take(self, start: float, stop: float) -> dict[str, float]:
        """Wall seconds of each category within [start, stop], outermost category first; spans
        still open stay for the next test."""
        with self.lock:
            spans = {c: [(max(a, start), min(b if b == b else stop, stop)) for a, b in s]
                     for c, s in self.spans.items()}
            self.spans = {c: [x for x in s if x[1] != x[1]] for c, s in self.spans.items()}
        claimed: list[tuple[float, float]] = []
        seconds = {}
        for category in CATEGORIES:
            mine = _union([s for s in spans[category] if s[1] > s[0]])
            seconds[category] = round(_length(_minus(mine, claimed)), 3)
            claimed = _union(claimed + mine)
        return seconds


def _union(spans):
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _minus(spans, taken):
    out = []
    for a, b in spans:
        pieces = [(a, b)]
        for c, d in taken:
            pieces = [p for x, y in pieces
                      for p in ((x, min(y, c)), (max(x, d), y)) if p[1] > p[0]]
        out.extend(pieces)
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _category_of_command(args) -> str | None:
    words = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    text = " ".join(words)
    if "torchrun" in text or "torch.distributed.run" in text:
        return "torchrun"
    if "autograder" in words or "nbgrader" in text:
        return "grading"
    return None


class SuiteProfile:
    """The plugin: one instance per test process (the xdist controller writes only the run's
    description)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.worker = getattr(config, "workerinput", {}).get("workerid", "main")
        self.intervals = _Intervals()
        self.record_file = None
        self._patch()

    # -- what counts as which category ---------------------------------------------------------
    def _patch(self) -> None:
        intervals = self.intervals

        def timed(category, fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                span = intervals.begin(category)
                try:
                    return fn(*args, **kwargs)
                finally:
                    intervals.end(span)
            wrapper.__suite_profile__ = True
            return wrapper

        import nbclient

        if not getattr(nbclient.NotebookClient.execute, "__suite_profile__", False):
            nbclient.NotebookClient.execute = timed("notebook", nbclient.NotebookClient.execute)
        import ddpcourse.launcher as launcher

        if not getattr(launcher.run_ranks, "__suite_profile__", False):
            launcher.run_ranks = timed("ranks", launcher.run_ranks)

        popen_init, popen_wait, popen_poll = (subprocess.Popen.__init__, subprocess.Popen.wait,
                                              subprocess.Popen.poll)
        if getattr(popen_init, "__suite_profile__", False):
            return

        def init(self, args, *rest, **kwargs):
            category = _category_of_command(args)
            self._suite_profile_span = intervals.begin(category) if category else None
            try:
                popen_init(self, args, *rest, **kwargs)
            except BaseException:
                if self._suite_profile_span:
                    intervals.end(self._suite_profile_span)
                raise

        def finished(self):
            span = getattr(self, "_suite_profile_span", None)
            if span is not None and self.returncode is not None:
                intervals.end(span)

        def wait(self, *args, **kwargs):
            try:
                return popen_wait(self, *args, **kwargs)
            finally:
                finished(self)

        def poll(self):
            try:
                return popen_poll(self)
            finally:
                finished(self)

        for name, fn in (("__init__", init), ("wait", wait), ("poll", poll)):
            fn.__suite_profile__ = True
            setattr(subprocess.Popen, name, fn)

    # -- hooks ---------------------------------------------------------------------------------
    def pytest_sessionstart(self, session) -> None:
        self.session_start = (time.monotonic(), _rusage_s(resource.RUSAGE_SELF),
                              _rusage_s(resource.RUSAGE_CHILDREN))
        if self.worker == "main" and self._is_controller():
            return
        PROFILE_DIR.mkdir(parents=True, exist_ok=True)
        self.record_file = open(PROFILE_DIR / f"{self.worker}.jsonl", "a", buffering=1)

    def _is_controller(self) -> bool:
        return bool(getattr(self.config.option, "numprocesses", None)) and not hasattr(
            self.config, "workerinput")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.record_file is None:
            yield
            return
        start = time.monotonic()
        self.intervals.take(0.0, start)  # whatever ran between tests is nobody's
        before = (_rusage_s(resource.RUSAGE_SELF), _rusage_s(resource.RUSAGE_CHILDREN),
                  _descendant_cpu_s())
        item._suite_profile_phases = {}
        yield
        stop = time.monotonic()
        after = (_rusage_s(resource.RUSAGE_SELF), _rusage_s(resource.RUSAGE_CHILDREN),
                 _descendant_cpu_s())
        wall = stop - start
        categories = self.intervals.take(start, stop)
        categories["other"] = round(max(0.0, wall - sum(categories.values())), 3)
        record = {
            "nodeid": item.nodeid,
            "file": item.nodeid.split("::")[0],
            "worker": self.worker,
            "start": round(start - self.session_start[0], 3),
            "wall_s": round(wall, 3),
            "cpu_self_s": round(after[0] - before[0], 3),
            "cpu_children_s": round((after[1] - before[1]) + (after[2] - before[2]), 3),
            "phases_s": item._suite_profile_phases,
            "categories_s": categories,
            "outcome": getattr(item, "_suite_profile_outcome", "passed"),
        }
        self.record_file.write(json.dumps(record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        phases = getattr(item, "_suite_profile_phases", None)
        if phases is not None:
            phases[call.when] = round(call.duration, 3)
            if report.failed or (report.skipped and call.when != "teardown"):
                item._suite_profile_outcome = report.outcome if not report.failed else "failed"

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        wall = time.monotonic() - self.session_start[0]
        entry = {
            "process": self.worker,
            "wall_s": round(wall, 3),
            "cpu_self_s": round(_rusage_s(resource.RUSAGE_SELF) - self.session_start[1], 3),
            "cpu_children_s": round(_rusage_s(resource.RUSAGE_CHILDREN) - self.session_start[2], 3),
            "descendants_cpu_s_still_running": round(_descendant_cpu_s(), 3),
        }
        PROFILE_DIR.mkdir(parents=True, exist_ok=True)
        with open(PROFILE_DIR / f"session-{self.worker}.json", "w") as f:
            json.dump(entry, f)
        if self.worker == "main":
            workers = getattr(self.config.option, "numprocesses", None)
            with open(PROFILE_DIR / "run.json", "w") as f:
                json.dump({
                    "command": " ".join(["pytest", *self.config.invocation_params.args]),
                    "workers": self.config.getoption("numprocesses", None)
                    if workers else 0,
                    "wall_s": round(wall, 3),
                    "exitstatus": int(exitstatus),
                    "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "host": socket.gethostname(),
                    "cpus": os.cpu_count(),
                    "python": sys.version.split()[0],
                }, f)
        if self.record_file is not None:
            self.record_file.close()


def register(config: pytest.Config) -> None:
    """Register the plugin (from ``pytest_configure``); the controller of an xdist run starts a
    fresh record folder before its workers start."""
    if not enabled():
        return
    if not hasattr(config, "workerinput"):
        shutil.rmtree(PROFILE_DIR, ignore_errors=True)
    config.pluginmanager.register(SuiteProfile(config), "ddpcourse_suite_profile")
