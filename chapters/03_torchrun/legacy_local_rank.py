"""A script written for the deprecated `python -m torch.distributed.launch`: it takes --local-rank.

    python -m torch.distributed.launch --nproc_per_node 2 chapters/03_torchrun/legacy_local_rank.py

Launch test: custom (tests/test_chapter_03_torchrun.py runs it under the old launcher and under
torchrun).

The old launcher (torch 2.13: a thin wrapper around torchrun's own argument parser, which also
prints a FutureWarning) appends ``--local-rank=N`` to every worker's command line unless it is
given ``--use-env``; torchrun never does. A script whose parser does not know that option stops at
once with "unrecognized arguments: --local-rank=0". This one accepts both spellings, as PyTorch's
launch docs advise for old scripts, and falls back to LOCAL_RANK, which both launchers set.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
    opts = parser.parse_args()
    local_rank = opts.local_rank if opts.local_rank is not None else int(os.environ["LOCAL_RANK"])
    source = "--local-rank argument" if opts.local_rank is not None else "LOCAL_RANK variable"
    print(f"local rank {local_rank} (from the {source}); argv tail {sys.argv[1:]}; "
          f"LOCAL_RANK={os.environ.get('LOCAL_RANK')}\n", end="", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
