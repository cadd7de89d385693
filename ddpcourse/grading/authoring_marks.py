"""The first line of every hidden-test cell: the notebook runner shows such a cell of a student
release as "runs when graded", and tests/test_exercise_authoring.py requires it."""

HIDDEN_MARK = "# Hidden tests: they run when your notebook is graded."
