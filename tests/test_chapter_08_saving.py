"""Chapter 08 (checkpoints): who writes, what to save, crash safety.

``checkpoint_files.py`` (atomic writes, the ``latest`` pointer, keep the last K) is tested here
directly and launched as its docstring says. ``who_writes.py``, ``state_dict_keys.py`` and
``crash_safety.py`` run under torchrun in tests/test_chapter_scripts.py; here their functions run
in real ranks through ``run_ranks`` (one launch per script, deadlines, no ports), each script's
``problems`` holds on that data and catches wrong data, and the killed writer is killed for real
(SIGKILL) in this process's children.

The chapter's modules are loaded under names of their own (``ch08_...``): chapter 07 has modules
named like scripts of other chapters, and all share one pytest worker.
"""

from __future__ import annotations

import copy
import io
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from course_layout import import_by_path
from ddpcourse.launcher import run_bounded, run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "08_checkpoints"


def load_chapter_module(name: str):
    """The chapter's ``name.py`` as module ``ch08_name``, sent to ranks by value."""
    return import_by_path(f"ch08_{name}", CHAPTER / f"{name}.py", by_value=True)


cf = load_chapter_module("checkpoint_files")
ww = load_chapter_module("who_writes")
sk = load_chapter_module("state_dict_keys")
cs = load_chapter_module("crash_safety")


# ------------------------------------------------------------------------------ checkpoint files

def test_checkpoint_files_checks_itself_when_launched_as_documented(no_orphans):
    done = run_bounded([sys.executable, str(CHAPTER / "checkpoint_files.py")], 60, cwd=ROOT)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "checkpoint_files self-check: passed" in done.stdout
    assert cf.self_check() == []


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot be saved")


