"""The input pipeline of a DDP job: ``num_workers``, ``prefetch_factor``, ``persistent_workers``,
``pin_memory`` — counted, then timed on a loader-bound toy.

    torchrun --standalone --nproc_per_node 2 chapters/10_performance/input_pipeline.py

Launch test: custom (tests/test_chapter_10_input_pipeline.py launches it once and reads its
output, instead of a second launch by tests/test_chapter_scripts.py).

A toy data set whose ``__getitem__`` sleeps ``DECODE_S`` (a stand-in for decoding an image), read
through a ``DistributedSampler``. Counted (the same on every machine; exit 1 if contradicted):

* **workers are per process**: every rank's ``DataLoader`` starts its own ``num_workers``
  processes, so the job runs ranks × ``num_workers`` of them (distinct worker pids, gathered);
* **prefetch**: on ``iter(loader)`` each worker is handed ``prefetch_factor`` batches at once
  (``_MultiProcessingDataLoaderIter._reset`` in torch/utils/data/dataloader.py), so
  ``num_workers × prefetch_factor`` batches are requested before the first is consumed
  (counted by the batch sampler);
* **persistent_workers=True** keeps the same worker processes from one epoch to the next
  (same pids); without it each epoch starts new ones;
* **pin_memory=True** pins a batch only where an accelerator is present (``batch.is_pinned()``):
  on a CPU-only machine it does nothing.

Timed (live, repeated, min/median, with ``ddpcourse.timing.judge``'s verdict): one epoch with
``num_workers`` 0 and 2. The source article's figures (pin_memory +18 %, persistent_workers
+12 %) are its own, measured on its GPU cluster; pinning matters for host-to-GPU copies, which a
CPU run does not make.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from ddpcourse.dist_env import process_group
from ddpcourse.report import report_checks
from ddpcourse.timing import Timing, judge, machine_load

DECODE_S = 0.002
SAMPLES, BATCH = 64, 4


class SlowData(Dataset):
    """``SAMPLES`` vectors; each read sleeps ``DECODE_S`` and returns the reading process's pid."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        time.sleep(DECODE_S)
        return torch.full((16,), float(i)), os.getpid()


class CountingBatchSampler(BatchSampler):
    """A batch sampler that counts the batches handed out (to the workers, or to the loop)."""

    def __init__(self, sampler, batch_size: int):
        super().__init__(sampler, batch_size, drop_last=False)
        self.handed_out = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.handed_out += 1
            yield batch


def loader(rank: int, world_size: int, **kwargs) -> tuple[DataLoader, CountingBatchSampler]:
    sampler = DistributedSampler(SlowData(), num_replicas=world_size, rank=rank, shuffle=False)
    batches = CountingBatchSampler(sampler, BATCH)
    return DataLoader(SlowData(), batch_sampler=batches, **kwargs), batches


def counts(rank: int, world_size: int, workers: int = 2, prefetch: int = 3) -> dict:
    """The counted facts of the docstring, on this rank."""
    out = {}
    dl, batches = loader(rank, world_size, num_workers=workers, prefetch_factor=prefetch)
    it = iter(dl)
    out["requested_before_first"] = batches.handed_out
    pids = {pid for _, pid_batch in it for pid in pid_batch.tolist()}
    out["worker_pids"] = sorted(pids)
    del it
    for persistent in (False, True):
        dl, _ = loader(rank, world_size, num_workers=workers, persistent_workers=persistent)
        epochs = [sorted({p for _, pb in dl for p in pb.tolist()}) for _ in range(2)]
        out[f"persistent={persistent}"] = epochs
        del dl
    dl, _ = loader(rank, world_size, num_workers=0, pin_memory=True)
    out["pinned"] = bool(next(iter(dl))[0].is_pinned())
    out["accelerator"] = torch.accelerator.is_available()
    return out


def epoch_times(rank: int, world_size: int, workers: int, repeats: int = 3) -> list[float]:
    """Seconds of one epoch (a new loader each time: worker start-up included), ``repeats`` times."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dl, _ = loader(rank, world_size, num_workers=workers)
        for _ in dl:
            pass
        times.append(time.perf_counter() - start)
    return times


def claims(ranks: list[dict], workers: int = 2, prefetch: int = 3) -> list[str]:
    """The docstring's counted statements these counts contradict (none with torch 2.13)."""
    wrong = []
    all_pids = [set(r["worker_pids"]) for r in ranks]
    if not (all(len(p) == workers for p in all_pids)
            and len(set().union(*all_pids)) == workers * len(ranks)):
        wrong.append("every rank starts its own num_workers processes: ranks x num_workers")
    if any(r["requested_before_first"] != workers * prefetch for r in ranks):
        wrong.append("num_workers x prefetch_factor batches are requested before the first")
    for r in ranks:
        a, b = r["persistent=True"]
        c, d = r["persistent=False"]
        if not (a == b and set(c).isdisjoint(d)):
            wrong.append("persistent_workers keeps the workers; without it each epoch starts new")
            break
    if any(r["pinned"] != r["accelerator"] for r in ranks):
        wrong.append("pin_memory pins only where an accelerator is present")
    return wrong


def main() -> int:
    with process_group(timeout_s=120, backend="gloo") as ctx:
        found = counts(ctx.rank, ctx.world_size)
        ranks = [None] * ctx.world_size
        dist.all_gather_object(ranks, found)
        timed = {w: epoch_times(ctx.rank, ctx.world_size, w) for w in (0, 2)}
        wrong = claims(ranks)
        p = ctx.print0
        p(f"{ctx.world_size} ranks x 2 workers: worker pids {[r['worker_pids'] for r in ranks]}")
        p(f"batches requested before the first is consumed (num_workers=2, prefetch_factor=3): "
          f"{[r['requested_before_first'] for r in ranks]}")
        p(f"worker pids, epoch 1 / epoch 2: persistent_workers=False "
          f"{found['persistent=False']}, True {found['persistent=True']}")
        p(f"pin_memory=True: batch pinned {found['pinned']} (accelerator present: "
          f"{found['accelerator']})")
        table = {f"num_workers={w}": Timing.of(t) for w, t in timed.items()}
        for name, t in table.items():
            p(f"one epoch ({SAMPLES // ctx.world_size} samples per rank, {DECODE_S * 1e3:g} ms "
              f"each), {name}: min {1e3 * t.min:.1f} ms, median {1e3 * t.median:.1f} ms")
        if ctx.rank == 0:
            print(f"timings: {judge(table, machine_load(0.5), statistic='median')}")
        p("the source article's figures, on its own GPU hardware: pin_memory +18 %, "
          "persistent_workers +12 % (not measured here)")
        code = report_checks(wrong, echo=p, label="claims of the docstring")
        dist.barrier()
    return code


if __name__ == "__main__":
    sys.exit(main())
