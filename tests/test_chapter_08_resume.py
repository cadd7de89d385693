"""Chapter 08: the resumable ``train.py`` and ``resume_bit_exact.py``, in real ranks.

``tests/test_chapter_scripts.py`` launches train.py under torchrun (it checks itself). Here:
resume_bit_exact.py under torchrun, once (a deadline; its process group is killed at it), and
every row of its table, which fails if any piece were dropped from what train.py saves or
restores; with ``run_ranks`` (deadlines, no ports): a resume in the middle
of an epoch with DataLoader workers and a short accumulation window, bit-exact, from a checkpoint
that loads into the plain model; and the checks and the command line against wrong data.

The chapter modules are imported by path under unique names (chapter 07 has a ``train`` module
too). The functions the ranks run live in this module, which the ranks import by name.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_layout import import_by_path
from ddpcourse.launcher import run_bounded, run_ranks

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "08_checkpoints"


def import_chapter_module(name: str, file: str):
    return import_by_path(name, CHAPTER / file)


tr = import_chapter_module("ch08_train", "train.py")
rbe = import_chapter_module("ch08_resume_bit_exact", "resume_bit_exact.py")


# ------------------------------------------------------------------------- resume_bit_exact

@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """resume_bit_exact.py as documented, under torchrun (2 ranks, a hard deadline); its
    results as it wrote them."""
    path = tmp_path_factory.mktemp("resume_bit_exact") / "results.json"
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent),
                                                 os.environ.get("PATH", "")]))
    done = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(CHAPTER / "resume_bit_exact.py"),
                        "--json", str(path)], timeout=300, cwd=ROOT, env=env)
    assert not done.timed_out, f"still running after 300 s\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "checks: passed" in done.stdout and done.stdout.count("checks:") == 1
    return json.loads(path.read_text())


def test_the_whole_checkpoint_resumes_bit_exact_and_each_used_piece_is_needed(table, no_orphans):
    """Removing any piece from train.py's checkpoint (or its restore) turns the whole-checkpoint
    row into a mismatch; a restore that did nothing would make every 'NO' row match."""
    rank0 = table
    rows = {(setting, row["missing"]): row for setting, found in rank0.items()
            for row in (found if isinstance(found, list) else [found])}
    for setting in ("fp32", "fp16, growth_interval 2000", "fp16, growth_interval 2"):
        whole = rows[(setting, "nothing (whole checkpoint)")]
        assert whole["weights_equal"] and whole["optimizer_equal"], (setting, whole)
        assert whole["max_weight_difference"] == 0.0 and whole["steps_run"] == 8
    needed = [p for p in tr.PIECES if p not in rbe.UNUSED_HERE + ("GradScaler", "CUDA RNG")]
    for piece in needed:
        row = rows[("fp32", piece)]
        assert not row["bit_exact"] and row["max_weight_difference"] > 0, (piece, row)
    for piece in rbe.UNUSED_HERE:
        assert rows[("fp32", piece)]["bit_exact"], piece
    assert rows[("fp32", "step counter")]["steps_run"] == 16  # it trained 4 epochs again
    assert not rows[("fp16, growth_interval 2", "GradScaler")]["bit_exact"]
    assert not rows[("persistent workers", "nothing (whole checkpoint)")]["bit_exact"]
    assert not rows[("evaluation draws from it", "nothing (whole checkpoint)")]["bit_exact"]
    assert rbe.problems(rank0) == []


def test_the_table_check_catches_wrong_rows(table):
    results = table
    broken_whole = {**results, "fp32": [dict(results["fp32"][0], bit_exact=False),
                                        *results["fp32"][1:]]}
    assert any("whole checkpoint" in p for p in rbe.problems(broken_whole))
    harmless_optimizer = {**results, "fp32": [dict(row, bit_exact=True) if
                                              row["missing"] == "optimizer" else row
                                              for row in results["fp32"]]}
    assert any("optimizer" in p for p in rbe.problems(harmless_optimizer))
    exact_persistent = {**results, "persistent workers": dict(results["persistent workers"],
                                                              bit_exact=True)}
    assert any("persistent" in p for p in rbe.problems(exact_persistent))
    assert "nothing (whole checkpoint)" in rbe.table(results)


# --------------------------------------------------------------------- train.py, mid-epoch

# 7 batches per epoch: accumulation windows 3, 3, 1
MID_EPOCH = dict(train_samples=224, eval_samples=61, batch_size=16, hidden=32, epochs=2,
                 workers=1, accumulation_steps=3, progress=False, stuck_worker_s=60.0)


def resume_in_the_middle_of_an_epoch(rank: int, world_size: int) -> dict:
    torch.use_deterministic_algorithms(True)
    root = [tempfile.mkdtemp(prefix="ch08-resume-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    directory = str(Path(root[0]) / "checkpoints")
    reference = tr.train(rank, world_size, **MID_EPOCH)
    stopped = tr.train(rank, world_size, **MID_EPOCH, checkpoint_dir=directory,
                       checkpoint_every=2, keep=2, stop_at_step=4)
    kept = sorted(p.name for p in Path(directory).glob("step_*.pt"))
    saved = torch.load(tr.checkpoint_files.CheckpointDir(directory, keep=2).latest())
    dist.barrier()  # every rank has read it before the resume writes the next ones
    resumed = tr.train(rank, world_size, **MID_EPOCH, checkpoint_dir=directory,
                       checkpoint_every=2, resume=True, save_final=f"{root[0]}/final.pt")
    final = torch.load(f"{root[0]}/final.pt") if rank == 0 else None
    dist.barrier()
    return {"reference": reference, "stopped": stopped, "resumed": resumed, "kept": kept,
            "saved": saved, "final": final, "root": root[0]}


def same(a, b) -> bool:
    """Equal values, tensors bit for bit, through tuples, lists and dicts."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def test_a_resume_mid_epoch_with_workers_and_accumulation_is_bit_exact(no_orphans):
    """Step 4 is the first window of epoch 2 (3 windows per epoch): the resumed run replays the
    epoch's loader from its saved generator state, skips 3 batches, then restores the streams."""
    rank0, rank1 = run_ranks(resume_in_the_middle_of_an_epoch, 2, timeout=120)
    try:
        reference, stopped, resumed = rank0["reference"], rank0["stopped"], rank0["resumed"]
        assert reference["total_steps"] == 6 and stopped["final_step"] == 4
        assert rank0["kept"] == ["step_00000002.pt", "step_00000004.pt"]
        assert resumed["resumed_from"] == 4 and resumed["steps_run"] == 2
        # the checkpoint holds every piece, each rank's random-number states as that rank had them
        saved = rank0["saved"]
        assert {"model", "optimizer", "scheduler", "step", "epoch", "batch",
                "sampler epoch", "rng"} <= saved.keys()
        assert (saved["step"], saved["epoch"], saved["batch"], saved["sampler epoch"]) == (
            4, 1, 3, 1)  # 3 steps per epoch: step 4 is epoch 2's first window of 3 batches
        assert saved["optimizer"]["state"] and saved["scheduler"]["last_epoch"] == 4
        assert [set(r) for r in saved["rng"]] == [{"python", "numpy", "torch",
                                                  "loader generator at epoch start"}] * 2
        for rank, result in enumerate((rank0, rank1)):
            assert same(saved["rng"][rank], result["stopped"]["rng"]), rank
        assert not same(saved["rng"][0], saved["rng"][1])  # per-rank streams
        for name, value in reference["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name
            assert torch.equal(rank1["resumed"]["weights"][name], value), name
        assert resumed["optimizer_state"].keys() == reference["optimizer_state"].keys()
        for key, value in reference["optimizer_state"].items():
            assert torch.equal(resumed["optimizer_state"][key], value), key
        # the final file is the plain module's state_dict: it loads into a model never wrapped
        assert not any(k.startswith(("module.", "_orig_mod.")) for k in rank0["final"])
        plain = tr.build_model(tr.Config(**MID_EPOCH), torch.device("cpu"))
        plain.load_state_dict(rank0["final"])
        for name, p in plain.named_parameters():
            assert torch.equal(p.detach(), reference["weights"][name]), name
        assert tr.problems(resumed) == [] and tr.problems(reference) == []
    finally:
        shutil.rmtree(rank0["root"], ignore_errors=True)


def test_the_training_loaders_workers_start_from_a_fork_server():
    """The rank is multi-threaded, so its workers are not forked from it (chapter 06, section 6);
    the test above shows that NoisySamples and the watchdog reach such workers."""
    loader = tr.build_data(tr.Config(**MID_EPOCH), 0, 2, torch.device("cpu"))[0]
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    config = tr.Config(**dict(MID_EPOCH, workers=0))
    assert tr.build_data(config, 0, 2, torch.device("cpu"))[0].multiprocessing_context is None


def test_restoring_the_saved_random_states_repeats_every_generators_draws():
    """set_rng_state(rng_state(...)) in one process: Python, NumPy and torch draw again what
    they drew after the save; a forgotten piece does not."""
    import random

    import numpy as np

    def draws():
        return (random.random(), float(np.random.rand()), torch.rand(1).item())

    saved = tr.rng_state(torch.Generator().get_state())
    try:
        first = draws()
        tr.set_rng_state(saved, forget=())
        assert draws() == first
        tr.set_rng_state(saved, forget=("NumPy RNG",))
        again = draws()
        assert again[0] == first[0] and again[2] == first[2] and again[1] != first[1]
    finally:
        tr.set_rng_state(saved, forget=())  # this test process's streams as they were


def fake_history(**changes) -> dict:
    history = {"config": {"classes": 4, "eval_samples": 61, "stop_at_step": 0},
               "checksums": [7, 7], "final_step": 6, "total_steps": 6,
               "epochs": [{"train_loss": 1.0, "eval_accuracy": 0.6, "eval_samples": 61},
                          {"train_loss": 0.5, "eval_accuracy": 0.8, "eval_samples": 61}]}
    history.update(changes)
    return history


def test_the_train_check_passes_right_data_and_catches_wrong_data():
    assert tr.problems(fake_history()) == []
    assert tr.problems(fake_history(epochs=[], final_step=4,
                                    config={"stop_at_step": 4})) == []
    for wrong in (dict(final_step=5), dict(checksums=[7, 8]),
                  dict(epochs=[], checksums=[1, 2]),
                  dict(epochs=[{"train_loss": 1.0, "eval_accuracy": 0.2, "eval_samples": 61}])):
        assert tr.problems(fake_history(**wrong)) != [], wrong


def test_the_command_line_adds_this_chapters_options_to_chapter_07s():
    config = tr.parse_args(["--checkpoint-dir", "d", "--checkpoint-every", "4", "--resume",
                            "--kill-at-step", "6", "--forget", "scheduler", "--epochs", "2",
                            "--no-progress"])
    assert (config.checkpoint_dir, config.checkpoint_every, config.resume, config.kill_at_step,
            config.forget, config.epochs, config.progress) == ("d", 4, True, 6,
                                                               ("scheduler",), 2, False)
    assert tr.parse_args([]) == tr.Config()
    for wrong in (["--resume"], ["--kill-at-step", "3"], ["--keep", "0"], ["--epochs", "0"],
                  ["--forget", "everything"]):
        with pytest.raises(SystemExit):
            tr.parse_args(wrong)


class _NeverReturns(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        time.sleep(3600)


def test_a_stuck_worker_reports_where_it_is_and_the_rank_fails_instead_of_waiting(capfd):
    loader = torch.utils.data.DataLoader(
        _NeverReturns(), num_workers=1, worker_init_fn=functools.partial(tr.report_if_stuck, 1.0))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        next(iter(loader))
    assert time.monotonic() - started < 30
    assert "in __getitem__" in capfd.readouterr().err  # the worker's stack, from faulthandler


def test_replay_and_skip_fetches_again_a_stateful_sampler_needs_the_stream_state():
    loader_resume = import_by_path("ch08_loader_resume", ROOT / "chapters" / "08_checkpoints"
                                   / "loader_resume.py")
    per_rank = [loader_resume.run_all(rank, 3) for rank in range(3)]
    assert loader_resume.check(per_rank) == []
    stream = per_rank[2]["stream"]
    assert stream["replay and skip"]["fetched before training"] == 12
    assert not stream["stateful sampler, without the stream's state"]["same batches"]
    assert stream["stateful sampler, with the stream's state at the stop"]["same batches"]
    wrong = [dict(r, stream=dict(r["stream"])) for r in per_rank]
    wrong[0]["stream"]["replay and skip"] = dict(stream["replay and skip"],
                                                 **{"fetched before training": 0})
    assert loader_resume.check(wrong) != []
