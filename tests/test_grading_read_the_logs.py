"""The checks of exercise read_the_logs (chapter 09: facts read from real logs of failed jobs)
take their truth from the committed logs, pass the solution notebook's answers (visible and
hidden checks, once through the trusted grader's path), name each tempting wrong field with a
hint that does not give the value away, and read the rank's report as untrusted data. The truth
is parsed on the grader's side only (autograder/hidden/read_the_logs.py): the visible checks,
which students get and their code can import, hold digests of the visible fields, which must be
the digests of what the parser reads in the committed logs, and nothing that gives a hidden
field away. A fresh capture of the CPU logs on the installed torch (one parallel launch of
make_logs.py) must still tell the facts the exercise asks about, so a torch that changes them
turns this red. The exercise: solutions/09_debugging/read_the_logs.nb.py; the logs and their
scripts: chapters/09_debugging/captured_logs/.
"""

from __future__ import annotations

import ast
import inspect
import re
import shutil
import sys

import cloudpickle
import nbformat
import pytest
import torch
from course_layout import ROOT, import_by_path
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from autograder import student_repo
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
    return returning({**hidden.truth(lab), **changed})


# --- the truth comes from the committed logs ---------------------------------------------------


def test_every_fact_asked_is_found_in_the_committed_logs():
    for lab in checks.LABS:
        facts = hidden.truth(lab)
        assert set(checks.VISIBLE[lab]) < set(facts), lab
        assert all(value is not None for value in facts.values()), (lab, facts)


def test_the_lesson_reads_none_of_the_logs_the_exercise_asks_about():
    """Its worked examples come from lesson_job.py: an excerpt of an exercise log would show the
    ranks, lines and collectives the exercise asks for."""
    lesson = (ROOT / "chapters/09_debugging/09_debugging.nb.py").read_text()
    shown = set(re.findall(r"""excerpt\(["']([\w.]+)\.log["']""", lesson))
    asked = {name for names in checks.LABS.values() for name in names}
    assert shown and not shown & asked, shown & asked


def test_the_visible_digests_are_those_of_the_facts_parsed_from_the_committed_logs():
    assert checks.DIGESTS == hidden.visible_digests(), (
        "the logs changed: print the new table with `python -m autograder.hidden.read_the_logs` "
        "and put it in ddpcourse/grading/exercises/read_the_logs.py")


def test_a_log_that_tells_another_fact_no_longer_matches_the_digests(tmp_path):
    folder = tmp_path / "logs"
    shutil.copytree(checks.LOGS_DIR, folder)
    raised = folder / "raise.log"
    line = hidden.truth("child_failed")["line"]
    raised.write_text(raised.read_text().replace(f'failing_job.py", line {line},',
                                                 f'failing_job.py", line {line + 1},'))
    assert hidden.truth("child_failed", folder)["line"] == line + 1
    changed = hidden.visible_digests(folder)
    assert changed["child_failed"]["line"] != checks.DIGESTS["child_failed"]["line"]
    assert changed["timeout"] == checks.DIGESTS["timeout"]


def test_the_logs_say_what_the_exercise_teaches():
    plain, recorded = (hidden.read_log(name).body for name in ("raise", "raise_record"))
    # without @record: no error file, no traceback in the summary; with it, both
    assert all(f.error_file == "<N/A>" for f in hidden.summary(plain))
    assert "To enable traceback see" in plain
    root = hidden.root_cause(hidden.summary(recorded))
    assert root.error_file.endswith("error.json")
    assert hidden.exception_of(root.traceback) == "ValueError"
    assert hidden.root_cause(hidden.summary(plain)).rank == \
        hidden.truth("child_failed")["failing_rank"]
    killed = hidden.summary(hidden.read_log("sigkill").body)
    assert {(f.exitcode, f.signal) for f in killed} == {(-9, "SIGKILL"), (-15, "SIGTERM")}
    gpu = hidden.read_log("gpu_duplicate_no_set_device")
    assert gpu.torch_version == "2.11.0+cu130" and "Duplicate GPU detected" in gpu.body
    assert "[rank" not in hidden.read_log("gpu_duplicate_set_device").body


