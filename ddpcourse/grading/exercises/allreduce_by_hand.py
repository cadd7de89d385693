"""Chapter 05, AllReduce by hand: the visible checks, and the rank-side cases they are built from.

The contract is the docstrings of ``average_gradients`` and ``ring_allreduce`` in
solutions/05_allreduce/allreduce_by_hand.nb.py (students:
exercises/05_allreduce/allreduce_by_hand.ipynb).

The reference is always PyTorch's own ``dist.all_reduce``, run in the same rank on a copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading.checks import CheckFailed, expect_close, ring_traffic_bounds, run_student
from ddpcourse.grading.comm_audit import CommAudit

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


# --- average_gradients ------------------------------------------------------------------------


class GradModel(nn.Module):
    """A small model; with ``awkward`` it adds a frozen layer and a layer that is never used
    (so both keep ``.grad is None``); with ``tied`` two layers share one weight."""

    def __init__(self, awkward: bool, tied: bool):
        super().__init__()
        self.awkward = awkward
        self.inp = nn.Linear(4, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6)
        if tied:
            self.out.weight = self.mid.weight
        if awkward:
            self.mid.bias.requires_grad_(False)
            self.unused = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def average_gradients_case(rank, world_size, average_gradients, dtype_name="float32",
                           awkward=False, tied=False, seed=0):
    dtype = DTYPES[dtype_name]
    torch.manual_seed(seed)
    model = GradModel(awkward, tied).to(dtype)
    torch.manual_seed(seed + 1000 * (rank + 1))  # every rank sees different data
    x = torch.randn(5, 4, dtype=dtype)
    model(x).pow(2).mean().backward()
    named = list(model.named_parameters())
    weights = {name: p.detach().clone() for name, p in named}
    expected = {}
    for name, p in named:
        if p.grad is not None:
            total = p.grad.detach().clone()
            dist.all_reduce(total)
            expected[name] = total / world_size
    result = average_gradients(model)
    if result is not None:
        raise CheckFailed(f"average_gradients should return None (it works in place), "
                          f"it returned {type(result).__name__}")
    rtol, atol = TOLERANCES[dtype]
    for name, p in named:
        if name not in expected:
            if p.grad is not None:
                raise CheckFailed(f"parameter {name!r} had no gradient (.grad is None) and must be "
                                  "skipped, but now it has one")
            continue
        if p.grad is None:
            raise CheckFailed(f"parameter {name!r}: its .grad became None")
        expect_close(p.grad, expected[name], f"{name}.grad (mean over {world_size} ranks)",
                     rtol, atol)
        expect_close(p.detach(), weights[name], f"parameter {name!r} itself (must not change)",
                     0.0, 0.0)
    return sorted(expected)


def check_average_gradients_two_ranks(average_gradients) -> None:
    run_student(average_gradients_case, 2, average_gradients)


def check_average_gradients_skips_missing(average_gradients) -> None:
    """A frozen bias and an unused layer have no .grad; they must stay that way."""
    run_student(average_gradients_case, 2, average_gradients, "float32", True)


# --- ring_allreduce ---------------------------------------------------------------------------


def make_rank_tensor(rank, shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(-1000, 1000, shape, generator=generator, dtype=dtype)


def ring_allreduce_case(rank, world_size, ring_allreduce, shape=(8,), dtype_name="float32",
                        seed=0, check_traffic=False):
    dtype = DTYPES[dtype_name]
    tensor = make_rank_tensor(rank, shape, dtype, seed)
    expected = tensor.clone()
    dist.all_reduce(expected)
    storage = tensor.data_ptr()
    with CommAudit() as audit:
        result = ring_allreduce(tensor)
    record = audit.record
    what = f"tensor of shape {tuple(shape)}, {dtype_name}, world size {world_size}"
    if record.collectives:
        raise CheckFailed(f"{what}: ring_allreduce must use point-to-point calls only "
                          f"(send/recv/isend/irecv), but it called {sorted(set(record.collectives))}")
    if result is not None and result is not tensor:
        raise CheckFailed(f"{what}: ring_allreduce must work in place and return None; it "
                          f"returned a {type(result).__name__}")
    if tensor.data_ptr() != storage or tuple(tensor.shape) != tuple(shape):
        raise CheckFailed(f"{what}: the input tensor must be updated in place")
    rtol, atol = TOLERANCES.get(dtype, (0.0, 0.0))
    expect_close(tensor, expected, f"{what}, after ring_allreduce", rtol, atol)
    numel = tensor.numel()
    lower, upper = ring_traffic_bounds(numel, world_size, tensor.element_size())
    if check_traffic and not lower <= record.bytes_sent <= upper:
        ideal = 2 * (world_size - 1) / world_size * numel * tensor.element_size()
        raise CheckFailed(
            f"{what}: this rank sent {record.bytes_sent} bytes; a ring all-reduce sends about "
            f"2(N-1)/N of the tensor = {ideal:.0f} bytes (accepted: {lower}..{upper}). "
            + ("Sending the whole tensor to every peer is not bandwidth-optimal."
               if record.bytes_sent > upper else "Too little data moved for a correct all-reduce.")
        )
    return record.bytes_sent


def check_ring_allreduce_two_ranks(ring_allreduce) -> None:
    for shape in [(8,), (7,)]:
        run_student(ring_allreduce_case, 2, ring_allreduce, shape)


def check_ring_allreduce_world_sizes(ring_allreduce) -> None:
    """3 and 4 ranks, lengths not divisible by the world size, and fewer elements than ranks."""
    for world_size in (3, 4):
        for shape in [(10,), (2,), (world_size * 5,)]:
            run_student(ring_allreduce_case, world_size, ring_allreduce, shape)


def check_ring_allreduce_is_bandwidth_optimal(ring_allreduce) -> None:
    run_student(ring_allreduce_case, 4, ring_allreduce, (1000,), "float32", 0, True)
