"""Chapter 09, reading the logs of failed jobs: visible checks for the ``answer_*`` functions of
the exercise read_the_logs, and the case the hidden checks reuse.

The contract is the docstring of each ``answer_*`` function in
solutions/09_debugging/read_the_logs.nb.py (students: exercises/09_debugging/read_the_logs.ipynb):
each returns a small dict of facts read from one real log of chapters/09_debugging/captured_logs/
(the failing rank, the line of the script, the collective, exit codes...).

This module ships to students and is importable where their code runs, so it holds no answer and
nothing that derives one: no parser of the logs, no true value. For each field a visible check
asks it keeps only :data:`DIGESTS`, a salted SHA-256 of the field's normalized true value
(:func:`normalize`: ``dist.broadcast`` and ``BROADCAST`` alike, ``INT`` as ``SIGINT``), and
judges a student's field by comparing digests; a wrong field is named with a hint on where in the
log to look, never its value. A digest of a small set (a rank, a line number) is no secret from a
loop that tries every value, and neither is the visible check itself, which says whether a guess
is right: that is why only the visible fields have a digest here. The other fields' truth exists
only on the grader's side: autograder/hidden/read_the_logs.py parses the committed logs (the
``[rankN]:`` tracebacks, torchrun's ChildFailedError summary, gloo's timeout, the DETAIL
fingerprints, NCCL's duplicate-GPU error) and judges them there. tests/test_grading_read_the_logs.py
checks that :data:`DIGESTS` are the digests of what that parser finds in the committed logs, so a
log captured again (make_logs.py) with different facts turns it red until the digests are
written again (``python -m autograder.hidden.read_the_logs`` prints them).

One :class:`~ddpcourse.grading.checks.Case`, ANSWERS: in one rank (no process group) it calls the
student's functions and keeps only plain data (ints, strings, lists of them); its judge compares
each asked field with the digests; the hidden checks judge the same observations with the parser.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

from ddpcourse.grading.checks import Case, CheckFailed, cut_text, run_student, together

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
LOGS_DIR = Path(__file__).resolve().parents[3] / "chapters" / "09_debugging" / "captured_logs"
ANSWER_TIMEOUT_S = 30.0  # one rank returning a dict; only a hang gets near it
MAX_KEYS, MAX_LIST, MAX_TEXT = 20, 8, 200


def show_log(name: str, folder: Path = LOGS_DIR) -> None:
    """Print a log as captured, header included, with line numbers to refer to."""
    for number, line in enumerate((folder / f"{name}.log").read_text().splitlines(), 1):
        print(f"{number:4d}  {line}")


# Each lab: the logs it shows, and the function the student writes.
LABS = {
    "child_failed": ("raise",),
    "with_record": ("raise_record",),
    "timeout": ("timeout",),
    "mismatch": ("mismatch_detail",),
    "killed": ("sigkill",),
    "duplicate_gpu": ("gpu_duplicate_no_set_device", "gpu_duplicate_set_device"),
}
# The fields each lab's visible check asks; the hidden checks ask the others.
VISIBLE = {
    "child_failed": ("failing_rank", "line"),
    "with_record": ("root_cause_rank", "line"),
    "timeout": ("rank0_collective", "rank0_line", "rank1_collective", "rank1_line"),
    "mismatch": ("collective", "line"),
    "killed": ("failing_rank", "exitcode"),
    "duplicate_gpu": ("line", "collective"),
}

# --- comparing an answer with the truth -------------------------------------------------------

KINDS = {  # how each field is compared
    "failing_rank": "int", "root_cause_rank": "int", "line": "int", "rank0_line": "int",
    "rank1_line": "int", "line_with_device_id": "int", "exitcode": "int",
    "other_exitcode": "int", "rank0_exitcode": "int", "timeout_ms": "int",
    "sequence_number": "int", "shape_rank0": "shape", "shape_rank1": "shape",
    "collective": "collective", "rank0_collective": "collective",
    "rank1_collective": "collective", "exception": "name", "rank0_exception": "name",
    "signal": "signal", "nccl_error": "name",
}

HINTS = {
    ("child_failed", "failing_rank"): "of the two [rankN]: tracebacks, which one raised an error "
        "of its own, and which one only saw its peer go away ('Connection closed by peer')? "
        "The summary's Root Cause block says it too",
    ("child_failed", "line"): "the innermost frame of failing_job.py (the last `File "
        "\"...failing_job.py\", line N`) in the failing rank's [rankN]: traceback",
    ("child_failed", "exception"): "the last line of the failing rank's traceback, `Type: "
        "message`; give the type's name",
    ("child_failed", "other_exitcode"): "the `exitcode` of the other rank's entry under "
        "`Failures:` in torchrun's summary (a negative code is a signal)",
    ("with_record", "root_cause_rank"): "the `rank` of the entry under `Root Cause (first "
        "observed failure)` in torchrun's summary",
    ("with_record", "line"): "with @record the summary's `traceback :` holds the Python "
        "traceback: its innermost frame of failing_job.py",
    ("with_record", "rank0_exitcode"): "rank 0's entry under `Failures:`",
    ("with_record", "rank0_exception"): "the last line of the traceback in rank 0's entry of "
        "the summary; give the type's name",
    ("timeout", "rank0_collective"): "the torch.distributed function in rank 0's traceback "
        "(its frame in distributed_c10d.py, or the call on the line of failing_job.py above it)",
    ("timeout", "rank0_line"): "the innermost frame of failing_job.py in rank 0's traceback",
    ("timeout", "rank1_collective"): "the torch.distributed function in rank 1's traceback",
    ("timeout", "rank1_line"): "the innermost frame of failing_job.py in rank 1's traceback",
    ("timeout", "timeout_ms"): "gloo's message says how long it waited, in milliseconds",
    ("mismatch", "collective"): "the OpType in the CollectiveFingerPrint, or the "
        "torch.distributed function in the traceback; give the Python function's name",
    ("mismatch", "line"): "the innermost frame of failing_job.py in the tracebacks",
    ("mismatch", "shape_rank0"): "TensorShape in rank 0's CollectiveFingerPrint",
    ("mismatch", "shape_rank1"): "TensorShape in rank 1's CollectiveFingerPrint",
    ("mismatch", "sequence_number"): "SequenceNumber in the CollectiveFingerPrint",
    ("killed", "failing_rank"): "the only Python traceback in this log may not come from the "
        "rank that failed first: read the exit codes in torchrun's summary",
    ("killed", "exitcode"): "the `exitcode` of that rank's entry in torchrun's summary",
    ("killed", "signal"): "the name in brackets after that rank's exit code",
    ("killed", "rank0_line"): "the innermost frame of failing_job.py in rank 0's traceback",
    ("killed", "rank0_exitcode"): "rank 0's entry in torchrun's summary",
    ("duplicate_gpu", "line"): "the frame of dup_gpu.py in the [rankN]: tracebacks of "
        "gpu_duplicate_no_set_device.log",
    ("duplicate_gpu", "collective"): "the torch.distributed function in those tracebacks",
    ("duplicate_gpu", "line_with_device_id"): "gpu_duplicate_set_device.log: the two ranks' "
        "tracebacks are interleaved there, without [rankN]:; find the frame of dup_gpu.py",
    ("duplicate_gpu", "nccl_error"): "the `nccl...:` line that NCCL's error text starts with, "
        "e.g. `ncclSystemError`",
}


def normalize(kind: str, value: Any) -> Any:
    """The comparable form of an answer's value, or None when it has the wrong type."""
    if kind == "int":
        return value if type(value) is int else None
    if kind == "shape":
        if isinstance(value, list) and all(type(n) is int for n in value):
            return value
        return None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if kind == "collective":
        text = re.sub(r"^(torch\.distributed\.|dist\.)", "", text)
        return re.sub(r"[\s_()]", "", text).lower()
    if kind == "signal":
        text = text.upper()
        return text if text.startswith("SIG") else "SIG" + text
    return text.rsplit(".", 1)[-1].lower()  # a name: ValueError, builtins.ValueError


