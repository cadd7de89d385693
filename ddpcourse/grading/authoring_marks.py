"""Marks shared by the notebook author (autograder/authoring.py) and the notebook runner."""

HIDDEN_MARK = "# Hidden tests: they run when your notebook is graded."
