"""The source article's "NCCL bandwidth test", and why it tests nothing about communication.

    python chapters/00_setup/one_rank_all_reduce.py
    python chapters/00_setup/one_rank_all_reduce.py --backend nccl    # on a GPU machine

Launch test: custom (a plain ``python`` launch, like the article's one-liner;
tests/test_chapter_00_doctor.py runs it and checks what it prints).

The article checks its environment with a one-liner that calls
``init_process_group("nccl", init_method="tcp://127.0.0.1:29500", rank=0, world_size=1)`` and
prints "OK", next to the comment that NCCL bandwidth should be over 12 GB/s. With
``world_size=1`` the group has one member: there is nobody to connect to, so no bytes ever leave
the process, and a "successful" all-reduce returns its input unchanged. This script does the same
(gloo by default, so it runs anywhere; ``--backend nccl`` for the article's exact backend),
then all-reduces a 16 MiB tensor and shows three things:

* the result equals the input (a sum over one rank);
* it takes microseconds, less than copying the tensor once in memory, because nothing is done;
* nccl-tests' bus bandwidth ``algbw * 2(n-1)/n`` is exactly 0 for ``n = 1``.

To measure communication you need two ranks or more: ``chapters/00_setup/allreduce_bandwidth.py``
under torchrun, or ``python -m ddpcourse.doctor``. The port is picked by the OS (port 0), not the
article's fixed 29500, so the script never collides with another run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpcourse.doctor import algorithm_bandwidth, all_reduce_bus_bandwidth
from ddpcourse.dist_env import free_port


def median_time(fn, device: torch.device, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--mib", type=int, default=16, help="size of the all-reduced tensor")
    opts = parser.parse_args()

    device = torch.device("cuda", 0) if opts.backend == "nccl" else torch.device("cpu")
    start = time.perf_counter()
    dist.init_process_group(opts.backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=30),
                            device_id=device if device.type == "cuda" else None)
    print(f"init_process_group({opts.backend!r}, world_size=1) returned in "
          f"{(time.perf_counter() - start) * 1e3:.1f} ms: OK (the article's whole test)")
    try:
        nbytes = opts.mib * 2**20
        x = torch.randn(nbytes // 4, device=device)
        before = x.clone()
        dist.all_reduce(x)  # the first call may set things up: not timed
        seconds = median_time(lambda: dist.all_reduce(x), device)
        copy_seconds = median_time(lambda: x.clone(), device)
        print(f"all_reduce of {opts.mib} MiB on 1 rank: result equals the input: "
              f"{torch.equal(x, before)}")
        print(f"  time {seconds * 1e6:.1f} us, vs {copy_seconds * 1e6:.1f} us to copy the "
              "tensor once in memory")
        print(f"  algbw = bytes / time = {algorithm_bandwidth(nbytes, seconds) / 1e9:.1f} GB/s "
              "(meaningless: no bytes moved)")
        print(f"  busbw = algbw * 2(n-1)/n = "
              f"{all_reduce_bus_bandwidth(nbytes, seconds, 1) / 1e9:.1f} GB/s with n = 1")
        print("VERDICT: world_size=1 tests that the library loads, not communication; "
              "measure with 2+ ranks.")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
