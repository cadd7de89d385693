"""What torchrun tells each worker, and what it does not: the launcher's environment, rank by rank.

    torchrun --standalone --nproc_per_node 2 chapters/03_torchrun/print_env.py

Every rank reads the variables torchrun's elastic agent puts in a worker's environment (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT, the
TORCHELASTIC_* family, TORCH_NCCL_ASYNC_ERROR_HANDLING, ...) plus CUDA_VISIBLE_DEVICES, which
torchrun does *not* set by default.
Rank 0 gathers every rank's view and prints one table, so the output is in rank order.

Try it with ``CUDA_VISIBLE_DEVICES=0,1`` in front (every rank inherits the same value, unchanged)
and with ``--virtual-local-rank`` after ``torchrun`` (a recent flag, present in torch 2.13: each
rank then sees one device, and LOCAL_RANK is 0 everywhere). ``--json`` prints one JSON object,
for programs to read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from ddpcourse.dist_env import process_group

LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
NOT_SET_BY_DEFAULT = ("CUDA_VISIBLE_DEVICES",)
UNSET = "(unset)"


def my_view() -> dict[str, str]:
    """This process's launcher variables; missing ones are reported as UNSET, not skipped."""
    names = LAUNCHER_VARIABLES + NOT_SET_BY_DEFAULT
    names += tuple(sorted(n for n in os.environ if n.startswith("TORCHELASTIC_")))
    view = {name: os.environ.get(name, UNSET) for name in names}
    view["pid"] = str(os.getpid())
    return view


def _short(value: str, limit: int = 36) -> str:
    return value if len(value) <= limit else "..." + value[-(limit - 3):]


def table(views: list[dict[str, str]]) -> str:
    names = list(dict.fromkeys(name for view in views for name in view))
    columns = [[f"rank {r}"] + [_short(view.get(n, UNSET)) for n in names]
               for r, view in enumerate(views)]
    widths = [max(len(cell) for cell in column) for column in columns]
    first = ["variable"] + names
    width0 = max(len(n) for n in first)
    return "\n".join(
        (f"{first[i]:<{width0}}  " + "  ".join(f"{c[i]:<{w}}" for c, w in zip(columns, widths)))
        .rstrip()
        for i in range(len(first))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object, rank -> view")
    opts = parser.parse_args()

    with process_group(timeout_s=30) as ctx:
        views: list = [None] * ctx.world_size
        dist.all_gather_object(views, my_view())
        if opts.json:
            ctx.print0(json.dumps({str(r): v for r, v in enumerate(views)}))
        else:
            ctx.print0(table(views))
    return 0


if __name__ == "__main__":
    sys.exit(main())
