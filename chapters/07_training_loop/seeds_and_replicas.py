"""Seeds under DDP: what must be equal on every rank, what must differ, and what drifts apart.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/seeds_and_replicas.py

DDP keeps exactly one thing equal for you: the parameters and buffers of the module it wraps
(broadcast from rank 0 in the constructor, ``_sync_module_states`` in torch/distributed/utils.py;
gradients averaged at every backward). Everything else is the rank's own business:

* **must be equal**: anything random made before or outside the wrapper that should be the same
  on every rank (a teacher copied from the model before ``DDP(...)``, a fixed random projection
  kept as a plain tensor), the model's own initialisation only if ``DDP(..., init_sync=False)``,
  and the ``seed`` of ``DistributedSampler`` (each rank shuffles with it and takes its stride
  of the result; different seeds make the shards overlap and leave samples out);
  :func:`made_before_ddp`, :func:`sampler_shards`.
* **should differ**: random draws that are per sample, such as dropout masks and data
  augmentation. With one seed on every rank the ranks draw identical masks on their different
  samples; ``seed + rank`` gives each rank its own stream, still reproducible;
  :func:`random_draws`.
* **drifts apart silently**: a learnable module outside the wrapper (a projection head trained
  with the rank's own gradients), and an EMA teacher that copies the student's *buffers* (they
  differ between forwards, see ``buffers.py``). An EMA of the student's *parameters* stays
  bitwise equal; :func:`drift_curves`.

Every function runs in every rank of a process group (e.g. via ``run_ranks``) and returns plain
data; ``check_*`` return what contradicts the lesson. Rank 0 prints the results and exits with
code 1 if any check fails. Everything runs on the CPU, on GPU machines too (in a gloo group
beside the NCCL one, :func:`cpu_group`).
"""

from __future__ import annotations

import copy
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ddpcourse.dist_env import cpu_group, process_group
from ddpcourse.report import report_checks

SEEDINGS = ("same seed", "seed + rank")
BASE_SEED = 0
WIDTH = 12  # dropout mask length in random_draws


def seed_rank(rank: int, seeding: str) -> None:
    if seeding not in SEEDINGS:
        raise ValueError(f"seeding must be one of {SEEDINGS}, not {seeding!r}")
    torch.manual_seed(BASE_SEED + (rank if seeding == "seed + rank" else 0))


