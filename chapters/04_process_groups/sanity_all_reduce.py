"""The article's communication sanity check, with the number it really prints.

    torchrun --standalone --nproc_per_node 2 chapters/04_process_groups/sanity_all_reduce.py

Every rank all-reduces ``ones * rank`` (default op: SUM), so every rank must print
0 + 1 + ... + (N-1) = N(N-1)/2: 1 on 2 ranks, 6 on 4 (the article says 4 on 4 cards; that would
be ``ones`` without ``* rank``). Per-rank output is the point here, so every rank prints.
Exit code 1 if any rank got something else.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ddpcourse.dist_env import process_group


def main() -> int:
    with process_group(timeout_s=30) as ctx:
        tensor = torch.ones(1, device=ctx.device) * ctx.rank
        dist.all_reduce(tensor)
        expected = ctx.world_size * (ctx.world_size - 1) / 2
        # one write per line: the ranks share one pipe
        print(f"Rank {ctx.rank}: tensor = {tensor.item():g} (expected {expected:g})\n",
              end="", flush=True)
        ok = torch.tensor([1.0 if tensor.item() == expected else 0.0], device=ctx.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return 0 if ok.item() == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
