"""Gradient accumulation under DDP: ``no_sync()`` around the forward *and* the backward, the
optimizer step right after the synchronised micro-batch, and each micro-batch loss divided by k.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/accumulation.py

Every all-reduce is counted by a communication hook (:func:`counting_allreduce_hook`, registered
with ``DistributedDataParallel.register_comm_hook``): it records each gradient bucket it is given,
then averages it as DDP does without a hook (up to rounding), with ``allreduce_hook`` of
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py (divide by the world size, sum).
The model (``ddpcourse.toys.make_model``, 1377 parameters) fits in one bucket, so one call is one
synchronisation of every gradient.

What the script measures and checks (rank 0 prints it, exits 1 if a claim fails):

* **Where ``no_sync()`` goes** (:func:`syncs_by_placement`). Around the forward and the backward:
  no all-reduce, each rank keeps its own gradient. Around the backward only: one all-reduce, as if
  ``no_sync()`` were not there. The reason is in torch/nn/parallel/distributed.py: ``no_sync``
  only sets ``self.require_backward_grad_sync = False``, and that flag is read by the *forward*:
  ``_pre_forward`` (``reducer.prepare_for_forward()``) and ``_post_forward``
  (``reducer.prepare_for_backward(...)``) run only when it is true. ``prepare_for_backward`` is
  what arms the reducer for the coming backward (``expect_autograd_hooks_ = true`` in
  ``Reducer::prepare_for_backward``, torch/csrc/distributed/c10d/reducer.cpp; its
  ``autograd_hook`` returns early otherwise). ``no_sync``'s own docstring warns: "The forward pass
  should be included inside the context manager, or else gradients will still be synchronized."
* **Sync and step on the right micro-batch** (:func:`accumulate`, :data:`VARIANTS`). The gradients
  accumulated under ``no_sync()`` are all-reduced, together with the new ones, by the next
  synchronised backward. An optimizer step taken on gradients that include unsynchronised ones
  makes the replicas different, and nothing raises: DDP all-reduces gradients, it never compares
  parameters after the constructor's broadcast. An off-by-one (``i % k == 0`` for the sync, the
  step still after the k-th micro-batch) does exactly that. Syncing every micro-batch (no
  ``no_sync()``) gives the correct parameters up to rounding, with k times the all-reduces.
* **k micro-batches on 1 process = k ranks x 1 micro-batch** (:func:`one_process_vs_ranks`). Divide
  each micro-batch loss by k and k accumulated backwards give the mean gradient of the k
  micro-batches, which is what DDP's average over k ranks gives. On 2 ranks the two trainings
  agree bit for bit (halving is exact, and a sum of two terms rounds alike in either order); on 3 or
  4 within a few units in the last place (dividing by 3 rounds, and gloo sums in its own order).
  Without the division the accumulated gradient is k times too large.
* **Gradient clipping** (:func:`clipping`). After the synced backward every rank holds the
  averaged gradient, so ``clip_grad_norm_`` sees the same norm on every rank, the norm of one
  process's gradient on the global batch, and clips as that process would (up to rounding).
  Inside ``no_sync()`` each rank holds its own partial sum: a clip there sees a different norm
  on each rank and changes the result (the replicas stay equal, since the sync averages what
  each rank clipped, but the training is not one process's any more). Clip after the synced
  backward, before ``optimizer.step()``.
* **``gradient_as_bucket_view=True`` with ``no_sync()``** (:func:`bucket_views`). The option
  makes each ``.grad`` a view into DDP's bucket, saving one copy of the gradients. Measured per
  micro-batch: with ``zero_grad(set_to_none=True)`` (the default) the no_sync micro-batches'
  gradients are new tensors of their own, outside the bucket, and only the synced backward puts
  them back into it, so the memory saving does not hold inside an accumulation window; with
  ``set_to_none=False`` they stay bucket views from the first sync on. The trained parameters
  are bit-identical to ``gradient_as_bucket_view=False`` either way.
"""