def spread(tensors) -> float:
    """All ranks: the largest ``|x_r - x_0|`` over ranks ``r`` and all elements of ``tensors``."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat, group=cpu_group())
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def made_before_ddp(rank: int, world_size: int, seeding: str, init_sync: bool = True) -> dict:
    """Seed, build a model, copy it as a teacher and draw a random projection (a plain tensor),
    then wrap the model. Returns the spread over ranks of each."""
    seed_rank(rank, seeding)
    model = small_model()
    teacher = copy.deepcopy(model)
    projection = torch.randn(4, 4)
    DDP(model, init_sync=init_sync, process_group=cpu_group())
    return {"wrapped model": spread(model.state_dict().values()),
            "teacher copied before DDP()": spread(teacher.state_dict().values()),
            "random tensor outside modules": spread([projection])}


def check_made_before_ddp(seeding: str, init_sync: bool, result: dict) -> list[str]:
    where = f"{seeding}, init_sync={init_sync}"
    problems = []
    for name, value in result.items():
        should_differ = seeding == "seed + rank" and (name != "wrapped model" or not init_sync)
        if (value > 0) != should_differ:
            problems.append(f"{where}: {name} spread {value}, expected "
                            f"{'> 0' if should_differ else '0'}")
    return problems


def sampler_shards(n: int, seeds: list[int]) -> dict:
    """Every rank's ``DistributedSampler(shuffle=True)`` shard when rank r passes ``seeds[r]``
    (explicit ``num_replicas``/``rank``: no process group needed); how many samples two ranks
    share and how many no rank gets."""
    world_size = len(seeds)
    shards = [list(DistributedSampler(range(n), num_replicas=world_size, rank=r, seed=seed))
              for r, seed in enumerate(seeds)]
    counts = Counter(i for shard in shards for i in shard)
    return {"shards": shards, "on two ranks or more": sum(1 for c in counts.values() if c > 1),
            "on no rank": n - len(counts)}


def check_sampler_shards(n: int, world_size: int) -> list[str]:
    """Same seed: only the sampler's padding (``-n % world_size`` repeats) is shared, nothing is
    missing; seed + rank: more is shared and some samples are on no rank."""
    problems = []
    padding = -n % world_size
    same = sampler_shards(n, [BASE_SEED] * world_size)
    if same["on two ranks or more"] > padding or same["on no rank"]:
        problems.append(f"same seed: {same['on two ranks or more']} shared, "
                        f"{same['on no rank']} missing")
    different = sampler_shards(n, [BASE_SEED + r for r in range(world_size)])
    if world_size > 1 and not (different["on two ranks or more"] > padding
                               and different["on no rank"]):
        problems.append("seed + rank: the shards neither overlap nor miss samples")
    return problems


def random_draws(rank: int, world_size: int, seeding: str, steps: int = 4) -> dict:
    """Seed, then train ``steps`` steps of a DDP model that ends in ``Dropout(0.5)``, drawing a
    random crop offset and a flip per step as augmentation would. Returns the dropout masks
    (1 = kept) and the augmentation draws of every step."""
    seed_rank(rank, seeding)
    linear = nn.Linear(WIDTH, WIDTH)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(WIDTH))
        linear.bias.zero_()
    model = DDP(nn.Sequential(linear, nn.Dropout(0.5)), process_group=cpu_group())
    masks, augmentation = [], []
    for _ in range(steps):
        crop, flip = torch.randint(0, 8, ()).item(), bool(torch.rand(()) < 0.5)
        augmentation.append((crop, flip))
        out = model(torch.ones(1, WIDTH))  # the identity before dropout: out == 0 where dropped
        masks.append((out != 0).int().reshape(-1).tolist())
        out.sum().backward()
    return {"dropout masks": masks, "augmentation": augmentation}


def check_random_draws(seeding: str, per_rank: list[dict], rerun: list[dict]) -> list[str]:
    """Same seed: every rank draws the same; seed + rank: at least one step differs between
    any two ranks; either way a rerun draws the same again."""
    problems = []
    if rerun != per_rank:
        problems.append(f"{seeding}: a rerun with the same seeds drew differently")
    for rank, r in enumerate(per_rank[1:], start=1):
        for kind in ("dropout masks", "augmentation"):
            same = r[kind] == per_rank[0][kind]
            if same != (seeding == "same seed"):
                problems.append(f"{seeding}: rank {rank}'s {kind} "
                                f"{'equal' if same else 'differ from'} rank 0's")
    return problems


def rank_batch(rank: int, step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step``: inputs and class labels, different on every rank."""
    generator = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(size, 4, generator=generator) + rank
    return x, torch.randint(0, 2, (size,), generator=generator)


def _ema(teacher: nn.Module, student: nn.Module, decay: float, with_buffers: bool) -> None:
    """``teacher = decay * teacher + (1 - decay) * student`` for the parameters, and with
    ``with_buffers`` for the floating-point buffers too (what an EMA over ``state_dict()`` does;
    integer buffers such as ``num_batches_tracked`` are copied)."""
    with torch.no_grad():
        pairs = list(zip(teacher.parameters(), student.parameters()))
        if with_buffers:
            pairs += list(zip(teacher.buffers(), student.buffers()))
        for t, s in pairs:
            if t.is_floating_point():
                t.mul_(decay).add_(s, alpha=1 - decay)
            else:
                t.copy_(s)


