"""2 epochs + checkpoint + resume + 2 epochs == 4 straight epochs, bit for bit; and what each
piece of the checkpoint is for, measured by leaving it out.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/resume_bit_exact.py

Launch test: custom (tests/test_chapter_08_resume.py launches it once, with ``--json PATH``, and
checks every row of the table it writes there; one launch instead of two in CI).

Every experiment runs in the same 2 ranks (one process group) with train.py's ``train`` on a small
configuration (128 training samples, batch 16 per rank: 4 optimizer steps per epoch; dropout,
noisy samples fetched by one DataLoader worker per rank, a cosine schedule, SGD with momentum),
``torch.use_deterministic_algorithms(True)``:

1. the reference: 4 epochs straight;
2. the same run stopped after epoch 2 (``stop_at_step``): its checkpoint is the one every resume
   below starts from (a copy per resume, so no resume reads another's checkpoints);
3. resumes in fresh state (new model, optimizer, loader, generators, everything seeded afresh as a
   new process would be), once with the whole checkpoint, then once per missing piece; each is
   compared with the reference: ``torch.equal`` on every parameter and every optimizer state
   tensor, and the largest absolute weight difference.

What "left out" means, row by row (``--forget`` in train.py does the same): optimizer, scheduler,
GradScaler: freshly built ones are used; step counter: the run starts again at step 0 (it trains
all 4 epochs from the checkpoint's weights); sampler epoch: the resumed run counts the sampler's
epochs from 0 again; torch / Python / NumPy RNG: that generator keeps its fresh seed; per-rank
RNG: every rank restores rank 0's states; loader generator: the loader's generator keeps its
fresh seed, so the workers of the resumed epochs get other seeds.

A row for the GradScaler compares fp16 runs (autocast + GradScaler on the CPU) with an fp16
reference, at torch's default ``growth_interval`` (2000: over 32 steps the scale never grows, so
the scaler's state is its initial one unless a step overflowed) and at ``growth_interval=2``
(the scale changes every few steps). It runs on the CPU (gloo) even where there are GPUs: the
claim is about CPU determinism, and a GPU run would need its own deterministic settings
(``CUBLAS_WORKSPACE_CONFIG``); so the CUDA generator's row is not measured here.
A last line resumes with the whole checkpoint but *persistent* DataLoader workers: they are seeded
once, in the first epoch, so a resume in epoch 3 starts them from another seed.

Its own check (exit 1 if one fails): the whole checkpoint resumes bit-exact (fp32 and fp16);
leaving out any piece this training uses breaks bit-exactness; leaving out a piece it never draws
from (Python's and NumPy's generators in the ranks) does not; persistent workers break it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from ddpcourse.dist_env import process_group
from ddpcourse.imports import import_by_path
from ddpcourse.report import report_checks

HERE = Path(__file__).resolve().parent


train = import_by_path("ch08_train", HERE / "train.py")  # chapter 07 has a train.py too

SMALL = dict(train_samples=128, eval_samples=32, batch_size=16, hidden=32, epochs=4, workers=1,
             progress=False, stuck_worker_s=60.0)
STOP_EPOCH = 2
# Pieces that nothing in these ranks draws from: leaving them out changes nothing here.
UNUSED_HERE = ("Python RNG", "NumPy RNG")


def steps_per_epoch(world_size: int) -> int:
    return SMALL["train_samples"] // (world_size * SMALL["batch_size"])


def compare(run: dict, reference: dict) -> dict:
    """Bit-exact on every parameter and optimizer state tensor? And the largest weight gap."""
    weights = all(torch.equal(run["weights"][k], v) for k, v in reference["weights"].items())
    optimizer = (run["optimizer_state"].keys() == reference["optimizer_state"].keys() and all(
        torch.equal(run["optimizer_state"][k], v) for k, v in reference["optimizer_state"].items()))
    gap = max((run["weights"][k] - v).abs().max().item() for k, v in reference["weights"].items())
    return {"bit_exact": weights and optimizer, "weights_equal": weights,
            "optimizer_equal": optimizer, "max_weight_difference": gap,
            "steps_run": run["steps_run"]}


def fresh_copy(source: Path, name: str) -> str:
    """A private copy of the checkpoint directory (rank 0 copies, everyone waits)."""
    target = source.parent / name
    if dist.get_rank() == 0:
        shutil.copytree(source, target)
    dist.barrier()
    return str(target)


def resume_experiments(rank: int, world_size: int, root: str, label: str,
                       **overrides) -> list[dict]:
    """The reference, the stopped run, and one resume per row; every rank returns the rows.
    ``label`` names this configuration's folders under ``root``."""
    config = {**SMALL, **overrides}
    stop = STOP_EPOCH * steps_per_epoch(world_size)
    reference = train.train(rank, world_size, **config)
    stopped_dir = Path(root) / f"{label}-stopped"
    train.train(rank, world_size, **config, checkpoint_dir=str(stopped_dir), stop_at_step=stop)
    rows = []
    pieces = [()] + [(piece,) for piece in train.PIECES if piece not in ("GradScaler", "CUDA RNG")]
    if overrides.get("amp") == "fp16":
        pieces = [(), ("GradScaler",)]
    for forget in pieces:
        directory = fresh_copy(stopped_dir, f"{label}-resume-{len(rows)}")
        resumed = train.train(rank, world_size, **config, checkpoint_dir=directory, resume=True,
                              forget=forget)
        rows.append({"missing": forget[0] if forget else "nothing (whole checkpoint)",
                     "resumed_from": resumed["resumed_from"], **compare(resumed, reference)})
    return rows


