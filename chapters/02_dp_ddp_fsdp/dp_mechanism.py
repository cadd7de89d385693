"""DataParallel re-replicates the model every iteration; DDP copies it once. Timed on the CPU.

    torchrun --standalone --nproc_per_node 2 chapters/02_dp_ddp_fsdp/dp_mechanism.py

``nn.DataParallel`` without GPUs just calls the module, so on the CPU rank 0 does by hand what
DataParallel does on GPUs every iteration (scatter the batch, replicate the module, run the
replicas in Python threads, gather the outputs, backward into device 0's parameters; see
``_ch02_helpers.dp_step_emulated``) and times each phase, for MLPs of growing width. Both ranks
then time what DDP costs for the same models: the one-time construction (rank 0's parameters
broadcast, buckets set up) and the per-step gradient all-reduce (a training step with
synchronisation minus the same step under ``no_sync``).

Read the table for how each cost grows with the model, and for which costs come every step.
Absolute numbers are CPU numbers: an in-memory copy here is far cheaper than a GPU-to-GPU copy
through device 0 there, and a gloo all-reduce far slower than NCCL. Times are the fastest of a
few repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ch02_helpers import ddp_costs, dp_mechanism_cost, from_every_rank  # noqa: E402

from ddpcourse.dist_env import process_group  # noqa: E402

WIDTHS = [256, 512, 1024, 2048]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2,
                        help="devices DataParallel would use, in the by-hand emulation")
    opts = parser.parse_args()

    with process_group(timeout_s=60) as ctx:
        everyone = from_every_rank(ddp_costs(ctx.rank, ctx.world_size, opts.widths, opts.depth,
                                             device=str(ctx.device)))
        if not ctx.is_main:
            return 0
        # the slowest rank sets DDP's pace
        ddp_rows = [max(rows, key=lambda r: r["allreduce_s"]) for rows in zip(*everyone)]
        dp_rows = [dp_mechanism_cost(w, opts.depth, n_devices=opts.devices)
                   for w in opts.widths]

        print(f"DataParallel by hand on {opts.devices} emulated devices (CPU) vs DDP on "
              f"{ctx.world_size} ranks ({ctx.backend}); milliseconds")
        header = (f"{'width':>6}{'params MB':>10} |{'DP scatter':>11}{'replicate':>10}"
                  f"{'gather':>8}{'DP step':>9} |{'DDP init':>9}{'all-reduce':>11}"
                  f"{'DDP step':>9}")
        print(header)
        print("-" * len(header))
        for dp, ddp in zip(dp_rows, ddp_rows):
            print(f"{dp['width']:>6}{dp['param_bytes'] / 1e6:>10.1f} |"
                  f"{dp['scatter_s'] * 1e3:>11.2f}{dp['replicate_s'] * 1e3:>10.2f}"
                  f"{dp['gather_s'] * 1e3:>8.2f}{dp['step_s'] * 1e3:>9.1f} |"
                  f"{ddp['construct_s'] * 1e3:>9.1f}{ddp['allreduce_s'] * 1e3:>11.1f}"
                  f"{ddp['step_sync_s'] * 1e3:>9.1f}")
        print("every step: DP scatter, replicate, gather (and its backward onto device 0);"
              " DDP all-reduce")
        print("once per run: DDP init (broadcast from rank 0 + bucket set-up)")
        largest = dp_rows[-1]
        print(f"per step DP sends {largest['bytes_sent_from_device0'] / 1e6:.1f} MB of "
              f"parameters out of device 0 and reduces as many gradient bytes back onto it "
              f"(width {largest['width']})")
        return 0


if __name__ == "__main__":
    sys.exit(main())
