"""Distributed evaluation with ``DistributedSampler``: the padded average is biased; de-duplicate.

    torchrun --standalone --nproc_per_node 2 chapters/06_data_loading/eval_without_duplicates.py

A fixed model (``make_model(0)``) is evaluated on a generated regression set whose length does
not divide by the world size, three ways:

* ``single process``: the mean squared error over the whole set, on one rank (the reference);
* ``naive``: each rank averages its ``DistributedSampler`` shard, the ranks average those means
  (``all_reduce``). The sampler repeated a few samples to make the shards equal, so they count
  twice;
* ``de-duplicated``: each rank ``all_gather``\\ s its (index, per-sample error) pairs, keeps each
  index once, and averages;
* ``sum and count``: each rank takes the unpadded strided slice ``range(rank, n, world_size)``,
  and the ranks ``all_reduce`` their error sums and sample counts.

Rank 0 prints the four numbers and exits with code 1 unless the last two equal the reference and
the naive one does not.

The lesson also imports :func:`rank0_evaluates`: evaluation on rank 0 alone while the other ranks
wait at a barrier. Through the DDP wrapper it blocks (the forward's buffer broadcast, or the
one-time bucket rebuild, waits for ranks that are not there); through ``model.module`` it is exact.
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ddpcourse.dist_env import process_group, short_timeout_group
from ddpcourse.report import report_checks
from ddpcourse.toys import make_model, make_regression


def per_sample_errors(n: int, indices: list[int]) -> torch.Tensor:
    """Squared error of the fixed model on the samples ``indices`` of an ``n``-sample set."""
    x, y = make_regression(n, seed=1).tensors
    with torch.no_grad():
        return (make_model(0)(x[indices]) - y[indices]).pow(2).squeeze(1)


def single_process(n: int) -> float:
    return per_sample_errors(n, list(range(n))).mean().item()


def naive(n: int) -> float:
    """Mean of the ranks' means over their padded shards: repeated samples count twice."""
    shard = list(DistributedSampler(range(n), shuffle=True))
    mean = per_sample_errors(n, shard).mean().reshape(1)
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def deduplicated(n: int) -> float:
    """Gather (index, error) from every rank; keep each index once."""
    shard = list(DistributedSampler(range(n), shuffle=True))
    errors = per_sample_errors(n, shard)
    indices = torch.tensor(shard)
    world = dist.get_world_size()
    all_indices = [torch.empty_like(indices) for _ in range(world)]  # equal lengths: the sampler
    all_errors = [torch.empty_like(errors) for _ in range(world)]
    dist.all_gather(all_indices, indices)
    dist.all_gather(all_errors, errors)
    by_index = dict(zip(torch.cat(all_indices).tolist(), torch.cat(all_errors).tolist()))
    assert sorted(by_index) == list(range(n))
    return sum(by_index.values()) / n


def sum_and_count(n: int) -> float:
    """Unpadded shards of unequal length; reduce the sum and the count, divide at the end."""
    shard = list(range(dist.get_rank(), n, dist.get_world_size()))
    errors = per_sample_errors(n, shard)
    totals = torch.tensor([errors.sum().item(), float(len(shard))], dtype=torch.float64)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def small_net(with_buffers: bool) -> nn.Module:
    """A fixed small regression net; ``with_buffers`` adds a BatchNorm (running mean and variance
    are buffers, as in most vision models)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(16)] if with_buffers else []
    return nn.Sequential(nn.Linear(8, 16), *norm, nn.Tanh(), nn.Linear(16, 1))


def rank0_evaluates(rank: int, world_size: int, call: str, with_buffers: bool = True,
                    grad: bool = False, train_steps: int = 2, timeout_s: float = 3.0) -> dict:
    """Train ``train_steps`` DDP steps, then rank 0 evaluates the whole set while the others wait.

    ``call`` is ``"ddp"`` (rank 0 calls the DDP model) or ``"module"`` (rank 0 calls
    ``model.module``, the wrapped model); ``"ddp, every rank"`` is the reference: every rank calls
    the DDP model, so its collectives meet. DDP runs on a group whose ``timeout_s`` clock starts
    after a barrier; the waiting ranks sit in a barrier of the patient default group, which rank 0
    joins when it is done, also after an error. Returns this rank's MSE (if it evaluated), or the
    error and the functions of torch/nn/parallel/distributed.py it was raised in.
    """
    x, y = make_regression(64, seed=1).tensors
    model = DDP(small_net(with_buffers), process_group=short_timeout_group(timeout_s))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(train_steps):
        batch = slice(8 * (world_size * step + rank), 8 * (world_size * step + rank + 1))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        optimizer.step()
    result: dict = {"mse": None, "error": None, "raised in": None}
    if rank == 0 or call == "ddp, every rank":
        evaluated = model.module if call == "module" else model
        evaluated.eval()
        try:
            with torch.set_grad_enabled(grad):
                result["mse"] = torch.nn.functional.mse_loss(evaluated(x), y).item()
        except RuntimeError as error:
            result["error"] = str(error).splitlines()[0]
            result["raised in"] = [frame.name for frame in traceback.extract_tb(error.__traceback__)
                                   if frame.filename.endswith("nn/parallel/distributed.py")]
    dist.barrier()  # the others wait here while rank 0 evaluates (default group: patient)
    return result


def evaluate_all(rank: int, world_size: int, n: int) -> dict[str, float]:
    """All four evaluations (call inside a process group, e.g. via ``run_ranks``)."""
    return {"single process": single_process(n), "naive": naive(n),
            "de-duplicated": deduplicated(n), "sum and count": sum_and_count(n)}


def main() -> int:
    with process_group(timeout_s=30) as ctx:
        n = 3 * ctx.world_size + 1
        results = evaluate_all(ctx.rank, ctx.world_size, n)
        if not ctx.is_main:
            return 0
        padded = -n % ctx.world_size
        print(f"{n} samples on {ctx.world_size} ranks: the sampler repeats {padded} of them")
        for name, value in results.items():
            print(f"  {name:<15} MSE = {value:.6f}")
        reference = results["single process"]
        problems = [f"{way} MSE {results[way]:.9f} is not the single process's {reference:.9f}"
                    for way in ("de-duplicated", "sum and count")
                    if abs(results[way] - reference) >= 1e-6]
        if padded and abs(results["naive"] - reference) <= 1e-6:
            problems.append(f"the naive mean ignored the {padded} repeated samples")
        return report_checks(problems)


if __name__ == "__main__":
    sys.exit(main())
