"""What graded exercises share: the notebook's locked setup, tamper checks, and rank-side audits.

* :func:`setup_notebook` - called by every exercise's locked first cell.
* :mod:`ddpcourse.grading.integrity` - notices when notebook code replaced what the tests rely on.
* :mod:`ddpcourse.grading.comm_audit` - counts what a rank sends and which collectives it calls.
* :mod:`ddpcourse.grading.checks` - run a student's function in clean ranks and compare;
  ``agree`` ends a failed case on every rank at once (no peer left waiting in a collective).
* ``ddpcourse.grading.chNN`` - each exercise notebook's visible checks: ch00 (bus bandwidth, an
  all-reduce self-test that can fail), ch01 (DDP on shares = one process), ch02 (bytes per rank,
  DDP vs FSDP2, measured), ch03 (torchrun flags from SLURM, launched for real), ch04 (ranks from
  the environment), ch05 (average_gradients, ring all-reduce), ch05_ddp (broadcast, BucketedDDP),
  ch06 (DistributedSampler's indices by hand). Hidden checks are grader-only, in autograder/hidden/.
* :mod:`ddpcourse.grading.forbidden` - run a student's function under a profile hook that sees
  whether a forbidden shortcut (the library function to be rebuilt) ran.
* :mod:`ddpcourse.grading.notebook_runner` - execute a notebook and report each test cell.
"""

from ddpcourse.grading.notebook_guard import setup_notebook

__all__ = ["setup_notebook"]
