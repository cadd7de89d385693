"""Timings a shared machine cannot turn into a wrong conclusion, and the recorded runs beside them.

A lesson's live timing cell runs on whatever machine the reader has, often a laptop that is
doing something else. So a lesson never draws its conclusion from a live timing alone:

* :func:`repeat` times a call several times (after warm-up) and :class:`Timing` keeps every
  sample, its minimum (the least disturbed run), its median (the typical one), the spread
  between the two, and how closely the second-best repeat reproduces the best;
* :func:`machine_load` says how busy the machine is *with other work* right now (how many cores
  were busy during a short sleep of ours; the 1-minute load average where /proc/stat is missing),
  and lets a test or a reader inject the figure instead;
* :func:`judge` turns the load and the agreement between repeats into a :class:`Verdict`:
  ``conclusive``, "too loaded to conclude" (other work kept the cores busy) or "too noisy to
  conclude" (the machine looked quiet, but the repeats disagree), with the reasons in words,
  which the cell prints instead of a conclusion;
* the conclusion itself rests on a **recorded reference run**: a JSON file under
  ``benchmarks/results/`` that names the machine, the date, the torch version, the exact command
  that reproduces it and how loaded the machine was. :func:`reference_header` writes that part,
  :func:`load_reference` reads a record back and refuses one that lacks any of it, and
  :func:`describe` is its one-line label for a plot.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
REQUIRED_FIELDS = ("machine", "date", "torch", "command", "load")
MAX_BUSY_FRACTION = 0.25  # of the cores, busy with other work: more and a timing is not conclusive
MAX_SPREAD = 0.20  # repeats further apart than 20% disagree too much to conclude
MAX_DISAGREEING = 0.10  # isolated disagreements tolerated: 10% of the timings (scheduler noise)


@dataclass(frozen=True)
class Timing:
    """Repeated measurements of one thing (seconds, or any 'smaller is faster' figure)."""

    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Iterable[float]) -> "Timing":
        values = tuple(float(s) for s in samples)
        if not values:
            raise ValueError("a Timing needs at least one sample")
        if any(not v > 0 for v in values):  # also rejects NaN
            raise ValueError(f"timings must be positive, got {values}")
        return cls(values)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """How far the typical repeat is above the best one: median / min - 1 (0.1 = 10%).
        Robust to one disturbed repeat out of three or more; 0 for a single sample, which is
        why :func:`judge` also wants at least two."""
        return self.median / self.min - 1.0

    @property
    def repeatability(self) -> float:
        """How far the second-best repeat is above the best: 0.05 = the minimum was reproduced
        within 5%. A conclusion drawn from minima needs this, not a small spread: on a machine
        whose scheduler adds heavy-tailed delays (a VM, loopback TCP), the median can sit far
        above a minimum that every quiet moment reproduces. 0 for a single sample."""
        ordered = sorted(self.samples)
        return ordered[1] / ordered[0] - 1.0 if len(ordered) > 1 else 0.0

    def __str__(self) -> str:
        return (f"min {_human_seconds(self.min)}, median {_human_seconds(self.median)} "
                f"(spread {100 * self.spread:.0f}%, second-best {100 * self.repeatability:.0f}% "
                f"above the best, {len(self.samples)} repeats)")


def repeat(fn: Callable[[], object], repeats: int = 5, warmup: int = 1,
           clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed, one call per sample.

    ``clock`` must include any waiting for asynchronous work (on a GPU, synchronise in ``fn``).
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append(clock() - start)
    return Timing.of(samples)


@dataclass(frozen=True)
class Load:
    """How much of the machine other work is using: ``busy`` cores out of ``cores``."""

    busy: float
    cores: int
    source: str

    @property
    def fraction(self) -> float:
        return self.busy / self.cores

    def __str__(self) -> str:
        return f"{self.busy:.1f} of {self.cores} cores busy with other work ({self.source})"

    def as_dict(self) -> dict:
        return {"busy_cores": round(self.busy, 3), "cores": self.cores, "source": self.source}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def machine_load(interval: float = 1.0, busy: float | None = None,
                 cores: int | None = None) -> Load:
    """How many cores other work kept busy while this process slept for ``interval`` seconds.

    The 1-minute load average is the fallback only: it lags by a minute, so it still counts the
    lesson's own previous cell. ``busy`` injects the figure instead of measuring it (tests, or a
    reader who knows better); ``cores`` defaults to the cores this process may use.
    """
    cores = cores or usable_cores()
    if busy is not None:
        return Load(float(busy), cores, "given")
    before = _cpu_times()
    if before is None:
        return Load(os.getloadavg()[0], cores, "1-minute load average")
    time.sleep(interval)
    after = _cpu_times()
    busy_jiffies, total_jiffies = after[0] - before[0], after[1] - before[1]
    all_cpus = os.cpu_count() or cores
    share = busy_jiffies / total_jiffies if total_jiffies else 0.0
    return Load(min(cores, share * all_cpus), cores, f"/proc/stat over {interval:g} s")


@dataclass(frozen=True)
class Verdict:
    """Whether a live timing may be read as a result, and why (or why not)."""

    conclusive: bool
    reasons: tuple[str, ...] = field(default_factory=tuple)
    loaded: bool = False  # other work kept the cores busy (else: only the repeats disagreed)

    def __str__(self) -> str:
        head = "conclusive"
        if not self.conclusive:
            head = (("TOO LOADED" if self.loaded else "TOO NOISY") + " TO CONCLUDE: read the "
                    "recorded reference run instead; rerun on a quiet machine to compare")
        return head + "".join(f"\n  - {reason}" for reason in self.reasons)


def judge(timings: Mapping[str, Timing], load: Load,
          max_busy_fraction: float = MAX_BUSY_FRACTION, max_spread: float = MAX_SPREAD,
          statistic: str = "min", max_disagreeing: float = MAX_DISAGREEING) -> Verdict:
    """Conclusive only if the machine was quiet and the repeats agree.

    ``statistic`` is the figure the conclusion is drawn from, and says what "agree" means:
    ``"min"`` (the least disturbed repeat): the second-best repeat within ``max_spread`` of the
    best, so the minimum is reproducible; ``"median"``: the median within ``max_spread`` of the
    minimum. ``timings`` names each measured thing; those whose repeats disagree are named in
    the reasons. Other work that starts during a measurement disturbs many timings, while an
    isolated disagreement among many is the scheduler's noise: so up to ``max_disagreeing`` of
    the timings (rounded down; none of fewer than ten) may disagree in a conclusive run; read
    those points with care. A timing of one sample cannot show that it is reproducible.
    """
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic must be 'min' or 'median', not {statistic!r}")
    reasons, ok = [], True
    loaded = load.fraction > max_busy_fraction
    if loaded:
        ok = False
        reasons.append(f"{load}: more than {max_busy_fraction * load.cores:.1f}")
    else:
        reasons.append(f"quiet machine: {load}")
    if not timings:
        return Verdict(ok, tuple(reasons), loaded)
    gap = (lambda t: t.repeatability) if statistic == "min" else (lambda t: t.spread)
    what = ("second-best repeat {:.0f}% above the best" if statistic == "min"
            else "median {:.0f}% above the minimum")
    too_few = [n for n, t in timings.items() if len(t.samples) < 2]
    if too_few:
        ok = False
        reasons.append(f"a single repeat cannot show it is reproducible: {', '.join(too_few)}")
    disagree = sorted(((gap(t), n) for n, t in timings.items() if gap(t) > max_spread),
                      reverse=True)
    allowed = int(max_disagreeing * len(timings))
    if disagree:
        listed = "; ".join(f"{n} ({what.format(100 * g)})" for g, n in disagree[:5])
        more = f" and {len(disagree) - 5} more" if len(disagree) > 5 else ""
        if len(disagree) > allowed:
            ok = False
            reasons.append(f"repeats disagree (more than {100 * max_spread:.0f}%) in "
                           f"{len(disagree)} of {len(timings)} timings: {listed}{more}")
        else:
            reasons.append(f"repeats agree within {100 * max_spread:.0f}% except in "
                           f"{len(disagree)} of {len(timings)} timings (read with care): {listed}")
    elif not too_few:
        name = max(timings, key=lambda n: gap(timings[n]))
        reasons.append(f"repeats agree: at worst {what.format(100 * gap(timings[name]))} ({name})")
    return Verdict(ok, tuple(reasons), loaded)


def machine_description() -> dict:
    """What a reader needs to compare a record with their machine (no host name)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "usable_cores": usable_cores(),
            "os": f"{platform.system()} {platform.machine()}", "python": platform.python_version()}


