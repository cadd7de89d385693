"""All-reduce written by hand from point-to-point calls: the reference that chapter 05 benchmarks.

    python chapters/05_allreduce/hand_collectives.py    # self-check only: vs dist.all_reduce

Launch test: custom (an importable module, not a torchrun script: the lesson notebook, the
benchmark ring_vs_gloo.py and tests/test_chapter_05_allreduce.py import it and call its functions
inside a process group; run directly, it only checks itself on 1 to 4 ranks with ``run_ranks``).

SPOILER WARNING: :func:`ring_allreduce` below is a complete answer to exercise 05's
``ring_allreduce`` (exercises/05_allreduce, ``pytest exercises/05_allreduce``). Solve the exercise
first, then read this module.

Every function is an in-place SUM over the default group, built only from ``dist.isend`` /
``dist.recv``:

* :func:`naive_allreduce`: everyone sends the whole tensor to rank 0, rank 0 adds and sends the
  sum back. Rank 0 moves ``2(N-1)`` tensors: its link is the bottleneck, and it grows with N.
* :func:`ring_allreduce`: reduce-scatter then all-gather around a ring, ``2(N-1)`` steps of one
  ``1/N`` chunk each, so every rank sends ``2(N-1)/N`` of the tensor whatever N is.
* :func:`halving_doubling_allreduce`: recursive halving (reduce-scatter) then recursive doubling
  (all-gather) between partners ``rank XOR 2^k``: ``2 log2(N)`` steps instead of ``2(N-1)``, the
  same ``2(N-1)/N`` bytes when N is a power of two (extra ranks are folded in first otherwise).

:func:`count_traffic` records the messages and bytes a rank sends during a call, by wrapping
``dist.isend`` and ``dist.send`` for that call only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

StepHook = Callable[[str, int, torch.Tensor], None]


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int) -> None:
    """Send ``send`` to ``to`` while receiving ``recv`` from ``source``.

    The send is posted first and asynchronously: if every rank did a blocking send before its
    receive, the ring could wait on itself.
    """
    request = dist.isend(send, to)
    dist.recv(recv, source)
    request.wait()


def naive_allreduce(tensor: torch.Tensor) -> None:
    """Gather everything on rank 0, add there, send the sum back to everyone."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size == 1:
        return
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for source in range(1, world_size):
            dist.recv(incoming, source)
            tensor += incoming
        requests = [dist.isend(tensor, peer) for peer in range(1, world_size)]
        for request in requests:
            request.wait()
    else:
        dist.isend(tensor, 0).wait()
        dist.recv(tensor, 0)


