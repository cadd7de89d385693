"""Pipeline parallelism: GPipe and 1F1B by hand with send/recv, then torch.distributed.pipelining.

    torchrun --standalone --nproc_per_node 2 chapters/11_beyond_ddp/pipeline_by_hand.py

A stack of Linear + Tanh blocks is cut into one stage per rank. The batch is cut into
``--microbatches`` micro-batches. Each rank runs its list of steps (``"F3"``: forward of
micro-batch 3, ``"B3"``: its backward) with ``ddpcourse.pipeline.run_steps``. The orders are
read from ``pipeline_schedules.json`` (written out for 2 and 4 ranks, 4 micro-batches; writing
them for any count is the exercise ``pipeline_schedule``), or from ``--schedules FILE``, the
same layout with your own orders. A forward receives its input from the previous stage
(``dist.recv``) and sends its output to the next (``dist.isend``); a backward receives the
gradient of its output from the next stage and sends the gradient of its input to the previous.
Rank 0 prints, for each schedule:

* the largest difference of the loss and of every weight gradient from the unsplit model's
  on the whole batch (one process, same weights);
* each rank's timeline in unit time slots (every forward and every backward one slot, the
  messages free), the idle slots counted from it, and the bubble fraction they give beside
  the formula ``(p - 1) / (m + p - 1)``;
* the largest number of micro-batches whose activations a rank held at once (GPipe: all m;
  1F1B: at most p - stage).

Then the same model through ``torch.distributed.pipelining`` (``PipelineStage``,
``ScheduleGPipe``, ``Schedule1F1B``): loss and gradients against the unsplit model again.
Exit code 1 if a check fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.pipeline import bubble, run_steps, timeline

WIDTH, BATCH = 16, 8


def make_blocks(stages: int, per_stage: int = 2, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                           for _ in range(stages * per_stage)])


def stage_module(blocks: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    per = len(blocks) // stages
    return nn.Sequential(*blocks[stage * per:(stage + 1) * per])


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def loss_fn(out, target):
    return nn.functional.mse_loss(out, target, reduction="sum") / BATCH


# ------------------------------------------------------------------------ the two schedules

SCHEDULES = ("gpipe", "1f1b")
WRITTEN_OUT = Path(__file__).with_name("pipeline_schedules.json")


def written_out(kind: str, stages: int, microbatches: int, path: Path = WRITTEN_OUT) -> list:
    """The order of ``kind`` ("gpipe" or "1f1b") for ``stages`` ranks and ``microbatches``
    micro-batches, as written out in ``path``: one list of steps per rank."""
    table = json.loads(path.read_text())
    key = f"{kind} p={stages} m={microbatches}"
    if key not in table:
        raise SystemExit(f"{path.name} has no {key!r} (it has {sorted(k for k in table if k != 'about')}); "
                         "pass --schedules FILE with your own pipeline_schedule's orders")
    return table[key]


# ------------------------------------------------------------ running a schedule with send/recv


def run_schedule(rank: int, world_size: int, order: list[list[str]],
                 microbatches: int = 4) -> dict:
    """This rank's stage runs its steps of ``order`` with send/recv (ddpcourse.pipeline.run_steps);
    returns its gradients, the loss (on the last stage), the messages it sent and the most
    micro-batches it held at once."""
    blocks = make_blocks(world_size)
    stage = stage_module(blocks, rank, world_size)
    x, y = batch()
    ran = run_steps(stage, order[rank], x.chunk(microbatches), y.chunk(microbatches), loss_fn)
    return {"grads": [p.grad.clone() for p in stage.parameters()], "loss": ran["loss"],
            "messages": ran["messages"], "peak_held": ran["peak_held"]}


def unsplit(world_size: int) -> dict:
    """The unsplit model's loss and gradients on the whole batch, one process."""
    blocks = make_blocks(world_size)
    x, y = batch()
    loss = loss_fn(blocks(x), y)
    loss.backward()
    return {"loss": loss.item(), "grads": [p.grad.clone() for p in blocks.parameters()]}


def by_torch_pipelining(rank: int, world_size: int, kind: str, microbatches: int = 4) -> dict:
    """The same pipeline with torch.distributed.pipelining's stage and schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    blocks = make_blocks(world_size)
    stage = PipelineStage(stage_module(blocks, rank, world_size), rank, world_size,
                          torch.device("cpu"))
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    # loss of one micro-batch: sum over its samples / the whole batch, so that the micro-batch
    # losses add up to the whole batch's mean; scale_grads=False keeps them as they are
    schedule = schedule_cls(stage, microbatches, loss_fn=loss_fn, scale_grads=False)
    x, y = batch()
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    elif rank == world_size - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return {"grads": [p.grad.clone() for p in stage.submod.parameters()],
            "loss": float(sum(loss.item() for loss in losses))}


def compare(results: list[dict], reference: dict) -> dict:
    grads = [g for r in results for g in r["grads"]]
    return {"loss_error": abs(results[-1]["loss"] - reference["loss"]),
            "grad_error": max((a - b).abs().max().item()
                              for a, b in zip(grads, reference["grads"]))}


def run_all(rank: int, world_size: int, orders: dict[str, list[list[str]]],
            microbatches: int = 4) -> dict:
    """Each schedule of ``orders`` (kind -> one list of steps per rank) by hand, then the same
    kind through torch.distributed.pipelining."""
    out = {}
    for kind, order in orders.items():
        out[kind] = run_schedule(rank, world_size, order, microbatches)
        out[f"torch_{kind}"] = by_torch_pipelining(rank, world_size, kind, microbatches)
    return out


def main() -> int:
    import argparse

    from ddpcourse.dist_env import process_group

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", type=Path, default=WRITTEN_OUT,
                        help="JSON of the orders to run, keyed 'KIND p=P m=M' (default: the "
                             "written-out ones)")
    opts = parser.parse_args()
    with process_group(timeout_s=120, backend="gloo") as ctx:
        p, m = ctx.world_size, opts.microbatches
        orders = {kind: written_out(kind, p, m, opts.schedules) for kind in SCHEDULES}
        mine = run_all(ctx.rank, ctx.world_size, orders, m)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        if not ctx.is_main:
            return 0
        reference = unsplit(p)
        ok = True
        for kind, order in orders.items():
            slots = timeline(order)
            b = bubble(slots)
            formula = (p - 1) / (m + p - 1)
            print(f"{kind}: p={p} stages, m={m} micro-batches")
            for s, row in enumerate(slots):
                print(f"  rank {s}: " + " ".join(row.get(t, "..").rjust(3)
                                                 for t in range(b["makespan"])))
            print(f"  idle slots per rank {b['idle']} of {b['makespan']}: bubble "
                  f"{b['fraction']:.3f}, formula (p-1)/(m+p-1) = {formula:.3f}")
            print(f"  micro-batches held at once per rank: {b['peak_held']}")
            for label in (kind, f"torch_{kind}"):
                err = compare([r[label] for r in everyone], reference)
                print(f"  {label:<12} vs unsplit model: loss {err['loss_error']:.1e}, "
                      f"gradients {err['grad_error']:.1e}")
                ok &= err["loss_error"] < 1e-5 and err["grad_error"] < 1e-5
            held = [r[kind]["peak_held"] for r in everyone]
            ok &= abs(b["fraction"] - formula) < 1e-12 and held == b["peak_held"]
        print("RESULT: both schedules match the unsplit model and the bubble formula" if ok
              else "RESULT: a check FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
