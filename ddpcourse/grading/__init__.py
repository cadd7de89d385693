"""What graded exercises share: the notebook's locked setup, tamper checks, and rank-side audits.

* :func:`setup_notebook` - called by every exercise's locked first cell.
* :mod:`ddpcourse.grading.integrity` - notices when notebook code replaced what the tests rely on.
* :mod:`ddpcourse.grading.comm_audit` - counts what a rank sends and which collectives it calls.
* Shared judges and inputs that several exercises use (invariants only, never an answer):
  :mod:`~ddpcourse.grading.collective_names` (one name per collective in the in-rank audit and
  the grader's broker), :mod:`~ddpcourse.grading.point_to_point` (no collective was called),
  :mod:`~ddpcourse.grading.left_unchanged` (the input is what the grader handed in, bit for bit),
  :mod:`~ddpcourse.grading.salted_inputs` (per-rank inputs no other rank can compute; dtypes and
  tolerances), :mod:`~ddpcourse.grading.raises_first` (a bad argument raises ValueError first),
  :mod:`~ddpcourse.grading.written_out` (expected values written out as digests).
* :mod:`ddpcourse.grading.checks` - run a student's function in clean ranks and compare;
  ``agree`` ends a failed case on every rank at once (no peer left waiting in a collective).
* ``ddpcourse.grading.exercises.<slug>`` - each exercise's visible checks, one module per
  exercise (README.md's course map names every chapter's exercises; a test keeps it complete).
  Hidden checks are grader-only, in ``autograder.hidden.<slug>``.
* :mod:`ddpcourse.grading.forbidden` - run a student's function under a profile hook that sees
  whether a forbidden shortcut (the library function to be rebuilt) ran.
* :mod:`ddpcourse.grading.notebook_runner` - execute a notebook and report each test cell.
"""

__all__ = ["setup_notebook"]


def __getattr__(name: str):
    # Imported on first use (it imports torch): processes that only pass data on, such as the
    # one-rank hosts of the autograder, import ddpcourse.grading without paying for torch.
    if name == "setup_notebook":
        from ddpcourse.grading.notebook_guard import setup_notebook

        return setup_notebook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
