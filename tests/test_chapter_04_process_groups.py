"""Chapter 04 (process groups): init methods, timeouts, subgroups, the collectives catalogue, and
the "every process is rank 0" bug, each run in real process groups.

Multi-rank checks go through ``run_ranks`` (deadlines, no ports); the bug script runs under
torchrun in its own session, killed as a group if it overstays its deadline.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ddpcourse.launcher import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "04_process_groups"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too, so they import the same
sys.path.insert(0, str(ROOT / "chapters" / "03_torchrun"))

import _demos  # noqa: E402
import collectives_tour  # noqa: E402
from ddpcourse.launcher import run_bounded  # a deadline, and no process left behind


# --- init methods, timeouts, subgroups ------------------------------------------------------

@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_each_init_method_forms_a_group(method, tmp_path, no_orphans):
    env = None
    if method == "env":
        init_method = "env://"
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_demos.free_port())}
    elif method == "tcp":
        init_method = f"tcp://127.0.0.1:{_demos.free_port()}"
    else:
        init_method = f"file://{tmp_path / 'store'}"
    joined = run_ranks(_demos.join_and_sum, 2, init_method, init_process_group=False, env=env,
                       timeout=30)
    assert joined == [{"rank": r, "world_size": 2, "sum": 1.0} for r in range(2)]


def test_a_short_timeout_turns_a_missing_peer_into_an_error(tmp_path, no_orphans):
    [outcome] = run_ranks(_demos.wait_for_a_missing_peer, 1, str(tmp_path / "store"), 2.0,
                          init_process_group=False, timeout=30)
    assert outcome["error"] is not None and "timeout" in outcome["error"].lower()
    assert 1.5 < outcome["after_s"] < 20
    assert "collective_error" not in outcome  # gloo's default: init itself waited for the peer


def test_a_lazy_backend_returns_from_init_and_waits_at_the_first_collective(tmp_path, no_orphans):
    """What NCCL does without device_id, shown on CPU: gloo with TORCH_GLOO_LAZY_INIT=1."""
    [outcome] = run_ranks(_demos.wait_for_a_missing_peer, 1, str(tmp_path / "store"), 2.0,
                          init_process_group=False, env={"TORCH_GLOO_LAZY_INIT": "1"}, timeout=30)
    assert outcome["error"] is None, outcome  # init_process_group returned without the peer
    assert outcome["after_s"] < 1.5  # well below the 2 s timeout: it did not wait for it
    assert "timeout" in outcome["collective_error"].lower()
    assert 1.5 < outcome["collective_s"] < 20


def test_subgroups_reduce_within_themselves_and_destroy_cleanly(no_orphans):
    results = run_ranks(_demos.subgroups, 4, timeout=30)
    assert [r["group_sum"] for r in results] == [2.0, 4.0, 2.0, 4.0]  # 0+2 and 1+3
    assert [r["rank_in_group"] for r in results] == [0, 0, 1, 1]
    assert all(r["world_sum"] == 6.0 and r["group_size"] == 2 for r in results)
    assert all(r["rank_in_other_group"] == -1 for r in results)  # not a member: -1
    assert not any(r["initialized_after_destroy"] for r in results)


# --- the collectives ------------------------------------------------------------------------

def test_every_collective_leaves_the_expected_values_on_4_ranks(no_orphans):
    results = run_ranks(collectives_tour.tour, 4, timeout=60)
    assert collectives_tour.mismatches(results, 4) == []
    assert results[3]["all_to_all"] == ([3.0, 13.0, 23.0, 33.0], [30.0, 31.0, 32.0, 33.0])


def test_the_checker_catches_a_wrong_result():
    results = run_ranks(collectives_tour.tour, 2, timeout=60)
    results[1]["all_reduce"] = ([2.0], [2.0])  # as if rank 1 had skipped the all-reduce
    assert collectives_tour.mismatches(results, 2) == [
        "all_reduce: rank 1 got [2.0], expected [3.0]"]


def test_ddp_divides_before_the_sum_all_reduce_as_float16_overflow_shows(no_orphans):
    results = run_ranks(_demos.ddp_average_in_float16, 2, timeout=60)
    for r in results:
        assert r["all_reduce(SUM), then / N"] == float("inf")  # 80000 > 65504
        assert r["/ N, then all_reduce(SUM)"] == 40000.0
        assert r["DDP"] == 40000.0  # finite: DDP divided first


def test_a_comm_hook_gets_the_bucket_undivided_and_must_average_itself(no_orphans):
    results = run_ranks(_demos.what_a_comm_hook_sees, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["bucket seen by the hook"] == [float(rank + 1)]  # this rank's own gradient
        assert r["gradient after DDP"] == 3.0  # 1 + 2: the hook summed, nobody divided


def test_the_articles_sanity_check_prints_6_on_4_ranks_not_4(no_orphans):
    assert run_ranks(_demos.ones_times_rank, 4, timeout=30) == [6.0] * 4


# --- every process is rank 0 ----------------------------------------------------------------

def torchrun_bug_script(*args: str, timeout: float = 60, **env: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(CHAPTER / "everyone_is_rank0.py"), *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env)
    done = run_bounded(cmd, timeout, cwd=ROOT, env=full_env)
    if done.timed_out:
        pytest.fail(f"hung for {timeout} s instead of failing:\n{done.stdout}\n{done.stderr}")
    return done.returncode, done.stdout, done.stderr, done.seconds


def test_all_ranks_zero_fails_loudly_at_start_up_within_the_timeout(no_orphans):
    code, out, err, took = torchrun_bug_script("--timeout", "4", SLURM_PROCID="0")
    assert code != 0
    assert out.count("joins as rank 0 of 2") == 2
    assert "DistStoreError" in err and "wait timeout after 4000ms" in err
    assert "init_process_group failed after" in out
    assert "all_reduce" not in out  # it never got as far as training
    assert took < 60


def test_reading_a_missing_slurm_variable_fails_at_once(no_orphans):
    code, out, err, _ = torchrun_bug_script()
    assert code != 0 and "KeyError: 'SLURM_PROCID'" in err


def test_rank_and_world_size_from_slurm_give_silent_worlds_of_one(no_orphans):
    code, out, err, _ = torchrun_bug_script("--world-size-from", "SLURM_NTASKS",
                                            SLURM_PROCID="0", SLURM_NTASKS="1")
    assert code == 0, err
    assert "RANK=0: in a group of 1, all_reduce(ones * RANK) = 0" in out
    assert "RANK=1: in a group of 1, all_reduce(ones * RANK) = 1" in out


def test_reading_torchruns_rank_works(no_orphans):
    code, out, err, _ = torchrun_bug_script("--rank-from", "RANK")
    assert code == 0, err
    assert out.count("in a group of 2, all_reduce(ones * RANK) = 1") == 2


def test_started_by_hand_all_rank_0_gives_address_in_use_and_a_store_timeout(no_orphans):
    outcomes = run_ranks(_demos.everyone_rank0_by_hand, 2, _demos.free_port(), 2.0,
                         init_process_group=False, timeout=30)
    assert sum("EADDRINUSE" in o for o in outcomes) == 1, outcomes
    assert sum("waiting for clients" in o for o in outcomes) == 1, outcomes


# --- one GPU per rank ---------------------------------------------------------------------------

def gpu_setup(*flags: str, timeout: float = 120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(CHAPTER / "gpu_setup.py"), *flags]
    done = run_bounded(cmd, timeout, cwd=ROOT)
    if done.timed_out:
        pytest.fail(f"gpu_setup.py {' '.join(flags)} still running after {timeout} s:\n"
                    f"{done.stdout}\n{done.stderr}")
    return done


def two_gpus_with_nccl() -> bool:
    import torch
    import torch.distributed as dist

    return torch.cuda.device_count() >= 2 and dist.is_nccl_available()


NEEDS_TWO_GPUS = pytest.mark.skipif(not two_gpus_with_nccl(),
                                    reason="needs 2 CUDA GPUs and NCCL; runs only on a GPU machine")


@pytest.mark.skipif(two_gpus_with_nccl(), reason="this machine has the GPUs: the real runs below")
@pytest.mark.parametrize("flags", [(), ("--forget-set-device",)])
def test_gpu_setup_says_why_it_skips_without_gpus(flags, no_orphans):
    done = gpu_setup(*flags)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("skipped: this script needs NCCL and one GPU per local rank") == 1


@NEEDS_TWO_GPUS
def test_gpu_setup_puts_each_rank_on_its_own_gpu(no_orphans):
    done = gpu_setup()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "current devices [0, 1]: one GPU per rank" in done.stdout
    for rank in (0, 1):
        line = next(l for l in done.stdout.splitlines() if l.startswith(f"rank {rank},"))
        assert f"parameters_on cuda:{rank}" in line and f"output_on cuda:{rank}" in line
        assert f"plain_cuda_tensor_on cuda:{rank}" in line  # set_device made it the current device
    assert "gradients identical on every rank: True" in done.stdout


@NEEDS_TWO_GPUS
def test_without_set_device_every_rank_lands_on_gpu_0(no_orphans):
    done = gpu_setup("--forget-set-device")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "current devices [0, 0]: shared: several ranks on one GPU" in done.stdout
    assert done.stdout.count("plain_cuda_tensor_on cuda:0") == 2