DIGEST_SALT = "ddp-course/09_debugging/read_the_logs"


def digest(lab: str, field: str, normalized: Any) -> str:
    """The salted SHA-256 of one field's value, already :func:`normalize` d."""
    text = json.dumps([DIGEST_SALT, lab, field, normalized])
    return hashlib.sha256(text.encode()).hexdigest()


# The digest of each visible field's true value, as the grader's parser reads it from the
# committed logs (tests/test_grading_read_the_logs.py compares; `python -m
# autograder.hidden.read_the_logs` prints this table again after the logs change).
DIGESTS = {
    "child_failed": {
        "failing_rank": "a2e5e5cc238bb234e06d9cb7093b0d986513157685ca8d6b61da8380344e0097",
        "line": "fd18e8de7430827b1a0c578595f303dcef8ead2693fe70f725d44049013164e3",
    },
    "with_record": {
        "root_cause_rank": "f96a0e5b5f95151de84e25981bed1cc951d355b75e2ca820eec7e09ddf74f4d2",
        "line": "af8109a4aa6ce34ae4aee99c89713818138493bddb496776524545b431b2d467",
    },
    "timeout": {
        "rank0_collective": "807a799de7d3ad2e3c557a88369b515d07c46eaed7284a352276fc9ee714e933",
        "rank0_line": "4a757eb48bbddd9e0a32590bd1c0baef5cc4c6f7f6cdba52b942783bb2a994de",
        "rank1_collective": "302064c24b037623f632985d0bfb8af4c96becbc69ca200855f5f487ede00f4f",
        "rank1_line": "75fde26694f1c823996bfbf6e817c0e5447fa61fca2f7df39fba9c8f69f7acbe",
    },
    "mismatch": {
        "collective": "836d7f90465aa71f8df306ce4be071ae0f620548275f96ff90ac0773314554ee",
        "line": "dae4e31bfd34ace07559402f636ec2af7b6cbc6f25133fb1f4b367758bd22a51",
    },
    "killed": {
        "failing_rank": "7331cfdbfcbd3431d815b5827b6ed416240511aecfd283aacf504de54f776955",
        "exitcode": "aec65d4cd6bb6ea4214ad5327d6c0da1ea5fa37f81515e08b9739f2d81a6b8a1",
    },
    "duplicate_gpu": {
        "line": "59b7ac2526c5b5daae97966536b9b532d072d6c892b0e2818e7c530714ef3be3",
        "collective": "16a156a226dddd823874015101c1f59b9d407a7d8de7556ea6156cc4b521bfc3",
    },
}


