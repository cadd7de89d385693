"""Chapter 08 (checkpoints) at scale: DCP resharding and async_save.

``dcp_reshard.py``: a checkpoint saved by 2 ranks (each rank's file, who wrote each item, the
save counted as collective and failing on a lone rank) loads at 1 and at 4 ranks into model and
optimizer exactly, and converts to one torch.save file and back. ``async_checkpoint.py``:
async_save returns an unfinished Future, writes the call-time state although a step runs before
the write, stages the whole state, and runs its collectives in its own thread. Each script's own
check holds on data from real ranks (``run_ranks``: deadlines, no ports; the three world sizes
of dcp_reshard are three calls, as its docstring's three torchrun commands are) and catches
wrong data; their verdict is one report of every rank's contradicted claims. The recorded
async_save timing run is complete, its state size is the model's, and its sentences follow from
its numbers.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from course_layout import import_by_path
from ddpcourse.launcher import run_ranks
from ddpcourse.report import report_checks_of_every_rank

ROOT = Path(__file__).resolve().parent.parent


def load_module(name: str, path: Path):
    """A chapter script under a name of its own, sent to the ranks by value."""
    return import_by_path(name, path, by_value=True)


reshard = load_module("ch08_dcp_reshard", ROOT / "chapters/08_checkpoints/dcp_reshard.py")
async_ckpt = load_module("ch08_async_checkpoint",
                         ROOT / "chapters/08_checkpoints/async_checkpoint.py")
bench = load_module("ch08_async_save_benchmark", ROOT / "benchmarks/ch08_async_save.py")


@pytest.fixture(scope="module")
def reshard_reports(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("dcp"))
    return {"save": run_ranks(reshard.save_mode, 2, directory, timeout=90),
            1: run_ranks(reshard.load_mode, 1, directory, timeout=60),
            4: run_ranks(reshard.load_mode, 4, directory, timeout=90)}


def test_saved_by_two_ranks_each_writing_part_and_saving_collectively(reshard_reports,
                                                                       no_orphans):
    rank0, rank1 = reshard_reports["save"]
    assert reshard.problems(rank0, "save") == []
    assert rank1["dcp.save collectives"] == rank0["dcp.save collectives"]
    assert "Timed out" in rank0["lone save"]["error"]


@pytest.mark.parametrize("world_size", [1, 4])
def test_loaded_exactly_at_another_world_size(reshard_reports, world_size):
    reports = reshard_reports[world_size]
    assert len(reports) == world_size
    for rank, report in enumerate(reports):
        assert reshard.problems(report, "load") == [], (rank, report)
    assert "conversion" in reports[0]


WRONG_SAVE = {
    "rank 0 wrote everything": lambda r: r.update(
        writer_of={k: 0 for k in r["writer_of"]}, items_per_rank={0: len(r["writer_of"])}),
    "a tensor missing": lambda r: r["writer_of"].pop("model.0.weight"),
    "one file only": lambda r: r["files"].pop("__1_0.distcp"),
    "no collectives": lambda r: r.update({"dcp.save collectives": {}}),
    "lone save succeeded": lambda r: r["lone save"].update(error=None),
    "lone save left metadata": lambda r: r["lone save"].update({"metadata written": True}),
}

WRONG_LOAD = {
    "a tensor differs": lambda r: r["differences after loading"].append("optim.state.0.bias.step"),
    "round trip differs": lambda r: r["differences after the round trip"].append("model.2.bias"),
    "nothing to overwrite": lambda r: r.update({"differed before loading": []}),
    "file not loadable into a plain model": lambda r: r["conversion"][
        "plain model differences"].append("model.0.weight"),
}


@pytest.mark.parametrize("name", WRONG_SAVE)
def test_the_save_check_catches_wrong_data(reshard_reports, name):
    wrong = copy.deepcopy(reshard_reports["save"][0])
    WRONG_SAVE[name](wrong)
    assert reshard.problems(wrong, "save") != []


@pytest.mark.parametrize("name", WRONG_LOAD)
def test_the_load_check_catches_wrong_data(reshard_reports, name):
    wrong = copy.deepcopy(reshard_reports[4][0])
    WRONG_LOAD[name](wrong)
    assert reshard.problems(wrong, "load") != []


@pytest.fixture(scope="module")
def async_results(tmp_path_factory):
    return run_ranks(async_ckpt.run_all, 2, str(tmp_path_factory.mktemp("async")), timeout=90)


def test_async_save_writes_the_call_time_state_from_its_own_thread(async_results, no_orphans):
    for rank, results in enumerate(async_results):
        assert async_ckpt.problems(results) == [], (rank, results)


WRONG_ASYNC = {
    "done at return": lambda r: r["async_save"]["returned"].update(done=True),
    "metadata at return": lambda r: r["async_save"]["returned"].update({".metadata exists": True}),
    "wrote the later step": lambda r: r["async_save"].update(
        {"checkpoint equals the state at the call": False}),
    "staged no copy": lambda r: r["async_save"].update(
        {"staged copy shares memory with the model": True}),
    "staged half": lambda r: r["async_save"].update(
        {"staged bytes": r["async_save"]["state bytes"] // 2}),
    "collectives in the main thread": lambda r: r["async_save"].update(
        {"collectives by thread": {"gather_object in MainThread": 2}}),
    "own thread wrote the call-time state": lambda r: r["own thread"].update(
        {"checkpoint equals the state at the call": True,
         "checkpoint equals the state after the next step": False}),
}


@pytest.mark.parametrize("name", WRONG_ASYNC)
def test_the_async_check_catches_wrong_data(async_results, name):
    wrong = copy.deepcopy(async_results[0])
    WRONG_ASYNC[name](wrong)
    assert async_ckpt.problems(wrong) != []


def test_the_benchmarks_state_size_is_the_checkpointed_state():
    """The formula in ``build`` (3 x parameters + one 4-byte step each) against the tensors
    get_state_dict really gives, on a small model after one AdamW step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, state_bytes = bench.build(width=8, layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    tensors = async_ckpt.tensors_of(dict(zip(("model", "optim"), get_state_dict(model, optimizer))))
    assert state_bytes == sum(t.numel() * t.element_size() for t in tensors)


def test_the_recorded_async_save_run_is_complete_and_its_sentences_follow_from_it():
    from ddpcourse.timing import load_reference

    record = load_reference("ch08_async_save.json")  # machine, date, torch, command, load
    assert record["state_bytes"] == bench.build(record["width"], record["layers"])[1]
    assert 50e6 <= record["state_bytes"] <= 200e6
    assert len(record["attempts"]) >= 2
    for attempt in record["attempts"]:
        assert set(attempt) == set(bench.VARIANTS)
        for variant, figures in attempt.items():
            for figure in bench.FIGURES:
                assert len(figures[figure]["samples"]) == record["rounds"], (variant, figure)
        assert set(attempt["no checkpoint"]["stall_ms"]["samples"]) == {0.0}
        assert all(v < 1.0 for v in attempt["dcp.save"]["wait_ms"]["samples"])  # no future
    assert record["findings"] == bench.findings(record)


def report_of_ranks_that_found(rank: int, world_size: int, findings: dict) -> tuple[int, list]:
    """``report_checks_of_every_rank`` on this rank's ``findings[rank]``: its code, and what it
    printed."""
    printed = []
    code = report_checks_of_every_rank(findings.get(rank, []),
                                       echo=lambda *words: printed.append(" ".join(words)))
    return code, printed


@pytest.mark.parametrize("findings, report", [
    ({}, ["checks: passed"]),
    ({2: ["the write was not atomic"]}, ["checks: FAILED", "  - rank 2: the write was not atomic"]),
    ({0: ["a", "b"], 1: ["b"], 2: ["b"]},
     ["checks: FAILED", "  - rank 0: a", "  - ranks 0, 1, 2: b"]),
])
def test_the_scripts_verdict_reports_every_ranks_problems_on_rank_0_alone(findings, report):
    """async_checkpoint.py and dcp_reshard.py check each rank's run: a problem found by rank 2
    alone still fails every rank and is printed by rank 0."""
    results = run_ranks(report_of_ranks_that_found, 3, findings, timeout=60)
    assert results[0] == (1 if findings else 0, report)
    assert results[1:] == [(results[0][0], [])] * 2
