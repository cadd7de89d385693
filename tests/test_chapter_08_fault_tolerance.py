"""Chapter 08: fault tolerance under torchrun (``fault_tolerance.py``, which launches train.py).

Real launches of ``python -m torch.distributed.run --standalone --nproc_per_node 2``, each with a
deadline at which torchrun and every worker are killed: the uninterrupted run, a worker really
SIGKILLed after step 14 and a worker raising there (``--max_restarts 1``: every rank restarted,
resumed at the checkpoint of step 12, mid-epoch, 2 steps redone, final weights bit-identical),
the SIGKILL with ``--max_restarts 0`` (the job fails), and the driver's clean-up of workers
torchrun started in sessions of their own. The driver's checks are also shown to catch wrong
launches.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from course_layout import import_by_path
from ddpcourse.launcher.processes import is_alive, kill_tree

CHAPTER = Path(__file__).resolve().parent.parent / "chapters" / "08_checkpoints"


def import_chapter_module(name: str, file: str):
    return import_by_path(name, CHAPTER / file)


ft = import_chapter_module("ch08_fault_tolerance", "fault_tolerance.py")


def test_a_killed_and_a_raising_worker_are_recovered_with_the_same_final_weights(tmp_path,
                                                                                 no_orphans):
    reference = ft.launch("uninterrupted", tmp_path)
    assert ft.reference_problems(reference) == [], reference.stderr
    for fault, how in (("kill", "SIGKILL"), ("raise", "raise")):
        run = ft.launch(fault, tmp_path, fault=fault)
        assert ft.recovery_problems(run, reference, how) == [], run.stderr
        told = ft.story(run)
        assert told["checkpoints in attempt 0"] == [4, 8, 12]
        assert told["resumed at"] == {1: 12} and told["steps redone"] == ft.FAULT_STEP - 12 == 2
        assert not set(told["pids"][0].values()) & set(told["pids"][1].values())
        for name, value in reference.final_weights.items():
            assert torch.equal(run.final_weights[name], value), (fault, name)
        assert "resumed from the checkpoint of step 12 (epoch 1, batch 4) in attempt 1" in \
            run.stdout, run.stdout
        if fault == "raise":
            assert "fails on purpose after step 14 in attempt 0" in run.stderr
    # the checks catch a run that was not recovered
    lost = dataclasses.replace(run, final_weights={k: v + 1 for k, v in
                                                  run.final_weights.items()})
    assert any("final weights differ" in p for p in ft.recovery_problems(lost, reference, how))
    same_pids = dataclasses.replace(run, events=[dict(e, pid=0) for e in run.events])
    assert any("new process" in p for p in ft.recovery_problems(same_pids, reference, how))
    from_scratch = dataclasses.replace(run, events=[e for e in run.events
                                                    if e["event"] != "resumed"])
    assert any("resume" in p for p in ft.recovery_problems(from_scratch, reference, how))


def test_without_restarts_the_killed_worker_ends_the_job(tmp_path, no_orphans):
    run = ft.launch("alone", tmp_path, max_restarts=0, fault="kill")
    assert ft.no_restart_problems(run) == [], run.stderr
    assert run.returncode != 0 and run.final_weights is None
    assert ft.story(run)["attempts"] == [0]
    assert ft.story(run)["steps redone"] is None  # nobody resumed: nothing was redone
    assert "no step was redone" in ft.describe(run, run)
    finished = dataclasses.replace(run, returncode=0)
    assert ft.no_restart_problems(finished) != []


def test_at_the_deadline_the_workers_in_their_own_sessions_are_killed_too(tmp_path, no_orphans):
    """torchrun starts each worker with start_new_session=True: killing torchrun's process group
    alone would leave them running. ``kill_tree`` (what ``run_bounded`` does at its deadline)
    kills them."""
    events = tmp_path / "events.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", str(ft.TRAIN), "--epochs", "1000", "--no-progress", "--event-file",
               str(events)]
    proc = subprocess.Popen(command, cwd=ft.ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        give_up = time.monotonic() + 120
        started = []
        while len(started) < 2 and time.monotonic() < give_up and proc.poll() is None:
            time.sleep(0.2)
            started = [json.loads(line) for line in events.read_text().splitlines()
                       ] if events.exists() else []
        assert len(started) == 2, f"the workers did not start: {started}"
        workers = [event["pid"] for event in started]
        kill_tree(proc.pid)
        proc.wait(timeout=30)
        give_up = time.monotonic() + 10
        while any(map(is_alive, workers)) and time.monotonic() < give_up:
            time.sleep(0.05)
        assert not any(map(is_alive, workers)), workers
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)


@pytest.mark.parametrize("returncode, expected", [(0, []), (1, ["exit 1"])])
def test_the_reference_check(returncode, expected, tmp_path):
    events = [{"attempt": 0, "rank": r, "pid": 10 + r, "event": e} for r in (0, 1)
              for e in ("started", "finished")]
    run = ft.Launch("uninterrupted", [], returncode, False, "", "", events,
                    {"w": torch.zeros(2)})
    found = ft.reference_problems(run)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found))
