"""Check that this machine can run the course, on one screen: ``python -m ddpcourse.doctor``.

Each check is a function that returns a :class:`CheckResult` (name, status, detail, advice) and
prints nothing, so tests and notebooks can call them one by one; :func:`format_report` turns a list
of results into the screen, and :func:`main` is the command line. The exit code is 1 when a check
failed and 0 otherwise: a check that does not apply here (NCCL on a CPU-only machine, say) is
skipped, not failed.

The communication checks are real: two processes join a process group and all-reduce a tensor
whose correct sum is known, once per available backend (NCCL only with two GPUs or more, since
NCCL wants one GPU per rank). They also time the all-reduce and report the two bandwidths that
NVIDIA's nccl-tests report, with the same formulas
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

* algorithm bandwidth ``algbw = S / t`` for ``S`` bytes all-reduced in ``t`` seconds;
* bus bandwidth ``busbw = algbw * 2(n-1)/n`` for an all-reduce over ``n`` ranks: each element
  takes ``n-1`` additions and ``n`` assignments, ``2(n-1)`` transfers spread over ``n`` links,
  so busbw is comparable to the hardware's link speed whatever ``n`` is. With ``n = 1`` it is 0:
  a one-rank "all-reduce" moves nothing between processes.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ddpcourse.launcher import run_ranks, usable_cores

PASS, WARN, SKIP, FAIL = "pass", "warn", "skip", "fail"
DEFAULT_MASTER_PORT = 29500  # torchrun's --master-port default (torch/distributed/run.py)
PROBE_BYTES = 4 * 2**20
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check. ``status`` is pass, warn, skip (does not apply here) or fail;
    ``advice`` says what to do about anything but a pass."""

    name: str
    status: str
    detail: str
    advice: str = ""

    @property
    def ok(self) -> bool:
        """False only for a failure: warnings and skipped checks do not fail the doctor."""
        return self.status != FAIL


# --- bandwidth arithmetic (nccl-tests' definitions) -------------------------------------------

def algorithm_bandwidth(nbytes: float, seconds: float) -> float:
    """Bytes per second as the user sees it: the message size over the time of one operation."""
    return nbytes / seconds


