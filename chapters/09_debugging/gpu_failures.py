"""GPU-only failures: two ranks on one GPU, no ``set_device``, and an NCCL collective timeout.

    python chapters/09_debugging/gpu_failures.py          # every case this machine's GPUs allow
    torchrun --standalone --nproc_per_node 2 chapters/09_debugging/gpu_failures.py CASE

Launch test: custom (the cases fail on purpose; tests/test_chapter_09_tools.py runs the driver
when GPUs are present, and says why it skips otherwise).

Each case is a two-rank NCCL job launched with ``torchrun``; the driver checks that it fails (or
works) the way this docstring says:

* ``same_device`` (needs 1 GPU): both ranks ``torch.cuda.set_device(0)``, e.g. from a hard-coded
  ``cuda:0`` or ``LOCAL_RANK`` read wrongly. NCCL refuses the communicator: ``ncclInvalidUsage``
  with "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ...". Passing
  ``device_id`` to ``init_process_group`` makes the communicator at once, so it fails there;
  without it, at the first collective.
* ``no_set_device`` (needs 1 GPU): no ``set_device`` at all and tensors made with
  ``device="cuda"``: every rank's "cuda" is GPU 0, the same failure at the first collective.
  (On a job that gets past NCCL by luck, e.g. one rank per node, the symptom is every process
  allocating on GPU 0: ``nvidia-smi`` shows all processes on one card.)
* ``fixed`` (needs 2 GPUs): ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` before
  anything touches the GPU, and ``device_id`` in ``init_process_group``: the all-reduce gives the
  exact sum.
* ``nccl_timeout`` (needs 2 GPUs): rank 1 skips an all-reduce. NCCL kernels run asynchronously,
  so rank 0's ``all_reduce`` call returns at once; the *watchdog* thread of ProcessGroupNCCL
  notices after the group's timeout ("Watchdog caught collective operation timeout:
  WorkNCCL(SeqNum=..., OpType=ALLREDUCE, ...)") and ends the process. With
  ``TORCH_FR_BUFFER_SIZE`` set, the flight recorder keeps the last collectives of each rank
  (``TORCH_FR_DUMP_TEMP_FILE``: where the dump is written on a timeout; analyse the dumps of all
  ranks with ``python -m torch.distributed.flight_recorder.fr_trace``).

Real logs of the first two cases, captured on one NVIDIA H200 (torch 2.11.0+cu130, NCCL 2.28.9),
are in ``captured_logs/``. Exit code 1 if a case that ran did not behave as described.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import tempfile

from ddpcourse.report import report_checks

CASES = {  # case -> (GPUs it needs, what its output must contain, whether it must succeed)
    "same_device": (1, "Duplicate GPU detected", False),
    "no_set_device": (1, "Duplicate GPU detected", False),
    "fixed": (2, "all_reduce sum = 3.0", True),
    "nccl_timeout": (2, "Watchdog caught collective operation timeout", False),
}
TIMEOUT_S = 10
DEADLINE_S = 150.0


def worker(case: str) -> int:
    """One rank of a case (under torchrun)."""
    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if case == "same_device":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", 0))
    elif case == "no_set_device":
        dist.init_process_group("nccl", timeout=timeout)
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout,
                                device_id=torch.device("cuda", local_rank))
    try:
        total = torch.tensor([float(rank + 1)], device="cuda")
        if case != "nccl_timeout" or rank == 0:
            dist.all_reduce(total)
        torch.cuda.synchronize()  # under nccl_timeout, rank 0 waits here for the watchdog
        print(f"rank {rank}: all_reduce sum = {total.item()}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def launch(case: str):
    from ddpcourse.launcher.processes import run_bounded

    with tempfile.TemporaryDirectory(prefix="ch09_fr_") as dumps:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_FR_BUFFER_SIZE": "200",
               "TORCH_FR_DUMP_TEMP_FILE": os.path.join(dumps, "rank_")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", os.path.abspath(__file__), case]
        done = run_bounded(cmd, DEADLINE_S, env=env)
        return done, sorted(os.listdir(dumps))


def run_all(gpus: int) -> dict:
    outcomes = {}
    for case, (needs, expected, must_succeed) in CASES.items():
        if gpus < needs:
            outcomes[case] = {"skipped": f"needs {needs} GPU(s), this machine has {gpus}"}
            continue
        done, dumps = launch(case)
        text = done.stdout + done.stderr
        lines = [line.strip() for line in text.splitlines() if expected in line]
        outcomes[case] = {"returncode": done.returncode, "timed_out": done.timed_out,
                          "found": lines[:2], "flight recorder dumps": dumps,
                          "ok": bool(lines) and (done.returncode == 0) == must_succeed
                          and not done.timed_out,
                          "tail": text[-3000:]}
    return outcomes


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] in CASES:
        return worker(sys.argv[1])
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    outcomes = run_all(gpus)
    failed = []
    for case, seen in outcomes.items():
        if "skipped" in seen:
            print(f"{case:14s} skipped: {seen['skipped']}")
            continue
        found = re.sub(r"\s+", " ", " | ".join(seen["found"]))[:200]
        print(f"{case:14s} {'as described' if seen['ok'] else 'NOT AS DESCRIBED'}: exit code "
              f"{seen['returncode']}; {found}")
        if seen["flight recorder dumps"]:
            print(f"{'':14s} flight recorder dumps: {seen['flight recorder dumps']}")
        if not seen["ok"]:
            failed.append(case)
            print(seen["tail"])
    return report_checks(failed)


if __name__ == "__main__":
    sys.exit(main())