import contextlib
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.dist_env import group_device, process_group
from ddpcourse.report import report_checks
from ddpcourse.toys import flat_parameters, make_model, make_regression

MSE = torch.nn.functional.mse_loss
PLACEMENTS = ("forward and backward", "backward only", "no no_sync")
# name: (micro-batch of each group on which the backward synchronises, ... on which to step)
VARIANTS = {
    "correct: sync and step on the last": ("last", "last"),
    "off by one: sync on the first, step on the last": ("first", "last"),
    "off by one: sync on the last, step on the first": ("last", "first"),
    "sync and step on the first": ("first", "first"),
    "no no_sync: sync every micro-batch": ("every", "last"),
}
CORRECT = "correct: sync and step on the last"


@dataclass
class CommLog:
    """What a counting comm hook saw: one entry per all-reduce call (one gradient bucket)."""

    process_group: dist.ProcessGroup | None = None  # None: the default group
    elements: list[int] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.elements)

    def clear(self) -> None:
        self.elements.clear(), self.dtypes.clear(), self.bytes.clear()


def counting_allreduce_hook(log: CommLog,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: write down the bucket's size and dtype, then average it across ranks with
    ``default_hooks.allreduce_hook`` (divide by W, all-reduce the sum).

    Without a hook DDP does the same up to rounding: it multiplies each gradient by 1/W while
    copying it into the bucket (``at::mul_out`` in ``Reducer::mark_variable_ready_dense``,
    torch/csrc/distributed/c10d/reducer.cpp), then sums. Dividing by W and multiplying by 1/W
    agree bit for bit when W is a power of two (measured on 2 ranks); on 3 ranks 563 of the 1377
    gradients differ by one unit in the last place.

    ``register_comm_hook`` checks these annotations (``_check_comm_hook``): they must be the real
    ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``, not the strings that
    ``from __future__ import annotations`` would make of them, which it rejects."""
    buffer = bucket.buffer()
    log.elements.append(buffer.numel())
    log.dtypes.append(str(buffer.dtype).removeprefix("torch."))
    log.bytes.append(buffer.numel() * buffer.element_size())
    return default_hooks.allreduce_hook(log.process_group, bucket)




def wrap(model: torch.nn.Module) -> DDP:
    """``DDP(model)`` on :func:`group_device` (one device per rank)."""
    device = group_device()
    return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)


def counted_ddp(seed: int = 0) -> tuple[DDP, CommLog]:
    """``wrap(make_model(seed))`` with :func:`counting_allreduce_hook` registered."""
    model = wrap(make_model(seed))
    log = CommLog()
    model.register_comm_hook(log, counting_allreduce_hook)
    return model, log


def micro_batches(count: int, size: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """``count`` micro-batches of ``size`` samples, the same on every rank (slice them by rank),
    on :func:`group_device`."""
    x, y = (t.to(group_device()) for t in make_regression(count * size, seed=seed).tensors)
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(count)]


def spread_across_ranks(tensor: torch.Tensor) -> float:
    """max over ranks of max |tensor on that rank - tensor on rank 0| (0.0: equal everywhere)."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.detach().contiguous())
    return max((t - gathered[0]).abs().max().item() for t in gathered)


def gradient_vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def syncs_by_placement(rank: int, world_size: int, placement: str) -> dict:
    """One forward and backward of this rank's own micro-batch, with ``no_sync()`` placed as
    ``placement`` says (one of :data:`PLACEMENTS`). Returns the all-reduce calls and elements the
    hook saw, the DDP flag the forward read, and how much the ranks' gradients differ."""
    model, log = counted_ddp()
    x, y = micro_batches(world_size)[rank]
    if placement == "forward and backward":
        with model.no_sync():
            flag_at_forward = model.require_backward_grad_sync
            MSE(model(x), y).backward()
    elif placement == "backward only":
        flag_at_forward = model.require_backward_grad_sync
        loss = MSE(model(x), y)
        with model.no_sync():  # too late: the forward has already armed the reducer
            loss.backward()
    elif placement == "no no_sync":
        flag_at_forward = model.require_backward_grad_sync
        MSE(model(x), y).backward()
    else:
        raise ValueError(f"placement must be one of {PLACEMENTS}, not {placement!r}")
    return {"all-reduce calls": log.calls, "elements": sum(log.elements),
            "require_backward_grad_sync at forward": flag_at_forward,
            "gradient spread across ranks": spread_across_ranks(gradient_vector(model))}


def _is_position(i: int, k: int, when: str) -> bool:
    return when == "every" or i % k == (k - 1 if when == "last" else 0)


def accumulate(rank: int, world_size: int, sync_on: str = "last", step_on: str = "last",
               k: int = 4, groups: int = 3) -> dict:
    """Train ``groups * k`` micro-batches per rank, accumulating the gradients of k of them.

    The backward synchronises on the micro-batch of each group that ``sync_on`` names (``"last"``,
    ``"first"`` or ``"every"``; the others run under ``no_sync()``, forward included); the
    optimizer steps after the micro-batch ``step_on`` names. Rank r trains micro-batches
    ``r, r + W, r + 2W, ...`` of one shared list. Returns the parameter spread across ranks after
    each micro-batch, the all-reduce calls and the optimizer steps; nothing here raises when the
    replicas drift apart.
    """
    model, log = counted_ddp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = micro_batches(groups * k * world_size)[rank::world_size]
    spread, steps = [], 0
    for i, (x, y) in enumerate(batches):
        sync = _is_position(i, k, sync_on)
        with contextlib.nullcontext() if sync else model.no_sync():
            (MSE(model(x), y) / k).backward()
        if _is_position(i, k, step_on):
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
        spread.append(spread_across_ranks(flat_parameters(model.module)))
    return {"parameter spread after each micro-batch": spread, "all-reduce calls": log.calls,
            "optimizer steps": steps, "micro-batches": len(batches),
            "parameters": flat_parameters(model.module).tolist()}


def all_variants(rank: int, world_size: int, k: int = 4, groups: int = 3) -> dict:
    """:func:`accumulate` for every entry of :data:`VARIANTS`, by name, each with its largest
    parameter difference from the correct run on this rank (instead of the parameters)."""
    results = {name: accumulate(rank, world_size, sync_on, step_on, k, groups)
               for name, (sync_on, step_on) in VARIANTS.items()}
    correct = torch.tensor(results[CORRECT]["parameters"])
    for result in results.values():
        parameters = torch.tensor(result.pop("parameters"))
        result["max |difference| from the correct run"] = (parameters - correct).abs().max().item()
    return results


def one_process_vs_ranks(rank: int, world_size: int, steps: int = 3, size: int = 4) -> dict:
    """DDP on W ranks, one micro-batch each per step, against one process that accumulates the
    same W micro-batches (each loss divided by W) and against one process on one batch of
    ``W * size`` samples. Every rank computes both references itself (same threads, same data).
    Returns max |parameter difference| after ``steps`` SGD steps, the largest |parameter| (the
    scale of one unit in the last place), and the first step's gradient ratio when the
    accumulated losses are *not* divided by W (expect exactly W on 2 ranks)."""
    batches = micro_batches(steps * world_size, size)
    ddp = wrap(make_model(0))
    accumulated, big_batch, undivided = (make_model(0).to(group_device()) for _ in range(3))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1)
                  for m in (ddp, accumulated, big_batch, undivided)]
    ratio = None
    for step in range(steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        group = batches[step * world_size:(step + 1) * world_size]
        MSE(ddp(group[rank][0]), group[rank][1]).backward()
        for x, y in group:
            (MSE(accumulated(x), y) / world_size).backward()
            MSE(undivided(x), y).backward()
        x_all, y_all = (torch.cat(parts) for parts in zip(*group))
        MSE(big_batch(x_all), y_all).backward()
        if step == 0:
            reference = gradient_vector(ddp)
            ratio = (gradient_vector(undivided) / reference)[reference != 0]
            ratio = (ratio.min().item(), ratio.max().item())
        for optimizer in optimizers:
            optimizer.step()
    final = flat_parameters(ddp.module)
    return {"max |DDP - 1 process accumulating W micro-batches|":
                (final - flat_parameters(accumulated)).abs().max().item(),
            "max |DDP - 1 process, one batch of W micro-batches|":
                (final - flat_parameters(big_batch)).abs().max().item(),
            "max |parameter|": final.abs().max().item(),
            "gradient ratio without / W (min, max)": ratio}


CLIPPINGS = ("after the synced backward", "after every backward, inside no_sync too")


def clipping(rank: int, world_size: int, where: str, k: int = 2, steps: int = 3,
             max_norm: float = 0.01) -> dict:
    """Accumulation of ``k`` micro-batches per step (right placement of ``no_sync``) with
    ``clip_grad_norm_(max_norm)`` placed as ``where`` says (one of :data:`CLIPPINGS`), against
    one process that accumulates every rank's micro-batches of the step and clips once. Returns
    the total norm each rank's first clip saw, the reference's first norm, the replicas' spread
    and the largest difference from the reference after ``steps`` SGD steps."""
    batches = micro_batches(steps * k * world_size)
    ddp = wrap(make_model(0))
    reference = make_model(0).to(group_device())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, reference)]
    first_norm = reference_norm = None
    for step in range(steps):
        group = batches[step * k * world_size:(step + 1) * k * world_size]
        mine = group[rank::world_size]
        for position, (x, y) in enumerate(mine):
            last = position == k - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                (MSE(ddp(x), y) / k).backward()
            if last or where != CLIPPINGS[0]:
                norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm).item()
                first_norm = norm if first_norm is None else first_norm
        for x, y in group:
            (MSE(reference(x), y) / (k * world_size)).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item()
        reference_norm = norm if reference_norm is None else reference_norm
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    final = flat_parameters(ddp.module)
    return {"first norm clipped, this rank": first_norm,
            "first norm clipped, one process": reference_norm,
            "parameter spread across ranks": spread_across_ranks(final),
            "max |DDP - one process|": (final - flat_parameters(reference)).abs().max().item(),
            "max |parameter|": final.abs().max().item()}


