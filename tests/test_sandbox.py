"""The grading sandbox (autograder/sandbox.py), with real sandboxed processes.

One sandboxed Python (the ``inside`` fixture) tries everything a submission might and reports what
happened; the tests below check its report against the world outside. Separate sandboxes test
what needs its own process: the kill, the file-size and process-count limits.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from autograder.sandbox import (
    Sandbox,
    SandboxUnavailable,
    bwrap_problem,
    nproc_counts_per_sandbox,
    resolve,
)
from ddpcourse.launcher.processes import live_descendants

REPO = Path(__file__).resolve().parents[1]
CHECKS = REPO / "ddpcourse/grading/checks.py"
SITE_PACKAGES = Path(next(p for p in sys.path if p.endswith("site-packages")))
PROBLEM = bwrap_problem()
needs_bwrap = pytest.mark.skipif(PROBLEM is not None, reason=f"no sandbox here: {PROBLEM}")
pytestmark = pytest.mark.usefixtures("no_orphans")

# What a submission tries. argv: facts file, repo, work folder, class folder, site-packages,
# outside TCP port, outside pid, fd to write to, private store name.
PROBE = r"""
import errno, hashlib, json, os, signal, socket, sys, time
from pathlib import Path

out, repo, work, klass, site = map(Path, sys.argv[1:6])
port, victim, fd = map(int, sys.argv[6:9])
store = sys.argv[9]
facts = {}

def attempt(name, action):
    try:
        facts[name] = ["ok", action()]
    except OSError as e:
        facts[name] = [errno.errorcode.get(e.errno, str(e.errno)), None]

attempt("open_checks_for_writing",  # opening is what a read-only mount refuses; no byte written
        lambda: os.close(os.open(repo / "ddpcourse/grading/checks.py", os.O_WRONLY | os.O_APPEND)))
attempt("create_in_repo", lambda: open(repo / "sandbox-was-here", "w").write("x"))
attempt("create_in_venv", lambda: open(site / "sandbox-was-here.pth", "w").write("x"))
attempt("write_work", lambda: (work / "hello.txt").write_text("hello"))
attempt("list_solutions", lambda: os.listdir(repo / "solutions"))
attempt("create_in_solutions", lambda: (repo / "solutions/mine").write_text("x"))
attempt("read_hidden", lambda: (repo / "autograder/hidden/ranks_from_env.py").read_text())
attempt("list_class", lambda: os.listdir(klass))
attempt("read_other_student", lambda: (klass / "other/secret.txt").read_text())
attempt("hash_checks", lambda: hashlib.sha256((repo / "ddpcourse/grading/checks.py")
                                               .read_bytes()).hexdigest())