def whole_checkpoint_experiment(rank: int, world_size: int, root: str, label: str,
                                **overrides) -> dict:
    """Reference, stop, and one resume from the whole checkpoint, with train.py changed."""
    config = {**SMALL, **overrides}
    stop = STOP_EPOCH * steps_per_epoch(world_size)
    reference = train.train(rank, world_size, **config)
    directory = str(Path(root) / label)
    train.train(rank, world_size, **config, checkpoint_dir=directory, stop_at_step=stop)
    resumed = train.train(rank, world_size, **config, checkpoint_dir=directory, resume=True)
    return {"missing": "nothing (whole checkpoint)", **compare(resumed, reference)}


def all_experiments(rank: int, world_size: int) -> dict:
    """Everything, in one process group. A temporary directory shared by the ranks (one
    machine), made by rank 0."""
    torch.use_deterministic_algorithms(True)
    name = [tempfile.mkdtemp(prefix="resume-bit-exact-") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    try:
        return {"fp32": resume_experiments(rank, world_size, name[0], "fp32"),
                "fp16, growth_interval 2000": resume_experiments(
                    rank, world_size, name[0], "fp16-2000", amp="fp16", workers=0),
                "fp16, growth_interval 2": resume_experiments(
                    rank, world_size, name[0], "fp16-2", amp="fp16", scaler_growth_interval=2,
                    workers=0),
                "persistent workers": whole_checkpoint_experiment(
                    rank, world_size, name[0], "persistent", persistent_workers=True),
                "evaluation draws from it": whole_checkpoint_experiment(
                    rank, world_size, name[0], "evaluation", evaluation_apart=False,
                    workers=0)}
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(name[0], ignore_errors=True)


def table(results: dict) -> str:
    lines = [f"{'configuration':<27} {'left out on resume':<28} {'bit-exact':>9} "
             f"{'max |dw|':>10}  steps run"]
    for setting, rows in results.items():
        for row in rows if isinstance(rows, list) else [rows]:
            lines.append(f"{setting:<27} {row['missing']:<28} "
                         f"{'yes' if row['bit_exact'] else 'NO':>9} "
                         f"{row['max_weight_difference']:>10.3g}  {row['steps_run']}")
    return "\n".join(lines)


def problems(results: dict) -> list[str]:
    found = []
    for setting in ("fp32", "fp16, growth_interval 2000", "fp16, growth_interval 2"):
        rows = {row["missing"]: row for row in results[setting]}
        whole = rows.pop("nothing (whole checkpoint)")
        if not whole["bit_exact"]:
            found.append(f"{setting}: resuming from the whole checkpoint is not bit-exact "
                         f"(max weight difference {whole['max_weight_difference']:.3g})")
        for piece, row in rows.items():
            if piece == "GradScaler" and "2000" in setting:
                continue  # whatever it shows, the table reports it; the claim is on interval 2
            expected = piece in UNUSED_HERE
            if row["bit_exact"] != expected:
                found.append(f"{setting}: leaving out {piece} should "
                             f"{'not ' if not expected else ''}stay bit-exact, but it "
                             f"{'did' if row['bit_exact'] else 'did not'}")
    for setting in ("persistent workers", "evaluation draws from it"):
        if results[setting]["bit_exact"]:
            found.append(f"{setting}: the resume should not be bit-exact, but it is")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results there (rank 0)")
    args = parser.parse_args(argv)
    with process_group(backend="gloo") as ctx:  # the CPU, also on a machine with GPUs
        results = all_experiments(ctx.rank, ctx.world_size)
        found = problems(results)
        ctx.print0(f"{ctx.world_size} ranks, {ctx.backend}; {SMALL['epochs']} epochs of "
                   f"{steps_per_epoch(ctx.world_size)} steps, checkpoint after epoch "
                   f"{STOP_EPOCH}, resumed in fresh state; compared with the straight run:")
        ctx.print0(table(results))
        if args.json and ctx.is_main:
            Path(args.json).write_text(json.dumps(results, indent=1))
        return report_checks(found, echo=ctx.print0)


if __name__ == "__main__":
    sys.exit(main())
