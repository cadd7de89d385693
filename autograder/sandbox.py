"""Run a submission's processes in a bubblewrap (``bwrap``) sandbox.

The threat is a student's code: it runs in the grader's kernel, ranks and tools, and could
otherwise rewrite the grader, the repository, a gradebook or another student's work, read the
hidden checks and the solutions, reach the network or the grader's processes, and leave processes
running after its deadline. Inside the sandbox:

* the whole file system is read-only, except the submission's own work folder(s);
* grader-only paths (``solutions/``, ``autograder/hidden/``, the class's output folder) are empty;
  a student's own folder inside one of them is bound back in, writable;
* ``/tmp``, ``/dev/shm`` and ``/run`` (the host's service sockets) are private and empty;
* it has its own network (loopback only: gloo works, nothing outside answers), PID, IPC, UTS,
  cgroup and user namespaces; it runs as uid/gid 65534 with no capabilities and cannot create
  further user namespaces;
* it cannot outlive the process that started it: bwrap kills the sandbox's PID namespace when
  bwrap or its parent dies;
* a file-size limit (and, where the kernel counts it per sandbox, a process-count limit) holds
  for every process.

Grade as an ordinary user where you can. The sandbox's uid stands for the uid that started bwrap
outside, so under root files only root may read (``/etc/shadow``, ``/root``) are readable inside
(still read-only), and the kernel applies no process-count limit to root.

Use :func:`resolve` with a :data:`SandboxPolicy` to decide whether to sandbox, and
:meth:`Sandbox.command` to wrap a command line. bwrap keeps the caller's environment and file
descriptors, so ``subprocess.Popen(sandbox.command(argv), pass_fds=...)`` works as without it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SANDBOX_UID = 65534  # nobody/nogroup
MiB = 1 << 20

SandboxPolicy = Literal["require", "warn", "off"]
POLICIES: tuple[str, ...] = ("require", "warn", "off")
POLICY_VARIABLE = "DDPCOURSE_SANDBOX"  # the policy `grade --sandbox` hands its workers

INSTALL_HINT = "install bubblewrap with `apt-get install -y bubblewrap` (Debian/Ubuntu)"
NEEDS = ("the sandbox needs root, or unprivileged user namespaces "
         "(`sysctl kernel.unprivileged_userns_clone=1` where that setting exists, "
         "`user.max_user_namespaces` > 0, and on Ubuntu 24.04 "
         "`kernel.apparmor_restrict_unprivileged_userns=0`), or a setuid bwrap")


class SandboxUnavailable(RuntimeError):
    """The policy is "require" and bwrap cannot run here."""


def nproc_counts_per_sandbox() -> bool:
    """True where RLIMIT_NPROC counts the tasks of one user namespace, i.e. one sandbox.

    Since Linux 5.14 the count is kept per (user namespace, uid). Before, it counted every process
    and thread of the real uid on the whole machine: the grader's own processes and every other
    sandbox would share the limit, and a busy grader would break the ranks. There we leave it out.
    Either way the kernel never applies it to processes whose real uid is root (the sandbox's uid
    maps to the grader's), so a grader running as root gets no process-count limit.
    """
    try:
        major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 14)


@dataclass(frozen=True)
class Sandbox:
    """How to confine one submission. ``command(argv)`` gives the bwrap command line.

    A writable folder may lie inside a hidden one (it is bound back in), not the other way round.
    """

    writable: tuple[Path, ...] = ()
    hidden: tuple[Path, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    chdir: Path | None = None
    max_file_bytes: int = 64 * MiB  # RLIMIT_FSIZE: a bigger write gets SIGXFSZ / EFBIG
    max_processes: int = 4096  # RLIMIT_NPROC (tasks: processes and threads), see below
    tmpfs_bytes: int = 1024 * MiB  # each of /tmp and /dev/shm, held in memory
    # Bound back in, read-only, over the private /tmp, /dev/shm and /run: the repository and
    # the Python running it, wherever they are (a checkout in /tmp is common in CI).
    readable: tuple[Path, ...] = field(default_factory=lambda: _runtime_paths())

    def __post_init__(self):
        for hide in self.hidden:
            for keep in self.writable:
                if Path(hide).resolve().is_relative_to(Path(keep).resolve()):
                    raise ValueError(f"hidden {hide} lies inside writable {keep}")

    def command(self, argv: list[str]) -> list[str]:
        writable = [Path(p).resolve() for p in self.writable]
        hidden = [Path(p).resolve() for p in self.hidden]
        cmd = ["bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
               "--size", str(self.tmpfs_bytes), "--tmpfs", "/tmp",
               "--size", str(self.tmpfs_bytes), "--tmpfs", "/dev/shm",
               "--tmpfs", "/run"]
        for path in dict.fromkeys(Path(p).resolve() for p in self.readable):
            if path.exists() and _is_under(path, PRIVATE_MOUNTS):
                cmd += ["--ro-bind", str(path), str(path)]
        # Order matters: hide, bind the writable folders back in (bwrap makes their mount points
        # in the still-writable tmpfs), then make the hiding tmpfs read-only.
        for path in hidden:
            if path.is_dir():
                cmd += ["--tmpfs", str(path)]
            elif path.exists():
                cmd += ["--ro-bind", "/dev/null", str(path)]
        for path in writable:
            cmd += ["--bind", str(path), str(path)]
        for path in hidden:
            if path.is_dir():
                cmd += ["--remount-ro", str(path)]
        cmd += ["--unshare-all", "--unshare-user", "--disable-userns",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--cap-drop", "ALL",
                "--die-with-parent", "--new-session"]
        env = {"HOME": str(writable[0]) if writable else "/tmp", "TMPDIR": "/tmp",
               "PYTHONDONTWRITEBYTECODE": "1",
               "GLOO_SOCKET_IFNAME": "lo",  # the only interface inside
               **self.env}
        for name, value in env.items():
            cmd += ["--setenv", name, str(value)]
        if self.chdir is not None:
            cmd += ["--chdir", str(Path(self.chdir).resolve())]
        # The limits are set by util-linux's prlimit inside the sandbox, which then execs argv:
        # no preexec_fn in the caller, and the hard limit is set too, so nothing inside can raise
        # it again.
        limits = [f"--fsize={self.max_file_bytes}"]
        if nproc_counts_per_sandbox():
            limits.append(f"--nproc={self.max_processes}")
        return cmd + ["--", "prlimit", *limits, "--", *argv]


PRIVATE_MOUNTS = ("/tmp", "/dev/shm", "/run")


def _is_under(path: Path, roots: tuple[str, ...]) -> bool:
    return any(path == Path(root) or Path(root) in path.parents for root in roots)


def _runtime_paths() -> tuple[Path, ...]:
    """The repository and the Python that runs it (virtual environment and base install)."""
    repository = Path(__file__).resolve().parent.parent
    return (repository, Path(sys.prefix), Path(sys.base_prefix),
            Path(sys.executable).resolve().parent.parent)


@functools.cache
def bwrap_problem() -> str | None:
    """None if a trivial sandboxed ``true`` runs here (asked once), else why not, in a sentence."""
    if shutil.which("bwrap") is None:
        return f"bubblewrap (`bwrap`) is not installed: {INSTALL_HINT}."
    if shutil.which("prlimit") is None:
        return "`prlimit` is missing: install util-linux (`apt-get install -y util-linux`)."
    try:
        done = subprocess.run(Sandbox().command(["true"]), capture_output=True, text=True,
                              timeout=30, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return "bwrap did not finish a sandboxed `true` within 30 s."
    if done.returncode == 0:
        return None
    said = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
    if "unknown option" in said.lower():
        return f"this bwrap is too old ({said}): the sandbox needs bubblewrap 0.8 or later."
    return f"bwrap cannot start a sandbox here ({said}): {NEEDS}."


def resolve(policy: SandboxPolicy,
            problem: Callable[[], str | None] = bwrap_problem) -> tuple[bool, str | None]:
    """(sandbox the submissions?, a warning to show in every feedback page and CSV row).

    "require" raises :class:`SandboxUnavailable` when bwrap cannot run; "warn" then grades without
    it and returns the warning; "off" never sandboxes (a trusted self-check) and warns of nothing.
    """
    if policy not in POLICIES:
        raise ValueError(f"sandbox policy {policy!r}: choose one of {', '.join(POLICIES)}")
    if policy == "off":
        return False, None
    why = problem()
    if why is None:
        return True, None
    if policy == "require":
        raise SandboxUnavailable(
            f"Refusing to grade: student code must run in a sandbox, and {why} "
            f"To grade anyway, unsandboxed, choose the sandbox policy 'warn' or 'off'.")
    return False, (f"WARNING: graded WITHOUT a sandbox: {why} Student code ran with the "
                   f"grader's permissions: it could read the hidden tests and change files "
                   f"outside its work folder. Fix this and re-grade.")
