"""The loss under DDP: DDP averages gradients, never the loss; the scalar rule is autograd's; a
summed loss gives gradients W times smaller; a global metric needs sums and counts.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/loss_and_logging.py

What the script measures and checks (rank 0 prints it, exits 1 if a claim fails):

* **Each rank's loss is its own** (:func:`own_loss_shared_gradient`). After one DDP
  forward/backward on each rank's own batch, the ranks' gradients are identical and their losses
  are not: DDP's reducer all-reduces parameter gradients (each parameter's autograd hook marks it
  ready; full buckets are averaged) and never touches the loss tensor. Logging ``loss.item()`` on
  rank 0 logs rank 0's batch only.
* **The scalar rule is autograd's, not DDP's** (:func:`non_scalar_backward`). ``backward()`` on a
  vector raises "grad can be implicitly created only for scalar outputs" with or without DDP (it
  is raised by ``_make_grads`` in torch/autograd/__init__.py, before any gradient exists). Give
  the vector its gradient, ``loss.backward(gradient=...)``, and DDP synchronises as usual: one
  all-reduce, equal gradients on every rank, the same gradients as ``loss.mean().backward()``.
  The source article says the loss must be a scalar "否则DDP不知道同步哪个值" (or DDP won't know
  which value to sync): DDP never syncs a value of the loss, only parameter gradients.
* **reduction="sum"** (:func:`summed_loss`). DDP divides the summed gradients by the world size W
  (``allreduce_hook``: ``tensor.div_(group_to_use.size())``), so a per-rank *sum* loss gives
  1/W of the gradient one process gets by summing the loss over the global batch: the factor is
  exactly W on 2 ranks (halving is exact), W up to rounding otherwise. A per-rank *mean* loss
  (equal shards) gives the global mean's gradient. To train on a global sum, multiply the loss by
  W (or scale the learning rate).
* **A global metric** (:func:`global_metrics`). With shards of unequal size (the last batch of an
  epoch, an unpadded split), the mean of per-rank means weighs a sample of a small shard more:
  it is wrong. All-reduce the sums and the counts, divide at the end: the accuracy is then exactly
  the single-process one (integer counts), the mean loss equal up to float64 rounding.
"""

import sys

import torch
import torch.distributed as dist

from accumulation import counted_ddp, gradient_vector, group_device, spread_across_ranks, wrap
from ddpcourse.dist_env import process_group
from ddpcourse.report import report_checks
from ddpcourse.toys import make_model, make_regression

MSE = torch.nn.functional.mse_loss
AUTOGRAD_SCALAR_RULE = "grad can be implicitly created only for scalar outputs"