def matches_digest(lab: str, field: str, normalized: Any) -> bool:
    """Whether a normalized value is the field's true one; only for visible fields."""
    if field not in DIGESTS.get(lab, {}):
        raise ValueError(f"answer_{lab}()'s {field!r} is judged when the notebook is graded")
    return digest(lab, field, normalized) == DIGESTS[lab][field]


# is_true(lab, field, normalized value): the visible checks' digests, or the grader's parser
IsTrue = Callable[[str, str, Any], bool]

_EXPECTED_TYPE = {"int": "an int", "shape": "a list of ints", "collective": "a string",
                  "signal": "a string", "name": "a string"}


def judge_answer(lab: str, answer: Any, fields: tuple[str, ...],
                 is_true: IsTrue = matches_digest) -> None:
    """CheckFailed naming every wrong field of ``answer`` (plain data) among ``fields``."""
    what = f"answer_{lab}()"
    if isinstance(answer, dict) and set(answer) == {"not_plain"}:
        raise CheckFailed(f"{what} must return a dict of ints, strings and lists of ints; it "
                          f"returned {cut_text(answer['not_plain'], 100)}")
    if not isinstance(answer, dict):
        raise CheckFailed(f"{what} must return a dict")
    wrong = []
    for name in fields:
        kind = KINDS[name]
        if name not in answer:
            wrong.append(f"{name!r} is missing (the dict has {cut_text(sorted(answer), 200)})")
            continue
        given = normalize(kind, answer[name])
        if given is None and answer[name] is not None:
            wrong.append(f"{name!r} should be {_EXPECTED_TYPE[kind]}, not "
                         f"{cut_text(repr(answer[name]), 60)}")
        elif given is None or not is_true(lab, name, given):
            wrong.append(f"{name!r} = {cut_text(repr(answer[name]), 60)} is not what the log "
                         f"says. Where to look: {HINTS[(lab, name)]}")
    if wrong:
        logs = ", ".join(f"{name}.log" for name in LABS[lab])
        raise CheckFailed(f"{what} ({logs}):\n" + "\n".join(f"* {line}" for line in wrong))


