"""Each exercise's visible checks: one module per exercise, named by the exercise's slug.

The slug is the exercise's one name (its notebook ``solutions/NN_topic/SLUG.ipynb``, these checks
``ddpcourse.grading.exercises.SLUG``, its grader-only checks ``autograder.hidden.SLUG``, its tests
``tests/test_grading_SLUG.py``). Each module's docstring points to the exercise, whose stub
docstring states the contract. The package names below are the one place every other piece
(the setup cell, the integrity snapshot, the traceback filter) takes them from.
"""

CHECKS_PACKAGE = __name__
HIDDEN_PACKAGE = "autograder.hidden"  # grader-only: not in a student's copy of the course
GRADER_PACKAGES = ("ddpcourse.grading", HIDDEN_PACKAGE)


def hidden_checks(slug: str) -> str:
    """The module name of an exercise's grader-only checks."""
    return f"{HIDDEN_PACKAGE}.{slug}"
