"""The α–β cost model of a DDP training step: what a step should cost, before it is run.

Chapter 10 uses it as a practitioner would: measure two numbers of the network once, then ask
at which bandwidth, model size or batch DDP stops paying off, and whether communication hides
behind the backward pass.

The network (the latency–bandwidth model of Hockney, used by every collective-algorithm paper):

* one all-reduce of ``n`` bytes over ``N`` ranks costs ``α + 2(N−1)/N · n / β``, where ``α`` is a
  fixed cost per call (seconds: software, wake-ups, the network's latency) and ``β`` the *bus*
  bandwidth (bytes per second). ``2(N−1)/N · n`` is what every rank sends in a ring all-reduce
  (reduce-scatter, then all-gather), the least any algorithm built of point-to-point messages
  can send; it is also nccl-tests' ``busbw / algbw`` factor, so ``β`` is comparable with the
  busbw of ``chapters/10_performance/allreduce_bandwidth.py``. One rank all-reduces nothing.

The step (``step_time``):

* DDP puts the gradients into buckets (``bucket_sizes``: the rule of
  ``torch/csrc/distributed/c10d/reducer.cpp``'s ``compute_bucket_assignment_by_size``, tensors in
  reverse registration order, a bucket closed once it holds at least its cap) and launches a
  bucket's all-reduce as soon as its last gradient is ready;
* the model assumes the backward pass produces gradients at a steady rate in bytes (the last
  layer's first), so bucket ``i`` is ready after the share of the backward time its bytes and
  those of the buckets before it make up;
* all-reduces run one after the other (one communication stream, as gloo and NCCL run a
  process group's collectives), each starting when its bucket is ready *and* the previous one
  is done;
* the step is input (the part not hidden behind compute by loader workers) + forward +
  the later of backward's end and the last all-reduce's end + optimizer. Communication is
  hidden exactly when it fits under the backward pass: ``exposed_communication`` is what sticks
  out.

Where it is wrong, on purpose (the lesson measures each): compute is not a steady stream (a
big layer's gradient arrives at once); communication slows compute down when they share cores
(CPU/gloo: the all-reduce runs on the same two cores as backward) or memory bandwidth; α and β
depend on the message size (protocols switch: NCCL's LL/LL128/Simple; gloo's algorithms); the
first iteration uses other buckets (DDP rebuilds them after it); stragglers make every rank wait
for the slowest.

What the module leaves to its users: fitting α and β to a measured sweep (chapter 10's benchmark
fits its own record; the exercise ``fit_cost_model`` has students fit raw sweep rows), and a
backward whose gradients arrive unevenly (``step_time`` assumes the steady rate above; the
exercise's ``predict_step_time`` works from each gradient's measured ready time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

MiB = 2**20


@dataclass(frozen=True)
class Link:
    """A network as the α–β model sees it: ``alpha_s`` seconds per call, ``beta_bytes_per_s``
    bus bandwidth."""

    alpha_s: float
    beta_bytes_per_s: float

    def __post_init__(self):
        if not self.alpha_s >= 0:
            raise ValueError(f"alpha_s must be >= 0 seconds, got {self.alpha_s}")
        if not self.beta_bytes_per_s > 0:
            raise ValueError(f"beta_bytes_per_s must be > 0, got {self.beta_bytes_per_s}")


def bus_factor(world_size: int) -> float:
    """``2(N−1)/N``: the bytes each rank sends per byte all-reduced (ring), nccl-tests' busbw
    factor."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2 * (world_size - 1) / world_size


