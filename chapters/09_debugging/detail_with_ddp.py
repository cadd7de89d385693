"""``TORCH_DISTRIBUTED_DEBUG`` around DDP on the CPU: INFO works, DETAIL crashes (torch 2.13).

    python chapters/09_debugging/detail_with_ddp.py

Launch test: custom (it launches ``torchrun`` itself, twice, and expects one of them to crash;
tests/test_chapter_09_tools.py runs it).

The same two-rank DDP job (one ``DistributedDataParallel(nn.Linear)`` on gloo, two steps) under
``torchrun --nproc_per_node 2``, once with ``TORCH_DISTRIBUTED_DEBUG=INFO`` and once with
``DETAIL`` (both with ``TORCH_CPP_LOG_LEVEL=INFO``, without which the C++ log lines stay
hidden). INFO adds DDP's own report, "DDP Initialized with:" and its construction data (bucket
sizes, ``find_unused_parameters``, ``broadcast_buffers``, ...; ``set_construction_data_and_log``
in DDP's ``_ddp_init_helper``, torch/nn/parallel/distributed.py), and the job ends normally. Under DETAIL, with torch 2.13's CPU
build, both ranks die of a segmentation fault inside that same call while DDP is constructed:
torchrun reports ``exitcode  : -11`` and ``Signal 11 (SIGSEGV)`` for each rank, with no Python
traceback. So on the CPU use DETAIL where it helps, on plain collectives (``hang_to_error.py``:
the collective fingerprints), and INFO around DDP. Exit code 1 if either run ends otherwise.
"""

from __future__ import annotations

import os
import re
import sys

from ddpcourse.report import report_checks

WORKER = "worker"
DEADLINE_S = 120.0
CRASH_SEEN_WITH = "2.13.0"  # the CPU build this crash was seen with; other versions: reported only


def worker() -> int:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from ddpcourse.dist_env import process_group

    with process_group(timeout_s=60, backend="gloo") as ctx:
        model = DistributedDataParallel(nn.Linear(4, 2))
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        print(f"rank {ctx.rank}: DDP built and stepped", flush=True)
    return 0


def launch(level: str):
    """The worker under torchrun with ``TORCH_DISTRIBUTED_DEBUG=level``: its Finished record."""
    from ddpcourse.launcher.processes import run_bounded

    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": level, "TORCH_CPP_LOG_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), WORKER]
    return run_bounded(cmd, DEADLINE_S, env=env)


def run_all() -> dict:
    """Both launches: exit code, the ranks that finished, and what torchrun said of each rank."""
    outcomes = {}
    for level in ("INFO", "DETAIL"):
        done = launch(level)
        text = done.stdout + done.stderr
        outcomes[level] = {
            "returncode": done.returncode, "timed_out": done.timed_out,
            "ranks that finished": sorted(int(r) for r in re.findall(r"rank (\d): DDP built", text)),
            "exit codes torchrun reports": re.findall(r"exitcode\s*:\s*(-?\d+)", text),
            "DDP's own log": [line.strip() for line in text.splitlines()
                              if re.match(r"(\[rank0\].*DDP Initialized with|bucket_sizes|"
                                          r"find_unused_parameters|broadcast_buffers)", line.strip())
                              ][:4],
        }
    return outcomes


def crash_expected() -> bool:
    import torch

    return torch.__version__.split("+")[0] == CRASH_SEEN_WITH and not torch.cuda.is_available()


def problems(outcomes: dict) -> list[str]:
    """The claims: INFO ends normally with DDP's report; DETAIL crashes (on the CPU build of
    torch 2.13; elsewhere what DETAIL does is printed, not judged)."""
    info, detail = outcomes["INFO"], outcomes["DETAIL"]
    found = []
    if info["returncode"] != 0 or info["ranks that finished"] != [0, 1]:
        found.append(f"under INFO the job should end normally: {info}")
    if not any("DDP Initialized with" in line for line in info["DDP's own log"]):
        found.append("under INFO DDP should log its construction data ('DDP Initialized with')")
    if not crash_expected():
        return found
    if detail["returncode"] == 0 or detail["ranks that finished"]:
        found.append(f"under DETAIL DDP's construction should crash: {detail}")
    elif "-11" not in detail["exit codes torchrun reports"]:
        found.append(f"under DETAIL torchrun should report exit code -11 (SIGSEGV): {detail}")
    return found


def main() -> int:
    if sys.argv[1:] == [WORKER]:
        return worker()
    outcomes = run_all()
    for level, seen in outcomes.items():
        print(f"TORCH_DISTRIBUTED_DEBUG={level}: exit code {seen['returncode']}, ranks that "
              f"finished {seen['ranks that finished']}, exit codes torchrun reports "
              f"{seen['exit codes torchrun reports'] or 'none'}")
        for line in seen["DDP's own log"]:
            print("   ", line[:150])
    found = problems(outcomes)
    return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