# --- the case ---------------------------------------------------------------------------------


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data when it is an int, str, None or (once) a list of them; else a
    description. Only exact built-in types: a subclass could run the student's code later."""
    if value is None or type(value) in (int, bool):
        return value
    if type(value) is str:
        return value[:MAX_TEXT]
    if type(value) in (list, tuple) and depth == 0 and len(value) <= MAX_LIST:
        items = [_plain(item, 1) for item in value]
        return items if all(item is None or type(item) in (int, bool, str) for item in items) \
            else f"a {type(value).__name__} of other things"
    return f"a {type(value).__name__}"


def plain_answer(answer: Any) -> dict:
    """The student's returned dict as plain data: at most MAX_KEYS string keys."""
    if type(answer) is not dict:
        return {"not_plain": f"a {type(answer).__name__}"}
    if len(answer) > MAX_KEYS or any(type(key) is not str for key in answer):
        return {"not_plain": f"a dict with {len(answer)} keys, not all strings"}
    return {key[:MAX_TEXT]: _plain(value) for key, value in answer.items()}


# A diagnosis is one rank returning a dict: only a hang gets near this.
DIAGNOSIS_TIMEOUT_S = 30.0


def observe_diagnosis(rank, world_size, diagnose):
    """Call a lab's ``diagnose_<lab>()`` (chapter 09's ddp_errors, collectives_that_hang,
    replicas_that_disagree) and keep what it returns as plain data. Nothing here knows the right
    diagnosis: autograder/hidden/diagnoses.py judges the observation."""
    return {"answer": plain_answer(diagnose())}


def observe_answers(rank, world_size, functions, labs, fields):
    """Call each of the student's ``answer_*`` functions; keep what they return as plain data."""
    functions = functions if isinstance(functions, tuple) else (functions,)
    return {"answers": [plain_answer(function()) for function in functions]}


def judge_observed(observations, labs, fields, is_true: IsTrue) -> None:
    """Judge the rank's report (untrusted data): every lab's answer, ``fields`` of each."""
    [observation] = observations
    answers = observation.get("answers") if isinstance(observation, dict) else None
    if not isinstance(answers, list) or len(answers) != len(labs):
        raise CheckFailed("the rank's report lacks the answers (did the code replace the check's "
                          "own functions?)")
    problems = []
    for lab, answer, asked in zip(labs, answers, fields):
        try:
            judge_answer(lab, answer, tuple(asked), is_true)
        except CheckFailed as failed:
            problems.append(str(failed))
    if problems:
        raise CheckFailed("\n".join(problems))


def judge_answers(observations, world_size, labs, fields):
    judge_observed(observations, labs, fields, matches_digest)


ANSWERS = Case(observe_answers, judge_answers)


def run_answers(case: Case, functions: tuple, labs: tuple[str, ...],
                fields: tuple[tuple[str, ...], ...], **kwargs) -> None:
    """Judge the student's functions for ``labs`` (same order), asking ``fields`` of each, with
    ``case`` (:data:`ANSWERS`, or the hidden checks' case: the same observation, judged there)."""
    student = together(*functions) if len(functions) > 1 else functions[0]
    run_student(case, 1, student, labs, fields, timeout=ANSWER_TIMEOUT_S,
                init_process_group=False, **kwargs)


def _check(lab: str, function) -> None:
    run_answers(ANSWERS, (function,), (lab,), (VISIBLE[lab],))


def check_child_failed(answer_child_failed) -> None:
    _check("child_failed", answer_child_failed)


def check_with_record(answer_with_record) -> None:
    _check("with_record", answer_with_record)


def check_timeout(answer_timeout) -> None:
    _check("timeout", answer_timeout)


def check_mismatch(answer_mismatch) -> None:
    _check("mismatch", answer_mismatch)


def check_killed(answer_killed) -> None:
    _check("killed", answer_killed)


def check_duplicate_gpu(answer_duplicate_gpu) -> None:
    _check("duplicate_gpu", answer_duplicate_gpu)
