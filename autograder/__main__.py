"""Command line: ``python -m autograder {release,grade}`` (run from the repository root)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from autograder import sandbox
from autograder.sources import assignments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autograder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("release", help="generate exercises/ from solutions/ with nbgrader")
    grade = sub.add_parser("grade", help="autograde a folder of submissions")
    grade.add_argument("submissions", type=Path,
                       help="nbgrader's submitted/ folder: SUBMISSIONS/{student}/{assignment}/")
    grade.add_argument("--assignment", required=True, choices=assignments(),
                       help="which exercises/ folder the submissions are for, e.g. 05_allreduce")
    grade.add_argument("--out", type=Path, default=Path("autograder/course"),
                       help="where grades.csv, feedback/ and work/ go (default autograder/course)")
    grade.add_argument("--jobs", type=int, default=None,
                       help="submissions graded at once (default: number of CPU cores)")
    grade.add_argument("--cell-timeout", type=int, default=None,
                       help="seconds per notebook cell (default: nbgrader_config.py's)")
    grade.add_argument("--student-timeout", type=int, default=1800,
                       help="hard limit in seconds for one submission, everything included")
    grade.add_argument("--sandbox", choices=sandbox.POLICIES, default="require",
                       help="run each submission's kernel and ranks in a bubblewrap sandbox: "
                            "'require' (default) refuses to grade where it cannot; 'warn' grades "
                            "unsandboxed and says so in every feedback page and CSV row; 'off' "
                            "grades unsandboxed (trusted submissions only)")
    opts = parser.parse_args(argv)

    if opts.command == "release":
        from autograder.release import release_all

        for path in release_all():
            print(f"released {path}")
        return 0
    from autograder.grade import grade_class, print_summary
    from autograder.worker import SANDBOX_POLICY

    try:
        sandbox.resolve(opts.sandbox, sandbox.bwrap_problem)
    except sandbox.SandboxUnavailable as refused:
        print(refused, file=sys.stderr)
        return 2
    os.environ[SANDBOX_POLICY] = opts.sandbox  # the workers inherit it

    results = grade_class(opts.submissions, opts.assignment, opts.out, jobs=opts.jobs,
                          cell_timeout=opts.cell_timeout, student_timeout=opts.student_timeout)
    print_summary(results, opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
