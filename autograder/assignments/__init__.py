"""One module per assignment; each defines ASSIGNMENT, NOTEBOOK and cells()."""

from autograder.assignments import ch04_process_groups, ch05_allreduce

ALL = [ch04_process_groups, ch05_allreduce]