def test_save_atomically_writes_beside_the_target_fsyncs_and_replaces(tmp_path, monkeypatch):
    replaced, synced = [], []
    real_replace, real_fsync = os.replace, os.fsync
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((Path(a), Path(b))),
                                                     real_replace(a, b))[1])
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(
        "directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"), real_fsync(fd))[1])
    target = tmp_path / "model.pt"
    cf.save_atomically({"w": torch.ones(3)}, target)
    assert len(replaced) == 1 and replaced[0][1] == target
    assert replaced[0][0].parent == tmp_path and replaced[0][0].name.startswith(".model.pt.")
    assert synced == ["file", "directory"]  # the data before the rename, the rename after it
    assert torch.equal(torch.load(target, weights_only=True)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_a_failed_save_keeps_the_previous_file_and_removes_its_temporary(tmp_path):
    target = tmp_path / "model.pt"
    cf.save_atomically({"step": 1}, target)
    before = target.read_bytes()
    with pytest.raises(RuntimeError, match="cannot be saved"):
        cf.save_atomically({"step": 2, "bad": Unpicklable()}, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_checkpoint_dir_pointer_fallback_and_keep(tmp_path):
    with pytest.raises(ValueError):
        cf.CheckpointDir(tmp_path / "none", keep=0)
    checkpoints = cf.CheckpointDir(tmp_path / "run", keep=3)
    assert checkpoints.latest() is None and checkpoints.load_latest() is None
    for step in (10, 20, 30, 40):
        assert checkpoints.save({"step": step}, step) == checkpoints.path_for(step)
    assert [p.name for p in checkpoints.checkpoints()] == [
        "step_00000020.pt", "step_00000030.pt", "step_00000040.pt"]
    assert checkpoints.pointer.read_text() == "step_00000040.pt"
    assert checkpoints.load_latest(map_location="cpu") == {"step": 40}
    # a pointer that names a file no longer there, then no pointer: the newest complete file
    checkpoints.pointer.write_text("step_00000099.pt")
    assert checkpoints.latest() == checkpoints.path_for(40)
    checkpoints.pointer.unlink()
    checkpoints.path_for(50).write_bytes(b"PK\x03\x04 a torn file")
    assert checkpoints.latest() == checkpoints.path_for(40)
    # a leftover of a killed writer is removed by the next save; stray names are ignored
    leftover = checkpoints.root / ".step_00000060.pt.abc.tmp"
    leftover.write_bytes(b"half")
    (checkpoints.root / "step_notes.pt").write_text("not a checkpoint")
    checkpoints.save({"step": 60}, 60)
    assert not leftover.exists() and checkpoints.latest() == checkpoints.path_for(60)


def test_the_pausing_writer_stops_at_the_byte_asked_and_changes_no_byte(tmp_path):
    state = {"w": torch.arange(300.0), "step": 7}
    size = cf.saved_size(state)
    seen = []
    path = tmp_path / "paused.pt"
    with open(path, "wb") as file:
        torch.save(state, cf.PausingWriter(file, 1000, lambda: seen.append(path.stat().st_size)))
    assert seen == [1000]
    reference = io.BytesIO()
    torch.save(state, reference)
    assert path.read_bytes() == reference.getvalue() and len(reference.getvalue()) == size


# ------------------------------------------------------------------------------------ who writes

@pytest.fixture(scope="module")
def who_writes_results(tmp_path_factory):
    return run_ranks(ww.run_all, 2, str(tmp_path_factory.mktemp("who_writes")), timeout=90)


def test_who_writes_check_passes_on_data_from_real_ranks(who_writes_results, no_orphans):
    assert ww.problems(who_writes_results) == []
    r0, r1 = who_writes_results
    assert r0["rank 0 writes"]["inside torch.save"]["in torch/distributed"] == 0
    assert r1["rank 0 writes"]["collectives in all"] == ["barrier"]
    torn = r0["every rank writes plainly"]["values"]
    # rank 1 wrote its whole file; rank 0 then overwrote the second half: 2.0s first, then 1.0s
    assert torn["bias"] == {1.0: 4} and set(torn["weight"]) == {1.0, 2.0}
    assert sum(torn["weight"].values()) == 256
    assert r0["every rank writes plainly"]["CRC-32 mismatch (zipfile)"] == "data/0"  # weight


WHO_WRITES_WRONG = {
    "rank 1 calls a collective during the save": lambda r: r[1]["rank 0 writes"].update(
        {"collectives during the save": ["all_gather"]}),
    "torch.save runs distributed code": lambda r: r[0]["rank 0 writes"]["inside torch.save"]
        .update({"in torch/distributed": 3}),
    "rank 1 also saves": lambda r: r[1]["rank 0 writes"].update({"called torch.save": True}),
    "rank 1 loads something else": lambda r: r[1]["rank 0 writes"].update(
        {ww.LOADED_RANK0: False}),
    "the first writer wins": lambda r: r[0]["every rank writes atomically"].update(
        {"file holds my own RNG state": True}),
    "the torn file fails to load": lambda r: r[0]["every rank writes plainly"].update(
        {"load error": "RuntimeError: x", "values": None}),
    "the torn file holds one rank's tensor": lambda r: r[0]["every rank writes plainly"].update(
        {"values": {"weight": {2.0: 256}, "bias": {1.0: 4}}}),
    "the CRC-32s match": lambda r: r[0]["every rank writes plainly"].update(
        {"CRC-32 mismatch (zipfile)": None}),
    "a half-written plain file loads": lambda r: r[1]["reader without barrier"][
        "plain, over step 1"].update({"read half way": 2}),
    "an atomic save shows the new step early": lambda r: r[1]["reader without barrier"][
        "atomic, over step 1"].update({"read half way": 2}),
    "the barrier does not help": lambda r: r[1]["reader without barrier"][
        "atomic, over step 1"].update({"read after the barrier": 1}),
}


@pytest.mark.parametrize("name", WHO_WRITES_WRONG)
def test_who_writes_check_catches_wrong_data(who_writes_results, name):
    wrong = copy.deepcopy(who_writes_results)
    WHO_WRITES_WRONG[name](wrong)
    assert ww.problems(wrong) != []


# ---------------------------------------------------------------------------- what to save, load

@pytest.fixture(scope="module")
def state_dict_results():
    return run_ranks(sk.run_all, 2, timeout=120)


def test_state_dict_keys_check_passes_on_data_from_real_ranks(state_dict_results, no_orphans):
    assert sk.problems(state_dict_results) == []
    rank1 = state_dict_results[1]["load order"]
    assert rank1["rank 0 loads the optimizer"]["Adam state entries after loading"] == 0
    assert rank1["every rank loads the optimizer"]["Adam step counts after loading"] == [3] * 4


STATE_DICT_WRONG = {
    "DDP keys unprefixed": lambda r: r[0]["prefixes"]["keys"].update(
        {"ddp.state_dict()": ["0.weight", "0.bias", "2.weight", "2.bias"]}),
    "compile adds nothing": lambda r: r[0]["prefixes"]["keys"].update(
        {"torch.compile(model).state_dict()": ["0.weight", "0.bias", "2.weight", "2.bias"]}),
    "strict=False loads prefixed keys": lambda r: r[0]["prefixes"].update(
        {"strict=False on prefixed keys: missing": []}),
    "DDP's state_dict holds more than the renamed module": lambda r: r[0]["prefixes"].update(
        {"ddp.state_dict() is ddp.module.state_dict() renamed, nothing more": False}),
    "plain model differs": lambda r: r[1]["prefixes"].update(
        {"plain model, strict=True, same output": False}),
    "map_location function sees no tag": lambda r: r[0]["map_location"]["saved from cuda:0"]
        .update({"tags the function received": []}),
    "weights not broadcast": lambda r: r[1]["load order"]["rank 0 loads the optimizer"].update(
        {"holds the checkpoint's weights after wrapping": False}),
    "optimizer state broadcast": lambda r: r[1]["load order"]["rank 0 loads the optimizer"]
        .update({"Adam state entries after loading": 4,
                 "Adam step counts after loading": [3, 3, 3, 3]}),
    "ranks stay equal without the optimizer": lambda r: r[0]["load order"][
        "rank 0 loads the optimizer"].update(
        {"largest weight difference from rank 0 after more steps": 0.0}),
    "ranks differ with the optimizer": lambda r: r[1]["load order"][
        "every rank loads the optimizer"].update(
        {"largest weight difference from rank 0 after more steps": 1e-7}),
}


@pytest.mark.parametrize("name", STATE_DICT_WRONG)
def test_state_dict_keys_check_catches_wrong_data(state_dict_results, name):
    wrong = copy.deepcopy(state_dict_results)
    STATE_DICT_WRONG[name](wrong)
    assert sk.problems(wrong) != []


def test_the_gpu_part_says_why_it_is_skipped_on_this_machine(state_dict_results):
    for r in state_dict_results:
        gpu = r["gpu map_location"]
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            assert gpu["skipped"] is None
        else:
            assert "needs one CUDA GPU per rank" in gpu["skipped"]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs one CUDA GPU per rank (2)")
def test_without_map_location_every_rank_restores_onto_gpu0(no_orphans):
    results = run_ranks(sk.gpu_map_locations, 2, backend="nccl", timeout=120)
    assert [r["no map_location"]["device"] for r in results] == ["cuda:0", "cuda:0"]
    assert results[1]["no map_location"]["bytes this rank allocated on GPU 0"] >= 4 * 2**20
    assert [r['map_location=f"cuda:{local_rank}"']["device"] for r in results] == [
        "cuda:0", "cuda:1"]


# ---------------------------------------------------------------------------------- crash safety

@pytest.fixture(scope="module")
def crash_results(tmp_path_factory):
    return cs.run_all(str(tmp_path_factory.mktemp("crash")))


def test_the_killed_writers_check_passes(crash_results, no_orphans):
    assert cs.problems(crash_results) == []
    for name, r in crash_results.items():
        if "killed" in name:
            assert r["killed by"] == "SIGKILL", name


def test_a_writer_that_never_reaches_its_kill_point_is_reported(tmp_path, monkeypatch,
                                                                no_orphans):
    monkeypatch.setattr(cs, "write_until_killed", lambda *args: None)  # finishes, never stops
    ended = cs.kill_writer_at("plain", "half written", tmp_path)
    assert ended == {"reached the kill point": False, "killed by": "exit 5"}


CRASH_WRONG = {
    "a plain save keeps step 1": lambda r: r["plain, killed while pickling"].update(
        {"bytes after": 18046, "load gives": 1}),
    "a truncated plain file loads": lambda r: r["plain, killed half written"].update(
        {"load gives": 2}),
    "the writer died by itself": lambda r: r["atomic, killed half written"].update(
        {"killed by": "exit 3"}),
    "latest names the killed step": lambda r: r["atomic, killed half written"][
        "after the kill"].update({"latest names": "step_00000002.pt", "load_latest step": 2}),
    "the leftover is not cleaned": lambda r: r["atomic, killed while pickling"][
        "after the next save"].update({"leftover temporary files": 1}),
    "keep deletes what latest names": lambda r: r["keep last 2"].update(
        {"after saving an older step with keep=1": ["step_00000005.pt"]}),
}


@pytest.mark.parametrize("name", CRASH_WRONG)
def test_the_crash_check_catches_wrong_data(crash_results, name):
    wrong = copy.deepcopy(crash_results)
    CRASH_WRONG[name](wrong)
    assert cs.problems(wrong) != []