attempt("read_readme", lambda: len((repo / "README.md").read_text()))
attempt("connect_outside", lambda: socket.create_connection(("127.0.0.1", port), 2).close())
attempt("connect_internet", lambda: socket.create_connection(("192.0.2.1", 80), 2).close())
attempt("signal_outside", lambda: os.kill(victim, signal.SIGKILL))
attempt("write_fd", lambda: os.write(fd, b"through the passed fd"))
facts["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
facts["uid"] = [os.getuid(), os.getgid()]
facts["home"] = os.environ["HOME"]

def loopback():
    server = socket.create_server(("127.0.0.1", 0))
    socket.create_connection(server.getsockname(), 2).sendall(b"ping")
    return server.accept()[0].recv(4).decode()
attempt("loopback", loopback)

import datetime
import ddpcourse, torch, torch.distributed as dist
facts["imports"] = [torch.__version__, ddpcourse.__file__]

def rank(r):
    dist.init_process_group("gloo", store=dist.FileStore(f"/tmp/{store}", 2), rank=r,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    t = torch.tensor([r + 1.0])
    dist.all_reduce(t)
    os._exit(0 if t.item() == 3.0 else 1)
# Two gloo ranks, forked after torch's import as the launcher's rank server forks them.
ranks = []
for r in range(2):
    pid = os.fork()
    if pid == 0:
        try:
            rank(r)
        finally:
            os._exit(1)
    ranks.append(pid)
facts["gloo_exit_codes"] = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in ranks]
attempt("write_tmp", lambda: Path(f"/tmp/{store}.txt").write_text("mine"))
out.write_text(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A class output folder with this student's work folder and another student's file."""
    klass = tmp_path_factory.mktemp("class")
    work = klass / "me" / "work"
    work.mkdir(parents=True)
    (klass / "other").mkdir()
    (klass / "other" / "secret.txt").write_text("another student's work")
    return klass, work


@pytest.fixture(scope="module")
def inside(places):
    """Run PROBE once in the sandbox; return its facts and what the test saw outside."""
    if PROBLEM is not None:
        pytest.skip(f"no sandbox here: {PROBLEM}")
    klass, work = places
    sandbox = Sandbox(writable=(work,), chdir=work,
                      hidden=(REPO / "solutions", REPO / "autograder/hidden", klass))
    server = socket.create_server(("127.0.0.1", 0))
    victim = subprocess.Popen(["sleep", "60"])
    read_end, write_end = os.pipe()
    store = f"store-{uuid.uuid4().hex}"
    facts_file = work / "facts.json"
    # Where a broken sandbox would write; removed again so that a failure damages nothing.
    should_not_exist = (REPO / "sandbox-was-here", SITE_PACKAGES / "sandbox-was-here.pth",
                        REPO / "solutions/mine")
    checks_before = CHECKS.read_bytes()
    argv = [sys.executable, "-c", PROBE, str(facts_file), str(REPO), str(work), str(klass),
            str(SITE_PACKAGES), str(server.getsockname()[1]), str(victim.pid), str(write_end),
            store]
    try:
        done = subprocess.run(sandbox.command(argv), pass_fds=(write_end,), capture_output=True,
                              text=True, timeout=90)
        victim_alive = victim.poll() is None
    finally:
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            through_fd = pipe.read().decode()
        victim.kill()
        victim.wait()
        server.close()
        leaked = [str(path) for path in should_not_exist if path.exists()]
        for path in should_not_exist:
            path.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    return {"facts": json.loads(facts_file.read_text()), "through_fd": through_fd,
            "victim_alive": victim_alive, "leaked": leaked, "checks_before": checks_before,
            "store": store}


@needs_bwrap
def test_the_repository_and_the_venv_are_read_only_the_work_folder_is_not(inside, places):
    facts = inside["facts"]
    assert facts["open_checks_for_writing"][0] == "EROFS"
    assert CHECKS.read_bytes() == inside["checks_before"]
    assert facts["create_in_repo"][0] == "EROFS"
    assert facts["create_in_venv"][0] == "EROFS"
    assert inside["leaked"] == []
    assert facts["write_work"][0] == "ok"
    assert (places[1] / "hello.txt").read_text() == "hello"
    assert facts["home"] == str(places[1].resolve())


@needs_bwrap
def test_grader_only_paths_are_empty_the_rest_is_readable(inside):
    facts = inside["facts"]
    assert (REPO / "solutions").is_dir() and os.listdir(REPO / "solutions")
    assert facts["list_solutions"] == ["ok", []]
    assert facts["create_in_solutions"][0] == "EROFS"
    assert (REPO / "autograder/hidden/ranks_from_env.py").is_file()
    assert facts["read_hidden"][0] == "ENOENT"
    assert facts["hash_checks"][1] == hashlib.sha256(inside["checks_before"]).hexdigest()
    assert facts["read_readme"][0] == "ok"
    torch_version, ddpcourse_file = facts["imports"]
    assert torch_version and Path(ddpcourse_file).is_relative_to(REPO)


@needs_bwrap
def test_other_students_are_hidden_and_the_own_folder_is_bound_back(inside):
    facts = inside["facts"]
    assert facts["list_class"] == ["ok", ["me"]]
    assert facts["read_other_student"][0] == "ENOENT"


@needs_bwrap
def test_no_network_but_loopback_and_gloo_work_inside(inside):
    facts = inside["facts"]
    assert facts["connect_outside"][0] == "ECONNREFUSED"  # nothing listens on its own loopback
    assert facts["connect_internet"][0] == "ENETUNREACH"
    assert facts["loopback"] == ["ok", "ping"]
    assert facts["gloo_exit_codes"] == [0, 0]
    assert facts["write_tmp"][0] == "ok" and not Path(f"/tmp/{inside['store']}.txt").exists()


@needs_bwrap
def test_outside_processes_are_invisible_and_cannot_be_signalled(inside):
    facts = inside["facts"]
    assert facts["signal_outside"][0] == "ESRCH"
    assert inside["victim_alive"]
    assert os.getpid() not in facts["pids"] and len(facts["pids"]) < 10
    assert facts["uid"] == [65534, 65534]


@needs_bwrap
def test_passed_file_descriptors_work(inside):
    assert inside["facts"]["write_fd"][0] == "ok"
    assert inside["through_fd"] == "through the passed fd"


def _sleeping(marker: str) -> set[int]:
    """Pids of the processes running ``sleep MARKER``."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == (
                    f"sleep\0{marker}\0".encode()):
                found.add(int(entry.name))
        except OSError:
            pass
    return found


@needs_bwrap
def test_killing_the_sandbox_leaves_no_process_behind(tmp_path):
    marker = f"1000.{uuid.uuid4().int % 10**9}"  # a sleep of 1000 s, found by its argv
    proc = subprocess.Popen(Sandbox(writable=(tmp_path,)).command(
        ["sh", "-c", f"sleep {marker} & sleep {marker}; wait"]))
    try:
        give_up = time.monotonic() + 10
        while len(_sleeping(marker)) < 2 and time.monotonic() < give_up:
            time.sleep(0.05)
        assert len(_sleeping(marker)) == 2
        assert _sleeping(marker) <= live_descendants(proc.pid)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # bwrap, the top process, alone
        proc.wait()
    give_up = time.monotonic() + 3
    while _sleeping(marker) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not _sleeping(marker)


@needs_bwrap
def test_the_file_size_limit_stops_a_writer(tmp_path):
    limit = 1 << 20
    writer = ("import errno, os\n"
              "fd = os.open('big', os.O_WRONLY | os.O_CREAT)\n"
              "try:\n"
              "    for _ in range(12): os.write(fd, bytes(1 << 18))\n"
              "except OSError as e: print(errno.errorcode[e.errno])\n")
    sandbox = Sandbox(writable=(tmp_path,), chdir=tmp_path, max_file_bytes=limit)
    done = subprocess.run(sandbox.command([sys.executable, "-c", writer]), capture_output=True,
                          text=True, timeout=30)
    assert done.stdout.strip() == "EFBIG", done.stderr
    assert (tmp_path / "big").stat().st_size == limit
    assert f"--fsize={64 << 20}" in Sandbox().command(["true"])


@needs_bwrap
def test_a_checkout_under_tmp_stays_readable_inside(tmp_path):
    """/tmp is private inside; a repository or Python installed under it is bound back in
    read-only (CI often checks out under /tmp), the rest of /tmp stays out of sight."""
    checkout, elsewhere = tmp_path / "checkout", tmp_path / "elsewhere"
    for folder in (checkout, elsewhere):
        folder.mkdir()
        (folder / "file.txt").write_text(folder.name)
    sandbox = Sandbox(readable=(*Sandbox().readable, checkout))  # and the Python running this
    reader = ("import sys\nfor path in sys.argv[1:]:\n"
              "    try: print(open(path).read())\n"
              "    except OSError as e: print(type(e).__name__)\n"
              "try: open(sys.argv[1], 'a')\nexcept OSError as e: print('write', type(e).__name__)\n")
    done = subprocess.run(sandbox.command([sys.executable, "-c", reader,
                                           str(checkout / "file.txt"), str(elsewhere / "file.txt")]),
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.split() == ["checkout", "FileNotFoundError", "write", "OSError"], done.stderr
    assert str(REPO) in " ".join(Sandbox().command(["true"])) or not str(REPO).startswith("/tmp")


def _spawner(count: int) -> list[str]:
    # Prints how many `sleep`s it started; dash stops at the first fork that fails.
    return ["sh", "-c", f"n=0; while [ $n -lt {count} ]; do sleep 2 & n=$((n+1)); echo $n; done;"
                        " wait"]


@needs_bwrap
def test_the_process_limit_counts_each_sandbox_alone():
    if not nproc_counts_per_sandbox():
        pytest.skip("this kernel counts RLIMIT_NPROC per user machine-wide; the sandbox omits it")
    as_user: list[str] = []
    if os.geteuid() == 0:  # the kernel never limits a real root: run bwrap as nobody here
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv is needed to run the sandbox as an ordinary user")
        as_user = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    sandbox = Sandbox(chdir=Path("/"), max_processes=24)
    assert "--nproc=24" in sandbox.command(["true"])
    trial = subprocess.run(as_user + sandbox.command(["true"]), cwd="/", capture_output=True,
                           text=True, timeout=30)
    if trial.returncode != 0:
        pytest.skip(f"bwrap does not run for an ordinary user here: {trial.stderr.strip()}")
    # Two sandboxes of 16 and a fork bomb, at once: each is counted alone.
    runs = [subprocess.Popen(as_user + sandbox.command(_spawner(n)), cwd="/", text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for n in (16, 16, 60)]
    outcomes = [(run.wait(timeout=30), run.stdout.read().split(), run.stderr.read())
                for run in runs]
    for run in runs:
        run.stdout.close()
        run.stderr.close()
    assert [int(printed[-1]) for _, printed, _ in outcomes[:2]] == [16, 16], outcomes
    bomb_rc, bomb_printed, bomb_said = outcomes[2]
    assert bomb_rc != 0 and int(bomb_printed[-1]) < 24, outcomes
    assert "fork" in bomb_said.lower()


def test_hidden_inside_writable_is_refused(tmp_path):
    with pytest.raises(ValueError, match="inside writable"):
        Sandbox(writable=(tmp_path,), hidden=(tmp_path / "secret",))


def _unavailable() -> str:
    return "bubblewrap (`bwrap`) is not installed: install it."


def _never() -> str | None:
    raise AssertionError("the 'off' policy must not look for bwrap")


def test_policy_require_refuses_to_grade_without_a_sandbox():
    with pytest.raises(SandboxUnavailable, match="not installed") as refused:
        resolve("require", _unavailable)
    assert "Refusing to grade" in str(refused.value) and "'warn'" in str(refused.value)
    assert resolve("require", lambda: None) == (True, None)


def test_policy_warn_grades_unsandboxed_with_a_warning():
    use, warning = resolve("warn", _unavailable)
    assert use is False
    assert warning.startswith("WARNING: graded WITHOUT a sandbox") and _unavailable() in warning
    assert resolve("warn", lambda: None) == (True, None)


def test_policy_off_never_sandboxes_and_unknown_policies_are_refused():
    assert resolve("off", _never) == (False, None)
    with pytest.raises(ValueError, match="require, warn, off"):
        resolve("sometimes", _never)


def test_a_missing_bwrap_is_named_with_its_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no bwrap on it
    said = bwrap_problem.__wrapped__()
    assert "not installed" in said and "apt-get install -y bubblewrap" in said


@needs_bwrap
def test_bwrap_works_here_so_require_sandboxes():
    assert resolve("require") == (True, None)
