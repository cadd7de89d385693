"""Pipeline parallelism: GPipe and 1F1B by hand with send/recv, then torch.distributed.pipelining.

    torchrun --standalone --nproc_per_node 2 chapters/11_beyond_ddp/pipeline_by_hand.py

A stack of Linear + Tanh blocks is cut into one stage per rank. The batch is cut into
``--microbatches`` micro-batches. Each rank runs its list of steps (``"F3"``: forward of
micro-batch 3, ``"B3"``: its backward): a forward receives its input from the previous stage
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

import sys

import torch
import torch.distributed as dist
from torch import nn

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


def gpipe(stages: int, microbatches: int) -> list[list[str]]:
    """Every stage: all forwards, then all backwards (in the same order)."""
    return [[f"F{i}" for i in range(microbatches)] + [f"B{i}" for i in range(microbatches)]
            for _ in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> list[list[str]]:
    """Stage s: ``p - 1 - s`` warm-up forwards, then one forward and one backward in turn,
    then the remaining backwards (PipeDream-Flush, Narayanan et al. 2021)."""
    order = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        steps = [f"F{i}" for i in range(warmup)]
        forward, backward = warmup, 0
        while forward < microbatches:
            steps += [f"F{forward}", f"B{backward}"]
            forward, backward = forward + 1, backward + 1
        steps += [f"B{i}" for i in range(backward, microbatches)]
        order.append(steps)
    return order


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def timeline(order: list[list[str]]) -> list[dict[int, str]]:
    """Each rank's steps placed in unit time slots: a step starts when the rank is free and its
    inputs exist (forward i of stage s after forward i of stage s-1; backward i after
    backward i of stage s+1, and at the last stage after its own forward i)."""
    stages = len(order)
    done: dict[tuple[int, str], int] = {}  # (stage, step) -> slot it ran in
    position = [0] * stages
    free = [0] * stages
    slots: list[dict[int, str]] = [{} for _ in range(stages)]
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(order[s]):
                continue
            step = order[s][position[s]]
            kind, i = step[0], step[1:]
            needs = ([(s - 1, f"F{i}")] if kind == "F" and s > 0 else
                     [(s + 1, f"B{i}")] if kind == "B" and s < stages - 1 else
                     [(s, f"F{i}")] if kind == "B" else [])
            if all(n in done for n in needs):
                start = max([free[s]] + [done[n] + 1 for n in needs])
                done[(s, step)] = start
                slots[s][start] = step
                free[s] = start + 1
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"deadlock: stages wait on each other at steps {position}")
    return slots


def bubble(slots: list[dict[int, str]]) -> dict:
    """Idle slots counted from a timeline, the bubble fraction they give, and the most
    micro-batches whose activations each stage held at once."""
    makespan = max(max(s) for s in slots) + 1
    idle = [makespan - len(s) for s in slots]
    held = []
    for s in slots:
        live = peak = 0
        for slot in sorted(s):
            live += 1 if s[slot][0] == "F" else -1
            peak = max(peak, live)
        held.append(peak)
    return {"makespan": makespan, "idle": idle,
            "fraction": sum(idle) / (makespan * len(slots)), "peak_held": held}


def draw(slots: list[dict[int, str]], title: str, ax) -> None:
    """A per-rank timeline: one row per stage, forwards blue, backwards orange, idle blank."""
    for s, row in enumerate(slots):
        for slot, step in row.items():
            ax.barh(s, 1, left=slot, color="tab:blue" if step[0] == "F" else "tab:orange",
                    edgecolor="white")
            ax.text(slot + 0.5, s, step, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(slots)), [f"rank {s}" for s in range(len(slots))])
    ax.invert_yaxis()
    ax.set_xlabel("time slot")
    ax.set_title(title)


# ------------------------------------------------------------ running a schedule with send/recv


def run_schedule(rank: int, world_size: int, kind: str, microbatches: int = 4) -> dict:
    """This rank's stage runs its steps with send/recv; returns its gradients (and the loss on
    the last stage) and the number of messages it sent."""
    blocks = make_blocks(world_size)
    stage = stage_module(blocks, rank, world_size)
    x, y = batch()
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    pending, sent, loss_total, held, peak = [], 0, 0.0, 0, 0
    last = rank == world_size - 1
    for step in SCHEDULES[kind](world_size, microbatches)[rank]:
        i = int(step[1:])
        if step[0] == "F":
            if rank == 0:
                inp = xs[i]
            else:
                inp = torch.empty(xs[i].shape)
                dist.recv(inp, src=rank - 1)
                inp.requires_grad_(True)
            out = stage(inp)
            inputs[i], held = inp, held + 1
            peak = max(peak, held)
            if last:
                out = loss_fn(out, ys[i])
                loss_total += out.item()
            else:
                pending.append(dist.isend(out.detach(), dst=rank + 1))
                sent += 1
            outputs[i] = out
        else:
            if last:
                outputs[i].backward()
            else:
                grad = torch.empty(outputs[i].shape)
                dist.recv(grad, src=rank + 1)
                outputs[i].backward(grad)
            if rank > 0:
                pending.append(dist.isend(inputs[i].grad, dst=rank - 1))
                sent += 1
            del inputs[i], outputs[i]
            held -= 1
    for work in pending:
        work.wait()
    return {"grads": [p.grad.clone() for p in stage.parameters()], "loss": loss_total,
            "messages": sent, "peak_held": peak}


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


def run_all(rank: int, world_size: int, microbatches: int = 4) -> dict:
    out = {}
    for kind in SCHEDULES:
        out[kind] = run_schedule(rank, world_size, kind, microbatches)
        out[f"torch_{kind}"] = by_torch_pipelining(rank, world_size, kind, microbatches)
    return out


def main() -> int:
    import argparse

    from ddpcourse.dist_env import process_group

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    opts = parser.parse_args()
    with process_group(timeout_s=120, backend="gloo") as ctx:
        mine = run_all(ctx.rank, ctx.world_size, opts.microbatches)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        if not ctx.is_main:
            return 0
        p, m = ctx.world_size, opts.microbatches
        reference = unsplit(p)
        ok = True
        for kind, schedule in SCHEDULES.items():
            slots = timeline(schedule(p, m))
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
