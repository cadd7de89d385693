"""ddpcourse.timing: repeats, min/median/spread, the load check and its verdict (the "too loaded
to conclude" path by an injected load figure), and the records under benchmarks/results/."""

from __future__ import annotations

import json
import os

import pytest

from ddpcourse import timing
from ddpcourse.timing import IncompleteRecord, Load, Timing


def test_timing_keeps_min_median_spread_and_repeatability():
    t = Timing.of([0.30, 0.10, 0.12, 0.11, 0.50])
    assert t.min == 0.10 and t.median == 0.12
    assert t.spread == pytest.approx(0.2)  # median 20% above the minimum
    assert t.repeatability == pytest.approx(0.1)  # second-best 10% above the best
    assert "min 100 ms, median 120 ms" in str(t) and "5 repeats" in str(t)
    assert Timing.of([2.0]).repeatability == 0.0


@pytest.mark.parametrize("samples", [[], [0.1, 0.0], [float("nan")], [-1.0]])
def test_timing_refuses_empty_or_non_positive_samples(samples):
    with pytest.raises(ValueError):
        Timing.of(samples)


def test_repeat_warms_up_then_times_each_call_with_the_given_clock():
    ticks = iter(range(100))
    calls = []
    t = timing.repeat(lambda: calls.append(1), repeats=3, warmup=2,
                      clock=lambda: float(next(ticks)))
    assert len(calls) == 5  # 2 warm-up calls, untimed, then 3 timed
    assert t.samples == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        timing.repeat(lambda: None, repeats=0)


def test_an_injected_load_is_used_as_given():
    load = timing.machine_load(busy=1.5, cores=2)
    assert (load.busy, load.cores, load.source) == (1.5, 2, "given")
    assert load.fraction == 0.75


def test_measured_load_is_between_zero_and_the_cores():
    load = timing.machine_load(interval=0.05)
    assert 0 <= load.busy <= load.cores == timing.usable_cores()


def test_quiet_machine_and_agreeing_repeats_are_conclusive():
    verdict = timing.judge({"ring": Timing.of([1.0, 1.05, 1.1])}, Load(0.2, 2, "given"))
    assert verdict.conclusive
    assert str(verdict).startswith("conclusive")
    assert "quiet machine" in str(verdict)
    assert "at worst second-best repeat 5% above the best (ring)" in str(verdict)


def test_a_loaded_machine_is_too_loaded_to_conclude():
    verdict = timing.judge({"ring": Timing.of([1.0, 1.0, 1.0])}, Load(1.8, 2, "given"))
    assert not verdict.conclusive and verdict.loaded
    assert str(verdict).startswith("TOO LOADED TO CONCLUDE")
    assert "1.8 of 2 cores busy with other work (given): more than 0.5" in str(verdict)


def test_repeats_that_disagree_are_not_conclusive_even_on_a_quiet_machine():
    verdict = timing.judge({"ring": Timing.of([1.0, 1.05, 1.1]),
                            "gloo": Timing.of([1.0, 1.5, 1.6])}, Load(0.0, 2, "given"))
    assert not verdict.conclusive and not verdict.loaded
    assert str(verdict).startswith("TOO NOISY TO CONCLUDE")
    assert "in 1 of 2 timings: gloo (second-best repeat 50% above the best)" in str(verdict)


def test_an_isolated_disagreement_among_many_timings_is_tolerated_and_named():
    quiet = Load(0.0, 2, "given")
    timings = {f"size {i}": Timing.of([1.0, 1.05, 1.3]) for i in range(20)}
    timings["size 7"] = Timing.of([1.0, 1.4, 1.5])
    timings["size 9"] = Timing.of([1.0, 1.3, 1.5])
    verdict = timing.judge(timings, quiet)  # 2 of 20 disagree: 10% of 20 is 2
    assert verdict.conclusive
    assert ("except in 2 of 20 timings (read with care): size 7 (second-best repeat 40% above "
            "the best); size 9 (second-best repeat 30% above the best)") in str(verdict)
    timings["size 11"] = Timing.of([1.0, 1.25, 1.5])  # a third: a disturbed run, not noise
    assert not timing.judge(timings, quiet).conclusive
    assert timing.judge(timings, quiet, max_disagreeing=0.2).conclusive


def test_a_reproduced_minimum_concludes_where_a_wide_median_does_not():
    # heavy-tailed delays: the best is seen twice, the typical repeat is far slower
    tailed = {"4 KiB": Timing.of([0.50, 0.52, 0.90, 1.6, 2.9])}
    quiet = Load(0.0, 2, "given")
    assert timing.judge(tailed, quiet).conclusive  # statistic="min", the default
    by_median = timing.judge(tailed, quiet, statistic="median")
    assert not by_median.conclusive
    assert "4 KiB (median 80% above the minimum)" in str(by_median)
    with pytest.raises(ValueError):
        timing.judge(tailed, quiet, statistic="mean")


def test_a_single_repeat_is_not_conclusive():
    verdict = timing.judge({"once": Timing.of([1.0])}, Load(0.0, 2, "given"))
    assert not verdict.conclusive and "single repeat cannot show" in str(verdict)


def test_the_thresholds_are_parameters():
    load = Load(0.8, 2, "given")
    assert not timing.judge({}, load).conclusive
    assert timing.judge({}, load, max_busy_fraction=0.5).conclusive


def write(tmp_path, record, name="ch99_x.json"):
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return path


def complete_record():
    return {**timing.reference_header("python chapters/x/y.py --record", Load(0.1, 2, "given"),
                                      note="quiet"), "rows": [1, 2]}


def test_a_header_makes_a_complete_record(tmp_path):
    record = timing.load_reference(write(tmp_path, complete_record()))
    assert set(timing.REQUIRED_FIELDS) <= set(record)
    assert record["load"]["busy_cores"] == 0.1 and record["load"]["note"] == "quiet"
    assert len(record["load"]["load_average"]) == 3
    assert record["machine"]["usable_cores"] == timing.usable_cores()
    assert record["rows"] == [1, 2]
    label = timing.describe(record)
    assert label.startswith(f"reference run {record['date'][:10]}, torch {record['torch']}")


@pytest.mark.parametrize("drop", timing.REQUIRED_FIELDS)
def test_a_record_without_any_required_field_is_refused(tmp_path, drop):
    record = complete_record()
    del record[drop]
    with pytest.raises(IncompleteRecord, match=f"missing {drop}"):
        timing.load_reference(write(tmp_path, record))


@pytest.mark.parametrize("field, value, message", [
    ("date", "yesterday", "not ISO 8601"),
    ("command", "make bench", "not a python or torchrun command"),
    ("torch", "", "missing torch"),
])
def test_a_record_with_a_useless_field_is_refused(tmp_path, field, value, message):
    record = {**complete_record(), field: value}
    with pytest.raises(IncompleteRecord, match=message):
        timing.load_reference(write(tmp_path, record))


@pytest.mark.parametrize("name", ["ch01_scaling.json", "ch05_ring_vs_gloo_ws2.json",
                                  "ch05_ring_vs_gloo_ws4.json", "ch07_find_unused.json"])
def test_the_records_the_lessons_plot_are_complete(name):
    record = timing.load_reference(name)  # by name, from benchmarks/results/
    assert record["load"]["busy_cores"] is not None and record["load"]["note"]


def test_command_line_reads_as_typed(monkeypatch):
    monkeypatch.setattr("sys.argv", ["chapters/01_why_ddp/scaling.py", "--record", "x.json"])
    assert timing.command_line() == "python chapters/01_why_ddp/scaling.py --record x.json"
    assert os.getloadavg()  # the header's load average needs it on this platform
