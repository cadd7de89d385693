"""Chapter 09, reading the logs of failed jobs: visible checks for the ``answer_*`` functions of
the exercise read_the_logs, the truth they are judged against, and the case the hidden checks
reuse.

The contract is the docstring of each ``answer_*`` function in
solutions/09_debugging/read_the_logs.nb.py (students: exercises/09_debugging/read_the_logs.ipynb):
each returns a small dict of facts read from one real log of chapters/09_debugging/captured_logs/
(the failing rank, the line of the script, the collective, exit codes...).

Nothing here is a hard-coded answer: :func:`truth` parses the committed logs each time (the
``[rankN]:`` tracebacks, torchrun's ChildFailedError summary, gloo's timeout, the DETAIL
fingerprints, NCCL's duplicate-GPU error), so a log captured again on another torch (make_logs.py)
changes the truth with it, and tests/test_grading_read_the_logs.py checks that a fresh capture on
the installed torch still gives the facts the committed logs give.

One :class:`~ddpcourse.grading.checks.Case`, ANSWERS: in one rank (no process group) it calls the
student's functions and keeps only plain data (ints, strings, lists of them); the judge compares
each asked field with the truth and names every wrong field with a hint on where in the log to
look, never the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpcourse.grading.checks import Case, CheckFailed, cut_text, run_student, together

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
LOGS_DIR = Path(__file__).resolve().parents[3] / "chapters" / "09_debugging" / "captured_logs"
HEADER_END = "# ---- captured output (stdout and stderr, in order) ----"
ANSWER_TIMEOUT_S = 30.0  # one rank returning a dict; only a hang gets near it
MAX_KEYS, MAX_LIST, MAX_TEXT = 20, 8, 200


# --- the logs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Log:
    name: str
    header: dict[str, str]
    body: str  # what the job printed

    @property
    def torch_version(self) -> str:
        return self.header.get("torch", "")


def read_log(name: str, folder: Path = LOGS_DIR) -> Log:
    """``folder/NAME.log``: its header (``# key: value`` lines) and what the job printed."""
    text = (folder / f"{name}.log").read_text()
    head, end, body = text.partition(HEADER_END + "\n")
    if not end:
        raise ValueError(f"{name}.log has no header ending in {HEADER_END!r}")
    header = {}
    for line in head.splitlines():
        key, _, value = line.removeprefix("# ").partition(": ")
        header[key.split(" (")[0]] = value
    return Log(name, header, body)


def show_log(name: str, folder: Path = LOGS_DIR) -> None:
    """Print a log as captured, header included, with line numbers to refer to."""
    for number, line in enumerate((folder / f"{name}.log").read_text().splitlines(), 1):
        print(f"{number:4d}  {line}")


_RANK_LINE = re.compile(r"^\[rank(\d+)\]: ?(.*)$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::|$)")


def rank_lines(body: str) -> dict[int, list[str]]:
    """The lines each rank printed with its ``[rankN]:`` prefix (the prefix that
    init_process_group's excepthook puts on every line of an uncaught exception), by rank."""
    by_rank: dict[int, list[str]] = {}
    for line in body.splitlines():
        found = _RANK_LINE.match(line)
        if found:
            by_rank.setdefault(int(found.group(1)), []).append(found.group(2))
    return by_rank


def script_frames(lines: list[str], script: str) -> list[int]:
    """The line numbers of the frames in ``script`` (a file name), outermost first."""
    return [int(m.group(2)) for line in lines for m in [_FRAME.search(line)]
            if m and Path(m.group(1)).name == script]


def collective_of(lines: list[str]) -> str | None:
    """The torch.distributed function a traceback was in: its frame in distributed_c10d.py."""
    names = [m.group(3) for line in lines for m in [_FRAME.search(line)]
             if m and m.group(1).endswith("distributed_c10d.py")]
    return names[-1] if names else None


def exception_of(lines: list[str]) -> str | None:
    """The type name of the exception a traceback ends in (``ValueError``, not the module)."""
    names = [m.group(1) for line in lines for m in [_EXCEPTION.match(line.strip())] if m]
    return names[-1].rsplit(".", 1)[-1] if names else None


@dataclass(frozen=True)
class Failure:
    """One entry of torchrun's ChildFailedError summary."""

    rank: int
    exitcode: int
    signal: str | None
    error_file: str
    traceback: list[str]
    root_cause: bool


def summary(body: str) -> list[Failure]:
    """The entries of the ChildFailedError summary (``Failures:`` then ``Root Cause``)."""
    start = body.find("ChildFailedError")
    if start < 0:
        return []
    failures, entry, in_root, in_traceback = [], None, False, False

    def close():
        if entry is not None:
            failures.append(Failure(**entry))

    for line in body[start:].splitlines():
        if line.startswith("Root Cause"):
            in_root = True
        if re.match(r"^\[\d+\]:$", line):
            close()
            entry = {"rank": -1, "exitcode": 0, "signal": None, "error_file": "",
                     "traceback": [], "root_cause": in_root}
            in_traceback = False
            continue
        if entry is None:
            continue
        if re.match(r"^[=-]{20,}$", line):
            in_traceback = False
            continue
        field = re.match(r"^  (\w+)\s*: ?(.*)$", line)
        if field and not in_traceback:
            key, value = field.groups()
            if key == "rank":
                entry["rank"] = int(value.split()[0])
            elif key == "exitcode":
                entry["exitcode"] = int(value.split()[0])
                named = re.search(r"\((SIG\w+)\)", value)
                entry["signal"] = named.group(1) if named else None
            elif key == "error_file":
                entry["error_file"] = value.strip()
            elif key == "traceback":
                entry["traceback"] = [value]
                in_traceback = True
        elif in_traceback:
            entry["traceback"].append(line)
    close()
    return failures


def failure_of(failures: list[Failure], rank: int) -> Failure | None:
    return next((f for f in failures if f.rank == rank), None)


def root_cause(failures: list[Failure]) -> Failure | None:
    return next((f for f in failures if f.root_cause), None)


_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                          r"SequenceNumber=(\d+), OpType=(\w+), TensorShape=\[([\d, ]*)\]")
_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms")
_NCCL_ERROR = re.compile(r"^(nccl\w+):")