def drift_curves(rank: int, world_size: int, steps: int = 30, decay: float = 0.9) -> dict:
    """Two trainings on per-rank batches, same seed everywhere. Returns, after every step, the
    spread over ranks (:func:`spread`) of:

    * run 1, backbone in DDP, head outside it: the head, and the backbone;
    * run 2, backbone and head in one DDP model: the head; EMA teachers updated from the student
      after every step: parameters only, parameters and buffers, and parameters and buffers with
      the buffers averaged over ranks after each update.
    """
    torch.manual_seed(BASE_SEED)
    backbone, head = small_model()[:3], nn.Linear(8, 2)
    model = DDP(backbone, process_group=cpu_group())
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    curves: dict[str, list[float]] = {"head outside DDP": [], "backbone, head outside DDP": []}
    for step in range(steps):
        x, y = rank_batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(head(model(x)), y).backward()
        optimizer.step()
        curves["head outside DDP"].append(spread(head.parameters()))
        curves["backbone, head outside DDP"].append(spread(backbone.parameters()))

    torch.manual_seed(BASE_SEED)
    model = DDP(small_model(), process_group=cpu_group())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    teachers = {name: copy.deepcopy(model.module) for name in (
        "EMA of parameters", "EMA of parameters and buffers",
        "EMA of parameters and buffers, buffers averaged")}
    curves.update({"head inside DDP": [], **{name: [] for name in teachers}})
    for step in range(steps):
        x, y = rank_batch(rank, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        curves["head inside DDP"].append(spread(model.module[3].parameters()))
        for name, teacher in teachers.items():
            _ema(teacher, model.module, decay, with_buffers="buffers" in name)
            if name.endswith("averaged"):
                for buffer in teacher.buffers():
                    if buffer.is_floating_point():
                        dist.all_reduce(buffer, group=cpu_group())
                        buffer.div_(world_size)
            curves[name].append(spread(teacher.state_dict().values()))
    return curves


STAYS_EQUAL = ("backbone, head outside DDP", "head inside DDP", "EMA of parameters",
               "EMA of parameters and buffers, buffers averaged")
DRIFTS = ("head outside DDP", "EMA of parameters and buffers")


def check_drift_curves(curves: dict, world_size: int) -> list[str]:
    problems = [f"{name}: spread {max(curves[name])}, expected exactly 0"
                for name in STAYS_EQUAL if max(curves[name]) != 0.0]
    if world_size > 1:
        problems += [f"{name}: never drifted" for name in DRIFTS if max(curves[name]) == 0.0]
        head = curves["head outside DDP"]
        if not max(head) > 2 * head[0]:
            problems.append(f"head outside DDP: the spread does not grow: {head}")
    return problems


def run_all(rank: int, world_size: int) -> dict:
    """Every demo of this module, in one rank (the script's main runs this)."""
    results: dict = {"initial seed": torch.initial_seed()}  # before anything seeds
    for seeding, init_sync in (("same seed", True), ("seed + rank", True), ("seed + rank", False)):
        results[f"made before DDP, {seeding}, init_sync={init_sync}"] = made_before_ddp(
            rank, world_size, seeding, init_sync)
    for seeding in SEEDINGS:
        results[f"draws, {seeding}"] = random_draws(rank, world_size, seeding)
        results[f"draws again, {seeding}"] = random_draws(rank, world_size, seeding)
    results["drift"] = drift_curves(rank, world_size)
    return results


def check(gathered: list[dict], sampler_n: int = 100) -> list[str]:
    """Every check, on the per-rank results of :func:`run_all`."""
    world_size = len(gathered)
    first = gathered[0]
    problems = []
    seeds = [r["initial seed"] for r in gathered]
    if len(set(seeds)) != world_size:
        problems.append(f"unseeded ranks started with equal seeds {seeds}")
    for seeding, init_sync in (("same seed", True), ("seed + rank", True), ("seed + rank", False)):
        problems += check_made_before_ddp(
            seeding, init_sync, first[f"made before DDP, {seeding}, init_sync={init_sync}"])
    problems += check_sampler_shards(sampler_n, world_size)
    for seeding in SEEDINGS:
        problems += check_random_draws(seeding, [r[f"draws, {seeding}"] for r in gathered],
                                       [r[f"draws again, {seeding}"] for r in gathered])
    problems += check_drift_curves(first["drift"], world_size)
    return problems


def _print_results(gathered: list[dict], sampler_n: int = 100) -> None:
    first, world_size = gathered[0], len(gathered)
    print("torch.initial_seed() of the unseeded ranks:", [r["initial seed"] for r in gathered])
    print("spread over ranks after DDP() (0 = equal everywhere):")
    for key, value in first.items():
        if key.startswith("made before DDP, "):
            print(f"  {key[len('made before DDP, '):]:<27}", value)
    for seeds in ([BASE_SEED] * world_size, [BASE_SEED + r for r in range(world_size)]):
        s = sampler_shards(sampler_n, seeds)
        print(f"DistributedSampler seeds {seeds}: of {sampler_n} samples, "
              f"{s['on two ranks or more']} on two ranks, {s['on no rank']} on none")
    for seeding in SEEDINGS:
        masks = [r[f"draws, {seeding}"]["dropout masks"][0] for r in gathered]
        print(f"{seeding:<12} first dropout mask per rank: {masks}")
    print("largest spread over ranks in 30 steps:")
    for name, curve in first["drift"].items():
        print(f"  {name:<48} {max(curve):.3g}")


def main() -> int:
    with process_group(timeout_s=60) as ctx:
        results = run_all(ctx.rank, ctx.world_size)
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, results)
        if not ctx.is_main:
            return 0
        _print_results(gathered)
        problems = check(gathered)
        return report_checks(problems)


if __name__ == "__main__":
    sys.exit(main())
