"""Command line: ``python -m autograder {release,scaffold,student-repo,grade,merge,override}``
(run from the repository root)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from autograder import sandbox, scaffold, student_repo
from autograder.merge import Shard
from autograder.sources import assignments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograder", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("release", help="generate exercises/ from solutions/ with nbgrader")
    scaffold.add_command(sub)
    student_repo.add_command(sub)
    grade = sub.add_parser("grade", help="autograde a folder of submissions")
    grade.add_argument("submissions", type=Path,
                       help="nbgrader's submitted/ folder: SUBMISSIONS/{student}/{assignment}/")
    grade.add_argument("--assignment", required=True, choices=assignments(),
                       help="which exercises/ folder the submissions are for, e.g. 05_allreduce")
    grade.add_argument("--out", type=Path, default=Path("autograder/course"),
                       help="where grades.csv, feedback/ and work/ go (default autograder/course)")
    grade.add_argument("--jobs", type=int, default=None,
                       help="submissions graded at once (default: number of CPU cores)")
    grade.add_argument("--student", action="append", metavar="NAME",
                       help="grade only this student (repeat for several); their rows, feedback "
                            "and logs in OUT are replaced, everyone else's kept")
    grade.add_argument("--shard", type=Shard.parse, default=Shard(), metavar="I/N",
                       help="grade only shard I of N: every N-th student of the sorted student "
                            "ids, from the I-th (default 1/1, the whole class); join the shards' "
                            "outputs with `merge`")
    grade.add_argument("--cell-timeout", type=int, default=None,
                       help="seconds per notebook cell (default: nbgrader_config.py's)")
    grade.add_argument("--student-timeout", type=int, default=1800,
                       help="hard limit in seconds for one submission, everything included")
    grade.add_argument("--sandbox", choices=sandbox.POLICIES, default="require",
                       help="run each submission's kernel and ranks in a bubblewrap sandbox: "
                            "'require' (default) refuses to grade where it cannot; 'warn' grades "
                            "unsandboxed and says so in every feedback page and CSV row; 'off' "
                            "grades unsandboxed (trusted submissions only)")
    merge = sub.add_parser("merge", help="merge the outputs of grading runs (e.g. the shards of "
                                         "one class) into what one run of them all gives")
    merge.add_argument("outputs", type=Path, nargs="+", metavar="OUT_I",
                       help="the --out folders of the runs to merge")
    merge.add_argument("--out", type=Path, required=True,
                       help="where the merged grades.csv, feedback/ and summary.json go")
    override = sub.add_parser("override", help="apply OUT/overrides.csv (student, cell, score, "
                                               "reason) to OUT's gradebook, grades.csv and "
                                               "feedback; grade and merge apply it too")
    override.add_argument("out", type=Path, help="a grading output (default of grade: "
                                                 "autograder/course)")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)

    if opts.command == "release":
        from autograder.release import release_all

        for path in release_all():
            print(f"released {path}")
        return 0
    if opts.command == "scaffold":
        return scaffold.run(opts)
    if opts.command == "student-repo":
        return student_repo.run(opts)
    if opts.command == "merge":
        return merge(opts.outputs, opts.out)
    if opts.command == "override":
        return override(opts.out)
    from autograder.grade import GradingRefused, grade_class, print_summary

    if opts.student and opts.shard.count > 1:
        print("Refusing to grade: --student and --shard together; re-grade students into the "
              "merged output of the shards", file=sys.stderr)
        return 2

    try:
        sandbox.resolve(opts.sandbox, sandbox.bwrap_problem)
    except sandbox.SandboxUnavailable as refused:
        print(refused, file=sys.stderr)
        return 2
    os.environ[sandbox.POLICY_VARIABLE] = opts.sandbox  # the workers inherit it

    try:
        results = grade_class(opts.submissions, opts.assignment, opts.out, jobs=opts.jobs,
                              cell_timeout=opts.cell_timeout,
                              student_timeout=opts.student_timeout, shard=opts.shard,
                              students=opts.student)
    except GradingRefused as refused:
        print(f"Refusing to grade: {refused}", file=sys.stderr)
        return 2
    print_summary(results, opts.out)
    return report_grader_errors(results)


GRADER_FAILED = 3  # grade/merge's exit code when the grader itself failed on some notebooks


def report_grader_errors(results: list[dict]) -> int:
    """0, or GRADER_FAILED after saying on stderr which students' notebooks the grader itself
    could not grade (its fault, not theirs) and how to grade them again once it is fixed."""
    broken = [r for r in results if r.get("grader_errors") or r["status"] == "grader error"]
    if not broken:
        return 0
    print("\nGRADER ERROR: the grader itself failed, not the students' code. The other "
          "notebooks are graded; these are not (their cells score 0 until graded again):",
          file=sys.stderr)
    for result in broken:
        errors = result.get("grader_errors") or {"(all notebooks)": "; ".join(result["notes"])}
        for slug, why in sorted(errors.items()):
            print(f"  {result['student']}: {slug}: {why[:500]}", file=sys.stderr)
    print("Fix the grader (the message names the notebook and cell), then grade these students "
          "again with --student NAME into the same --out.", file=sys.stderr)
    return GRADER_FAILED


def merge(outputs: list[Path], out: Path) -> int:
    from autograder.grade import print_results
    from autograder.merge import MergeError, merge_outputs
    from autograder.overrides import OverrideError, apply_overrides

    try:
        summary = merge_outputs(outputs, out)
    except MergeError as refused:
        print(f"Refusing to merge: {refused}", file=sys.stderr)
        return 2
    try:
        absent = apply_overrides(out, summary["assignment"])
    except OverrideError as wrong:
        print(f"Merged, but {out / 'overrides.csv'} was not applied:\n{wrong}", file=sys.stderr)
        return 2
    print_results(summary["results"])
    if absent:
        print(f"overrides for students not in {out}: {', '.join(absent)}")
    parts = ", ".join(f"{part['path']} ({part['submissions']})" for part in summary["merged_from"])
    print(f"{summary['submissions']} submissions of {summary['assignment']} merged from {parts}; "
          f"grades: {out / 'grades.csv'}; feedback: {out / 'feedback'}")
    return report_grader_errors(summary["results"])


def override(out: Path) -> int:
    """Apply OUT/overrides.csv now, without grading."""
    from autograder.merge import MergeError, load
    from autograder.overrides import FILE, OverrideError, apply_overrides

    try:
        assignment = load(out).assignment
        absent = apply_overrides(out, assignment)
    except (MergeError, OverrideError) as wrong:
        print(f"Refusing to override: {wrong}", file=sys.stderr)
        return 2
    print(f"{out / FILE} applied to {out}'s gradebook, grades.csv and feedback")
    if absent:
        print(f"not graded in {out} yet (applied when they are): {', '.join(absent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