def reference_header(command: str, load: Load, note: str = "") -> dict:
    """The fields every record under ``benchmarks/results/`` starts with; add the results."""
    import torch

    return {"machine": machine_description(), "date": dt.datetime.now(dt.timezone.utc)
            .isoformat(timespec="seconds"), "torch": torch.__version__, "command": command,
            "load": {**load.as_dict(), "load_average": [round(x, 2) for x in os.getloadavg()],
                     "note": note}}


def close_record(record: dict, timings: Mapping[str, Timing], load: Load,
                 statistic: str = "min") -> Verdict:
    """Finish a record started by :func:`reference_header`: judge its timings against the load
    measured before the run, add how busy the machine was after it and the verdict, and print
    the verdict. Returns it (``verdict.conclusive`` says whether the timings may be read)."""
    verdict = judge(timings, load, statistic=statistic)
    record["load"]["busy_cores_after"] = machine_load(2.0).busy
    record.update(verdict=str(verdict), conclusive=verdict.conclusive)
    print(verdict)
    return verdict


def write_record(record: dict, out: Path) -> None:
    """Write a record as the files under ``benchmarks/results/`` are written, and say where."""
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    print("written:", out)


def command_line() -> str:
    """This process's command as a reader would type it from the repository root."""
    args = list(sys.argv)
    return shlex.join(["python"] + args if args and args[0].endswith(".py") else args)


