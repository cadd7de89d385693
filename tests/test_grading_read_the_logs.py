"""The checks of exercise read_the_logs (chapter 09: facts read from real logs of failed jobs)
take their truth from the committed logs, pass the solution notebook's answers (visible and
hidden checks, once through the trusted grader's path), name each tempting wrong field with a
hint that does not give the value away, and read the rank's report as untrusted data. A fresh
capture of the CPU logs on the installed torch (one parallel launch of make_logs.py) must still
tell the facts the exercise asks about, so a torch that changes them turns this red. The
exercise: solutions/09_debugging/read_the_logs.nb.py; the logs and their scripts:
chapters/09_debugging/captured_logs/.
"""

from __future__ import annotations

import re
import sys

import cloudpickle
import nbformat
import pytest
import torch
from course_layout import ROOT, import_by_path
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from autograder.hidden import read_the_logs as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import read_the_logs as checks
from trusted_path import submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the answers travel to a rank
SOURCE = ROOT / "solutions" / "09_debugging" / "read_the_logs.ipynb"
CPU_LOGS = ("raise", "raise_record", "timeout", "mismatch_detail", "sigkill")
# What a fresh capture must repeat: the facts that do not depend on which exit torchrun's agent
# happened to notice first (the other rank may exit on its own or be stopped with SIGTERM).
STABLE = {
    "child_failed": ("failing_rank", "line", "exception"),
    # with_record: its root cause is picked by timestamps; see test_a_fresh_capture_shows_...
    "timeout": ("rank0_collective", "rank0_line", "rank1_collective", "rank1_line",
                "timeout_ms"),
    "mismatch": ("collective", "line", "shape_rank0", "shape_rank1", "sequence_number"),
    "killed": ("failing_rank", "exitcode", "signal", "rank0_line"),
}


def solution_answers() -> dict:
    """The solution notebook's ``answer_*`` functions, by lab."""
    namespace: dict = {}
    for cell in nbformat.read(SOURCE, as_version=4).cells:
        if cell.cell_type == "code" and cell.metadata.get("nbgrader", {}).get("solution"):
            exec(compile(cell.source, str(SOURCE), "exec"), namespace)
    return {lab: namespace[f"answer_{lab}"] for lab in checks.LABS}


def returning(answer: dict):
    def answer_function():
        return answer
    return answer_function


def with_field(lab: str, **changed):
    return returning({**checks.truth(lab), **changed})


# --- the truth comes from the committed logs ---------------------------------------------------


def test_every_fact_asked_is_found_in_the_committed_logs():
    for lab in checks.LABS:
        facts = checks.truth(lab)
        assert set(checks.VISIBLE[lab]) < set(facts), lab
        assert all(value is not None for value in facts.values()), (lab, facts)


def test_the_logs_say_what_the_exercise_teaches():
    plain, recorded = (checks.read_log(name).body for name in ("raise", "raise_record"))
    # without @record: no error file, no traceback in the summary; with it, both
    assert all(f.error_file == "<N/A>" for f in checks.summary(plain))
    assert "To enable traceback see" in plain
    root = checks.root_cause(checks.summary(recorded))
    assert root.error_file.endswith("error.json")
    assert checks.exception_of(root.traceback) == "ValueError"
    assert checks.root_cause(checks.summary(plain)).rank == \
        checks.truth("child_failed")["failing_rank"]
    killed = checks.summary(checks.read_log("sigkill").body)
    assert {(f.exitcode, f.signal) for f in killed} == {(-9, "SIGKILL"), (-15, "SIGTERM")}
    gpu = checks.read_log("gpu_duplicate_no_set_device")
    assert gpu.torch_version == "2.11.0+cu130" and "Duplicate GPU detected" in gpu.body
    assert "[rank" not in checks.read_log("gpu_duplicate_set_device").body


@pytest.mark.parametrize("log, script", [
    *((name, "failing_job.py") for name in CPU_LOGS),
    ("gpu_duplicate_no_set_device", "gpu_duplicate.py"),
    ("gpu_duplicate_set_device", "gpu_duplicate.py"),
])
def test_the_scripts_beside_the_logs_still_have_the_lines_the_logs_quote(log, script):
    """A script edited without capturing its logs again would make the lines asked wrong."""
    source = (checks.LOGS_DIR / script).read_text().splitlines()
    lines = [re.sub(r"^\[rank\d+\]: ?", "", line)
             for line in checks.read_log(log).body.splitlines()]
    quoted = [(int(found.group(2)), following.strip())
              for line, following in zip(lines, lines[1:])
              for found in [checks._FRAME.search(line)]
              if found and found.group(1).endswith(("failing_job.py", "dup_gpu.py"))
              and not checks._FRAME.search(following)]  # interleaved ranks: the next frame
    assert quoted
    for number, text in quoted:
        assert source[number - 1].strip().startswith(text), (number, text)


@pytest.mark.parametrize("exitcode, name", [(-9, "SIGKILL"), (-15, "SIGTERM"), (-6, "SIGABRT")])
def test_torchrun_names_a_negative_exit_code_by_its_signal(exitcode, name):
    """ProcessFailure.signal_name (torch/distributed/elastic/multiprocessing/errors/__init__.py):
    the exit code is Popen's returncode, -N for signal N."""
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="")
    assert failure.signal_name() == name and failure.message.startswith(f"Signal {-exitcode}")


def test_show_log_prints_the_log_with_line_numbers(capsys):
    checks.show_log("sigkill")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("   1  # machine:") and any("SIGKILL" in line for line in lines)


# --- a fresh capture on the installed torch tells the same facts -------------------------------