@pytest.mark.parametrize("log, script", [
    *((name, "failing_job.py") for name in CPU_LOGS),
    *((name, "lesson_job.py") for name in ("lesson_raise", "lesson_raise_record", "lesson_abort")),
    ("gpu_duplicate_no_set_device", "gpu_duplicate.py"),
    ("gpu_duplicate_set_device", "gpu_duplicate.py"),
])
def test_the_scripts_beside_the_logs_still_have_the_lines_the_logs_quote(log, script):
    """A script edited without capturing its logs again would make the lines asked wrong."""
    source = (checks.LOGS_DIR / script).read_text().splitlines()
    lines = [re.sub(r"^\[rank\d+\]: ?", "", line)
             for line in hidden.read_log(log).body.splitlines()]
    quoted = [(int(found.group(2)), following.strip())
              for line, following in zip(lines, lines[1:])
              for found in [hidden.FRAME.search(line)]
              if found and found.group(1).endswith((script, "dup_gpu.py"))
              and not hidden.FRAME.search(following)]  # interleaved ranks: the next frame
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
    captured = hidden.read_log("raise").torch_version
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
    committed, fresh = hidden.truth(lab), hidden.truth(lab, fresh_logs)
    stable = STABLE[lab]
    if lab == "killed" and fresh["rank0_line"] is None:
        # A race, seen on a loaded machine: torchrun's agent, which stops the other workers as
        # soon as one has died, terminated rank 0 before gloo told rank 0 its peer was gone, so
        # rank 0 printed no traceback. Then rank 0 must have ended by that SIGTERM.
        assert fresh["rank0_exitcode"] == -15, fresh
        stable = tuple(key for key in stable if key != "rank0_line")
    assert {k: fresh[k] for k in stable} == {k: committed[k] for k in stable}


def test_a_fresh_capture_shows_what_record_adds(fresh_logs):
    plain = hidden.summary(hidden.read_log("raise", fresh_logs).body)
    recorded = hidden.summary(hidden.read_log("raise_record", fresh_logs).body)
    raised = hidden.failure_of(recorded, hidden.truth("with_record")["root_cause_rank"])
    assert all(f.error_file == "<N/A>" for f in plain)
    assert raised.error_file.endswith("error.json")
    assert hidden.exception_of(raised.traceback) == "ValueError"
    assert hidden.script_frames(raised.traceback, "failing_job.py")[-1] == \
        hidden.truth("with_record")["line"]


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


# --- nothing a student can import or read gives an answer away ----------------------------------
# The visible checks ship to students and are importable where a submission runs: they must hold
# no true value and nothing that derives one, and no oracle for a hidden field. (A visible field
# is no secret from its own visible check, which says whether a guess is right.)


LOG_NAMES = [log for names in checks.LABS.values() for log in names]


def true_values(hidden_only: bool = False) -> dict[tuple[str, str], list]:
    """Each field's true value as parsed and as the checks normalize it, by (lab, field)."""
    return {(lab, field): [value, checks.normalize(checks.KINDS[field], value)]
            for lab in checks.LABS for field, value in hidden.truth(lab).items()
            if not (hidden_only and field in checks.VISIBLE[lab])}


def is_true_value(item, truths: dict) -> bool:
    return any(type(item) is type(value) and item == value
               for values in truths.values() for value in values)


def held_in(value, depth: int = 0):
    """``value`` and, recursively, what its dicts, lists, tuples and sets hold."""
    yield value
    if depth < 8 and isinstance(value, dict):
        for key, item in value.items():
            yield from held_in(key, depth + 1)
            yield from held_in(item, depth + 1)
    elif depth < 8 and isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from held_in(item, depth + 1)


def test_no_data_of_the_public_checks_is_a_true_value():
    truths = true_values()
    assert not hasattr(checks, "truth") and not hasattr(checks, "read_log")
    found = [(name, item) for name, value in vars(checks).items()
             if not name.startswith("__") and not callable(value) and not inspect.ismodule(value)
             for item in held_in(value) if is_true_value(item, truths)]
    assert found == []


def test_no_public_function_returns_a_true_value(capsys):
    """Every function of the visible checks, called with each lab, field, kind and log name and
    each (lab, field) and (kind, field): none returns a true value, whole or inside its result."""
    truths = true_values()
    words = [*checks.LABS, *checks.KINDS, *set(checks.KINDS.values()), *LOG_NAMES]
    calls = [(), *((word,) for word in words),
             *((lab, field) for lab in checks.LABS for field in checks.KINDS),
             *((kind, field) for kind in set(checks.KINDS.values()) for field in checks.KINDS)]
    functions = {name: f for name, f in vars(checks).items()
                 if inspect.isfunction(f) and f.__module__ == checks.__name__}
    assert {"show_log", "normalize", "digest", "judge_answer", "check_killed"} <= set(functions)
    found, called = [], 0
    for name, function in functions.items():
        signature = inspect.signature(function)
        for args in calls:
            try:
                signature.bind(*args)
            except TypeError:
                continue
            called += 1
            try:
                result = function(*args)
            except Exception:  # noqa: BLE001 - a refusal gives nothing away
                continue
            found += [(name, args, item) for item in held_in(result)
                      if is_true_value(item, truths)]
    capsys.readouterr()  # show_log printed the logs: reading them is the exercise
    assert called > 100 and found == []


