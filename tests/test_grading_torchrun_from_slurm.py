"""The checks of exercise torchrun_from_slurm (chapter 03: torchrun_argv_from_slurm, launched for
real) catch plausible wrong solutions, each with a message that says what was expected and what
came back, in the student's kernel and judged by the trusted grader (autograder/trusted.py, where
only the ranks' observations come back), and read the ranks' reports as untrusted data.
The exercise: solutions/03_torchrun/torchrun_from_slurm.nb.py."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping

import pytest

from autograder.hidden import torchrun_from_slurm as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import torchrun_from_slurm as checks
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


def the_solution():
    """``torchrun_argv_from_slurm`` as the source notebook's solution cell defines it.
    (autograder.sources is imported here, not above: the ranks import this module to rebuild its
    functions, and nbformat would cost each of them seconds.)"""
    from autograder.sources import SOLUTIONS, solution_code

    source = SOLUTIONS / "03_torchrun" / "torchrun_from_slurm.ipynb"
    namespace = {"Mapping": Mapping}
    exec(compile(solution_code(source, "torchrun-argv"), "<student notebook>", "exec"), namespace)
    return namespace["torchrun_argv_from_slurm"]


def command(env, script, port=29500, head=None, node="SLURM_NODEID"):
    nodes = env["SLURM_NNODES"]
    return ["torchrun", "--nnodes", nodes, "--node-rank", env[node], "--nproc-per-node",
            env.get("SLURM_GPUS_ON_NODE", "1"), "--master-addr", head or env["SLURM_JOB_NODELIST"],
            "--master-port", str(port), script]


def unexpanded(env, script, port=29500):
    """Uses SLURM_JOB_NODELIST as the host, brackets and all."""
    return command(env, script, port)


def padding_lost(env, script, port=29500):
    item = env["SLURM_JOB_NODELIST"].split(",")[0]
    if "[" in item:
        prefix, rest = item.split("[", 1)
        item = prefix + str(int(rest.split("-")[0].split(",")[0].rstrip("]")))
    return command(env, script, port, head=item)


def node_from_procid(env, script, port=29500):
    return command(env, script, port, head=hidden.first_host(env["SLURM_JOB_NODELIST"]),
                   node="SLURM_PROCID")


def smallest_number(env, script, port=29500):
    """Sorts the numbers in the brackets and takes the smallest ('a[3,1-2]' -> a1)."""
    missing = [n for n in checks.REQUIRED if n not in env]
    if missing or not 0 <= int(env["SLURM_NODEID"]) < int(env["SLURM_NNODES"]):
        raise ValueError(f"missing {missing} or SLURM_NODEID out of range")
    nodelist = env["SLURM_JOB_NODELIST"]
    head = hidden.first_host(nodelist)
    if "[" in nodelist.split(",")[0]:
        prefix, rest = nodelist.split("[", 1)
        numbers = rest.split("]", 1)[0].replace("-", ",").split(",")
        head = prefix + min(numbers, key=int) + rest.split("]", 1)[1].split(",")[0]
    return command(env, script, port, head=head)


def the_articles_command(env, script, port=29500):
    """--nnodes and --node_rank only: no --master-addr, no --master-port."""
    return ["torchrun", "--nnodes", env["SLURM_NNODES"], "--node_rank", env["SLURM_NODEID"],
            "--nproc_per_node", env.get("SLURM_GPUS_ON_NODE", "1"), script]


def names_first_missing_only(env, script, port=29500):
    for name in checks.REQUIRED:
        if name not in env:
            raise ValueError(f"{name} is not set")
    return command(env, script, port, head=hidden.first_host(env["SLURM_JOB_NODELIST"]))


def no_range_check(env, script, port=29500):
    missing = [n for n in checks.REQUIRED if n not in env]
    if missing:
        raise ValueError(" ".join(missing))
    return command(env, script, port, head=hidden.first_host(env["SLURM_JOB_NODELIST"]))


def test_the_reference_first_host_handles_every_documented_form():
    for nodelist, head in [("gpu07", "gpu07"), ("n1,n2", "n1"), ("gpu[07-09,12]", "gpu07"),
                           ("node-[003-004],login1", "node-003"), ("a[3,1-2]", "a3"),
                           ("gpu[01-02]-ib", "gpu01-ib"), ("login1,node-[003-004]", "login1")]:
        assert hidden.first_host(nodelist) == head


def test_every_case_states_the_first_host_of_its_hostlist():
    """The checks hold no hostlist parser (it is the exercise's answer): each case states its
    head, held here to the reference parser of the hidden checks."""
    for env, *_, what, head in [case[:5] for case in checks.VISIBLE_CASES + hidden.CASES]:
        assert head == hidden.first_host(env["SLURM_JOB_NODELIST"]), what
    assert not hasattr(checks, "first_host")


@pytest.mark.parametrize("wrong, expected", [
    (unexpanded, "--master-addr: expected 'gpu07', torchrun reads 'gpu[07-08]'"),
    (padding_lost, "--master-addr: expected 'gpu07', torchrun reads 'gpu7'"),
    (node_from_procid, "raised KeyError: 'SLURM_PROCID'"),
    (the_articles_command, "--master-port: expected 31000, torchrun reads 29500"),
])
def test_visible_parse_check_catches(wrong, expected):
    with pytest.raises(CheckFailed) as info:
        checks.check_torchrun_argv_parses(wrong)
    assert expected in str(info.value)


def test_visible_error_check_wants_every_missing_variable_named():
    with pytest.raises(CheckFailed, match=r"must name \['SLURM_NODEID', 'SLURM_JOB_NODELIST'\]"):
        checks.check_torchrun_argv_rejects_missing_variables(names_first_missing_only)


@pytest.mark.parametrize("wrong, expected", [
    (smallest_number, "the first number listed"),
    (no_range_check, "SLURM_NODEID equal to SLURM_NNODES"),
])
def test_hidden_checks_catch(wrong, expected):
    checks.check_torchrun_argv_parses(wrong)  # right on every visible case
    checks.check_torchrun_argv_rejects_missing_variables(wrong)
    with pytest.raises(CheckFailed, match=expected):
        hidden.check_torchrun_argv(wrong)


def test_the_articles_command_never_meets_and_the_launch_check_says_so_quickly(no_orphans):
    with pytest.raises(CheckFailed) as info:
        checks.check_torchrun_argv_launches_two_nodes(the_articles_command)
    message = str(info.value)
    assert "node 1 uses --master-addr 127.0.0.1 --master-port 29500 (torchrun's default)" in message
    assert "never meet node 0" in message
    # the lonely node gave up by itself (rendezvous timeout), it did not run into the deadline
    assert "exited with code 1" in message and "timed out after 3000ms" in message


def test_a_right_command_meets_for_real(no_orphans):
    reports = checks.launch_nodes(node_from_procid, 2, "localhost,127.0.0.1",  # PROCID == NODEID
                                  "localhost")
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert {r["store"].rsplit(":", 1)[0] for r in reports} == {"localhost"}
    assert {r["group_rank"] for r in reports} == {"0", "1"}


def returns_a_tuple_and_rebinds_the_judge(env, script, port=29500):
    """A tuple, not a list, and the check module's comparisons rebound in its process."""
    import ddpcourse.grading.checks as grading
    import ddpcourse.grading.exercises.torchrun_from_slurm as case

    case.compare_args = case.parse_torchrun = lambda *args, **kwargs: None
    grading.judge_each_rank = case.judge_each_rank = lambda *args, **kwargs: None
    return tuple(command(env, script, port, head=hidden.first_host(env["SLURM_JOB_NODELIST"])))


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("wrong, check, message", [
    (unexpanded, checks.check_torchrun_argv_parses,
     re.escape("--master-addr: expected 'gpu07', torchrun reads 'gpu[07-08]'")),
    (node_from_procid, checks.check_torchrun_argv_parses, "raised KeyError: 'SLURM_PROCID'"),
    (names_first_missing_only, checks.check_torchrun_argv_rejects_missing_variables,
     r"must name \['SLURM_NODEID', 'SLURM_JOB_NODELIST'\]"),
    (returns_a_tuple_and_rebinds_the_judge, checks.check_torchrun_argv_parses,
     r"expected a list of str, got \('torchrun', "),
    (smallest_number, hidden.check_torchrun_argv, "the first number listed"),
    (the_articles_command, checks.check_torchrun_argv_launches_two_nodes,
     r"(?s)node 1 uses --master-addr 127.0.0.1 --master-port 29500 \(torchrun's default\).*"
     r"never meet node 0.*exited with code 1"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(wrong, host))
    assert str(failed.value).startswith("rank 0: ")  # the failed rank is named


# --- the judges read the ranks' reports as untrusted data ----------------------------------

ARGV_CASES = checks.VISIBLE_CASES
LAUNCH_ARGS = (2, "localhost,127.0.0.1", "localhost", None, 60.0)  # nnodes, nodelist, head, gpus


def honest_argv_reports():
    report = checks.observe_argvs(0, 1, the_solution(), ARGV_CASES)
    return [report, copy.deepcopy(report)]


def honest_error_reports():
    report = checks.observe_errors(0, 1, the_solution(), checks.VISIBLE_ERRORS)
    return [report, copy.deepcopy(report)]


def honest_launch_report(lonely=False):
    """What a rank reports for the solution's (or the article's) commands, without launching."""
    nnodes, nodelist, _, gpus, _ = LAUNCH_ARGS
    port, script = 40123, "/tmp/ddpcourse-torchrun-from-slurm-x/grader_worker.py"
    fn = the_articles_command if lonely else the_solution()
    calls = [checks.observe_call(fn, env, script, port)
             for env in checks.node_envs(nnodes, nodelist, gpus)]
    report = {"port": port, "script": script, "calls": calls, "lonely": None, "runs": None}
    if lonely:
        report["lonely"] = {"returncode": 1, "timed_out": False, "seconds": 3.4,
                            "stdout_tail": "", "workers": [],
                            "stderr_tail": "torch.distributed.DistStoreError: Timed out after "
                                           "3000ms waiting for clients. 1/2 clients joined."}
        return report
    report["runs"] = [
        {"returncode": 0, "timed_out": False, "seconds": 4.0, "stdout_tail": "",
         "stderr_tail": "", "workers": [json.dumps(
             {"rank": node, "world_size": 2, "sum": 1.0, "group_rank": str(node),
              "local_rank": "0", "store": f"localhost:{port}"})]}
        for node in range(nnodes)]
    return report


CALL_DAMAGE = [
    ((), None), ((), [1, 2]), (("calls",), "all"), (("calls",), []), (("calls", 0), None),
    (("calls", 0, "argv"), "torchrun --nnodes 2"), (("calls", 0, "argv"), ["torchrun", 2]),
    (("calls", 0, "argv"), ["x"] * 10**5), (("calls", 0, "argv"), ["torchrun", "x" * 10**6]),
    (("calls", 0, "argv"), ["torchrun", "--help"]), (("calls", 0, "argv"), None),
    (("calls", 0, "argv"), ["torchrun", "--nnodes", "2", "--node-rank", "one", "train.py"]),
    (("calls", 0), {"argv": None, "type": None, "repr": None, "raised": None}),
    (("calls", 0, "raised"), "ValueError"), (("calls", 0, "raised"), {"raised": "ValueError"}),
    (("calls", 0, "raised"), {"raised": "X" * 10**6, "message": "m" * 10**6,
                              "is_value_error": True}),
]
ERROR_DAMAGE = CALL_DAMAGE[:5] + CALL_DAMAGE[-3:] + [
    (("calls", 0, "raised"), None), (("calls", 0, "raised", "is_value_error"), "yes"),
    (("calls", 0, "raised", "message"), "x" * 1_000_000),
    (("calls", 0, "raised", "raised"), ["ValueError"]), (("calls",), [None, None]),
]
LAUNCH_DAMAGE = [
    ((), None), ((), {}), (("port",), "40123"), (("port",), True), (("port",), 10**6),
    (("port",), 40124), (("script",), None), (("script",), "s" * 10**6), (("calls",), []),
    (("calls", 1, "argv"), ["torchrun"]), (("runs",), None), (("runs",), []),
    (("runs", 0), None), (("runs", 0, "returncode"), "0"), (("runs", 0, "returncode"), False),
    (("runs", 0, "returncode"), 1), (("runs", 0, "timed_out"), 0), (("runs", 0, "seconds"), None),
    (("runs", 0, "stderr_tail"), None), (("runs", 0, "timed_out"), True),
    (("runs", 0, "workers"), "WORKER"),
    (("runs", 0, "workers"), [1]), (("runs", 0, "workers"), ["{}"] * 10**4),
    (("runs", 0, "workers"), []), (("runs", 0, "workers"), ["not json"]),
    (("runs", 0, "workers"), ["[" * 5000 + "]" * 5000]), (("runs", 0, "workers"), ["{}"]),
    (("runs", 0, "workers"), ['{"rank": 0, "world_size": 2, "sum": NaN, "group_rank": "0", '
                              '"local_rank": "0", "store": "s"}']),
    (("runs", 0, "workers"), ['{"rank": true, "world_size": 2, "sum": 1, "group_rank": "0", '
                              '"local_rank": "0", "store": "s"}']),
    (("runs", 0, "workers"), ['{"rank": 1, "world_size": 2, "sum": 1, "group_rank": "0", '
                              '"local_rank": "0", "store": "s"}']),
]
LONELY_DAMAGE = [
    (("lonely",), None), (("lonely",), {}), (("lonely", "seconds"), "3"),
    (("lonely", "stderr_tail"), ["timed out"]), (("lonely", "stderr_tail"), "t" * 10**6),
    (("lonely", "timed_out"), None),
]


def test_honest_reports_pass_the_judges():
    checks.judge_argvs(honest_argv_reports(), 2, ARGV_CASES)
    checks.judge_errors(honest_error_reports(), 2, checks.VISIBLE_ERRORS)
    reports = checks.worker_reports(honest_launch_report(), *LAUNCH_ARGS)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    with pytest.raises(CheckFailed, match="(?i)never meet node 0.*timed out after 3000ms"):
        checks.judge_launch([honest_launch_report(lonely=True)], 1, *LAUNCH_ARGS)


@pytest.mark.parametrize("case, path, value",
                         [("argvs", *damage) for damage in CALL_DAMAGE]
                         + [("errors", *damage) for damage in ERROR_DAMAGE]
                         + [("launch", *damage) for damage in LAUNCH_DAMAGE + CALL_DAMAGE]
                         + [("lonely", *damage) for damage in LONELY_DAMAGE],
                         ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(case, path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    if case == "argvs":
        reports = honest_argv_reports()
        judge = lambda: checks.judge_argvs(reports, 2, ARGV_CASES)  # noqa: E731
    elif case == "errors":
        reports = honest_error_reports()
        judge = lambda: checks.judge_errors(reports, 2, checks.VISIBLE_ERRORS)  # noqa: E731
    else:
        reports = [honest_launch_report(case == "lonely")] * 2
        judge = lambda: checks.judge_launch(reports, 2, *LAUNCH_ARGS)  # noqa: E731
    reports[1] = altered(reports[1], path, value)
    with pytest.raises(CheckFailed) as failed:
        judge()
    message = str(failed.value)
    if case != "lonely":
        assert message.startswith("rank 1:") and "rank 0:" not in message, message[:3000]
    else:  # both ranks' commands never meet (rank 0 says so); rank 1's lonely run is damaged
        assert message.startswith("rank 0: the commands") and "\nrank 1: " in message
    assert len(message) < 8000, message[:3000]