@pytest.fixture(scope="module")
def fresh_logs(tmp_path_factory, host):
    captured = checks.read_log("raise").torch_version
    if captured.split("+")[0] != torch.__version__.split("+")[0]:
        pytest.skip(f"the logs were captured with torch {captured}, this is {torch.__version__}")
    host.start()  # the trusted-path test's host warms up while the jobs run (and wait 5 s)
    make_logs = import_by_path("ch09_make_logs",
                               ROOT / "chapters/09_debugging/captured_logs/make_logs.py")
    folder = tmp_path_factory.mktemp("fresh_logs")
    make_logs.capture(list(CPU_LOGS), folder)
    return folder


@pytest.mark.parametrize("lab", sorted(STABLE))
def test_a_fresh_capture_tells_the_same_facts(fresh_logs, lab):
    committed, fresh = checks.truth(lab), checks.truth(lab, fresh_logs)
    assert {k: fresh[k] for k in STABLE[lab]} == {k: committed[k] for k in STABLE[lab]}


def test_a_fresh_capture_shows_what_record_adds(fresh_logs):
    plain = checks.summary(checks.read_log("raise", fresh_logs).body)
    recorded = checks.summary(checks.read_log("raise_record", fresh_logs).body)
    raised = checks.failure_of(recorded, checks.truth("with_record")["root_cause_rank"])
    assert all(f.error_file == "<N/A>" for f in plain)
    assert raised.error_file.endswith("error.json")
    assert checks.exception_of(raised.traceback) == "ValueError"
    assert checks.script_frames(raised.traceback, "failing_job.py")[-1] == \
        checks.truth("with_record")["line"]


# --- the checks --------------------------------------------------------------------------------


def test_the_solution_passes_every_check_through_the_trusted_path(host):
    answers = solution_answers()
    for lab, answer in answers.items():
        getattr(checks, f"check_{lab}")(submitted(answer, host))
    hidden.check_read_the_logs(*(submitted(answers[lab], host) for lab in checks.LABS))


def test_answers_are_compared_by_meaning_not_spelling():
    checks.check_timeout(with_field("timeout", rank0_collective="dist.all_reduce",
                                    rank1_collective="ALLGATHER"))
    checks.check_mismatch(with_field("mismatch", collective="torch.distributed.all_gather"))
    answers = {lab: with_field(lab) for lab in checks.LABS}
    answers["killed"] = with_field("killed", signal="KILL")
    answers["child_failed"] = with_field("child_failed", exception="builtins.ValueError")
    hidden.check_read_the_logs(*answers.values())


# Tempting wrong fields: (lab, field, wrong value, the truth that must not be revealed).
TEMPTING = [
    ("child_failed", "failing_rank", 0, None),  # the summary's other entry
    ("child_failed", "line", 69, 37),  # an outer frame of failing_job.py
    ("with_record", "line", 367, 37),  # torch's @record wrapper, not the script
    ("timeout", "rank1_line", 82, 56),  # the outer frame, in train
    ("timeout", "rank1_collective", "barrier", "all_gather"),
    ("mismatch", "line", 82, 56),
    ("killed", "failing_rank", 0, None),  # the only traceback in the log is rank 0's
    ("killed", "exitcode", 1, -9),
    ("duplicate_gpu", "line", 7, 14),  # where the other log's ranks failed
]


@pytest.mark.parametrize("lab, field, wrong, secret", TEMPTING,
                         ids=[f"{lab}-{field}" for lab, field, _, _ in TEMPTING])
def test_a_tempting_wrong_field_is_named_with_a_hint_not_the_value(lab, field, wrong, secret):
    with pytest.raises(CheckFailed) as failed:
        getattr(checks, f"check_{lab}")(with_field(lab, **{field: wrong}))
    message = str(failed.value)
    assert f"'{field}' = {wrong!r} is not what the log says. Where to look:" in message
    assert message.count("* ") == 1, message  # only that field
    if secret is not None:
        assert str(secret) not in message


def test_hidden_checks_ask_the_fields_the_visible_ones_leave_out():
    answers = {lab: with_field(lab) for lab in checks.LABS}
    answers["killed"] = with_field("killed", rank0_exitcode=1)
    answers["mismatch"] = with_field("mismatch", shape_rank1=[8, 1])
    checks.check_killed(answers["killed"])  # the visible check does not ask them
    with pytest.raises(CheckFailed) as failed:
        hidden.check_read_the_logs(*answers.values())
    message = str(failed.value)
    assert "'rank0_exitcode' = 1" in message and "'shape_rank1' = [8, 1]" in message
    assert "answer_killed()" in message and "answer_mismatch()" in message


@pytest.mark.parametrize("answer, says", [
    ({"failing_rank": "1", "exitcode": -9}, "'failing_rank' should be an int, not '1'"),
    ({"failing_rank": True, "exitcode": -9}, "'failing_rank' should be an int"),
    ({"exitcode": -9}, "'failing_rank' is missing"),
    ([1, -9], "must return a dict of ints, strings and lists of ints; it returned a list"),
    ({1: 1}, "must return a dict"),
])
def test_malformed_answers_say_what_is_wrong(answer, says):
    with pytest.raises(CheckFailed, match=None) as failed:
        checks.check_killed(returning(answer))
    assert says in str(failed.value)


@pytest.mark.parametrize("observations", [[{}], [{"answers": "1"}], [{"answers": []}], ["x"]])
def test_the_judge_reads_the_report_as_untrusted_data(observations):
    with pytest.raises(CheckFailed, match="lacks the answers"):
        checks.judge_answers(observations, 1, ("killed",), (("failing_rank",),))
