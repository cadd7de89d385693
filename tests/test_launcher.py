"""The rank launcher: results, per-rank environment, and every way a rank can go wrong.

Each failure test also checks, through the ``no_orphans`` fixture, that no process survives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from ddpcourse.launcher import (
    RankError,
    RankTimeoutError,
    call_scratch_dir,
    rank_server_pids,
    resolve_backend,
    run_ranks,
    usable_cores,
)
from ddpcourse.launcher._server_client import THREADS_AFTER_IMPORTING_TORCH
from ddpcourse.launcher.processes import is_alive, live_descendants

pytestmark = pytest.mark.usefixtures("no_orphans")

HAS_TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
# Deadline for tests that hang on purpose, and the slack the launcher is allowed on top of it.
HANG_TIMEOUT_S = 2.0
SLACK_S = 3.0


def sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, dist.get_backend(), t


# --- results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_returns_its_value_from_a_real_process_group(world_size):
    results = run_ranks(sum_of_ranks, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    assert [r[0] for r in results] == list(range(world_size))
    for rank, ws, backend, total in results:
        assert ws == world_size and backend == "gloo"
        assert total.item() == expected_sum


def test_args_and_kwargs_reach_every_rank():
    def echo(rank, world_size, a, b, *, c):
        return (rank, a, b, c)

    assert run_ranks(echo, 2, "x", [1, 2], c={"k": 3}) == [
        (0, "x", [1, 2], {"k": 3}),
        (1, "x", [1, 2], {"k": 3}),
    ]


def test_the_calls_scratch_folder_is_shared_by_its_ranks_and_goes_with_the_call():
    """call_scratch_dir(): one folder per call, the same in every rank (rank 1 reads what rank 0
    wrote), another in the next call, and gone once the call returns; outside a rank, the system's
    temporary folder."""
    def write_then_read(rank, world_size):
        folder = call_scratch_dir()
        if rank == 0:
            with open(os.path.join(folder, "note"), "w") as f:
                f.write("from rank 0")
        dist.barrier()
        with open(os.path.join(folder, "note")) as f:
            return folder, f.read()

    first = run_ranks(write_then_read, 2)
    second = run_ranks(write_then_read, 2)
    assert first[0] == first[1] and first[0][1] == "from rank 0"
    assert second[0][0] != first[0][0]
    assert not os.path.exists(first[0][0]) and not os.path.exists(second[0][0])
    assert call_scratch_dir() == tempfile.gettempdir()


def test_tensors_come_back_detached_on_the_cpu_inside_containers():
    def make(rank, world_size):
        w = torch.ones(3, requires_grad=True) * (rank + 1)
        return {"w": w, "pair": (w, [w.sum()])}

    out = run_ranks(make, 2)
    for rank, value in enumerate(out):
        for t in (value["w"], value["pair"][0], value["pair"][1][0]):
            assert t.device.type == "cpu" and not t.requires_grad
        assert torch.equal(value["w"], torch.full((3,), float(rank + 1)))


def test_world_size_and_fn_are_validated():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(sum_of_ranks, 0)
    with pytest.raises(TypeError, match="callable"):
        run_ranks("not a function", 2)


# --- backends --------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_TWO_GPUS, reason="checks the CPU fallback; this machine has GPUs")
def test_auto_backend_is_gloo_without_gpus_and_nccl_is_refused():
    assert resolve_backend("auto", 2) == "gloo"
    with pytest.raises(RuntimeError, match="one GPU per rank"):
        run_ranks(sum_of_ranks, 2, backend="nccl")


@pytest.mark.skipif(not HAS_TWO_GPUS, reason="needs 2 CUDA GPUs for NCCL (gloo is tested above)")
def test_nccl_with_one_gpu_per_rank_returns_cpu_tensors():
    def on_gpu(rank, world_size):
        t = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        return dist.get_backend(), torch.cuda.current_device(), t

    results = run_ranks(on_gpu, 2)
    for rank, (backend, device, t) in enumerate(results):
        assert backend == "nccl" and device == rank
        assert t.device.type == "cpu" and torch.equal(t, torch.full((4,), 3.0))


# --- the environment each rank gets ----------------------------------------------------------


def draw(rank, world_size):
    import random

    import numpy

    return torch.rand(4), random.random(), float(numpy.random.rand())


def test_ranks_and_calls_get_distinct_random_streams_unless_seeded():
    first, second = run_ranks(draw, 2), run_ranks(draw, 2)
    draws = [d[0] for d in first + second]
    for i in range(len(draws)):
        for j in range(i + 1, len(draws)):
            assert not torch.equal(draws[i], draws[j])
    assert len({d[1] for d in first + second}) == 4 and len({d[2] for d in first + second}) == 4


def test_seed_gives_rank_r_the_seed_plus_r():
    seeded = run_ranks(draw, 2, seed=7)
    for rank, (t, _, _) in enumerate(seeded):
        torch.manual_seed(7 + rank)
        assert torch.equal(t, torch.rand(4))
    assert torch.equal(run_ranks(draw, 2, seed=7)[1][0], seeded[1][0])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_threads_are_shared_out_so_ranks_do_not_oversubscribe(world_size):
    def threads(rank, ws):
        return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]

    expected = max(1, usable_cores() // world_size)
    assert run_ranks(threads, world_size) == [(expected, str(expected))] * world_size


def test_a_rank_can_start_dataloader_workers():
    def load(rank, world_size):
        data = torch.utils.data.TensorDataset(torch.arange(8.0))
        loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2)
        return sorted(float(x) for (batch,) in loader for x in batch)

    assert run_ranks(load, 2) == [[float(i) for i in range(8)]] * 2


def test_ranks_see_the_callers_current_env_cwd_and_torchrun_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPCOURSE_TEST_VALUE", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)

    def context(rank, world_size):
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "DDPCOURSE_TEST_VALUE",
                "EXTRA"]
        return {k: os.environ.get(k) for k in keys}, os.getcwd()

    results = run_ranks(context, 2, env={"EXTRA": "yes"})
    for rank, (env, cwd) in enumerate(results):
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "DDPCOURSE_TEST_VALUE": "set-after-the-server-started",
                       "EXTRA": "yes"}
        assert cwd == str(tmp_path)


def test_without_a_process_group_ranks_still_get_their_identity():
    def identity(rank, world_size):
        return dist.is_initialized(), os.environ["RANK"]

    assert run_ranks(identity, 2, init_process_group=False) == [(False, "0"), (False, "1")]


def test_what_ranks_print_is_relayed_with_a_rank_prefix(capsys):
    def talk(rank, world_size):
        print(f"hello from {rank}")
        print(f"warning from {rank}", file=sys.stderr)

    run_ranks(talk, 2)
    out = capsys.readouterr().out
    for rank in range(2):
        assert f"[rank {rank}] hello from {rank}\n" in out
        assert f"[rank {rank}] warning from {rank}\n" in out


def test_a_flood_of_output_is_cut_at_the_cap(capsys):
    def flood(rank, world_size):
        for i in range(20000):
            print("x" * 99)

    run_ranks(flood, 2, max_output_bytes=10_000)
    out = capsys.readouterr().out
    assert out.count("output truncated") == 2
    assert len(out) < 2 * 10_000 + 2000


# --- failures: raise, exit, crash ------------------------------------------------------------


def raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom-123")
    time.sleep(60)


def test_a_raising_rank_is_named_with_its_traceback_and_the_others_stop_at_once():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(raise_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < SLACK_S, "the sleeping rank 0 should have been stopped"
    err = info.value
    assert err.failed_ranks == [1]
    first = err.failures[0]
    assert (first.rank, first.kind, first.exc_type) == (1, "raised", "ValueError")
    assert isinstance(first.exception, ValueError) and str(first.exception) == "boom-123"
    message = str(err)
    assert "rank 1 raised ValueError: boom-123" in message
    assert "in raise_on_rank_1" in message and 'raise ValueError("boom-123")' in message
    assert "rank 0 was stopped by the launcher" in message


def exit_hard(rank, world_size, how):
    if rank == 1:
        if how == "os._exit(3)":
            os._exit(3)
        if how == "os._exit(0)":
            os._exit(0)
        if how == "sys.exit(4)":
            sys.exit(4)
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
        if how == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


@pytest.mark.parametrize(
    "how, expected",
    [
        ("os._exit(3)", "rank 1 exited with code 3 without returning"),
        ("os._exit(0)", "rank 1 exited with code 0 without returning"),
        ("sys.exit(4)", "rank 1 raised SystemExit: 4"),
        ("segfault", "rank 1 was killed by SIGSEGV (exit code -11)"),
        ("SIGKILL", "rank 1 was killed by SIGKILL (exit code -9)"),
    ],
)
def test_a_rank_that_exits_or_crashes_is_reported_with_its_exit_code(how, expected):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(exit_hard, 2, how, timeout=60)
    assert time.monotonic() - start < SLACK_S
    assert expected in str(info.value)
    assert info.value.failed_ranks == [1]
    if how == "segfault":
        assert "Segmentation fault" in info.value.failures[0].stack
        assert "in exit_hard" in info.value.failures[0].stack


class BreaksOnArrival:
    """Pickles fine here, but rebuilding it in a rank raises (int("...") is a ValueError)."""

    def __reduce__(self):
        return (int, ("cannot be rebuilt in a rank",))


def test_a_failure_before_fn_runs_says_where_it_happened():
    with pytest.raises(RankError) as info:
        run_ranks(sum_of_ranks, 2, BreaksOnArrival())
    assert "(while loading the job)" in str(info.value)
    assert info.value.failures[0].exc_type == "ValueError"


def test_an_unpicklable_closure_fails_in_the_caller_before_any_rank_starts():
    lock = threading.Lock()

    def uses_lock(rank, world_size):
        with lock:
            return rank

    before = live_descendants()
    with pytest.raises(TypeError, match="could not send 'uses_lock'"):
        run_ranks(uses_lock, 2)
    assert live_descendants() <= before


# --- failures: hangs -------------------------------------------------------------------------


def deadlock_in_recv(rank, world_size):
    t = torch.zeros(1)
    dist.recv(t, src=1 - rank)  # both ranks wait to receive: neither ever sends


def mismatched_collectives(rank, world_size):
    t = torch.zeros(1)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=1)
        dist.barrier()


def spin_forever(rank, world_size):
    while True:
        pass


def sleep_long(rank, world_size):
    time.sleep(600)


@pytest.mark.parametrize(
    "fn, where",
    [
        (deadlock_in_recv, "in deadlock_in_recv"),
        (mismatched_collectives, "in mismatched_collectives"),
        (spin_forever, "in spin_forever"),
        (sleep_long, "in sleep_long"),
    ],
)
def test_a_hanging_rank_is_killed_at_the_deadline_with_its_stack(fn, where):
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_ranks(fn, 2, timeout=HANG_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert HANG_TIMEOUT_S <= elapsed < HANG_TIMEOUT_S + SLACK_S
    err = info.value
    assert sorted(f.rank for f in err.failures) == [0, 1]
    assert "did not finish within 2 s" in str(err)
    for failure in err.failures:
        assert failure.kind == "timeout" and where in failure.stack


def test_a_timeout_tells_finished_ranks_from_stuck_ones():
    def rank_1_sleeps(rank, world_size):
        if rank == 1:
            time.sleep(600)
        return rank

    with pytest.raises(RankTimeoutError) as info:
        run_ranks(rank_1_sleeps, 2, timeout=HANG_TIMEOUT_S)
    message = str(info.value)
    assert "rank(s) [1] did not finish" in message
    # rank 0 returned and waits in the launcher's exit barrier: reported, but not as stuck.
    assert "rank(s) [0] returned" in message
    assert [f.rank for f in info.value.failures] == [1]


def test_processes_a_hung_rank_started_are_killed_with_it(tmp_path):
    def start_child_then_hang(rank, world_size, folder):
        child = subprocess.Popen(["sleep", "600"])
        (folder / f"child-{rank}").write_text(str(child.pid))
        time.sleep(600)

    with pytest.raises(RankTimeoutError):
        run_ranks(start_child_then_hang, 2, tmp_path, timeout=HANG_TIMEOUT_S)
    for rank in range(2):
        assert not is_alive(int((tmp_path / f"child-{rank}").read_text()))


def test_ctrl_c_in_the_caller_stops_the_ranks():
    """nbclient and nbgrader interrupt a cell with SIGINT when it runs too long."""
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_ranks(sleep_long, 2, timeout=60)
    assert time.monotonic() - start < SLACK_S


# --- no shared ports, no orphans when the caller dies ----------------------------------------


CALLER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from ddpcourse.launcher import run_ranks

    def total(rank, world_size):
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    for _ in range(3):
        assert run_ranks(total, 2) == [2.0, 2.0]
    print("ok")
    """
)