def allreduce_time(nbytes: float, world_size: int, link: Link) -> float:
    """Seconds for one all-reduce of ``nbytes`` over ``world_size`` ranks: ``α + 2(N−1)/N·n/β``;
    0 for one rank (nothing to exchange)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if world_size == 1:
        return 0.0
    return link.alpha_s + bus_factor(world_size) * nbytes / link.beta_bytes_per_s


def bucket_sizes(tensor_bytes: Sequence[int], cap_bytes: int,
                 first_cap_bytes: int | None = None) -> list[int]:
    """Bytes per bucket, in launch order, for gradients of ``tensor_bytes`` (in the order the
    model registers its parameters).

    DDP's rule (``compute_bucket_assignment_by_size`` in torch/csrc/distributed/c10d/reducer.cpp,
    called by ``DistributedDataParallel.__init__`` with the caps ``[first_cap, cap]``): go
    through the tensors in reverse order (the last layer's gradient is ready first), add each to
    the open bucket, close the bucket once it holds at least its cap. A tensor is never split.
    The first bucket's cap is ``first_cap_bytes`` (DDP's default: ``dist._DEFAULT_FIRST_BUCKET_BYTES``,
    1 MiB, when ``bucket_cap_mb`` is left out), the others' ``cap_bytes``. (DDP also keeps
    tensors of different dtypes or devices apart; the model assumes one dtype on one device.)
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    caps = [first_cap_bytes if first_cap_bytes is not None else cap_bytes, cap_bytes]
    buckets, current = [], 0
    for size in reversed(list(tensor_bytes)):
        current += size
        if current >= caps[min(len(buckets), 1)]:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class StepTimes:
    """A predicted step, in seconds: its parts and the timeline of its all-reduces."""

    input_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    communication_s: float  # the all-reduces' total, hidden or not
    exposed_communication_s: float  # what does not fit under the backward pass
    bucket_starts_s: tuple[float, ...]  # from the start of backward
    bucket_ends_s: tuple[float, ...]

    @property
    def step_s(self) -> float:
        return (self.input_s + self.forward_s + self.backward_s + self.exposed_communication_s
                + self.optimizer_s)

    @property
    def hidden_fraction(self) -> float:
        """Share of the communication that overlaps the backward pass (1 when there is none)."""
        if self.communication_s == 0:
            return 1.0
        return 1.0 - self.exposed_communication_s / self.communication_s


def step_time(*, forward_s: float, backward_s: float, buckets: Sequence[int], world_size: int,
              link: Link, optimizer_s: float = 0.0, input_s: float = 0.0,
              input_workers: int = 0, overlap: bool = True) -> StepTimes:
    """Predict one DDP step (from step 1 on, once DDP has rebuilt its buckets).

    ``buckets``: bytes per bucket in launch order (:func:`bucket_sizes`). ``input_s``: seconds to
    produce one batch in one process; with ``input_workers`` > 0 loader processes working ahead
    (each makes every ``input_workers``-th batch), only what exceeds the step's compute is
    exposed: ``max(0, input_s / workers − compute)``. ``overlap=False`` launches every all-reduce
    after backward (as ``no_sync`` followed by a manual all-reduce, or a model too small to
    overlap, would).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if min(forward_s, backward_s, optimizer_s, input_s) < 0:
        raise ValueError("times must be >= 0")
    total = float(sum(buckets))
    starts, ends = [], []
    ready, comm_free = 0.0, 0.0
    for nbytes in buckets:
        ready += backward_s * nbytes / total if (overlap and total) else 0.0
        start = max(ready if overlap else backward_s, comm_free)
        comm_free = start + allreduce_time(nbytes, world_size, link)
        starts.append(start)
        ends.append(comm_free)
    communication = sum(e - s for s, e in zip(starts, ends))
    exposed = max(0.0, (ends[-1] if ends else 0.0) - backward_s)
    compute = forward_s + backward_s + exposed + optimizer_s
    exposed_input = input_s if input_workers <= 0 else max(0.0, input_s / input_workers - compute)
    return StepTimes(exposed_input, forward_s, backward_s, optimizer_s, communication, exposed,
                     tuple(starts), tuple(ends))


def scaling_efficiency(step_1_rank_s: float, step_n_ranks_s: float) -> float:
    """Weak scaling (the same batch per rank): N ranks do N times the work of one in
    ``step_n_ranks_s``, so the efficiency is ``step_1_rank_s / step_n_ranks_s`` (1 = perfect)."""
    return step_1_rank_s / step_n_ranks_s


def bandwidth_for_efficiency(target: float, *, forward_s: float, backward_s: float,
                             buckets: Sequence[int], world_size: int, alpha_s: float,
                             optimizer_s: float = 0.0, low: float = 1e3,
                             high: float = 1e13) -> float:
    """The least bus bandwidth (bytes/s) at which the predicted weak-scaling efficiency reaches
    ``target`` (found by bisection on a log scale); ``inf`` if even ``high`` does not (α alone
    is too slow), ``low`` if every bandwidth above it does."""
    def efficiency(beta):
        one = step_time(forward_s=forward_s, backward_s=backward_s, buckets=buckets,
                        world_size=1, link=Link(alpha_s, beta), optimizer_s=optimizer_s).step_s
        n = step_time(forward_s=forward_s, backward_s=backward_s, buckets=buckets,
                      world_size=world_size, link=Link(alpha_s, beta), optimizer_s=optimizer_s)
        return scaling_efficiency(one, n.step_s)

    if efficiency(high) < target:
        return float("inf")
    if efficiency(low) >= target:
        return low
    for _ in range(100):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if efficiency(mid) < target else (low, mid)
    return high
