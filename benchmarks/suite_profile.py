"""Where the suite's time goes: turn the record of the last ``pytest`` run into a JSON profile
and a short text summary.

Every run of the suite records itself (the plugin in ``tests/suite_profile.py``) under
``build/suite_profile/last/``. To regenerate a committed profile:

    pytest                                  # the suite as CI runs it (README command 2)
    python benchmarks/suite_profile.py --out benchmarks/results/suite_profile_after.json \\
        --note "quiet machine"

The JSON holds the run (command, workers, wall and CPU seconds, machine, date, torch), the
totals per test file, the 30 slowest tests and a breakdown into categories (notebook
executions, torchrun launches, grading runs, rank launches, other). The summary goes to stdout.
CPU seconds include the processes a test started (see ``tests/suite_profile.py`` for what is
and is not counted); on a shared machine compare CPU seconds rather than wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "build" / "suite_profile" / "last"
CATEGORIES = ("notebook", "torchrun", "grading", "ranks", "other")
CATEGORY_NAMES = {"notebook": "notebook executions", "torchrun": "torchrun launches",
                  "grading": "grading runs (autograder/nbgrader)", "ranks": "rank launches",
                  "other": "other (test code, start-up, waits)"}


def load(folder: Path) -> tuple[dict, list[dict], list[dict]]:
    run = json.loads((folder / "run.json").read_text()) if (folder / "run.json").exists() else {}
    tests = [json.loads(line) for path in sorted(folder.glob("*.jsonl"))
             for line in path.read_text().splitlines() if line.strip()]
    sessions = [json.loads(path.read_text()) for path in sorted(folder.glob("session-*.json"))]
    return run, tests, sessions


def cpu(test: dict) -> float:
    return test["cpu_self_s"] + test["cpu_children_s"]


def profile(run: dict, tests: list[dict], sessions: list[dict]) -> dict:
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0,
                                                  "worker": set()})
    categories = {c: 0.0 for c in CATEGORIES}
    for test in tests:
        entry = files[test["file"]]
        entry["tests"] += 1
        entry["wall_s"] += test["wall_s"]
        entry["cpu_s"] += cpu(test)
        entry["worker"].add(test["worker"])
        for category, seconds in test["categories_s"].items():
            categories[category] += seconds
    by_file = sorted(({"file": name, "tests": e["tests"], "wall_s": round(e["wall_s"], 1),
                       "cpu_s": round(e["cpu_s"], 1), "workers": sorted(e["worker"])}
                      for name, e in files.items()), key=lambda e: -e["wall_s"])
    slowest = sorted(tests, key=lambda t: -t["wall_s"])[:30]
    workers: dict[str, dict] = {}
    for test in tests:
        entry = workers.setdefault(test["worker"], {"tests": 0, "first_test_at_s": test["start"],
                                                    "last_test_done_at_s": 0.0, "busy_s": 0.0})
        entry["tests"] += 1
        entry["first_test_at_s"] = min(entry["first_test_at_s"], test["start"])
        entry["last_test_done_at_s"] = max(entry["last_test_done_at_s"],
                                           test["start"] + test["wall_s"])
        entry["busy_s"] += test["wall_s"]
    for entry in workers.values():
        for key in ("first_test_at_s", "last_test_done_at_s", "busy_s"):
            entry[key] = round(entry[key], 1)
    outcomes: dict[str, int] = defaultdict(int)
    for test in tests:
        outcomes[test["outcome"]] += 1
    return {
        "run": run,
        "processes": sessions,
        # per test process: when its first test started (start-up and collection before it),
        # when its last test ended (a process that ends early idles while the others finish)
        "workers": workers,
        "tests": len(tests),
        "outcomes": dict(outcomes),
        "sum_of_test_wall_s": round(sum(t["wall_s"] for t in tests), 1),
        "sum_of_test_cpu_s": round(sum(cpu(t) for t in tests), 1),
        "categories_wall_s": {c: round(s, 1) for c, s in categories.items()},
        "files": by_file,
        "slowest_tests": [{"nodeid": t["nodeid"], "wall_s": t["wall_s"], "cpu_s": round(cpu(t), 1),
                           "categories_s": {c: s for c, s in t["categories_s"].items() if s >= 0.5}}
                          for t in slowest],
    }


def summary(result: dict) -> str:
    run = result["run"]
    lines = [f"{result['tests']} tests {result['outcomes']}; run wall {run.get('wall_s', '?')} s "
             f"with {run.get('workers', '?')} workers; sum of test wall "
             f"{result['sum_of_test_wall_s']} s, CPU {result['sum_of_test_cpu_s']} s"]
    if "cpu_total_s" in run:
        lines.append(f"CPU of the whole run (user+sys of pytest and everything it reaped): "
                     f"{run['cpu_total_s']} s")
    for name, worker in sorted(result["workers"].items()):
        lines.append(f"  {name}: {worker['tests']} tests, first at {worker['first_test_at_s']} s "
                     f"(start-up and collection), last done at {worker['last_test_done_at_s']} s")
    lines.append("\nWall seconds by category (summed over tests):")
    total = sum(result["categories_wall_s"].values()) or 1.0
    for category, seconds in result["categories_wall_s"].items():
        lines.append(f"  {CATEGORY_NAMES[category]:<38} {seconds:8.1f}  {100 * seconds / total:4.0f}%")
    lines.append("\nPer test file (wall, CPU seconds):")
    for entry in result["files"]:
        lines.append(f"  {entry['wall_s']:7.1f} {entry['cpu_s']:7.1f}  {entry['file']} "
                     f"({entry['tests']})")
    lines.append("\n30 slowest tests (wall, CPU seconds):")
    for test in result["slowest_tests"]:
        lines.append(f"  {test['wall_s']:7.1f} {test['cpu_s']:7.1f}  {test['nodeid']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=Path, default=RECORDS,
                        help="the folder the last run recorded (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="write the JSON profile here")
    parser.add_argument("--note", default="", help="what to know about the machine and run")
    parser.add_argument("--cpu-total", type=float,
                        help="user+sys seconds of the whole run, e.g. from /usr/bin/time")
    parser.add_argument("--wall-total", type=float, help="wall seconds of the whole run")
    args = parser.parse_args(argv)
    run, tests, sessions = load(args.records)
    if not tests:
        parser.error(f"no test records in {args.records}: run pytest first")
    run.update({"date": run.get("finished"), "machine": platform.platform(),
                "cpus": run.get("cpus", os.cpu_count()), "note": args.note})
    try:
        import torch

        run["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    if args.cpu_total is not None:
        run["cpu_total_s"] = args.cpu_total
    if args.wall_total is not None:
        run["wall_total_s"] = args.wall_total
    result = profile(run, tests, sessions)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
