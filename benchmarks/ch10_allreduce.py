"""All-reduce bandwidth, 1 KiB to 256 MiB on 2 and 4 ranks, and the α–β fit of chapter 10, as JSON.

    python benchmarks/ch10_allreduce.py                      # a few minutes on 2 cores
    python benchmarks/ch10_allreduce.py --short --out /tmp/x.json

Runs ``measure`` of chapters/10_performance/allreduce_bandwidth.py in real process groups
(``ddpcourse.launcher.run_ranks``: a deadline, no fixed port) for each world size, then fits the
α–β model of ``ddpcourse.cost_model`` (``α + 2(N−1)/N · n / β``) to the best times, once
per world size (:func:`fit_alpha_beta`) and writes, beside every measured point, what the fit predicts
and its error. The record starts with ``ddpcourse.timing.reference_header`` (machine, date, torch,
this command, how busy the machine was) and carries ``ddpcourse.timing.judge``'s verdict on the
repeats. The lesson plots benchmarks/results/ch10_allreduce.json beside its live run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "chapters" / "10_performance"))

from ddpcourse.cost_model import Link, allreduce_time, bus_factor  # noqa: E402
from ddpcourse.launcher import run_ranks  # noqa: E402
from ddpcourse.timing import (  # noqa: E402
    Timing, close_record, command_line, machine_load, reference_header, write_record)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ch10_allreduce.json"
SHORT_SIZES = ["1K", "64K", "4M"]


def fit_alpha_beta(points: list[tuple[int, int, float]]) -> Link:
    """α and β of ``t = α + 2(N−1)/N · n / β`` from ``(bytes n, world_size N, seconds t)``
    points, by least squares on the *relative* error (weights 1/t²): the times span four orders
    of magnitude, and a plain fit would let the largest messages decide α alone. Needs two
    distinct ``2(N−1)/N · n``; α is clipped at 0."""
    xs = [bus_factor(n_ranks) * nbytes for nbytes, n_ranks, _ in points]
    ts = [t for *_, t in points]
    if len(set(xs)) < 2:
        raise ValueError("fitting two parameters needs at least two distinct message sizes")
    w = [1 / t**2 for t in ts]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, ts))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    alpha = max(0.0, (st - slope * sx) / sw)
    if alpha == 0.0:  # refit the slope alone through the origin
        slope = sxt / sxx
    return Link(alpha, 1 / slope)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--short", action="store_true", help=f"sizes {' '.join(SHORT_SIZES)}, "
                        "3 repeats (a check that it runs, not a measurement)")
    parser.add_argument("--repeats", type=int, default=None, help="default 10 (3 with --short)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--note", default="", help="what the reader should know about the run")
    args = parser.parse_args()
    import allreduce_bandwidth as ab

    sizes = [ab.parse_size(s) for s in (SHORT_SIZES if args.short else ab.FULL_SIZES)]
    repeats = args.repeats or (3 if args.short else 10)
    load = machine_load(2.0)
    record = reference_header(command_line(), load, args.note)
    record.update(backend="gloo", repeats=repeats, rows=[])
    for world_size in args.world_sizes:
        rows = run_ranks(ab.measure, world_size, sizes, repeats, backend="gloo", timeout=900)[0]
        print(f"{world_size} ranks:\n{ab.format_table(rows)}")
        record["rows"].extend(rows)
    record["fit"] = {"method": "fit_alpha_beta: least squares on relative error, best times, "
                               "one fit per world size (ranks beyond the cores raise α)"}
    for world_size in args.world_sizes:
        rows = [r for r in record["rows"] if r["world_size"] == world_size]
        link = fit_alpha_beta([(r["bytes"], world_size, r["best_s"]) for r in rows])
        for r in rows:
            r["predicted_s"] = allreduce_time(r["bytes"], world_size, link)
            r["prediction_error"] = r["predicted_s"] / r["best_s"] - 1
        record["fit"][str(world_size)] = {"alpha_s": link.alpha_s,
                                          "beta_bytes_per_s": link.beta_bytes_per_s}
        print(f"fit, {world_size} ranks: alpha = {link.alpha_s * 1e6:.1f} us, "
              f"beta = {link.beta_bytes_per_s / 1e9:.3f} GB/s")
    print(f"{'ranks':>5} {'size':>9} {'measured us':>12} {'predicted us':>13} {'error':>7}")
    for r in record["rows"]:
        print(f"{r['world_size']:>5} {ab.human(r['bytes']):>9} {r['best_s'] * 1e6:>12.1f} "
              f"{r['predicted_s'] * 1e6:>13.1f} {100 * r['prediction_error']:>+6.0f}%")
    record["all_sums_correct"] = all(r["correct"] for r in record["rows"])
    close_record(record, {f"{r['world_size']} ranks {ab.human(r['bytes'])}":
                          Timing.of(r["timings_s"]) for r in record["rows"]}, load)
    write_record(record, args.out)
    return 0 if record["all_sums_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