# --- the truth of every question, from the logs -----------------------------------------------

CPU_SCRIPT, GPU_SCRIPT = "failing_job.py", "dup_gpu.py"
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


def _innermost(lines: list[str], script: str) -> int | None:
    frames = script_frames(lines, script)
    return frames[-1] if frames else None


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def own_error_ranks(tracebacks: dict[int, list[str]]) -> list[int]:
    """The ranks whose traceback ends in an error of their own, not in gloo's report that a
    peer went away (which every survivor of a failed rank raises)."""
    return [rank for rank, lines in sorted(tracebacks.items())
            if not any(lost in line for line in lines[-3:] for lost in _PEER_LOST)]


def truth_child_failed(folder: Path = LOGS_DIR) -> dict:
    body = read_log("raise", folder).body
    failures, tracebacks = summary(body), rank_lines(body)
    # The rank with an error of its own; torchrun's Root Cause agrees in the committed log, but
    # it is the first exit the agent saw, in whole seconds, and could be a survivor's.
    own = own_error_ranks(tracebacks)
    failing = own[0] if len(own) == 1 else None
    others = [f.exitcode for f in failures if f.rank != failing]
    lines = tracebacks.get(failing, [])
    return {"failing_rank": failing, "line": _innermost(lines, CPU_SCRIPT),
            "exception": exception_of(lines), "other_exitcode": others[0] if others else None}


def truth_with_record(folder: Path = LOGS_DIR) -> dict:
    failures = summary(read_log("raise_record", folder).body)
    root = root_cause(failures)
    rank0 = failure_of(failures, 0)
    return {"root_cause_rank": root.rank if root else None,
            "line": _innermost(root.traceback, CPU_SCRIPT) if root else None,
            "rank0_exitcode": rank0.exitcode if rank0 else None,
            "rank0_exception": exception_of(rank0.traceback) if rank0 else None}


def truth_timeout(folder: Path = LOGS_DIR) -> dict:
    body = read_log("timeout", folder).body
    tracebacks = rank_lines(body)
    waited = _TIMEOUT.search(body)
    answer = {"timeout_ms": int(waited.group(1)) if waited else None}
    for rank in (0, 1):
        lines = tracebacks.get(rank, [])
        answer[f"rank{rank}_collective"] = collective_of(lines)
        answer[f"rank{rank}_line"] = _innermost(lines, CPU_SCRIPT)
    return answer


def truth_mismatch(folder: Path = LOGS_DIR) -> dict:
    body = read_log("mismatch_detail", folder).body
    tracebacks = rank_lines(body)
    prints = {int(m.group(1)): m for m in _FINGERPRINT.finditer(body)}
    first = prints.get(0) or prints.get(1)
    answer = {"collective": collective_of(tracebacks.get(0, [])),
              "line": _innermost(tracebacks.get(0, []), CPU_SCRIPT),
              "sequence_number": int(first.group(2)) if first else None}
    for rank in (0, 1):
        found = prints.get(rank)
        answer[f"shape_rank{rank}"] = ([int(n) for n in found.group(4).split(",") if n.strip()]
                                       if found else None)
    return answer