def ring_allreduce(tensor: torch.Tensor, on_step: StepHook | None = None) -> None:
    """In-place SUM all-reduce as a ring: N-1 reduce-scatter steps, then N-1 all-gather steps.

    The tensor (contiguous) is cut into N chunks. In reduce-scatter step s, rank r sends chunk
    ``r - s`` to its right neighbour and adds the chunk ``r - s - 1`` it receives from its left
    one; after N-1 steps chunk ``r + 1`` holds the full sum on rank r. All-gather then passes the
    finished chunks around the ring, copying instead of adding. ``on_step(phase, step, tensor)``
    is called after every step (the notebook uses it to draw the state of each rank).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size == 1:
        return
    chunks = tensor.view(-1).tensor_split(world_size)  # views: writes land in `tensor`
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    buffer = torch.empty(max(c.numel() for c in chunks), dtype=tensor.dtype, device=tensor.device)
    for step in range(world_size - 1):
        send, recv = chunks[(rank - step) % world_size], chunks[(rank - step - 1) % world_size]
        incoming = buffer[: recv.numel()]
        _exchange(send, right, incoming, left)
        recv += incoming
        if on_step:
            on_step("reduce-scatter", step, tensor)
    for step in range(world_size - 1):
        send, recv = chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size]
        _exchange(send, right, recv, left)  # the finished chunk is received in place
        if on_step:
            on_step("all-gather", step, tensor)


def _bounds(numel: int, pieces: int) -> list[int]:
    """Start offsets of ``tensor_split(pieces)`` of a length-``numel`` vector, plus the end."""
    base, extra = divmod(numel, pieces)
    bounds = [0]
    for i in range(pieces):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def halving_doubling_allreduce(tensor: torch.Tensor, on_step: StepHook | None = None) -> None:
    """In-place SUM all-reduce by recursive halving then recursive doubling (Rabenseifner).

    With P = the largest power of two <= N: ranks P..N-1 first hand their tensor to rank r - P
    and wait for the result at the end. Among the first P ranks, halving step k pairs rank r with
    ``r XOR P/2^(k+1)``: each keeps one half of the range it is responsible for, sends the other
    half and adds the partner's copy of the kept half. After log2(P) steps rank r holds chunk r of
    the sum; doubling runs the same pairs in reverse, swapping finished ranges until everyone
    holds the whole sum.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size == 1:
        return
    flat = tensor.view(-1)
    p2 = 1 << (world_size.bit_length() - 1)
    if rank >= p2:  # an extra rank: fold in, then receive the answer
        dist.isend(flat, rank - p2).wait()
        dist.recv(flat, rank - p2)
        return
    if rank + p2 < world_size:
        incoming = torch.empty_like(flat)
        dist.recv(incoming, rank + p2)
        flat += incoming
    bounds = _bounds(flat.numel(), p2)
    buffer = torch.empty(bounds[p2 // 2], dtype=flat.dtype,
                         device=flat.device)  # the largest half is the first one
    lo, hi = 0, p2  # the chunk indices this rank is responsible for
    mask = p2 // 2
    step = 0
    while mask:
        partner, mid = rank ^ mask, (lo + hi) // 2
        (keep_lo, keep_hi), (give_lo, give_hi) = (
            ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid)))
        keep = flat[bounds[keep_lo]:bounds[keep_hi]]
        incoming = buffer[: keep.numel()]
        _exchange(flat[bounds[give_lo]:bounds[give_hi]], partner, incoming, partner)
        keep += incoming
        lo, hi = keep_lo, keep_hi
        if on_step:
            on_step("halving", step, tensor)
        mask //= 2
        step += 1
    mask = 1
    step = 0
    while mask < p2:
        partner = rank ^ mask
        size = hi - lo
        other_lo = lo + size if rank & mask == 0 else lo - size
        other = flat[bounds[other_lo]:bounds[other_lo + size]]
        _exchange(flat[bounds[lo]:bounds[hi]], partner, other, partner)
        lo, hi = min(lo, other_lo), max(hi, other_lo + size)
        if on_step:
            on_step("doubling", step, tensor)
        mask *= 2
        step += 1
    if rank + p2 < world_size:
        dist.isend(flat, rank + p2).wait()


ALGORITHMS: dict[str, Callable[[torch.Tensor], None]] = {
    "naive": naive_allreduce,
    "ring": ring_allreduce,
    "halving_doubling": halving_doubling_allreduce,
}


@contextmanager
def count_traffic() -> Iterator[dict]:
    """Count the messages and bytes this rank sends with ``dist.isend``/``dist.send`` inside the
    block: ``with count_traffic() as sent: ring_allreduce(t)``, then ``sent["bytes"]``."""
    sent = {"messages": 0, "bytes": 0}
    originals = dist.isend, dist.send

    def counting(original):
        def call(tensor, *args, **kwargs):
            sent["messages"] += 1
            sent["bytes"] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        return call

    dist.isend, dist.send = counting(originals[0]), counting(originals[1])
    try:
        yield sent
    finally:
        dist.isend, dist.send = originals


def check_against_all_reduce(rank: int, world_size: int,
                             lengths=(0, 1, 2, 3, 5, 7, 13, 1001)) -> list[str]:
    """Every algorithm vs ``dist.all_reduce`` on the same inputs: lengths that do not divide by N
    (and fewer elements than ranks), int64 and float64, a 2-D tensor; in place. The mismatches."""
    wrong = []
    for name, algorithm in ALGORITHMS.items():
        inputs = []
        for numel in lengths:
            torch.manual_seed(numel + 31 * rank)
            values = 100 * torch.randn(numel)
            inputs += [values.to(torch.int64), values.to(torch.float64)]
        inputs.append(torch.arange(15.0).reshape(3, 5) * (rank + 1))
        for tensor in inputs:
            expected, address = tensor.clone(), tensor.data_ptr()
            dist.all_reduce(expected)
            algorithm(tensor)
            if tensor.data_ptr() != address or not torch.allclose(tensor, expected):
                wrong.append(f"{name}: {tuple(tensor.shape)} {tensor.dtype}: got "
                             f"{tensor.tolist()}, expected {expected.tolist()}")
    return wrong


if __name__ == "__main__":
    import sys

    from ddpcourse.launcher import run_ranks

    failures = 0
    for world_size in (1, 2, 3, 4):
        wrong = run_ranks(check_against_all_reduce, world_size, timeout=60)
        failures += sum(map(len, wrong))
        print(f"{world_size} ranks: " + ("all equal dist.all_reduce" if not any(wrong)
                                         else f"mismatches {wrong}"))
    sys.exit(1 if failures else 0)