class IncompleteRecord(ValueError):
    """A record under ``benchmarks/results/`` lacks the fields that make it reproducible."""


def load_reference(name: str | Path) -> dict:
    """Read a recorded reference run: a file name under ``benchmarks/results/`` or a path.

    Raises :class:`IncompleteRecord` naming what is missing when the record lacks a machine, a
    date (ISO 8601), a torch version, the command that reproduces it, or how loaded it was.
    """
    path = Path(name)
    if not path.is_absolute() and not path.exists():
        path = RESULTS_DIR / path
    record = json.loads(path.read_text())
    missing = [key for key in REQUIRED_FIELDS if not record.get(key)]
    if missing:
        raise IncompleteRecord(f"{path.name}: missing {', '.join(missing)} (every record names "
                               f"{', '.join(REQUIRED_FIELDS)})")
    try:
        dt.datetime.fromisoformat(record["date"])
    except (TypeError, ValueError):
        raise IncompleteRecord(f"{path.name}: date {record['date']!r} is not ISO 8601") from None
    if not any(word in record["command"].split()[:3] for word in ("python", "torchrun")):
        raise IncompleteRecord(f"{path.name}: command {record['command']!r} is not a python or "
                               "torchrun command line")
    return record


def describe(record: dict) -> str:
    """A record's one-line label: machine, date, torch, load (for a plot's legend or title)."""
    machine, load = record["machine"], record["load"]
    cpu = machine.get("cpu", "?") if isinstance(machine, dict) else str(machine)
    cores = machine.get("usable_cores", "?") if isinstance(machine, dict) else "?"
    busy = load.get("busy_cores") if isinstance(load, dict) else None
    return (f"reference run {record['date'][:10]}, torch {record['torch']}, {cores} cores "
            f"({cpu})" + (f", {busy:.1f} cores busy with other work" if busy is not None else ""))


def _human_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"