def check_clipping(per_rank: dict[str, list[dict]]) -> list[str]:
    """Clipping after the synced backward clips the global gradient (the same norm on every
    rank, one process's result up to rounding); clipping before the all-reduce clips each
    rank's local gradient: different norms, another result, replicas still equal."""
    found = []
    right, early = per_rank[CLIPPINGS[0]], per_rank[CLIPPINGS[1]]
    for name, results in per_rank.items():
        if max(r["parameter spread across ranks"] for r in results) != 0:
            found.append(f"clipping {name}: replicas apart")
    reference = right[0]["first norm clipped, one process"]
    if reference <= 0.01:
        found.append(f"the reference gradient's norm {reference} is not above max_norm: no clip")
    tolerance = ulp_tolerance(right[0]["max |parameter|"])
    for rank, r in enumerate(right):
        if abs(r["first norm clipped, this rank"] - reference) > 1e-6 * reference:
            found.append(f"rank {rank} clipped a norm of {r['first norm clipped, this rank']} "
                         f"after the sync, one process {reference}")
        if r["max |DDP - one process|"] > tolerance:
            found.append(f"clipping after the sync differs from one process by "
                         f"{r['max |DDP - one process|']} > {tolerance}")
    if len(early) > 1 and len({r["first norm clipped, this rank"] for r in early}) == 1:
        found.append("clipping inside no_sync saw the same norm on every rank")
    if early[0]["max |DDP - one process|"] <= tolerance:
        found.append("clipping inside no_sync gave one process's result")
    return found


