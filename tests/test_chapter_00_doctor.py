"""Chapter 00: the doctor's checks one by one (on this machine and with GPUs faked), its command
line and exit codes, the bandwidth arithmetic, and the chapter's two scripts."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpcourse import doctor

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
HAS_NVIDIA_SMI = doctor.shutil.which("nvidia-smi") is not None


# --- bandwidth arithmetic against hand-computed values ----------------------------------------

def test_algorithm_bandwidth_is_bytes_over_seconds():
    assert doctor.algorithm_bandwidth(4_000_000, 2e-3) == pytest.approx(2e9)


@pytest.mark.parametrize("world_size, expected", [
    (1, 0.0),          # 2(1-1)/1 = 0: nothing crosses a link
    (2, 1e9),          # 2(2-1)/2 = 1
    (4, 1.5e9),        # 2(4-1)/4 = 1.5
    (8, 1.75e9),       # 2(8-1)/8 = 1.75
])
def test_bus_bandwidth_follows_nccl_tests_all_reduce_formula(world_size, expected):
    # 1 GB in 1 s: algbw = 1e9 B/s, times 2(n-1)/n
    assert doctor.all_reduce_bus_bandwidth(1e9, 1.0, world_size) == pytest.approx(expected)


def test_bus_bandwidth_of_a_realistic_measurement():
    # 4 MiB in 5 ms on 4 ranks: algbw = 4194304 / 0.005 = 838,860,800 B/s; x 1.5
    assert doctor.all_reduce_bus_bandwidth(4 * 2**20, 5e-3, 4) == pytest.approx(1_258_291_200)


def test_human_bytes():
    assert doctor.human_bytes(4096) == "4 KiB"
    assert doctor.human_bytes(16 * 2**20) == "16 MiB"
    assert doctor.human_bytes(12) == "12 B"


# --- the checks on this machine ---------------------------------------------------------------

def test_result_ok_is_false_only_for_failures():
    assert doctor.CheckResult("x", doctor.PASS, "").ok
    assert doctor.CheckResult("x", doctor.WARN, "").ok
    assert doctor.CheckResult("x", doctor.SKIP, "").ok
    assert not doctor.CheckResult("x", doctor.FAIL, "").ok


def test_torch_check_reports_the_installed_version():
    result = doctor.check_torch()
    assert result.status == doctor.PASS
    assert torch.__version__ in result.detail


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only path")
def test_cuda_absent_is_skipped_with_advice():
    result = doctor.check_cuda()
    assert result.status in (doctor.SKIP, doctor.WARN) and result.ok
    assert "no GPU" in result.detail or "CPU-only" in result.detail
    assert result.advice


@pytest.mark.skipif(dist.is_nccl_available(), reason="checks the no-NCCL path")
def test_nccl_unavailable_is_reported_with_advice():
    result = doctor.check_nccl()
    assert result.status == doctor.SKIP and result.ok
    assert "not available" in result.detail
    assert "gloo" in result.advice
    nccl_reduce = doctor.check_nccl_all_reduce()
    assert nccl_reduce.status == doctor.SKIP and nccl_reduce.advice


def test_gloo_is_available_here():
    assert doctor.check_gloo().status == doctor.PASS


def test_gloo_all_reduce_passes_with_the_correct_sum(no_orphans):
    result = doctor.check_gloo_all_reduce()
    assert result.status == doctor.PASS, result
    assert "sum correct" in result.detail and "busbw" in result.detail


def test_measure_allreduce_checks_sums_and_reports_bandwidths(no_orphans):
    rows = doctor.measure_allreduce([4096, 65536, 2**20], world_size=2, backend="gloo")
    assert [row["bytes"] for row in rows] == [4096, 65536, 2**20]
    for row in rows:
        assert row["correct"] is True
        assert row["seconds"] > 0 and row["algbw"] > 0
        assert row["busbw"] == pytest.approx(row["algbw"])  # factor 1 for 2 ranks


def test_allreduce_probe_detects_a_wrong_sum(no_orphans):
    """The probe's check can fail: a rank that contributes the wrong values is caught."""
    from ddpcourse.launcher import run_ranks

    def lying_rank_probe(rank, world_size):
        real_all_reduce = dist.all_reduce
        calls = []

        def skewed(t, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1 and rank == 1:
                t.mul_(2)  # rank 1 sends twice its share in the checked all-reduce
            return real_all_reduce(t, *args, **kwargs)

        dist.all_reduce = skewed
        try:
            return doctor.allreduce_probe(rank, world_size, [4096], repeats=1)
        finally:
            dist.all_reduce = real_all_reduce

    results = run_ranks(lying_rank_probe, 2)
    assert [row[0][2] for row in results] == [False, False]


@pytest.mark.skipif(HAS_NVIDIA_SMI, reason="checks the no-nvidia-smi path")
def test_topology_without_nvidia_smi():
    result = doctor.check_topology()
    assert result.status == doctor.SKIP
    assert result.detail == "no nvidia-smi on PATH"


def test_free_port_check_names_the_port():
    result = doctor.check_free_port()
    assert result.status == doctor.PASS
    port = int(result.detail.split("port ")[1].split()[0])
    assert 0 < port < 65536


def test_master_port_free_and_busy():
    with socket.socket() as squatter:
        squatter.bind(("", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        held = doctor.check_master_port(busy)
    assert held.status == doctor.WARN and held.ok
    assert "in use" in held.detail and f"sport = :{busy}" in held.advice
    assert doctor.check_master_port(busy).status == doctor.PASS  # released


def test_master_port_defaults_to_29500_or_master_port(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert doctor.check_master_port().name == "port 29500"
    monkeypatch.setenv("MASTER_PORT", "29611")
    assert doctor.check_master_port().name == "port 29611"


@pytest.mark.parametrize("value, status", [(None, doctor.PASS), ("1", doctor.PASS),
                                           ("4096", doctor.WARN), ("many", doctor.WARN)])
def test_threads_check(monkeypatch, value, status):
    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    result = doctor.check_threads()
    assert result.status == status
    assert f"OMP_NUM_THREADS={value or '(not set)'}" in result.detail
    assert (result.advice != "") == (status == doctor.WARN)


# --- the GPU paths, with the GPU faked (this machine has none) --------------------------------

def fake_gpus(monkeypatch, count=2, nccl=(2, 21, 5)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)


def test_cuda_and_nccl_checks_with_gpus(monkeypatch):
    fake_gpus(monkeypatch)
    cuda = doctor.check_cuda()
    assert cuda.status == doctor.PASS
    assert "2 GPU(s)" in cuda.detail and "1: Fake GPU 1" in cuda.detail
    assert doctor.check_nccl().detail.startswith("NCCL 2.21.5")


def test_cuda_build_without_a_visible_gpu_warns(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = doctor.check_cuda()
    assert result.status == doctor.WARN
    assert "CUDA_VISIBLE_DEVICES=" in result.advice and "nvidia-smi" in result.advice


def test_nccl_all_reduce_needs_two_gpus(monkeypatch):
    fake_gpus(monkeypatch, count=1)
    result = doctor.check_nccl_all_reduce()
    assert result.status == doctor.SKIP
    assert "needs 2 GPUs" in result.detail and "1 visible" in result.detail


def write_fake_nvidia_smi(folder: Path, body: str) -> None:
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)


def test_topology_shows_the_matrix_of_nvidia_smi(tmp_path, monkeypatch):
    write_fake_nvidia_smi(tmp_path, 'echo "        GPU0    GPU1"; echo "GPU0     X      NV12"\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    result = doctor.check_topology()
    assert result.status == doctor.PASS
    assert "NV12" in result.detail
    report = doctor.format_report([result])
    assert "GPU0     X      NV12" in report  # multi-line details are not re-wrapped


def test_topology_when_nvidia_smi_fails(tmp_path, monkeypatch):
    write_fake_nvidia_smi(tmp_path, 'echo "NVIDIA-SMI has failed: driver mismatch" >&2; exit 9\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    result = doctor.check_topology()
    assert result.status == doctor.WARN
    assert "exited 9" in result.detail and "driver mismatch" in result.detail


# --- failures, the report and the exit code ---------------------------------------------------

def test_a_failing_all_reduce_fails_with_advice(monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError("Connection refused")

    monkeypatch.setattr(doctor, "measure_allreduce", refused)
    result = doctor.check_gloo_all_reduce()
    assert result.status == doctor.FAIL and not result.ok
    assert "Connection refused" in result.detail
    assert "GLOO_SOCKET_IFNAME" in result.advice


def test_a_wrong_sum_fails(monkeypatch):
    monkeypatch.setattr(doctor, "measure_allreduce", lambda *a, **k: [
        {"bytes": 4096, "seconds": 1e-4, "algbw": 4.1e7, "busbw": 4.1e7, "correct": False}])
    result = doctor.check_gloo_all_reduce()
    assert result.status == doctor.FAIL and "WRONG SUM" in result.detail


def test_a_crashing_check_becomes_a_failure():
    def check_that_crashes():
        raise ValueError("boom")

    [result] = doctor.run_checks([check_that_crashes])
    assert result.status == doctor.FAIL and "boom" in result.detail
    assert result.name == "check_that_crashes"


def test_simulated_failure_exits_1_and_prints_its_advice(monkeypatch, capsys):
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    code = doctor.main([])
    out = capsys.readouterr().out
    assert code == 1
    assert "[FAIL] gloo" in out
    assert "what to do: The CPU labs need gloo" in out
    assert out.rstrip().splitlines()[-1] == "RESULT: FAILED: gloo"


def test_exit_code_ignores_warnings_and_skips():
    results = [doctor.CheckResult("a", doctor.PASS, ""), doctor.CheckResult("b", doctor.WARN, ""),
               doctor.CheckResult("c", doctor.SKIP, "")]
    assert doctor.exit_code(results) == 0
    assert doctor.exit_code(results + [doctor.CheckResult("d", doctor.FAIL, "")]) == 1


def test_report_gives_advice_for_everything_but_passes():
    report = doctor.format_report([
        doctor.CheckResult("good", doctor.PASS, "fine", advice="never shown"),
        doctor.CheckResult("meh", doctor.WARN, "hmm", advice="do this"),
    ])
    assert "never shown" not in report
    assert "what to do: do this" in report


def test_the_command_line_runs_and_exits_0_here():
    done = subprocess.run([sys.executable, "-m", "ddpcourse.doctor"], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for name in ["torch", "CUDA", "NCCL", "gloo", "GPU topology", "all_reduce gloo x2",
                 "all_reduce nccl x2", "free port", "port ", "threads"]:
        assert f"] {name}" in out, name
    assert "[PASS] all_reduce gloo x2" in out
    if not HAS_NVIDIA_SMI:
        assert "no nvidia-smi" in out
    assert out.rstrip().splitlines()[-1] == "RESULT: everything available here works"


# --- the chapter's scripts --------------------------------------------------------------------

def test_one_rank_all_reduce_script_shows_it_moves_nothing():
    done = subprocess.run([sys.executable, "chapters/00_setup/one_rank_all_reduce.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "result equals the input: True" in done.stdout
    assert "busbw = algbw * 2(n-1)/n = 0.0 GB/s with n = 1" in done.stdout
    assert "VERDICT" in done.stdout


def test_bandwidth_script_prints_a_row_per_size_with_correct_sums():
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["torchrun", "--standalone", "--nproc_per_node", "2",
         "chapters/00_setup/allreduce_bandwidth.py", "--sizes", "4096", "1048576"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["4096", "1048576"]
    assert all(row[-1] == "True" for row in rows)
    assert done.stdout.count("all_reduce on 2 ranks") == 1  # rank 0 only
