"""Grader-only checks. Hidden test cells import them, so feedback shows a call, not the checks."""
