"""What each rank holds under DDP and under FSDP2, counted in bytes after one Adam step.

    torchrun --standalone --nproc_per_node 2 chapters/02_dp_ddp_fsdp/memory_per_rank.py

Both ranks build the same model (8 x Linear(256, 256) and a Linear(256, 5), 2.1 MB of float32
parameters), train it one step with Adam under DistributedDataParallel, then again under FSDP2
``fully_shard``, and count, tensor by tensor, the bytes of the parameters, gradients, Adam
state (exp_avg and exp_avg_sq, plus one ``step`` counter per parameter tensor) and DDP's
gradient buckets that the rank holds. Rank 0 prints the table for every rank, then checks the
exact relations the numbers must satisfy:

* DDP: every rank holds the FULL parameters, the full gradients, 2 x the parameters of Adam
  state, and bucket buffers as large as the gradients (separate storage by default).
* FSDP2: a rank holds only its shard (rows split along dim 0, padded to equal size), of the
  parameters, of the gradients and of the Adam state; the shards add up to the full model.

It also prints what each scheme sent during the step: DDP all-reduces every gradient once;
FSDP2 all-gathers every layer's parameters in forward and again in backward and
reduce-scatters the gradients. Exit code 1 if any relation fails.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ch02_helpers import (  # noqa: E402
    check_memory_relations,
    format_memory_table,
    from_every_rank,
    memory_per_rank,
)

from ddpcourse.dist_env import process_group  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    opts = parser.parse_args()

    with process_group(timeout_s=60) as ctx:
        everyone = from_every_rank(memory_per_rank(ctx.rank, ctx.world_size, opts.width,
                                                   opts.depth, device=str(ctx.device)))
        if not ctx.is_main:
            return 0
        full = everyone[0]["ddp"]["full_param_bytes"]
        print(f"{ctx.world_size} ranks, backend {ctx.backend}; model parameters: {full:,} bytes")
        print("bytes held by each rank after one Adam step:")
        print(format_memory_table(everyone))
        ddp, fsdp = everyone[0]["ddp"], everyone[0]["fsdp"]
        print(f"DDP  sent: all-reduce of {ddp['allreduce_bytes']:,} B of gradient buckets")
        print(f"FSDP sent: {fsdp['all_gather_calls']} all-gathers of {fsdp['all_gather_bytes']:,}"
              f" B (unsharded, padded) + {fsdp['reduce_scatter_calls']} reduce-scatters of "
              f"{fsdp['reduce_scatter_bytes']:,} B")
        checks = check_memory_relations(everyone)
        for statement, holds in checks:
            print(f"CHECK {'ok  ' if holds else 'FAIL'} {statement}")
        ok = all(holds for _, holds in checks)
        print("RESULT: all memory relations hold" if ok else "RESULT: a memory relation FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
