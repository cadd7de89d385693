"""The checks of exercises 02 (bytes per rank) and 03 (torchrun from Slurm) catch plausible wrong
solutions, each with a message that says what was expected and what came back."""

from __future__ import annotations

import math

import pytest

from ddpcourse.grading import ch02, ch03, integrity
from ddpcourse.grading.checks import CheckFailed

# --- exercise 02: bytes_per_rank -------------------------------------------------------------


def predictor(shard="chunk", step_bytes=4, frozen_state=False, ddp_share=False, as_float=False,
              step_like_param=False, validate=True):
    """A bytes_per_rank built from one rule per argument; the defaults give the right answer."""

    def bytes_per_rank(model, world_size, rank, strategy):
        if validate and (strategy not in ("ddp", "fsdp") or not 0 <= rank < world_size):
            raise ValueError("bad arguments")
        held = {"params": 0, "grads": 0, "adam_state": 0}
        for p in model.parameters():
            rows, numel = p.shape[0], p.numel()
            if strategy == "fsdp" or ddp_share:
                if shard == "chunk":
                    per = math.ceil(rows / world_size)
                    mine = max(0, min(per, rows - rank * per))
                elif shard == "padded":
                    mine = math.ceil(rows / world_size)
                elif shard == "tensor_split":
                    mine = rows // world_size + (rank < rows % world_size)
                else:  # "divide": numel / world_size, no rule for rows
                    mine = rows / world_size
                numel = mine * (numel // rows)
            nbytes = numel * p.element_size()
            held["params"] += nbytes
            if p.requires_grad or frozen_state:
                held["grads"] += nbytes
                held["adam_state"] += 2 * nbytes + (p.element_size() if step_like_param
                                                    else step_bytes)
        return {k: v if as_float else int(v) for k, v in held.items()}

    return bytes_per_rank


@pytest.fixture(scope="module")
def snapshot():
    integrity.snapshot()


def hidden02():
    from autograder.hidden import ch02 as hidden

    return hidden


def test_the_reference_rule_passes_visible_and_hidden(snapshot):
    right = predictor()
    ch02.check_bytes_per_rank_even_model(right)
    ch02.check_bytes_per_rank_rejects_bad_arguments(right)
    hidden02().check_bytes_per_rank(right)


def test_forgetting_adams_step_counters_is_caught_by_the_visible_check(snapshot):
    with pytest.raises(CheckFailed) as info:
        ch02.check_bytes_per_rank_even_model(predictor(step_bytes=0))
    message = str(info.value)
    assert "rank 0:" in message and "rank 1:" in message
    # 6 parameters, 4 bytes each: 24 bytes short, under both strategies
    assert "ddp, world size 2" in message and "adam_state: measured 2552, you predicted 2528" in message


def test_the_articles_ddp_share_is_caught_by_the_visible_check(snapshot):
    with pytest.raises(CheckFailed, match=r"ddp, world size 2.*params: measured 1264, you "
                                          r"predicted 632"):
        ch02.check_bytes_per_rank_even_model(predictor(ddp_share=True))


def test_floats_and_missing_value_errors_are_caught_by_the_visible_checks(snapshot):
    with pytest.raises(CheckFailed, match="must be an int"):
        ch02.check_bytes_per_rank_even_model(predictor(shard="divide", as_float=True))
    with pytest.raises(CheckFailed, match=r"strategy='zero3'\): expected ValueError"):
        ch02.check_bytes_per_rank_rejects_bad_arguments(predictor(validate=False))


@pytest.mark.parametrize("wrong, expected", [
    (predictor(shard="divide"), "fsdp, world size 3"),  # 7 rows / 3 is not a shard
    (predictor(shard="tensor_split"), "fsdp, world size 3"),  # 7 rows: 3 + 2 + 2, not 3 + 3 + 1
    (predictor(shard="padded"), "fsdp, world size 3"),  # counts FSDP2's padding
    (predictor(frozen_state=True), "ddp, world size 1"),  # grads + Adam state for frozen layers
    (predictor(step_like_param=True), "model 'float64'"),  # step is float32 for float64 params
])
def test_uneven_frozen_and_float64_mistakes_pass_visible_but_fail_hidden(snapshot, wrong,
                                                                        expected):
    ch02.check_bytes_per_rank_even_model(wrong)  # rows divide evenly, float32, nothing frozen
    with pytest.raises(CheckFailed, match=expected):
        hidden02().check_bytes_per_rank(wrong)


# --- exercise 03: torchrun_argv_from_slurm ----------------------------------------------------


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
    return command(env, script, port, head=ch03.first_host(env["SLURM_JOB_NODELIST"]),
                   node="SLURM_PROCID")


def smallest_number(env, script, port=29500):
    """Sorts the numbers in the brackets and takes the smallest ('a[3,1-2]' -> a1)."""
    missing = [n for n in ch03.REQUIRED if n not in env]
    if missing or not 0 <= int(env["SLURM_NODEID"]) < int(env["SLURM_NNODES"]):
        raise ValueError(f"missing {missing} or SLURM_NODEID out of range")
    nodelist = env["SLURM_JOB_NODELIST"]
    head = ch03.first_host(nodelist)
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
    for name in ch03.REQUIRED:
        if name not in env:
            raise ValueError(f"{name} is not set")
    return command(env, script, port, head=ch03.first_host(env["SLURM_JOB_NODELIST"]))


def no_range_check(env, script, port=29500):
    missing = [n for n in ch03.REQUIRED if n not in env]
    if missing:
        raise ValueError(" ".join(missing))
    return command(env, script, port, head=ch03.first_host(env["SLURM_JOB_NODELIST"]))


def test_the_reference_first_host_handles_every_documented_form():
    for nodelist, head in [("gpu07", "gpu07"), ("n1,n2", "n1"), ("gpu[07-09,12]", "gpu07"),
                           ("node-[003-004],login1", "node-003"), ("a[3,1-2]", "a3"),
                           ("gpu[01-02]-ib", "gpu01-ib"), ("login1,node-[003-004]", "login1")]:
        assert ch03.first_host(nodelist) == head


@pytest.mark.parametrize("wrong, expected", [
    (unexpanded, "--master-addr: expected 'gpu07', torchrun reads 'gpu[07-08]'"),
    (padding_lost, "--master-addr: expected 'gpu07', torchrun reads 'gpu7'"),
    (node_from_procid, "raised KeyError: 'SLURM_PROCID'"),
    (the_articles_command, "--master-port: expected 31000, torchrun reads 29500"),
])
def test_visible_parse_check_catches(snapshot, wrong, expected):
    with pytest.raises(CheckFailed) as info:
        ch03.check_torchrun_argv_parses(wrong)
    assert expected in str(info.value)


def test_visible_error_check_wants_every_missing_variable_named(snapshot):
    with pytest.raises(CheckFailed, match=r"must name \['SLURM_NODEID', 'SLURM_JOB_NODELIST'\]"):
        ch03.check_torchrun_argv_rejects_missing_variables(names_first_missing_only)


@pytest.mark.parametrize("wrong, expected", [
    (smallest_number, "the first number listed"),
    (no_range_check, "SLURM_NODEID equal to SLURM_NNODES"),
])
def test_hidden_checks_catch(snapshot, wrong, expected):
    from autograder.hidden import ch03 as hidden

    ch03.check_torchrun_argv_parses(wrong)  # right on every visible case
    ch03.check_torchrun_argv_rejects_missing_variables(wrong)
    with pytest.raises(CheckFailed, match=expected):
        hidden.check_torchrun_argv(wrong)


def test_the_articles_command_never_meets_and_the_launch_check_says_so_quickly(snapshot,
                                                                              no_orphans):
    with pytest.raises(CheckFailed) as info:
        ch03.check_torchrun_argv_launches_two_nodes(the_articles_command)
    message = str(info.value)
    assert "node 1 uses --master-addr 127.0.0.1 --master-port 29500 (torchrun's default)" in message
    assert "never meet node 0" in message
    # the lonely node gave up by itself (rendezvous timeout), it did not run into the deadline
    assert "exited with code 1" in message and "timed out after 3000ms" in message


def test_a_right_command_meets_for_real(snapshot, no_orphans):
    reports = ch03.launch_nodes(node_from_procid, 2, "localhost,127.0.0.1")  # PROCID == NODEID
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert {r["store"].rsplit(":", 1)[0] for r in reports} == {"localhost"}
    assert {r["group_rank"] for r in reports} == {"0", "1"}