def all_reduce_bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: ``algbw * 2(n-1)/n`` (0 for one rank)."""
    return algorithm_bandwidth(nbytes, seconds) * 2 * (world_size - 1) / world_size


def human_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes:g} B"


# --- the all-reduce probe (runs inside each rank) --------------------------------------------

def _iterations_for(nbytes: int) -> int:
    """Enough back-to-back all-reduces that one timing covers ~32 MB, so small messages are not
    all timer noise; at least 2, at most 50."""
    return max(2, min(50, (32 * 2**20) // max(nbytes, 1)))


def slowest_rank_timings(buffer: torch.Tensor, calls: int, repeats: int,
                         sync: Callable[[], None]) -> list[float]:
    """Seconds per all-reduce of ``buffer`` in each of ``repeats`` timings of ``calls``
    back-to-back all-reduces, after two warm-ups and a barrier before each timing; each figure
    is the slowest rank's (a collective is done when its last rank is). Every rank calls it.
    ``sync`` waits for the device (``torch.cuda.synchronize`` under NCCL)."""
    for _ in range(2):
        dist.all_reduce(buffer)
    timings = []
    for _ in range(repeats):
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(buffer)
        sync()
        timings.append((time.perf_counter() - start) / calls)
    slowest = torch.tensor(timings, dtype=torch.float64, device=buffer.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def allreduce_probe(rank: int, world_size: int, sizes: Sequence[int], repeats: int = 5) -> list:
    """All-reduce a known pattern of each size, check the sum, and time it.

    Rank r contributes ``(r+1) * (1 + i % 3)`` at element i, so the correct result is
    ``n(n+1)/2 * (1 + i % 3)``: a lost, doubled or misplaced chunk changes it. Each timing is
    ``k`` back-to-back all-reduces of a buffer of the same size after two warm-ups; the slowest rank's time counts (a
    collective is done when its last rank is), and the median of ``repeats`` timings is kept.
    Returns ``[(nbytes, seconds_per_all_reduce, sum_correct), ...]``.
    """
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    results = []
    for nbytes in sizes:
        pattern = 1 + torch.arange(nbytes // 4, device=device) % 3
        t = (rank + 1) * pattern.float()
        dist.all_reduce(t)
        correct = torch.equal(t, world_size * (world_size + 1) / 2 * pattern.float())
        # Timed on zeros: summing the same tensor again and again would overflow it to inf.
        buffer = torch.zeros_like(t)
        slowest = slowest_rank_timings(buffer, _iterations_for(nbytes), repeats, sync)
        ok = torch.tensor([1.0 if correct else 0.0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        results.append((nbytes, statistics.median(slowest), ok.item() == 1.0))
    return results


def measure_allreduce(sizes: Sequence[int], world_size: int = 2, backend: str = "gloo",
                      timeout: float = PROBE_TIMEOUT_S) -> list[dict]:
    """Run :func:`allreduce_probe` in ``world_size`` fresh ranks; one dict per size with
    ``bytes``, ``seconds``, ``algbw`` and ``busbw`` (bytes/s) and ``correct``."""
    per_rank = run_ranks(allreduce_probe, world_size, list(sizes), backend=backend,
                         timeout=timeout, relay_output=False)
    rows = []
    for nbytes, seconds, correct in per_rank[0]:
        rows.append({
            "bytes": nbytes,
            "seconds": seconds,
            "algbw": algorithm_bandwidth(nbytes, seconds),
            "busbw": all_reduce_bus_bandwidth(nbytes, seconds, world_size),
            "correct": correct,
        })
    return rows


# --- the checks ------------------------------------------------------------------------------

def check_torch() -> CheckResult:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    detail = (f"torch {torch.__version__} ({build}), Python {platform.python_version()}, "
              f"{platform.system()} {platform.machine()}")
    if not dist.is_available():
        return CheckResult("torch", FAIL, detail + "; torch.distributed is NOT available",
                           "This torch was built without distributed support (USE_DISTRIBUTED=0, "
                           "e.g. some source builds). Install an official wheel from pytorch.org.")
    return CheckResult("torch", PASS, detail + "; torch.distributed available")


def check_cuda() -> CheckResult:
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return CheckResult(
                "CUDA", SKIP,
                "no CUDA: this torch is a CPU-only build (torch.version.cuda is None)",
                "Nothing to do for this course: every chapter runs on CPU with gloo. For GPU "
                "training install a CUDA build that matches your driver (pytorch.org selector).")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)")
        return CheckResult(
            "CUDA", WARN, f"torch has CUDA {torch.version.cuda} but sees no GPU",
            "Run `nvidia-smi`: no output means no driver or no GPU; a driver older than CUDA "
            f"{torch.version.cuda} needs is refused. CUDA_VISIBLE_DEVICES={visible} "
            "(an empty value hides every GPU).")
    names = [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    return CheckResult("CUDA", PASS, f"CUDA {torch.version.cuda}, {len(names)} GPU(s): "
                       + "; ".join(names))


def check_nccl() -> CheckResult:
    if not dist.is_nccl_available():
        return CheckResult(
            "NCCL", SKIP, "NCCL is not available in this torch (dist.is_nccl_available() is False)",
            "NCCL ships only with CUDA builds of torch on Linux and needs GPUs. On CPU the course "
            "uses gloo: nothing to do. For GPUs, install a CUDA build of torch.")
    if not torch.cuda.is_available():
        return CheckResult("NCCL", SKIP, "NCCL is built in, but no GPU is visible to use it with",
                           "See the CUDA line: NCCL needs one GPU per rank.")
    try:
        version = ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception as exc:  # a broken install reports itself here
        return CheckResult("NCCL", WARN, f"NCCL is built in, but its version could not be read: "
                           f"{type(exc).__name__}: {exc}",
                           "Reinstall torch; set NCCL_DEBUG=INFO to see which libnccl loads.")
    return CheckResult("NCCL", PASS, f"NCCL {version} (torch.cuda.nccl.version())")


def check_gloo() -> CheckResult:
    if dist.is_gloo_available():
        return CheckResult("gloo", PASS, "gloo is available (dist.is_gloo_available())")
    return CheckResult("gloo", FAIL, "gloo is NOT available in this torch",
                       "The CPU labs need gloo, which every official Linux/macOS wheel has. "
                       "Install torch from pytorch.org.")


def check_topology() -> CheckResult:
    """``nvidia-smi topo -m``: how the GPUs are wired (NVLink ``NV#``, PCIe ``PIX/PXB/PHB``,
    across CPU sockets ``SYS``), which bounds how fast they can all-reduce."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return CheckResult("GPU topology", SKIP, "no nvidia-smi on PATH",
                           "Nothing to do on a CPU machine. On a GPU machine, nvidia-smi comes "
                           "with the NVIDIA driver: install the driver.")
    try:
        done = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CheckResult("GPU topology", WARN, f"`nvidia-smi topo -m` did not run: {exc}",
                           "Check the driver with a plain `nvidia-smi`.")
    if done.returncode != 0:
        return CheckResult("GPU topology", WARN,
                           f"`nvidia-smi topo -m` exited {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()[:300]}",
                           "Check the driver with a plain `nvidia-smi`.")
    return CheckResult("GPU topology", PASS, "nvidia-smi topo -m:\n" + done.stdout.rstrip())


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_all_reduce(backend: str, world_size: int = 2, nbytes: int = PROBE_BYTES) -> CheckResult:
    """A real ``world_size``-rank all-reduce on ``backend``: is the sum right, and how fast?"""
    name = f"all_reduce {backend} x{world_size}"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return CheckResult(name, SKIP, "NCCL is not available in this torch",
                               "Nothing to do on CPU: the gloo all_reduce tests this machine.")
        if _gpu_count() < world_size:
            return CheckResult(
                name, SKIP, f"needs {world_size} GPUs (one per rank), {_gpu_count()} visible",
                "NCCL refuses two ranks on one GPU; the gloo all_reduce tests the rest. Run "
                "the doctor again on a machine with 2+ GPUs before training on it.")
    elif not dist.is_gloo_available():
        return CheckResult(name, SKIP, "gloo is not available", "See the gloo line.")
    try:
        row = measure_allreduce([nbytes], world_size, backend)[0]
    except Exception as exc:
        return CheckResult(name, FAIL, f"{type(exc).__name__}: {str(exc).strip()[:600]}",
                           _ALL_REDUCE_ADVICE[backend])
    expected = world_size * (world_size + 1) // 2
    speed = (f"{human_bytes(nbytes)} in {row['seconds'] * 1e3:.2f} ms: "
             f"algbw {row['algbw'] / 1e9:.2f} GB/s, busbw {row['busbw'] / 1e9:.2f} GB/s")
    if not row["correct"]:
        return CheckResult(name, FAIL, f"WRONG SUM (expected 1+...+{world_size} = {expected} "
                           f"times the pattern); {speed}", _ALL_REDUCE_ADVICE[backend])
    return CheckResult(name, PASS, f"sum correct on every rank (1+...+{world_size} = {expected} "
                       f"times the pattern); {speed}")


