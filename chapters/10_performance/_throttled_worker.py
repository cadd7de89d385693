"""One "node" of throttled_network.py: time all-reduces and DDP steps over the namespaces' link.

Launched by throttled_network.py (torchrun inside a network namespace), not by hand. Rank 0
prints one line ``RESULT {json}``: the best and median seconds of an all-reduce of ``--bytes``
and of a DDP training step of buckets_and_hooks.make_net (one bucket: ``bucket_cap_mb=25``), each
the slowest rank's, and the same step's time without DDP on one process (the weak-scaling
baseline).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))

import buckets_and_hooks as bh  # noqa: E402
from ddpcourse.dist_env import process_group  # noqa: E402


def slowest(samples: list[float]) -> list[float]:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up (and DDP's step 0, after which it rebuilds its buckets)
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return slowest(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=4 * 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    with process_group(timeout_s=300, backend="gloo") as ctx:
        torch.set_num_threads(1)
        buffer = torch.zeros(opts.bytes // 4)
        allreduce = timed(lambda: dist.all_reduce(buffer), opts.repeats)
        x = torch.randn(bh.BATCH, bh.WIDTH)

        def step_of(model):
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step():
                opt.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
                opt.step()
            return step

        ddp = timed(step_of(DDP(bh.make_net(), bucket_cap_mb=25)), opts.repeats)
        alone = timed(step_of(bh.make_net()), opts.repeats)  # no communication at all
        if ctx.rank == 0:
            result = {"allreduce_bytes": 4 * buffer.numel(),
                      "gradient_bytes": bh.gradient_bytes(bh.make_net())}
            for name, samples in (("allreduce", allreduce), ("ddp_step", ddp),
                                  ("step_without_ddp", alone)):
                result[name] = {"best_s": min(samples), "median_s": statistics.median(samples),
                                "samples_s": samples}
            print("RESULT " + json.dumps(result), flush=True)
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