def bucket_views(rank: int, world_size: int, set_to_none: bool, k: int = 4,
                 steps: int = 3) -> dict:
    """Accumulation with ``gradient_as_bucket_view=True``: after each micro-batch's backward, is
    every ``.grad`` a view into DDP's gradient bucket (the same storage as the bucket the
    step's sync all-reduced)? ``set_to_none``: how ``zero_grad`` clears the gradients. Also the
    final parameters, to compare with ``gradient_as_bucket_view=False``."""
    results = {}
    for as_view in (True, False):
        model = DDP(make_model(0).to(group_device()), gradient_as_bucket_view=as_view)
        buckets: list[int] = []

        def hook(state, bucket):
            buckets.append(bucket.buffer().untyped_storage().data_ptr())
            return default_hooks.allreduce_hook(None, bucket)

        model.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        mine = micro_batches(steps * k * world_size)[rank::world_size]
        in_bucket = []
        for start in range(0, len(mine), k):
            storages = []
            for position, (x, y) in enumerate(mine[start:start + k]):
                with contextlib.nullcontext() if position == k - 1 else model.no_sync():
                    (MSE(model(x), y) / k).backward()
                storages.append({p.grad.untyped_storage().data_ptr()
                                 for p in model.parameters()})
            in_bucket += [found == {buckets[-1]} for found in storages]
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
        results[as_view] = {"grads in the bucket after each micro-batch": in_bucket,
                            "parameters": flat_parameters(model.module)}
    return {"grads in the bucket after each micro-batch":
                results[True]["grads in the bucket after each micro-batch"],
            "same parameters as without bucket views":
                torch.equal(results[True]["parameters"], results[False]["parameters"])}


