"""Chapter 05, AllReduce by hand: the visible checks, and the rank-side cases they are built from.

The contract is the docstrings of ``average_gradients`` and ``ring_allreduce`` in
solutions/05_allreduce/allreduce_by_hand.nb.py (students:
exercises/05_allreduce/allreduce_by_hand.ipynb).

Each case is a :class:`~ddpcourse.grading.checks.Case`: the ranks report what they hold after the
student's call, and the salt their input was drawn with. A rank's input depends on a salt each rank
draws afresh (:mod:`ddpcourse.grading.salted_inputs`), so no rank can compute another rank's input
without communicating; the judge rebuilds every rank's input from the reported salts and expects
their mean (gradients) or sum (tensors). This module holds no answer: the expected value of a case
is the sum of what the ranks held before the call, an invariant of the observations. The shared
judges say the rest: the parameters are left as they were (:mod:`ddpcourse.grading.left_unchanged`),
the ring calls no collective (:mod:`ddpcourse.grading.point_to_point`).
"""

from __future__ import annotations

import torch
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, audited_traffic, expect_close,
                                      judge_each_rank, observed, ring_traffic_bounds, run_student,
                                      type_name)
from ddpcourse.grading.left_unchanged import copy_of, judge_left_unchanged
from ddpcourse.grading.point_to_point import judge_point_to_point_only
from ddpcourse.grading.salted_inputs import (DTYPES, TOLERANCES, fresh_salt, rank_generator,
                                             reported_salts, salted_tensor, tolerance)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel


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


def model_after_backward(rank, dtype_name="float32", awkward=False, tied=False,
                         seed=0, salt=0) -> nn.Module:
    """Rank ``rank``'s model right after its backward: the same weights on every rank, gradients
    from the rank's own data (drawn with the rank's ``salt``)."""
    dtype = DTYPES[dtype_name]
    torch.manual_seed(seed)
    model = GradModel(awkward, tied).to(dtype)
    x = torch.randn(5, 4, dtype=dtype, generator=rank_generator(seed, rank, salt))
    model(x).pow(2).mean().backward()
    return model


def observe_average_gradients(rank, world_size, average_gradients, dtype_name="float32",
                              awkward=False, tied=False, seed=0):
    salt = fresh_salt()
    model = model_after_backward(rank, dtype_name, awkward, tied, seed, salt)
    result = average_gradients(model)
    return {"salt": salt, "returned": type_name(result),
            "grads": {name: None if p.grad is None else p.grad.detach().clone()
                      for name, p in model.named_parameters()},
            "weights": copy_of(dict(model.named_parameters()))}


def judge_average_gradients(observations, world_size, dtype_name="float32", awkward=False,
                            tied=False, seed=0):
    salts = reported_salts(observations)
    models = [dict(model_after_backward(r, dtype_name, awkward, tied, seed,
                                        salt).named_parameters())
              for r, salt in enumerate(salts)]
    expected = {name: sum(m[name].grad for m in models) / world_size
                for name, p in models[0].items() if p.grad is not None}
    rtol, atol = TOLERANCES[DTYPES[dtype_name]]

    def judge_rank(rank, observation):
        returned = observed(observation, "returned", str)
        grads = observed(observation, "grads", dict)
        weights = observed(observation, "weights", dict)
        if returned != "None":
            raise CheckFailed(f"average_gradients should return None (it works in place), it "
                              f"returned {returned}")
        if set(grads) != set(models[0]):
            raise CheckFailed(f"the model's parameters changed: {sorted(map(str, grads))}, "
                              f"expected {sorted(models[0])}")
        for name, p in models[rank].items():
            if name not in expected:
                if grads[name] is not None:
                    raise CheckFailed(f"parameter {name!r} had no gradient (.grad is None) and "
                                      "must be skipped, but now it has one")
            elif not isinstance(grads[name], torch.Tensor):
                raise CheckFailed(f"parameter {name!r}: its .grad became None")
            else:
                expect_close(grads[name], expected[name],
                             f"{name}.grad (mean over {world_size} ranks)", rtol, atol,
                             world_size)
        judge_left_unchanged(weights, {name: p.detach() for name, p in models[rank].items()},
                             "average_gradients", "the model's", "parameters",
                             "it averages the gradients (.grad) only, never the parameters")

    judge_each_rank(observations, judge_rank)


