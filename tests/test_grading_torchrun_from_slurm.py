"""The checks of exercise torchrun_from_slurm (chapter 03: torchrun_argv_from_slurm, launched for
real) catch plausible wrong solutions, each with a message that says what was expected and what
came back. The exercise: solutions/03_torchrun/torchrun_from_slurm.nb.py."""

from __future__ import annotations

import pytest

from autograder.hidden import torchrun_from_slurm as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import torchrun_from_slurm as checks

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


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
    return command(env, script, port, head=checks.first_host(env["SLURM_JOB_NODELIST"]),
                   node="SLURM_PROCID")


def smallest_number(env, script, port=29500):
    """Sorts the numbers in the brackets and takes the smallest ('a[3,1-2]' -> a1)."""
    missing = [n for n in checks.REQUIRED if n not in env]
    if missing or not 0 <= int(env["SLURM_NODEID"]) < int(env["SLURM_NNODES"]):
        raise ValueError(f"missing {missing} or SLURM_NODEID out of range")
    nodelist = env["SLURM_JOB_NODELIST"]
    head = checks.first_host(nodelist)
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
    return command(env, script, port, head=checks.first_host(env["SLURM_JOB_NODELIST"]))


def no_range_check(env, script, port=29500):
    missing = [n for n in checks.REQUIRED if n not in env]
    if missing:
        raise ValueError(" ".join(missing))
    return command(env, script, port, head=checks.first_host(env["SLURM_JOB_NODELIST"]))


def test_the_reference_first_host_handles_every_documented_form():
    for nodelist, head in [("gpu07", "gpu07"), ("n1,n2", "n1"), ("gpu[07-09,12]", "gpu07"),
                           ("node-[003-004],login1", "node-003"), ("a[3,1-2]", "a3"),
                           ("gpu[01-02]-ib", "gpu01-ib"), ("login1,node-[003-004]", "login1")]:
        assert checks.first_host(nodelist) == head


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
    reports = checks.launch_nodes(node_from_procid, 2, "localhost,127.0.0.1")  # PROCID == NODEID
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert {r["store"].rsplit(":", 1)[0] for r in reports} == {"localhost"}
    assert {r["group_rank"] for r in reports} == {"0", "1"}
