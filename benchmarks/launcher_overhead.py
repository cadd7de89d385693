"""How much does it cost to run one all_reduce in N fresh ranks? run_ranks vs torchrun vs mp.spawn.

    python benchmarks/launcher_overhead.py            # 5 runs of each; ~2 minutes on 2 cores
    python benchmarks/launcher_overhead.py --quick    # 1 run of each, 2 ranks only

Every figure is wall-clock time for the launch *and* the work (join a gloo group, one all_reduce of
one float, leave), measured in a fresh Python process that has already imported torch, as a
notebook or a test module has. "first call" starts the rank servers; "later calls" are the calls
that follow in the same process. torchrun is timed as the whole command, since that is what a
student waits for. Printed figures are this machine's; they are not asserted anywhere, because
wall-clock time on a shared machine is noise for a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

RUN_RANKS_PROBE = textwrap.dedent(
    """
    import json, sys, time
    import torch
    sys.path.insert(0, {here!r})
    from _allreduce_once import allreduce_once
    from ddpcourse.launcher import run_ranks, wait_until_warm
    world_size, later = int(sys.argv[1]), int(sys.argv[2])
    start = time.perf_counter()
    assert run_ranks(allreduce_once, world_size) == [float(world_size)] * world_size
    first = time.perf_counter() - start
    after_first = []
    for _ in range(later):
        start = time.perf_counter()
        run_ranks(allreduce_once, world_size)
        after_first.append(time.perf_counter() - start)
    wait_until_warm()
    steady = []
    for _ in range(later):
        start = time.perf_counter()
        run_ranks(allreduce_once, world_size)
        steady.append(time.perf_counter() - start)
    print(json.dumps({{"first": first, "after_first": after_first, "steady": steady}}))
    """
)

SPAWN_PROBE = textwrap.dedent(
    """
    import sys, tempfile, time, os
    import torch, torch.multiprocessing as mp
    sys.path.insert(0, {here!r})
    from _allreduce_once import spawned
    world_size = int(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        mp.spawn(spawned, args=(world_size, os.path.join(tmp, "store")), nprocs=world_size)
        print(time.perf_counter() - start)
    """
)


def python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, check=True)
    return done.stdout.strip().splitlines()[-1]


def time_torchrun(world_size: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={world_size}", "--log-dir", tmp,
                   str(HERE / "_allreduce_once.py")]
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, timeout=300, check=True)
        return time.perf_counter() - start


def row(name: str, world_size: int, samples: list[float]) -> str:
    return (f"{name:<34} {world_size:>5} {statistics.median(samples):>9.3f} "
            f"{min(samples):>8.3f} {max(samples):>8.3f} {len(samples):>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 run of each, 2 ranks only")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per method")
    opts = parser.parse_args()
    runs = 1 if opts.quick else opts.runs
    later = 5 if opts.quick else 20
    sizes = [2] if opts.quick else [2, 4]

    print("launch + one all_reduce (gloo), seconds; fresh process with torch already imported")
    print(f"{'method':<34} {'ranks':>5} {'median':>9} {'min':>8} {'max':>8} {'runs':>5}")
    for world_size in sizes:
        probes = [
            json.loads(python(RUN_RANKS_PROBE.format(here=str(HERE)), str(world_size), str(later)))
            for _ in range(runs)
        ]
        print(row("run_ranks, first call", world_size, [p["first"] for p in probes]))
        print(row(f"run_ranks, next {later} calls", world_size,
                  [t for p in probes for t in p["after_first"]]))
        print(row("run_ranks, later calls (warm)", world_size,
                  [t for p in probes for t in p["steady"]]))
        spawn = [float(python(SPAWN_PROBE.format(here=str(HERE)), str(world_size)))
                 for _ in range(runs)]
        print(row("torch.multiprocessing.spawn", world_size, spawn))
        print(row("torchrun --standalone (command)", world_size,
                  [time_torchrun(world_size) for _ in range(runs)]))


if __name__ == "__main__":
    main()