def truth_killed(folder: Path = LOGS_DIR) -> dict:
    body = read_log("sigkill", folder).body
    failures, tracebacks = summary(body), rank_lines(body)
    killed = next((f for f in failures if f.signal not in (None, "SIGTERM")), None)
    rank0 = failure_of(failures, 0)
    return {"failing_rank": killed.rank if killed else None,
            "exitcode": killed.exitcode if killed else None,
            "signal": killed.signal if killed else None,
            "rank0_line": _innermost(tracebacks.get(0, []), CPU_SCRIPT),
            "rank0_exitcode": rank0.exitcode if rank0 else None}


def truth_duplicate_gpu(folder: Path = LOGS_DIR) -> dict:
    without = read_log("gpu_duplicate_no_set_device", folder).body
    tracebacks = rank_lines(without)
    lines = tracebacks.get(0, [])
    errors = [m.group(1) for line in lines for m in [_NCCL_ERROR.match(line.strip())] if m]
    # Without device_id the error is raised in init_process_group, before its excepthook puts
    # [rankN]: in front of the lines: the two ranks' tracebacks are interleaved, unprefixed.
    early = read_log("gpu_duplicate_set_device", folder).body.splitlines()
    return {"line": _innermost(lines, GPU_SCRIPT), "collective": collective_of(lines),
            "line_with_device_id": _innermost(early, GPU_SCRIPT),
            "nccl_error": errors[0] if errors else None}


TRUTHS = {"child_failed": truth_child_failed, "with_record": truth_with_record,
          "timeout": truth_timeout, "mismatch": truth_mismatch, "killed": truth_killed,
          "duplicate_gpu": truth_duplicate_gpu}


def truth(lab: str, folder: Path = LOGS_DIR) -> dict:
    """Every field of ``lab``'s answer, parsed from the logs in ``folder``."""
    return TRUTHS[lab](folder)


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


def _normalize(kind: str, value: Any) -> Any:
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


_EXPECTED_TYPE = {"int": "an int", "shape": "a list of ints", "collective": "a string",
                  "signal": "a string", "name": "a string"}


def judge_answer(lab: str, answer: Any, fields: tuple[str, ...], folder: Path = LOGS_DIR) -> None:
    """CheckFailed naming every wrong field of ``answer`` (plain data) among ``fields``."""
    what = f"answer_{lab}()"
    if isinstance(answer, dict) and set(answer) == {"not_plain"}:
        raise CheckFailed(f"{what} must return a dict of ints, strings and lists of ints; it "
                          f"returned {cut_text(answer['not_plain'], 100)}")
    if not isinstance(answer, dict):
        raise CheckFailed(f"{what} must return a dict")
    expected = truth(lab, folder)
    wrong = []
    for name in fields:
        kind = KINDS[name]
        if name not in answer:
            wrong.append(f"{name!r} is missing (the dict has {cut_text(sorted(answer), 200)})")
            continue
        given = _normalize(kind, answer[name])
        if given is None and answer[name] is not None:
            wrong.append(f"{name!r} should be {_EXPECTED_TYPE[kind]}, not "
                         f"{cut_text(repr(answer[name]), 60)}")
        elif given is None or given != _normalize(kind, expected[name]):
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


def observe_answers(rank, world_size, functions, labs, fields):
    """Call each of the student's ``answer_*`` functions; keep what they return as plain data."""
    functions = functions if isinstance(functions, tuple) else (functions,)
    return {"answers": [plain_answer(function()) for function in functions]}


def judge_answers(observations, world_size, labs, fields):
    [observation] = observations
    answers = observation.get("answers") if isinstance(observation, dict) else None
    if not isinstance(answers, list) or len(answers) != len(labs):
        raise CheckFailed("the rank's report lacks the answers (did the code replace the check's "
                          "own functions?)")
    problems = []
    for lab, answer, asked in zip(labs, answers, fields):
        try:
            judge_answer(lab, answer, tuple(asked))
        except CheckFailed as failed:
            problems.append(str(failed))
    if problems:
        raise CheckFailed("\n".join(problems))


ANSWERS = Case(observe_answers, judge_answers)


def run_answers(functions: tuple, labs: tuple[str, ...], fields: tuple[tuple[str, ...], ...],
                **kwargs) -> None:
    """Judge the student's functions for ``labs`` (same order), asking ``fields`` of each."""
    student = together(*functions) if len(functions) > 1 else functions[0]
    run_student(ANSWERS, 1, student, labs, fields, timeout=ANSWER_TIMEOUT_S,
                init_process_group=False, **kwargs)


def _check(lab: str, function) -> None:
    run_answers((function,), (lab,), (VISIBLE[lab],))


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
