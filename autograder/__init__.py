"""The course's grading set-up: nbgrader config, the exercises found in solutions/, grading.

    python -m autograder release                                  # exercises/ from solutions/
    python -m autograder grade SUBMISSIONS --assignment NN_topic  # see autograder/README.md
"""