def test_the_public_checks_cannot_tell_a_right_hidden_field_from_a_wrong_one():
    assert {lab: set(fields) for lab, fields in checks.DIGESTS.items()} == \
        {lab: set(fields) for lab, fields in checks.VISIBLE.items()}
    for (lab, field), (value, normalized) in true_values(hidden_only=True).items():
        with pytest.raises(ValueError, match="judged when the notebook is graded"):
            checks.matches_digest(lab, field, normalized)
        with pytest.raises(ValueError):
            checks.judge_answer(lab, {field: value}, (field,))


def public_files() -> dict[str, str]:
    """read_the_logs' files that the student repository holds (autograder/student_repo.py's
    allow-list), by git path: the code a student reads."""
    listed = student_repo._git("ls-files", "*read_the_logs*").decode().split()
    return {path: (ROOT / path).read_text() for path in listed
            if student_repo.is_student_file(path)}


def constants(code: str):
    """The literal values in Python source: strings, numbers (with their sign), lists of ints."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Constant):
            yield node.value
        elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
              and isinstance(node.operand, ast.Constant)):
            yield -node.operand.value
        elif isinstance(node, ast.List) and all(isinstance(item, ast.Constant)
                                                for item in node.elts):
            yield [item.value for item in node.elts]


def leaks(value, truths: dict) -> list:
    """The hidden fields a literal gives away: the value itself, a name inside a text, or a
    number of two digits or more inside a text (one digit is in every text: 'rank 0')."""
    if type(value) is not str:
        return [key for key, values in truths.items() if is_true_value(value, {key: values})]
    for log in LOG_NAMES:  # a text may name a log: sigkill.log's name is the lab's topic
        value = re.sub(rf"\b{log}\b(\.log)?", "", value)
    found = []
    for key, values in truths.items():
        for true in values:
            if isinstance(true, str) and true.lower() in value.lower():
                found.append(key)
            elif type(true) is int and len(str(abs(true))) > 1 and re.search(
                    rf"(?<![\d.]){re.escape(str(true))}(?!\d)", value):
                found.append(key)
    return found


def test_the_student_repository_holds_no_hidden_fields_value_in_read_the_logs_code():
    """The code of the visible checks and of the released notebook (its markdown teaches facts
    such as "-9 is SIGKILL", and the logs themselves hold every answer: reading them is the
    exercise); and no digest of a hidden field anywhere in those files."""
    files = public_files()
    assert set(files) == {"ddpcourse/grading/exercises/read_the_logs.py",
                          "exercises/09_debugging/read_the_logs.ipynb"}
    truths = true_values(hidden_only=True)
    hidden_digests = {checks.digest(lab, field, normalized)
                      for (lab, field), (_, normalized) in truths.items()}
    found = []
    for path, text in files.items():
        if path.endswith(".ipynb"):
            notebook = nbformat.reads(text, as_version=4)
            code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
            assert all(not cell.get("outputs") for cell in code_cells), path
            codes = [cell.source for cell in code_cells]
        else:
            codes = [text]
        found += [(path, value, leaks(value, truths)) for code in codes
                  for value in constants(code) if leaks(value, truths)]
        found += [(path, digest) for digest in hidden_digests if digest in text]
    assert found == []


def test_the_leak_search_finds_what_it_looks_for():
    truths = true_values(hidden_only=True)
    code = (f'x = {hidden.truth("with_record")["rank0_exitcode"]}\n'
            f'shape = {hidden.truth("mismatch")["shape_rank1"]}\n'
            f'hint = "the type is {hidden.truth("child_failed")["exception"].lower()}"\n'
            f'note = "waited {hidden.truth("timeout")["timeout_ms"]}ms"\n'
            'fine = "rank 0 of 2 in sigkill.log, e.g. KeyError"')
    found = {key for value in constants(code) for key in leaks(value, truths)}
    assert {("with_record", "rank0_exitcode"), ("mismatch", "shape_rank1"),
            ("child_failed", "exception"), ("timeout", "timeout_ms")} <= found
    assert not leaks("rank 0 of 2 in sigkill.log, e.g. KeyError", truths)