def shard(rank: int, world_size: int, size: int = 4, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s ``size`` samples of a ``world_size * size``-sample regression set."""
    x, y = (t.to(group_device()) for t in make_regression(world_size * size, seed=seed).tensors)
    return x[rank * size:(rank + 1) * size], y[rank * size:(rank + 1) * size]


def own_loss_shared_gradient(rank: int, world_size: int) -> dict:
    """One DDP step on each rank's own batch: every rank's loss, and the spread of the gradients."""
    model = wrap(make_model(0))
    x, y = shard(rank, world_size)
    loss = MSE(model(x), y)
    loss.backward()
    losses = [torch.zeros(1, device=loss.device) for _ in range(world_size)]
    dist.all_gather(losses, loss.detach().reshape(1))
    return {"loss on each rank": [t.item() for t in losses],
            "gradient spread across ranks": spread_across_ranks(gradient_vector(model))}


def non_scalar_backward(rank: int, world_size: int) -> dict:
    """A per-sample loss vector (``reduction="none"``), backward three ways: on a plain model (no
    DDP), on DDP, and on DDP with an explicit ``gradient=`` of 1/n per sample; and, for reference,
    ``.mean().backward()`` on DDP. Returns the errors, all-reduce calls and gradient checks."""
    x, y = shard(rank, world_size)
    result: dict = {}
    for where in ("plain model", "DDP"):
        model = make_model(0).to(x.device) if where == "plain model" else counted_ddp()[0]
        try:
            MSE(model(x), y, reduction="none").backward()
            result[f"{where}: error"] = None
        except RuntimeError as error:
            result[f"{where}: error"] = str(error)
    explicit, log = counted_ddp()
    per_sample = MSE(explicit(x), y, reduction="none")
    per_sample.backward(gradient=torch.full_like(per_sample, 1 / per_sample.numel()))
    reference = counted_ddp()[0]  # the same hook: DDP's own one rounds differently on 3 ranks
    MSE(reference(x), y, reduction="none").mean().backward()
    result["DDP, gradient=1/n: all-reduce calls"] = log.calls
    result["DDP, gradient=1/n: gradient spread across ranks"] = \
        spread_across_ranks(gradient_vector(explicit))
    result["DDP, gradient=1/n: max |difference| from .mean().backward()"] = \
        (gradient_vector(explicit) - gradient_vector(reference)).abs().max().item()
    return result


def summed_loss(rank: int, world_size: int, size: int = 4) -> dict:
    """Gradients of DDP with a per-rank ``reduction="sum"`` loss against one process summing over
    the global batch (in one batch, and shard by shard, which adds in DDP's order); and of DDP
    with ``reduction="mean"`` against one process's global mean. Ratios are elementwise over the
    non-zero gradient entries, reported as (min, max)."""
    x, y = (t.to(group_device()) for t in make_regression(world_size * size, seed=1).tensors)
    mine = slice(rank * size, (rank + 1) * size)

    def ddp_gradient(reduction: str) -> torch.Tensor:
        model = wrap(make_model(0))
        MSE(model(x[mine]), y[mine], reduction=reduction).backward()
        return gradient_vector(model)

    def one_process_gradient(reduction: str, shard_by_shard: bool) -> torch.Tensor:
        model = make_model(0).to(x.device)
        if shard_by_shard:
            for r in range(world_size):
                rows = slice(r * size, (r + 1) * size)
                MSE(model(x[rows]), y[rows], reduction=reduction).backward()
        else:
            MSE(model(x), y, reduction=reduction).backward()
        return gradient_vector(model)

    def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> tuple[float, float]:
        r = (numerator / denominator)[denominator != 0]
        return r.min().item(), r.max().item()

    ddp_sum, ddp_mean = ddp_gradient("sum"), ddp_gradient("mean")
    global_sum = one_process_gradient("sum", shard_by_shard=False)
    return {"global sum / DDP sum, one batch": ratio(global_sum, ddp_sum),
            "global sum / DDP sum, shard by shard":
                ratio(one_process_gradient("sum", shard_by_shard=True), ddp_sum),
            "max |W x DDP sum - global sum| / max |global sum|":
                ((world_size * ddp_sum - global_sum).abs().max() / global_sum.abs().max()).item(),
            "max |DDP mean - global mean| / max |global mean|":
                ((ddp_mean - (g := one_process_gradient("mean", shard_by_shard=False))).abs().max()
                 / g.abs().max()).item()}


def uneven_sizes(world_size: int) -> list[int]:
    """Shard sizes that differ: 9 samples on every rank but the last, which gets 3."""
    return [9] * (world_size - 1) + [3]


def classification_set(n: int, classes: int = 3, seed: int = 2) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    labels = torch.randint(classes, (n,), generator=generator)
    return x.to(group_device()), labels.to(group_device())


def per_sample(x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy loss and correctness (0/1) of each sample under a fixed 3-class model."""
    with torch.no_grad():
        logits = make_model(0, out_features=3).to(x.device)(x)
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return losses.double(), (logits.argmax(1) == labels).double()


def global_metrics(rank: int, world_size: int, sizes: list[int] | None = None) -> dict:
    """Mean loss and accuracy over shards of ``sizes`` samples (default :func:`uneven_sizes`),
    four ways: rank 0's own shard, the mean of the ranks' means, all-reduced sums and counts, and
    one process reading the same batches one after the other (the reference, computed on every
    rank)."""
    sizes = sizes or uneven_sizes(world_size)
    x, labels = classification_set(sum(sizes))
    start = sum(sizes[:rank])
    losses, correct = per_sample(x[start:start + sizes[rank]], labels[start:start + sizes[rank]])
    own = torch.stack([losses.mean(), correct.mean()])
    means = own.clone()
    dist.all_reduce(means)
    means /= world_size
    count = torch.tensor(float(len(losses)), dtype=torch.float64, device=losses.device)
    totals = torch.stack([losses.sum(), correct.sum(), count])
    dist.all_reduce(totals)
    # The reference reads the same batches: float32 forwards of 12 rows and of 9 + 3 rows differ
    # in the last bits (measured ~1e-8 relative), which is the forward, not the aggregation.
    batches = [per_sample(x[a:a + n], labels[a:a + n])
               for a, n in zip(torch.tensor([0] + sizes).cumsum(0).tolist(), sizes)]
    reference = [torch.cat([b[i] for b in batches]).mean().item() for i in (0, 1)]
    own_rank0 = own.clone()
    dist.broadcast(own_rank0, src=0)
    return {"shard sizes": sizes,
            "rank 0's own (loss, accuracy)": own_rank0.tolist(),
            "mean of per-rank means": means.tolist(),
            "sums and counts": [(totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()],
            "single process": reference}


def problems(world_size: int, own: dict, scalar: dict, summed: dict, metrics: dict) -> list[str]:
    """What contradicts the module docstring, given the four measurements (rank 0's view)."""
    found = []
    if own["gradient spread across ranks"] != 0 or len(set(own["loss on each rank"])) == 1:
        found.append(f"expected equal gradients and different losses: {own}")
    for where in ("plain model", "DDP"):
        if AUTOGRAD_SCALAR_RULE not in (scalar[f"{where}: error"] or ""):
            found.append(f"{where}: backward on a vector gave {scalar[f'{where}: error']!r}")
    if scalar["DDP, gradient=1/n: all-reduce calls"] != 1 \
            or scalar["DDP, gradient=1/n: gradient spread across ranks"] != 0 \
            or scalar["DDP, gradient=1/n: max |difference| from .mean().backward()"] != 0:
        found.append(f"DDP with an explicit gradient did not sync like .mean(): {scalar}")
    exact = summed["global sum / DDP sum, shard by shard"]
    if world_size == 2 and exact != (2.0, 2.0):
        found.append(f"shard-by-shard global sum / DDP sum = {exact}, expected exactly 2")
    relative = 1e-5  # float32 rounding of sums in another order, measured ~1e-7 (see the lesson)
    if summed["max |W x DDP sum - global sum| / max |global sum|"] > relative \
            or summed["max |DDP mean - global mean| / max |global mean|"] > relative:
        found.append(f"summed/mean gradients off by more than rounding: {summed}")
    reference = metrics["single process"]
    loss, accuracy = metrics["sums and counts"]
    if accuracy != reference[1] or abs(loss - reference[0]) > 1e-12 * reference[0]:
        found.append(f"sums and counts {metrics['sums and counts']} != single process {reference}")
    if all(abs(a - b) < 1e-6 for a, b in zip(metrics["mean of per-rank means"], reference)):
        found.append("the mean of per-rank means matched the reference on uneven shards")
    return found


def main() -> int:
    with process_group(timeout_s=60) as ctx:
        ws = ctx.world_size
        own = own_loss_shared_gradient(ctx.rank, ws)
        scalar = non_scalar_backward(ctx.rank, ws)
        summed = summed_loss(ctx.rank, ws)
        metrics = global_metrics(ctx.rank, ws)
        ctx.print0(f"{ws} ranks")
        ctx.print0(f"  loss on each rank {own['loss on each rank']}, gradient spread across "
                   f"ranks {own['gradient spread across ranks']}")
        for result in (scalar, summed, metrics):
            for name, value in result.items():
                ctx.print0(f"  {name}: {value}")
        if not ctx.is_main:
            return 0
        found = problems(ws, own, scalar, summed, metrics)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
