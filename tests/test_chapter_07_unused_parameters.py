"""Chapter 07 (training loop), unused parameters: the script's check holds on data from real ranks
and catches wrong data; the error is raised on every rank alike (3 ranks); the node count equals
a hand count; ``TORCH_DISTRIBUTED_DEBUG=INFO`` works when set before the process starts, and
through ``run_ranks(env=...)`` (whose ranks read it again); set later in a process, it does
nothing unless ``dist.set_debug_level_from_env()`` is called (the script's own check); the recorded
timing run is complete and names the models it timed.

``unused_parameters.py`` itself runs under torchrun in tests/test_chapter_scripts.py; here its
functions run in ranks through ``run_ranks`` (deadlines, no ports), and one short single-rank
process is started with the variable in its environment.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpcourse.launcher import run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "07_training_loop"
sys.path.insert(0, str(CHAPTER))  # the ranks get this sys.path too

import unused_parameters as up  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return run_ranks(up.run_all, 2, timeout=120)[0]


def test_the_scripts_check_passes_on_data_from_real_ranks(results, no_orphans):
    assert up.problems(results) == []


WRONG = {  # what a broken DDP, or a wrong lesson, would have returned
    "error at the first step": lambda r: r["train"]["unused aux head"].update(step=0),
    "first step averaged": lambda r: r["train"]["unused aux head"].update(synced=[True]),
    "names without debug": lambda r: r["train"]["unused aux head"].update(
        named=["aux.bias", "aux.weight"]),
    "set_debug_level names nothing": lambda r: r["train"]["debug: set_debug_level"].update(
        named=None),
    "the article's checkpoint works": lambda r: r["train"][
        "article 1: reentrant checkpoint around aux"].update(ok=True, error=None),
    "the dummy all_reduce works": lambda r: r["train"][
        "article 2: dummy all_reduce in forward"].update(ok=True, error=None),
    "reentrant + find_unused trains": lambda r: r["train"][
        "reentrant checkpoint + find_unused_parameters=True"].update(ok=True, error=None),
    "static_graph fails": lambda r: r["train"]["static_graph=True"].update(ok=False),
    "find_unused does not search": lambda r: r["work"]["find_unused_parameters=True"].update(
        {"graph searches per iteration": 0.0}),
    "static_graph searches": lambda r: r["work"]["static_graph=True"].update(
        {"graph searches per iteration": 1.0}),
    "find_unused rebuilds": lambda r: r["work"]["find_unused_parameters=True"].update(
        {"buckets rebuilt": True}),
    "warning every step": lambda r: r["warning"].update(
        {"aux used on even steps": [True] * 4}),
    "search depends on batch": lambda r: r["search sizes"][0].update({"nodes, batch 64": 7}),
}


@pytest.mark.parametrize("name", WRONG)
def test_the_check_catches_wrong_data(results, name):
    wrong = copy.deepcopy(results)
    WRONG[name](wrong)
    assert up.problems(wrong) != []


def test_every_rank_raises_alike_at_three_ranks(no_orphans):
    results = run_ranks(up.train, 3, "unused", debug="set_debug_level", timeout=60)
    for rank, r in enumerate(results):
        assert r["error"] == up.PRIOR_REDUCTION and r["step"] == 1, (rank, r)
        assert r["named"] == ["aux.bias", "aux.weight"], (rank, r)
        assert r["synced"] == [False], (rank, r)


def test_the_search_visits_five_nodes_per_linear_and_tanh():
    # TanhBackward, AddmmBackward, TBackward and the two AccumulateGrad nodes of weight and bias
    model = up.mlp(1, width=3)
    assert up.nodes_searched([model(torch.randn(2, 3))]) == 5
    assert [r["nodes, batch 1"] for r in up.search_sizes(depths=(1, 3))] == [5, 15]


def test_run_ranks_passes_the_environment_variable_and_has_it_read_again(no_orphans):
    """The ranks fork from a server that imported torch before the variable was set; the
    launcher's rank child calls ``dist.set_debug_level_from_env()``, so ``env=`` still works."""
    r = run_ranks(up.train, 2, "unused", env={"TORCH_DISTRIBUTED_DEBUG": "INFO"}, timeout=60)[0]
    assert r["error"] == up.PRIOR_REDUCTION and r["named"] == ["aux.bias", "aux.weight"], r


SINGLE_RANK = """
import sys, torch.distributed as dist
sys.path.insert(0, {chapter!r})
import unused_parameters as up
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
print(up.train(0, 1, "unused")["named"])
dist.destroy_process_group()
"""


def test_the_environment_variable_set_before_the_process_starts_names_them():
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "INFO"}
    done = subprocess.run([sys.executable, "-c", SINGLE_RANK.format(chapter=str(CHAPTER))],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['aux.bias', 'aux.weight']", done.stdout


def test_the_recorded_timing_run_is_complete_and_matches_the_models_it_names():
    from ddpcourse.timing import load_reference

    record = load_reference("ch07_find_unused.json")  # machine, date, torch, command, load
    for workload in record["workloads"].values():
        model = up.mlp(workload["depth"], workload["width"])
        x = torch.randn(workload["batch"], workload["width"])
        assert workload["nodes searched per step"] == up.nodes_searched([model(x)])
        assert len(workload["attempts"]) == record["attempts"] >= 2