def check_bucket_views(by_set_to_none: dict[bool, dict], k: int = 4) -> list[str]:
    """With ``zero_grad(set_to_none=True)`` the no_sync micro-batches' gradients are tensors of
    their own and only the synced backward puts them back into the bucket; with
    ``set_to_none=False`` they stay bucket views from the first sync on. Same numbers either way."""
    found = []
    for set_to_none, result in by_set_to_none.items():
        if not result["same parameters as without bucket views"]:
            found.append(f"set_to_none={set_to_none}: parameters differ from plain gradients")
    views = by_set_to_none[True]["grads in the bucket after each micro-batch"]
    expected = [position == k - 1 for _ in range(len(views) // k) for position in range(k)]
    if views != expected:
        found.append(f"set_to_none=True: in the bucket {views}, expected {expected}")
    kept = by_set_to_none[False]["grads in the bucket after each micro-batch"]
    if not all(kept[k - 1:]):
        found.append(f"set_to_none=False: in the bucket {kept}, expected from the first sync on")
    return found


def ulp_tolerance(max_parameter: float, units: int = 4) -> float:
    """``units`` units in the last place of float32 at the largest parameter's magnitude."""
    return units * torch.finfo(torch.float32).eps * max_parameter


def problems(world_size: int, placements: dict, variants: dict, versus: dict) -> list[str]:
    """What contradicts the module docstring, given the three measurements (rank 0's view)."""
    found = []
    wrapped, late, plain = (placements[p] for p in PLACEMENTS)
    if wrapped["all-reduce calls"] != 0 or wrapped["gradient spread across ranks"] == 0:
        found.append(f"no_sync around forward and backward: {wrapped}, expected no all-reduce "
                     "and different gradients per rank")
    for name, result in (("backward only", late), ("no no_sync", plain)):
        if result["all-reduce calls"] != 1 or result["gradient spread across ranks"] != 0:
            found.append(f"{name}: {result}, expected one all-reduce and equal gradients")
    for name, result in variants.items():
        drifted = max(result["parameter spread after each micro-batch"]) > 0
        if drifted != name.startswith("off by one"):
            found.append(f"{name}: replicas {'drifted' if drifted else 'stayed equal'}")
    correct = variants[CORRECT]
    eager = variants["no no_sync: sync every micro-batch"]
    if correct["all-reduce calls"] * (correct["micro-batches"] // correct["optimizer steps"]) \
            != eager["all-reduce calls"]:
        found.append(f"all-reduce calls: {correct['all-reduce calls']} with no_sync, "
                     f"{eager['all-reduce calls']} without; expected k times more without")
    exact = world_size == 2
    tolerance = 0.0 if exact else ulp_tolerance(versus["max |parameter|"])
    difference = versus["max |DDP - 1 process accumulating W micro-batches|"]
    if difference > tolerance:
        found.append(f"DDP vs 1 process x W micro-batches differ by {difference} > {tolerance}")
    ratios = versus["gradient ratio without / W (min, max)"]
    ratio_tolerance = 0.0 if exact else 1e-3 * world_size  # elementwise ratios of rounded numbers
    if any(abs(ratio - world_size) > ratio_tolerance for ratio in ratios):
        found.append(f"without / W the gradient ratio is {ratios}, expected {world_size}")
    rounding = ulp_tolerance(versus["max |parameter|"])  # it sums in another order
    eager_difference = eager["max |difference| from the correct run"]
    if eager_difference > rounding:
        found.append(f"syncing every micro-batch moved the result by {eager_difference} > "
                     f"{rounding} (it should cost traffic only)")
    return found


def main() -> int:
    with process_group(timeout_s=60) as ctx:
        ws = ctx.world_size
        placements = {p: syncs_by_placement(ctx.rank, ws, p) for p in PLACEMENTS}
        variants = all_variants(ctx.rank, ws)
        versus = one_process_vs_ranks(ctx.rank, ws)
        ctx.print0(f"{ws} ranks, one bucket of {placements['no no_sync']['elements']} gradients")
        for name, result in placements.items():
            where = "without no_sync" if name == "no no_sync" else f"no_sync around {name}"
            ctx.print0(f"  {where:<36}: {result['all-reduce calls']} all-reduce, "
                       f"gradient spread across ranks {result['gradient spread across ranks']:.3g}")
        ctx.print0("k = 4 micro-batches per step, 12 micro-batches per rank:")
        for name, result in variants.items():
            ctx.print0(f"  {name:<48}: {result['all-reduce calls']:>2} all-reduces, "
                       f"{result['optimizer steps']} steps, final parameter spread "
                       f"{result['parameter spread after each micro-batch'][-1]:.3g}, off the "
                       f"correct run by {result['max |difference| from the correct run']:.3g}")
        for name, value in versus.items():
            ctx.print0(f"  {name}: {value}")
        clipped = {where: clipping(ctx.rank, ws, where) for where in CLIPPINGS}
        views = {set_to_none: bucket_views(ctx.rank, ws, set_to_none)
                 for set_to_none in (True, False)}
        gathered: list = [None] * ws
        dist.all_gather_object(gathered, clipped)
        for where in CLIPPINGS:
            r = clipped[where]
            ctx.print0(f"  clip_grad_norm_ {where:<42}: norm clipped on each rank "
                       f"{[round(g[where]['first norm clipped, this rank'], 4) for g in gathered]}"
                       f" (one process {r['first norm clipped, one process']:.4f}), off one "
                       f"process by {r['max |DDP - one process|']:.3g}")
        for set_to_none, r in views.items():
            marks = "".join("B" if b else "." for b in r["grads in the bucket after each micro-batch"])
            ctx.print0(f"  gradient_as_bucket_view, zero_grad(set_to_none={set_to_none}): .grad "
                       f"in the bucket after each micro-batch {marks}; same parameters as "
                       f"without: {r['same parameters as without bucket views']}")
        if not ctx.is_main:
            return 0
        found = problems(ws, placements, variants, versus)
        found += check_clipping({where: [g[where] for g in gathered] for where in CLIPPINGS})
        found += check_bucket_views(views)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
