"""ddpcourse: the code the DDP course's chapters, tests and autograder share.

Kept light on purpose: importing the package imports nothing heavy. Use the submodules:

* :mod:`ddpcourse.launcher` - ``run_ranks``: run a function in N ranks of a real process group;
  also its errors (:mod:`ddpcourse.launcher.errors`) and ``run_bounded`` and the process-group,
  parent-death and orphan-counting helpers (:mod:`ddpcourse.launcher.processes`).
* :mod:`ddpcourse.dist_env` - set up and tear down a process group in a ``torchrun`` script.
* :mod:`ddpcourse.toys` - tiny models and generated data sets (nothing is ever downloaded).
* :mod:`ddpcourse.doctor` - can this machine run the course? (``python -m ddpcourse.doctor``)
* :mod:`ddpcourse.kernels` - execute notebooks in kernels on Unix sockets (no TCP ports).
* :mod:`ddpcourse.grading` - what graded exercises share (setup cell, integrity, checks).
* :mod:`ddpcourse.imports` - import another chapter's script by its path, under a name of its own.
"""

__version__ = "0.1.0"
