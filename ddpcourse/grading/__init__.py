"""What graded exercises share: the notebook's locked setup, tamper checks, and rank-side audits.

* :func:`setup_notebook` - called by every exercise's locked first cell.
* :mod:`ddpcourse.grading.integrity` - notices when notebook code replaced what the tests rely on.
* :mod:`ddpcourse.grading.comm_audit` - counts what a rank sends and which collectives it calls.
* :mod:`ddpcourse.grading.checks` - run a student's function in clean ranks and compare.
* :mod:`ddpcourse.grading.ch04`, :mod:`ddpcourse.grading.ch05` - each chapter's visible checks
  (hidden ones are grader-only, in autograder/hidden/).
* :mod:`ddpcourse.grading.notebook_runner` - execute a notebook and report each test cell.
"""

from ddpcourse.grading.notebook_guard import setup_notebook

__all__ = ["setup_notebook"]