def test_many_callers_at_once_never_collide():
    callers = [
        subprocess.Popen([sys.executable, "-c", CALLER], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    for caller in callers:
        out, err = caller.communicate(timeout=120)
        assert caller.returncode == 0 and out.strip() == "ok", err


def test_threads_of_one_caller_can_share_the_launcher():
    results, errors = [], []

    def call():
        try:
            results.append(run_ranks(sum_of_ranks, 2)[0][3].item())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == [3.0, 3.0, 3.0]


DOOMED_CALLER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from ddpcourse.launcher import run_ranks

    def hang(rank, world_size, folder):
        child = subprocess.Popen(["sleep", "600"])
        (Path(folder) / f"ready-{rank}").write_text(str(child.pid))
        time.sleep(600)

    run_ranks(hang, 2, sys.argv[1], timeout=600)
    """
)


@pytest.mark.parametrize("servers", ["started", "forked"])
def test_when_the_caller_is_killed_its_servers_ranks_and_their_children_die_too(tmp_path,
                                                                                servers):
    first = "import threading; threading.Thread(target=threading.Event().wait, daemon=True)" \
            ".start()\n" if servers == "started" else \
        "import torch\nfrom ddpcourse.launcher import fork_server_now\nfork_server_now()\n"
    caller = subprocess.Popen([sys.executable, "-c", first + DOOMED_CALLER, str(tmp_path)])
    try:
        give_up = time.monotonic() + 60
        while len(list(tmp_path.glob("ready-*"))) < 2:
            assert time.monotonic() < give_up and caller.poll() is None, "ranks never started"
            time.sleep(0.05)
        family = live_descendants(caller.pid)
        assert len(family) >= 5  # two servers (or one), two ranks, two `sleep` children
    finally:
        caller.kill()
        caller.wait()
    give_up = time.monotonic() + 5
    while any(is_alive(pid) for pid in family) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not [pid for pid in family if is_alive(pid)]


def test_the_rank_servers_are_the_only_long_lived_processes():
    run_ranks(sum_of_ranks, 2)
    assert live_descendants() == rank_server_pids()


SERVER_OF_A_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch
    from ddpcourse.launcher import fork_server_now, run_ranks
    from ddpcourse.launcher._server_client import pool

    def what_a_rank_has(rank, world_size):
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:  # the listing's own descriptor, closed by now
                pass
        return {"held": held, "grad": torch.is_grad_enabled(),
                "dtype": str(torch.get_default_dtype())}

    secret = os.open(sys.argv[1], os.O_RDONLY)  # what this script holds open, e.g. a channel
    if sys.argv[2] == "thread":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    if sys.argv[3] == "fork now":
        fork_server_now(dynamo=False)
    torch.set_default_dtype(torch.float64)
    with torch.no_grad():  # what no rank may inherit from the caller's state
        sys.stdout = open(os.devnull, "w")
        ranks = run_ranks(what_a_rank_has, 2, timeout=60)
        sys.stdout = sys.__stdout__
    server = pool.fast or pool.warm
    print(json.dumps({"server": type(server.process).__name__, "ranks": ranks}))
    """
)


@pytest.mark.parametrize("threads, when, server", [
    ("none", "fork now", "ForkedServerProcess"),
    ("thread", "fork now", "Popen"),
    ("none", "later", "Popen")])
def test_a_script_forks_its_server_only_when_it_asks_at_its_start_and_runs_one_thread(
        tmp_path, threads, when, server):
    """fork_server_now at the start of a single-threaded script that has torch forks its rank
    server (no second import of torch); with another thread running, or without the call, the
    server is a fresh interpreter. Either way the ranks get none of what the script holds open
    (the grader's channel, for an observation host) and none of its later state: grad mode,
    default dtype, a redirected stdout."""
    secret = tmp_path / "secret"
    secret.write_text("the grader's channel")
    done = subprocess.run([sys.executable, "-c", SERVER_OF_A_SCRIPT, str(secret), threads, when],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["server"] == server
    for rank in said["ranks"]:
        assert str(secret) not in rank["held"]
        assert rank["grad"] is True and rank["dtype"] == "torch.float32"


def test_importing_torch_starts_only_the_threads_that_a_forked_server_allows():
    """The fork rule counts threads: a process that has just imported torch has
    THREADS_AFTER_IMPORTING_TORCH of them (a torch upgrade that changes it fails here, and
    rank servers would quietly be started afresh again), and one more once torch has run a
    parallel operation (its OpenMP pool, which must stop a fork)."""
    count = ("import os, torch; a = len(os.listdir('/proc/self/task')); "
             "torch.ones(512, 512) @ torch.ones(512, 512); "
             "print(a, len(os.listdir('/proc/self/task')))")
    done = subprocess.run([sys.executable, "-c", count], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, OMP_NUM_THREADS="2"))
    after_import, after_matmul = map(int, done.stdout.split())
    assert after_import == THREADS_AFTER_IMPORTING_TORCH
    assert after_matmul > THREADS_AFTER_IMPORTING_TORCH
