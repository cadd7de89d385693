"""DataParallel re-replicates the model every iteration; DDP copies it once. Counted and timed.

    torchrun --standalone --nproc_per_node 2 chapters/02_dp_ddp_fsdp/dp_mechanism.py

``nn.DataParallel`` without GPUs just calls the module, so on the CPU rank 0 does by hand what
DataParallel does on GPUs every iteration (scatter the batch, replicate the module, run the
replicas in Python threads, gather the outputs, backward into device 0's parameters; see
``_ch02_helpers.dp_step_emulated``), for MLPs of growing width. It prints what one iteration
copies (parameter bytes into the replicas, module shells built, input and output bytes moved:
counts, the same on every machine) and how long each phase took. Both ranks then time what DDP
costs for the same models: the one-time construction (rank 0's parameters broadcast, buckets
set up) and the per-step gradient all-reduce (a training step with synchronisation minus the
same step under ``no_sync``).

Times are fastest / median of a few repeats, followed by ``ddpcourse.timing``'s verdict: how
many cores other work kept busy, whether the repeats agree, and so whether the times can be read. They are CPU times: an in-memory
copy here is not a GPU-to-GPU copy there, and gloo is not NCCL. The last line prints each
scheme's bus bytes per step (computed: time on the wire x link bandwidth, as nccl-tests counts
it): on a CUDA build DP's replicate and gradient sum are an NCCL broadcast and reduce, 2 x P,
against 2 (n-1)/n x P for DDP's ring all-reduce.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ch02_helpers import (  # noqa: E402
    ddp_costs,
    dp_mechanism_cost,
    from_every_rank,
    link_bytes_per_step,
    live_timings,
)

from ddpcourse import timing  # noqa: E402
from ddpcourse.dist_env import process_group  # noqa: E402

WIDTHS = [256, 512, 1024, 2048]


def fastest_median(row: dict, name: str) -> str:
    return f"{row[name + '_s'] * 1e3:.2f}/{row[name + '_median_s'] * 1e3:.2f}"


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
        ddp_rows = [max(rows, key=lambda r: r["step_sync_s"]) for rows in zip(*everyone)]
        dp_rows = [dp_mechanism_cost(w, opts.depth, n_devices=opts.devices)
                   for w in opts.widths]

        print(f"DataParallel by hand on {opts.devices} emulated devices (CPU) vs DDP on "
              f"{ctx.world_size} ranks ({ctx.backend})")
        print("counted per DP iteration (the same on every machine):")
        header = (f"{'width':>6}{'params MB':>10}{'replica MB':>11}{'shells':>8}"
                  f"{'scatter+gather KB':>19}")
        print(header)
        print("-" * len(header))
        for dp in dp_rows:
            print(f"{dp['width']:>6}{dp['param_bytes'] / 1e6:>10.1f}"
                  f"{dp['replica_bytes'] / 1e6:>11.1f}{dp['modules_replicated']:>8}"
                  f"{(dp['scatter_bytes'] + dp['gather_bytes']) / 1e3:>19.1f}")
        print("timed on this machine, milliseconds, fastest/median:")
        header = (f"{'width':>6}{'params MB':>10} |{'DP replicate':>14}{'DP gather':>12}"
                  f"{'DP step':>14} |{'DDP init':>14}{'all-reduce':>14}{'DDP step':>14}")
        print(header)
        print("-" * len(header))
        for dp, ddp in zip(dp_rows, ddp_rows):
            print(f"{dp['width']:>6}{dp['param_bytes'] / 1e6:>10.1f} |"
                  f" {fastest_median(dp, 'replicate'):>13} {fastest_median(dp, 'gather'):>11}"
                  f" {fastest_median(dp, 'step'):>13} | {fastest_median(ddp, 'construct'):>13}"
                  f" {fastest_median(ddp, 'allreduce'):>13} {fastest_median(ddp, 'step_sync'):>13}")
        print(timing.judge({**live_timings(dp_rows, ["replicate", "step"], "DP "),
                            **live_timings(ddp_rows, ["construct", "step_sync", "step_nosync"],
                                           "DDP ")},
                           timing.machine_load()))
        print("every step: DP scatter, replicate, gather (and its backward onto device 0);"
              " DDP all-reduce")
        print("once per run: DDP init (broadcast from rank 0 + bucket set-up)")
        largest = dp_rows[-1]
        wire = link_bytes_per_step(opts.devices, largest["param_bytes"])
        print(f"bus bytes per step (computed, width {largest['width']}, "
              f"{opts.devices} devices): DP with NCCL {wire['dp_nccl'] / 1e6:.1f} MB, "
              f"DDP ring all-reduce {wire['ddp'] / 1e6:.1f} MB, "
              f"DP without NCCL {wire['dp_copies'] / 1e6:.1f} MB")
        return 0


if __name__ == "__main__":
    sys.exit(main())
