"""The course's grading set-up: nbgrader config, assignment sources, and the grading command.

    python -m autograder build                 # write solutions/ from autograder/assignments/
    python -m autograder release               # generate exercises/ from solutions/
    python -m autograder grade SUBMISSIONS     # grade a class; see autograder/README.md
"""