_ALL_REDUCE_ADVICE = {
    "gloo": "gloo could not connect two local processes. Check that this machine's hostname "
            "resolves (`getent hosts $(hostname)`), or pin gloo to loopback with "
            "GLOO_SOCKET_IFNAME=lo; rerun with TORCH_DISTRIBUTED_DEBUG=INFO for more.",
    "nccl": "Rerun with NCCL_DEBUG=INFO to see where NCCL stops. Look at `nvidia-smi topo -m`; "
            "to rule out peer-to-peer or InfiniBand trouble try NCCL_P2P_DISABLE=1 or "
            "NCCL_IB_DISABLE=1 (slower, but it tells you which transport is broken).",
}


def check_free_port() -> CheckResult:
    """Can the OS hand out a free TCP port on loopback? That is what ``torchrun --standalone``
    and single-node ``torchrun`` rely on (they rendezvous at ``localhost:0``)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    except OSError as exc:
        return CheckResult("free port", FAIL, f"could not bind a port on 127.0.0.1: {exc}",
                           "Loopback networking is missing (a sandbox or container without a "
                           "network namespace?). Process groups need it, even on one machine.")
    return CheckResult("free port", PASS, f"the OS handed out port {port} on 127.0.0.1")


def check_master_port(port: int | None = None) -> CheckResult:
    """Is MASTER_PORT (or the default 29500) free? A stuck rank from an earlier run often holds
    it."""
    port = port or int(os.environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    name = f"port {port}"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # TCPStore sets SO_REUSEADDR too: a port left in TIME_WAIT counts as free, a
            # listening one does not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
    except OSError as exc:
        return CheckResult(
            name, WARN, f"port {port} is in use ({exc.strerror})",
            f"A launch that needs port {port} (multi-node torchrun's default --master-port, or "
            f"MASTER_PORT={port} set by hand) fails with EADDRINUSE. See who holds it: "
            f"`ss -ltnp 'sport = :{port}'` (often a rank left over from a crashed run: end it), "
            "or choose another port. torchrun --standalone picks a free one itself.")
    return CheckResult(name, PASS, f"port {port} is free (MASTER_PORT "
                       + ("from the environment)" if "MASTER_PORT" in os.environ
                          else "not set; 29500 is torchrun's --master-port default)"))


def check_threads() -> CheckResult:
    cores = usable_cores()
    setting = os.environ.get("OMP_NUM_THREADS")
    detail = (f"OMP_NUM_THREADS={setting if setting is not None else '(not set)'}, "
              f"torch uses {torch.get_num_threads()} threads, {cores} usable cores. "
              "torchrun sets OMP_NUM_THREADS=1 in each worker when it is unset and "
              "nproc_per_node > 1")
    if setting is not None:
        try:
            threads = int(setting)
        except ValueError:
            return CheckResult("threads", WARN, detail, f"OMP_NUM_THREADS={setting!r} is not a "
                               "number: unset it or set e.g. 1.")
        if threads > cores:
            return CheckResult("threads", WARN, detail,
                               f"{threads} threads on {cores} cores oversubscribe the CPU, and "
                               "every rank of a CPU run multiplies that: use at most "
                               "cores / ranks threads per rank.")
    return CheckResult("threads", PASS, detail)


def check_gloo_all_reduce() -> CheckResult:
    return check_all_reduce("gloo")


def check_nccl_all_reduce() -> CheckResult:
    return check_all_reduce("nccl")


ALL_CHECKS: list[Callable[[], CheckResult]] = [
    check_torch,
    check_cuda,
    check_nccl,
    check_gloo,
    check_topology,
    check_gloo_all_reduce,
    check_nccl_all_reduce,
    check_free_port,
    check_master_port,
    check_threads,
]


def run_checks(checks: Sequence[Callable[[], CheckResult]] | None = None) -> list[CheckResult]:
    """Run every check (default: :data:`ALL_CHECKS`); a check that raises becomes a failure."""
    results = []
    for check in ALL_CHECKS if checks is None else checks:
        try:
            results.append(check())
        except Exception as exc:
            results.append(CheckResult(getattr(check, "__name__", "check"), FAIL,
                                       f"the check itself crashed: {type(exc).__name__}: {exc}",
                                       "Report this with the full output of the doctor."))
    return results


def format_report(results: Sequence[CheckResult], width: int = 100) -> str:
    """A line (wrapped to ``width``) per check, and a "what to do" line under each check that
    did not pass. Multi-line details (the topology matrix) are kept as they are."""
    name_width = max((len(r.name) for r in results), default=0)
    indent = " " * (name_width + 9)
    lines = [f"ddpcourse doctor ({sys.executable})"]
    for r in results:
        head = f"[{r.status.upper():4}] {r.name:<{name_width}}  "
        first, *rest = r.detail.splitlines() or [""]
        lines.append(textwrap.fill(first, width, initial_indent=head, subsequent_indent=indent,
                                   break_on_hyphens=False))
        lines.extend(indent + line for line in rest)
        if r.status != PASS and r.advice:
            lines.append(textwrap.fill(r.advice, width, initial_indent=indent + "what to do: ",
                                       subsequent_indent=indent + "  ", break_on_hyphens=False))
    failed = [r.name for r in results if not r.ok]
    lines.append("RESULT: " + (f"FAILED: {', '.join(failed)}" if failed
                               else "everything available here works"))
    return "\n".join(lines)


def exit_code(results: Sequence[CheckResult]) -> int:
    return 0 if all(r.ok for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpcourse.doctor",
                                     description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    results = run_checks()
    print(format_report(results), flush=True)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
