"""Hidden checks for chapter 09's read_the_logs, and the truth of every answer: the parser that
reads each fact the exercise asks about from the committed logs.

The parser lives here, grader-only, because whatever can derive the answers must not be
importable where a student's code runs (the visible checks ship to students: they hold only
digests of the visible fields, ddpcourse/grading/exercises/read_the_logs.py). Nothing here is a
hard-coded answer: :func:`truth` parses the logs each time (the ``[rankN]:`` tracebacks,
torchrun's ChildFailedError summary, gloo's timeout, the DETAIL fingerprints, NCCL's duplicate-GPU
error), so a log captured again (make_logs.py) changes the truth with it;
tests/test_grading_read_the_logs.py checks that the visible digests are those of this truth and
that a fresh capture on the installed torch gives the facts the committed logs give.

:func:`check_read_the_logs` judges the fields of every answer that the visible checks leave out
(exception types, exit codes, the signal, the timeout, the shapes, the sequence number, NCCL's
error name), all six answers in one call: the visible module's observation, judged here against
the parsed truth.

``python -m autograder.hidden.read_the_logs`` prints the visible module's ``DIGESTS`` table
as the committed logs give it (to paste there after capturing the logs again).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpcourse.grading.checks import Case
from ddpcourse.grading.exercises.read_the_logs import (KINDS, LABS, LOGS_DIR, VISIBLE, digest,
                                                       judge_observed, normalize,
                                                       observe_answers, run_answers)

HEADER_END = "# ---- captured output (stdout and stderr, in order) ----"


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


_RANK_LINE = re.compile(r"^\[rank(\d+)\]: ?(.*)$")
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
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
    return [int(m.group(2)) for line in lines for m in [FRAME.search(line)]
            if m and Path(m.group(1)).name == script]


def collective_of(lines: list[str]) -> str | None:
    """The torch.distributed function a traceback was in: its frame in distributed_c10d.py."""
    names = [m.group(3) for line in lines for m in [FRAME.search(line)]
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


def visible_digests(folder: Path = LOGS_DIR) -> dict[str, dict[str, str]]:
    """The visible module's ``DIGESTS`` as the logs in ``folder`` give them."""
    return {lab: {field: digest(lab, field, normalize(KINDS[field], truth(lab, folder)[field]))
                  for field in VISIBLE[lab]} for lab in LABS}


# --- the hidden checks --------------------------------------------------------------------------


def hidden_fields(lab: str) -> tuple[str, ...]:
    """The fields of ``lab``'s answer that its visible check does not ask."""
    return tuple(name for name in truth(lab) if name not in VISIBLE[lab])


def judge_with_the_parsed_truth(observations, world_size, labs, fields):
    """The visible module's observation, judged against the truth parsed from the logs."""
    expected = {lab: truth(lab) for lab in labs}

    def is_true(lab: str, field: str, normalized: Any) -> bool:
        return normalized == normalize(KINDS[field], expected[lab][field])

    judge_observed(observations, labs, fields, is_true)


ANSWERS_BY_THE_PARSER = Case(observe_answers, judge_with_the_parsed_truth)


def check_read_the_logs(answer_child_failed, answer_with_record, answer_timeout, answer_mismatch,
                        answer_killed, answer_duplicate_gpu) -> None:
    __tracebackhide__ = True  # noqa: F841
    labs = tuple(LABS)
    functions = (answer_child_failed, answer_with_record, answer_timeout, answer_mismatch,
                 answer_killed, answer_duplicate_gpu)
    run_answers(ANSWERS_BY_THE_PARSER, functions, labs,
                tuple(hidden_fields(lab) for lab in labs), hide_internals=True)


def digests_table(folder: Path = LOGS_DIR) -> str:
    """The ``DIGESTS = {...}`` assignment of the visible module, as the logs give it."""
    rows = []
    for lab, fields in visible_digests(folder).items():
        rows.append(f'    "{lab}": {{')
        rows += [f'        "{field}": "{value}",' for field, value in fields.items()]
        rows.append("    },")
    return "DIGESTS = {\n" + "\n".join(rows) + "\n}"


if __name__ == "__main__":
    print(digests_table())
