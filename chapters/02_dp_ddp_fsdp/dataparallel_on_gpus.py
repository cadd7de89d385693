"""The real nn.DataParallel on every visible GPU: per-iteration replicate and gather cost, and
how much more memory device 0 ends up holding than the others.

    python chapters/02_dp_ddp_fsdp/dataparallel_on_gpus.py

Launch test: custom (DataParallel is one process driving all GPUs, so this script is started
with plain ``python``, not torchrun; tests/test_chapter_02_dp_ddp_fsdp.py runs it.)

For MLPs of growing width it trains with ``nn.DataParallel`` and Adam and prints, per width,
the time of a whole training step, of ``DataParallel.replicate`` alone (done inside every
forward) and of ``DataParallel.gather`` alone (fastest/median of a few repeats, then a verdict
on whether the GPUs were quiet enough to read them), then ``torch.cuda.max_memory_allocated``
of each GPU over the training steps. Device 0 holds the module's parameters, its gradients,
Adam's state and the gathered outputs; the other GPUs hold only each iteration's replica
and its activations.

With fewer than two GPUs it prints why it skipped and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ch02_helpers import gpu_dataparallel_report, live_timings  # noqa: E402

from ddpcourse import timing  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=512)
    opts = parser.parse_args()

    rows, note = gpu_dataparallel_report(opts.widths, batch=opts.batch)
    print(f"nn.DataParallel: {note}")
    if rows is None:
        return 0
    def fastest_median(row: dict, name: str) -> str:
        return f"{row[name + '_s'] * 1e3:.2f}/{row[name + '_median_s'] * 1e3:.2f}"

    for row in rows:
        peaks = row["peak_bytes"]
        others = max(peaks[1:])
        print(f"width {row['width']:>5} ({row['param_bytes'] / 1e6:.0f} MB of parameters), ms "
              f"fastest/median: step {fastest_median(row, 'step')}, replicate "
              f"{fastest_median(row, 'replicate')}, gather {fastest_median(row, 'gather')}")
        print("    peak allocated per GPU (MB): "
              + ", ".join(f"cuda:{d} {p / 1e6:.0f}" for d, p in enumerate(peaks))
              + f"  -> device 0 / busiest other = {peaks[0] / others:.2f}")
    print(timing.judge(live_timings(rows, ["step", "replicate", "gather"]), timing.machine_load()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