AVERAGE_GRADIENTS = Case(observe_average_gradients, judge_average_gradients)


def check_average_gradients_two_ranks(average_gradients) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(AVERAGE_GRADIENTS, 2, average_gradients)


def check_average_gradients_skips_missing(average_gradients) -> None:
    """A frozen bias and an unused layer have no .grad; they must stay that way."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(AVERAGE_GRADIENTS, 2, average_gradients, "float32", True)


# --- ring_allreduce ---------------------------------------------------------------------------


make_rank_tensor = salted_tensor  # rank ``rank``'s input to the ring, drawn with its salt


def observe_ring_allreduce(rank, world_size, ring_allreduce, shape=(8,), dtype_name="float32",
                           seed=0, check_traffic=False):
    salt = fresh_salt()
    tensor = make_rank_tensor(rank, shape, DTYPES[dtype_name], seed, salt)
    storage = tensor.data_ptr()
    with audited_traffic() as traffic:
        result = ring_allreduce(tensor)
    return {"salt": salt,
            "returned": "the tensor itself" if result is tensor else type_name(result),
            "in_place": tensor.data_ptr() == storage and tuple(tensor.shape) == tuple(shape),
            "result": tensor.detach().clone(),
            "traffic": traffic}


def judge_ring_allreduce(observations, world_size, shape=(8,), dtype_name="float32", seed=0,
                         check_traffic=False):
    dtype = DTYPES[dtype_name]
    salts = reported_salts(observations)
    inputs = [make_rank_tensor(r, shape, dtype, seed, salt) for r, salt in enumerate(salts)]
    expected = sum(inputs[1:], inputs[0].clone())
    what = f"tensor of shape {tuple(shape)}, {dtype_name}, world size {world_size}"
    rtol, atol = tolerance(dtype)
    itemsize = expected.element_size()
    lower, upper = ring_traffic_bounds(expected.numel(), world_size, itemsize)

    def judge_rank(rank, observation):
        traffic = observed(observation, "traffic", dict)
        judge_point_to_point_only(traffic, what, "ring_allreduce")
        returned = observed(observation, "returned", str)
        if returned not in ("None", "the tensor itself"):
            raise CheckFailed(f"{what}: ring_allreduce must work in place and return None; it "
                              f"returned a {returned}")
        if observed(observation, "in_place", bool) is not True:
            raise CheckFailed(f"{what}: the input tensor must be updated in place")
        expect_close(observed(observation, "result", torch.Tensor), expected,
                     f"{what}, after ring_allreduce", rtol, atol)
        sent = observed(traffic, "bytes_sent", int)
        if check_traffic and not lower <= sent <= upper:
            ideal = 2 * (world_size - 1) / world_size * expected.numel() * itemsize
            raise CheckFailed(
                f"{what}: this rank sent {sent} bytes; a ring all-reduce sends about 2(N-1)/N of "
                f"the tensor = {ideal:.0f} bytes (accepted: {lower}..{upper}). "
                + ("Sending the whole tensor to every peer is not bandwidth-optimal."
                   if sent > upper else "Too little data moved for a correct all-reduce."))

    judge_each_rank(observations, judge_rank)


# Graded with every rank in its own sandbox: the grader's broker counts the traffic, and a blocking
# send completes only once received (rendezvous), as on gloo and NCCL: a ring must not deadlock.
RING_ALLREDUCE = Case(observe_ring_allreduce, judge_ring_allreduce, audit_traffic=True,
                      rendezvous=True)


def check_ring_allreduce_two_ranks(ring_allreduce) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for shape in [(8,), (7,)]:
        run_student(RING_ALLREDUCE, 2, ring_allreduce, shape)


def check_ring_allreduce_world_sizes(ring_allreduce) -> None:
    """3 and 4 ranks, lengths not divisible by the world size, and fewer elements than ranks."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size in (3, 4):
        for shape in [(10,), (2,), (world_size * 5,)]:
            run_student(RING_ALLREDUCE, world_size, ring_allreduce, shape)


def check_ring_allreduce_is_bandwidth_optimal(ring_allreduce) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(RING_ALLREDUCE, 4, ring_allreduce, (1000,), "float32", 0, True)
