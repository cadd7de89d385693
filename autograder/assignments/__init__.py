"""One module per assignment; each defines ASSIGNMENT, NOTEBOOK and cells()."""

from autograder.assignments import ch05_allreduce

ALL = [ch05_allreduce]
