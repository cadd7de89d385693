"""Pipeline schedules as lists of steps: their timeline, their bubble, and a run with send/recv.

A schedule is one list of steps per stage (one stage per rank): ``"F3"`` is the forward of
micro-batch 3, ``"B3"`` its backward. This module does not make schedules (writing them is
chapter 11's exercise ``pipeline_schedule``); it reads them:

* :func:`timeline` places each stage's steps in unit time slots (every forward and every backward
  one slot, messages free), or raises :class:`Deadlock` when the stages would wait on each other;
* :func:`bubble` counts the idle slots of a timeline and the micro-batches whose activations each
  stage held at once;
* :func:`run_steps` runs one stage's steps for real: ``dist.recv`` of the previous stage's
  activations (of the next stage's gradients), ``dist.isend`` of its own;
* :func:`draw` pictures a timeline, one row per rank.

Used by chapters/11_beyond_ddp (the lesson and ``pipeline_by_hand.py``) and by the exercise's
grader, which judges a submitted schedule with the same timeline.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

STEP = re.compile(r"([FB])(0|[1-9][0-9]*)")


class Deadlock(RuntimeError):
    """The stages of a schedule wait on each other: no order of execution runs it to the end."""


def parse_step(step: str) -> tuple[str, int]:
    """``"F3"`` -> ``("F", 3)``; ValueError for anything else."""
    match = STEP.fullmatch(step) if isinstance(step, str) else None
    if match is None:
        raise ValueError(f"{step!r} is not a step (a step is 'F<i>' or 'B<i>', e.g. 'F0')")
    return match[1], int(match[2])


def needs(order: Sequence[Sequence[str]], stage: int, step: str) -> list[tuple[int, str]]:
    """The steps ``step`` of ``stage`` waits for: a forward, the previous stage's forward of its
    micro-batch; a backward, the next stage's backward of it, and on the last stage its own
    forward (the loss)."""
    kind, i = parse_step(step)
    last = len(order) - 1
    if kind == "F":
        return [(stage - 1, f"F{i}")] if stage > 0 else []
    return [(stage + 1, f"B{i}")] if stage < last else [(stage, f"F{i}")]


def timeline(order: Sequence[Sequence[str]]) -> list[dict[int, str]]:
    """Each stage's steps in unit time slots, ``[{slot: step}, ...]`` per stage.

    Every stage runs its steps in its list's order; a step starts in the first slot where its
    stage is free and every step it :func:`needs` has finished. Raises :class:`Deadlock`, naming
    what each stuck stage waits for, when no stage can go on (a step waits on one that never
    comes, or on one behind it in a list)."""
    stages = len(order)
    finished: dict[tuple[int, str], int] = {}  # (stage, step) -> the slot it ran in
    position = [0] * stages
    free = [0] * stages
    slots: list[dict[int, str]] = [{} for _ in range(stages)]
    remaining = sum(len(steps) for steps in order)
    while remaining:
        progressed = False
        for s in range(stages):
            if position[s] == len(order[s]):
                continue
            step = order[s][position[s]]
            waits = needs(order, s, step)
            if all(w in finished for w in waits):
                start = max([free[s]] + [finished[w] + 1 for w in waits])
                finished[(s, step)] = start
                slots[s][start] = step
                free[s] = start + 1
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {order[s][position[s]]} waits for "
                     + " and ".join(f"stage {w}'s {step}" for w, step in
                                    needs(order, s, order[s][position[s]]) if (w, step)
                                    not in finished)
                     for s in range(stages) if position[s] < len(order[s])]
            raise Deadlock("deadlock: " + "; ".join(stuck))
    return slots


def bubble(slots: Sequence[dict[int, str]]) -> dict:
    """A timeline's length in slots (``makespan``), each stage's idle slots, the bubble fraction
    they give (idle slots / all slots), and ``peak_held``: per stage, the most micro-batches
    whose forward had run and whose backward had not yet, at any moment."""
    makespan = max((max(s) + 1 for s in slots if s), default=0)
    idle = [makespan - len(s) for s in slots]
    held = [held_at_once([s[t] for t in sorted(s)]) for s in slots]
    return {"makespan": makespan, "idle": idle,
            "fraction": sum(idle) / (makespan * len(slots)) if makespan else 0.0,
            "peak_held": held}


def held_at_once(steps: Sequence[str]) -> int:
    """The most micro-batches one stage held activations of, running ``steps`` in order."""
    live = peak = 0
    for step in steps:
        live += 1 if parse_step(step)[0] == "F" else -1
        peak = max(peak, live)
    return peak


def draw(slots: Sequence[dict[int, str]], title: str, ax) -> None:
    """A per-rank timeline on a matplotlib axis: one row per stage, forwards blue, backwards
    orange, idle slots blank."""
    for s, row in enumerate(slots):
        for slot, step in row.items():
            ax.barh(s, 1, left=slot, color="tab:blue" if step[0] == "F" else "tab:orange",
                    edgecolor="white")
            ax.text(slot + 0.5, s, step, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(slots)), [f"rank {s}" for s in range(len(slots))])
    ax.invert_yaxis()
    ax.set_xlabel("time slot")
    ax.set_title(title)


def run_steps(stage_module: torch.nn.Module, steps: Sequence[str], inputs: Sequence[torch.Tensor],
              targets: Sequence[torch.Tensor],
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> dict:
    """Run this rank's ``steps`` of a pipeline whose stage ``r`` is rank ``r`` of the default group.

    A forward of micro-batch ``i`` takes ``inputs[i]`` on rank 0, else receives it from rank - 1;
    it sends its output to rank + 1, or on the last rank adds ``loss_fn(output, targets[i])`` to
    the loss. A backward receives the gradient of its output from rank + 1 (on the last rank it
    starts from the loss) and sends the gradient of its input to rank - 1. Messages carry the
    micro-batch in their tag, so a stage may take micro-batches in any order. The sends are
    ``isend``: a rank blocks only in ``recv``, on a step it needs.

    Returns the steps run (in order), the messages sent, the most micro-batches held at once and
    the loss (the sum of the micro-batches' losses; 0 except on the last rank). The gradients are
    accumulated in ``stage_module``'s parameters."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    last = rank == world_size - 1
    saved_inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    pending, ran, loss_total, peak = [], [], 0.0, 0
    for step in steps:
        kind, i = parse_step(step)
        if kind == "F":
            if rank == 0:
                inp = inputs[i]
            else:
                inp = torch.empty_like(inputs[i])
                dist.recv(inp, src=rank - 1, tag=2 * i)
                inp.requires_grad_(True)
            out = stage_module(inp)
            if last:
                out = loss_fn(out, targets[i])
                loss_total += out.item()
            else:
                pending.append(dist.isend(out.detach(), dst=rank + 1, tag=2 * i))
            saved_inputs[i], outputs[i] = inp, out
            peak = max(peak, len(outputs))
        else:
            if last:
                outputs[i].backward()
            else:
                grad = torch.empty_like(outputs[i])
                dist.recv(grad, src=rank + 1, tag=2 * i + 1)
                outputs[i].backward(grad)
            if rank > 0:
                pending.append(dist.isend(saved_inputs[i].grad, dst=rank - 1, tag=2 * i + 1))
            del saved_inputs[i], outputs[i]
        ran.append(step)
    for work in pending:
        work.wait()
    return {"ran": ran, "messages": len(pending), "peak_held": peak, "loss": loss_total}
