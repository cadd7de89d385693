"""Hidden checks for chapter 09's read_the_logs: the fields of every answer that the visible
checks leave out (exception types, exit codes, the signal, the timeout, the shapes, the sequence
number, NCCL's error name), all six answers in one call of the visible module's Case."""

from __future__ import annotations

from ddpcourse.grading.exercises.read_the_logs import LABS, VISIBLE, run_answers, truth


def hidden_fields(lab: str) -> tuple[str, ...]:
    """The fields of ``lab``'s answer that its visible check does not ask."""
    return tuple(name for name in truth(lab) if name not in VISIBLE[lab])


def check_read_the_logs(answer_child_failed, answer_with_record, answer_timeout, answer_mismatch,
                        answer_killed, answer_duplicate_gpu) -> None:
    __tracebackhide__ = True  # noqa: F841
    labs = tuple(LABS)
    functions = (answer_child_failed, answer_with_record, answer_timeout, answer_mismatch,
                 answer_killed, answer_duplicate_gpu)
    run_answers(functions, labs, tuple(hidden_fields(lab) for lab in labs), hide_internals=True)
