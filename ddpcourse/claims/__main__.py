"""Re-check the claims page: ``python -m ddpcourse.claims`` (from the repository root).

1. checks the data (``chapters/claims.yaml``): every row has an experiment or a source reference,
   everything it names exists, and ``chapters/CLAIMS.md`` is up to date with it;
2. runs the page's own short experiments (``ddpcourse/claims/experiments.py``); the GPU ones run
   where a GPU is present and are skipped with the reason where not;
3. runs, in one pytest session, the chapter tests the rows name (unless ``--no-tests``; they need
   the repository's ``tests/`` and the ``[dev]`` extra, and take a few minutes on 2 cores);
4. prints a verdict table: each claim, the article's verdict, and what its experiments did here.

Exit code 1 when the data has a problem, the page is out of date, or an experiment contradicts a
row. ``--write`` regenerates ``chapters/CLAIMS.md`` from the data instead.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from ddpcourse.claims import DATA, PAGE, ROOT, Claims, load, node_ids, problems, render
from ddpcourse.claims.experiments import CHECKS, NeedsHardware

HELD, FAILED, SKIPPED = "held", "CONTRADICTED", "skipped"
ERROR = "error"  # the experiment could not run (a deadline on a busy machine, a crash): no verdict
# how a run that ran out of time reads (run_ranks' RankTimeoutError, pytest-timeout, a launcher)
DEADLINE = re.compile(r"RankTimeoutError|did not finish within|Timeout >|TimeoutExpired")


def run_checks(names) -> dict[str, tuple[str, str]]:
    """name -> (status, what was observed or why it was skipped)."""
    results = {}
    for name in names:
        try:
            outcome = CHECKS[name]()
        except NeedsHardware as why:
            results[name] = (SKIPPED, str(why))
        except Exception as error:  # an experiment that breaks contradicts nothing: report it
            results[name] = (ERROR, f"{type(error).__name__}: {error}")
        else:
            results[name] = (HELD if outcome.holds else FAILED, outcome.observed)
    return results


def junit_outcomes(xml_text: str) -> dict[str, list[tuple[str, str]]]:
    """``file::function`` -> [(status, message)] for each test case of a JUnit XML report
    (parametrized cases of one function are listed under the function)."""
    outcomes: dict[str, list[tuple[str, str]]] = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        function = case.get("name", "").split("[")[0]
        status, message = HELD, ""
        for child in case:
            if child.tag == "failure" and not DEADLINE.search(child.get("message") or ""):
                status, message = FAILED, (child.get("message") or "")[:200]
            elif child.tag == "failure" and status != FAILED:  # a deadline is no verdict
                status, message = ERROR, (child.get("message") or "")[:200]
            elif child.tag == "error" and status != FAILED:  # in a fixture: it never got to assert
                status, message = ERROR, (child.get("message") or "")[:200]
            elif child.tag == "skipped" and status not in (FAILED, ERROR):
                status, message = SKIPPED, (child.get("message") or "")[:200]
        outcomes.setdefault(f"{file}::{function}", []).append((status, message))
        if "[" in case.get("name", ""):
            outcomes.setdefault(f"{file}::{case.get('name')}", []).append((status, message))
    return outcomes


def run_tests(ids: list[str], timeout: float) -> dict[str, tuple[str, str]]:
    """Run the named tests in one pytest session; node id -> (status, message)."""
    if not (ROOT / "tests").is_dir():
        return {i: (SKIPPED, "this copy has no tests/ folder") for i in ids}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={report}", *ids]
        print("$ python -m pytest", ids[0], f"... ({len(ids)} tests named by the page)", flush=True)
        # pytest's own progress and summary go straight to the terminal; at the deadline its
        # whole session (xdist workers, ranks, launchers) is killed, so nothing is left behind
        session = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
        try:
            session.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(session.pid, signal.SIGKILL)
            session.wait()
            return {i: (ERROR, f"pytest did not finish within {timeout:.0f} s") for i in ids}
        except KeyboardInterrupt:
            os.killpg(session.pid, signal.SIGKILL)
            raise
        if not report.is_file():
            return {i: (ERROR, "pytest wrote no report (see its output above)") for i in ids}
        outcomes = junit_outcomes(report.read_text())
    results = {}
    for node_id in ids:
        cases = outcomes.get(node_id, [])
        if not cases:
            results[node_id] = (ERROR, "not run (not collected?)")
        elif any(s in (FAILED, ERROR) for s, _ in cases):
            results[node_id] = next((s, m) for s, m in cases if s in (FAILED, ERROR))
        elif all(s == SKIPPED for s, _ in cases):
            results[node_id] = cases[0]
        else:
            results[node_id] = (HELD, "")
    return results


def row_result(claim, checks: dict, tests: dict) -> tuple[str, str]:
    """What the row's experiments did: held / CONTRADICTED / error / skipped / not run, with a
    note. One contradiction decides; an error (nothing asserted) only where nothing failed."""
    parts = [checks[claim.check]] if claim.check in checks else []
    parts += [tests[t] for t in claim.tests if t in tests]
    for status in (FAILED, ERROR):
        if (found := [m for s, m in parts if s == status]):
            return status, found[0]
    if any(s == HELD for s, _ in parts):
        return HELD, ""
    if parts:
        return SKIPPED, parts[0][1]
    if claim.needs:
        pending = f"; {claim.pending}, pending" if claim.pending else ""
        return "—", f"needs {claim.needs}{pending}"
    if claim.pending:
        return "—", f"{claim.pending}, pending"
    return "—", "source reference only" if not claim.tests else "tests not run (--no-tests)"


def print_table(claims: Claims, results: dict) -> None:
    width = max(len(c.id) for c in claims.claims)
    print(f"\n{'§':<4} {'claim':<{width}} {'verdict':<17} here")
    for c in claims.claims:
        status, note = results[c.id]
        print(f"{c.section:<4} {c.id:<{width}} {c.verdict:<17} {status}"
              + (f" ({note})" if note else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpcourse.claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="regenerate chapters/CLAIMS.md from chapters/claims.yaml and stop")
    parser.add_argument("--no-tests", action="store_true",
                        help="skip the chapter tests the rows name; run only the page's own "
                        "experiments")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds for the pytest session (default 1800)")
    args = parser.parse_args(argv)

    claims = load(DATA)
    if args.write:
        PAGE.write_text(render(claims))
        print(f"wrote {PAGE.relative_to(ROOT)} ({len(claims.claims)} claims)")
        return 0

    import torch

    print(f"claims page checked against torch {claims.torch}; this machine: torch "
          f"{torch.__version__}, CUDA GPUs: {torch.cuda.device_count()}")
    if torch.__version__.split("+")[0] != claims.torch:
        print(f"note: torch {torch.__version__} is not the version the page states; a difference "
              "below may be the version's")
    found = problems(claims)
    if PAGE.read_text() != render(claims):
        found.append(f"{PAGE.relative_to(ROOT)} is out of date: python -m ddpcourse.claims --write")
    for line in found:
        print("PROBLEM:", line)

    checks = run_checks(dict.fromkeys(c.check for c in claims.claims if c.check))
    tests = {} if args.no_tests else run_tests(node_ids(claims), args.timeout)
    results = {c.id: row_result(c, checks, tests) for c in claims.claims}
    print_table(claims, results)
    contradicted = [i for i, (s, _) in results.items() if s == FAILED]
    errors = [i for i, (s, _) in results.items() if s == ERROR]
    held = sum(s == HELD for s, _ in results.values())
    print(f"\n{held} rows confirmed by a run here, {len(contradicted)} contradicted, "
          f"{len(errors)} could not run (errors), "
          f"{len(results) - held - len(contradicted) - len(errors)} not run here (GPU, nodes, "
          "pending, or source references only)"
          + (f"; {len(found)} data problems" if found else ""))
    if errors:
        print("An error is no verdict (the experiment did not get to its check, most often a "
              "deadline on a busy machine): rerun when the machine is quieter.")
    return 1 if contradicted or errors or found else 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
