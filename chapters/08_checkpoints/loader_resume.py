"""Resuming a data loader mid-epoch: replay and skip, or a sampler that starts where it stopped.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/loader_resume.py

A run stopped after batch ``STOP`` of an epoch must, on resume, train on exactly the batches the
uninterrupted run would have trained on next. Two ways to get there, compared here with the
uninterrupted run (each rank on its own ``DistributedSampler`` shard, ``set_epoch`` as usual):

* **replay and skip** (what ``train.py`` of this chapter does): build the loader as the epoch
  began, iterate it, and throw away the first ``STOP`` batches. Nothing but ``(epoch, batch)``
  and the random states at the epoch's start is saved, and the skipped batches are *fetched and
  transformed again*: ``STOP * BATCH`` samples of wasted loading per rank (:func:`resume`
  counts the dataset's ``__getitem__`` calls). Random transforms drawn from a stream replay
  too, so the batches after the skip are bit-identical.
* **a stateful sampler** (:class:`ResumableSampler`, the idea of torchdata's
  ``StatefulDataLoader``, which saves its sampler's and workers' states in ``state_dict()``):
  the sampler yields its shard's indices from position ``STOP * BATCH`` on, so nothing is
  fetched twice. The indices are right, but a transform that draws from a random *stream*
  now starts at the wrong point of it: the batches differ unless the stream's state at the stop
  was saved and restored too (measured: both cases), and restored *after* ``iter(loader)``,
  which draws the workers' base seed from that stream (``_BaseDataLoaderIter.__init__`` in
  torch/utils/data/dataloader.py). A transform seeded per sample (from the epoch and the index)
  needs no saved state at all.

Everything runs in one process per rank without communication (``DistributedSampler`` takes
``num_replicas`` and ``rank`` directly); under torchrun rank 0 gathers every rank's result,
prints it and exits 1 if a claim fails.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddpcourse.dist_env import cpu_group, process_group
from ddpcourse.report import report_checks

SAMPLES, BATCH, EPOCH, STOP = 48, 4, 1, 3
NOISE = ("stream", "per sample")


class NoisySamples(Dataset):
    """Sample ``i`` is ``i`` plus random noise, drawn from the torch random stream
    (``noise="stream"``) or from a generator seeded by ``(epoch, i)`` (``"per sample"``).
    ``fetched`` counts the ``__getitem__`` calls."""

    def __init__(self, noise: str):
        self.noise, self.epoch, self.fetched = noise, 0, 0

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched += 1
        if self.noise == "stream":
            noise = torch.rand(2)
        else:
            noise = torch.rand(2, generator=torch.Generator().manual_seed(self.epoch * SAMPLES + i))
        return i + noise


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start its shard at position ``start`` (a count of
    samples, saved in a checkpoint as ``batches done * batch size``), for one epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return super().__len__() - self.start


def _loader(dataset: NoisySamples, sampler: DistributedSampler) -> DataLoader:
    dataset.epoch = EPOCH
    sampler.set_epoch(EPOCH)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=0)


def resume(rank: int, world_size: int, noise: str) -> dict:
    """For one rank: the batches of epoch ``EPOCH`` after batch ``STOP`` in an uninterrupted run,
    and as each way of resuming gives them; the samples each way fetched before its first
    trained batch."""
    def sampler_for():
        return ResumableSampler(NoisySamples(noise), num_replicas=world_size, rank=rank,
                                shuffle=True, seed=0)

    torch.manual_seed(1000 + rank)  # the epoch begins: the random state a checkpoint saves
    at_epoch_start = torch.get_rng_state()
    straight = NoisySamples(noise)
    batches = list(_loader(straight, sampler_for()))
    torch.set_rng_state(at_epoch_start)  # the interrupted run: the same epoch, up to the stop
    stopped = iter(_loader(NoisySamples(noise), sampler_for()))
    for _ in range(STOP):
        next(stopped)
    stop_state = torch.get_rng_state()  # what a checkpoint written at the stop would hold

    results: dict = {}
    torch.set_rng_state(at_epoch_start)  # replay and skip: the epoch's start state, fetch again
    replayed = NoisySamples(noise)
    iterator = iter(_loader(replayed, sampler_for()))
    for _ in range(STOP):
        next(iterator)
    skipped_fetches = replayed.fetched
    results["replay and skip"] = {"batches": list(iterator), "fetched before training":
                                  skipped_fetches}
    for saved in ("without the stream's state", "with the stream's state at the stop"):
        torch.set_rng_state(at_epoch_start)
        sampler = sampler_for()
        sampler.start = STOP * BATCH
        iterator = iter(_loader(NoisySamples(noise), sampler))  # draws a base seed from the stream
        if saved.startswith("with "):
            torch.set_rng_state(stop_state)  # so restore it after iter(), not before
        results[f"stateful sampler, {saved}"] = {"batches": list(iterator),
                                                 "fetched before training": 0}
    expected = batches[STOP:]
    return {way: {"fetched before training": r["fetched before training"],
                  "same indices": len(r["batches"]) == len(expected) and all(
                      torch.equal(a.floor(), b.floor()) for a, b in zip(r["batches"], expected)),
                  "same batches": len(r["batches"]) == len(expected) and all(
                      torch.equal(a, b) for a, b in zip(r["batches"], expected))}
            for way, r in results.items()}


def run_all(rank: int, world_size: int) -> dict:
    return {noise: resume(rank, world_size, noise) for noise in NOISE}


def check(per_rank: list[dict]) -> list[str]:
    """Replay and skip: every batch bit-identical, ``STOP * BATCH`` samples fetched for nothing.
    Stateful sampler: nothing fetched twice, the right indices; bit-identical batches with
    per-sample noise, or with stream noise once the stream's state at the stop is restored;
    different batches with stream noise and only the epoch's start state."""
    found = []
    for rank, results in enumerate(per_rank):
        for noise, ways in results.items():
            for way, r in ways.items():
                where = f"rank {rank}, {noise} noise, {way}"
                wasted = STOP * BATCH if way == "replay and skip" else 0
                if r["fetched before training"] != wasted:
                    found.append(f"{where}: fetched {r['fetched before training']}, not {wasted}")
                if not r["same indices"]:
                    found.append(f"{where}: other samples than the uninterrupted run")
                exact = not (noise == "stream" and way.endswith("without the stream's state"))
                if r["same batches"] != exact:
                    found.append(f"{where}: batches {'differ' if exact else 'equal'}, expected "
                                 f"{'equal' if exact else 'different'}")
    return found


def main() -> int:
    with process_group(timeout_s=60) as ctx:
        results = run_all(ctx.rank, ctx.world_size)
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, results, group=cpu_group())
        if not ctx.is_main:
            return 0
        print(f"{SAMPLES} samples, batches of {BATCH}, {ctx.world_size} ranks; stopped after "
              f"batch {STOP} of epoch {EPOCH}, resumed:")
        for noise in NOISE:
            for way, r in gathered[0][noise].items():
                print(f"  {noise:<10} noise, {way:<46} fetched before training "
                      f"{r['fetched before training']:>2}; same samples {r['same indices']}, "
                      f"same batches {r['same batches']}")
        return report_checks(check(gathered))


if __name__ == "__main__":
    sys.exit(main())
