"""Chapter 05, from all-reduce to DDP: visible checks for ``broadcast_parameters`` and
``BucketedDDP``, and the cases the hidden checks reuse.

The contract is the docstrings of ``broadcast_parameters`` and ``BucketedDDP`` (the class and its
methods) in solutions/05_allreduce/bucketed_ddp.nb.py (students:
exercises/05_allreduce/bucketed_ddp.ipynb).

Every rank builds its model from a different seed, so only rank 0's initial state is right. The
all-reduces are recorded with :class:`~ddpcourse.grading.comm_audit.CommAudit`, and the moment
backward reaches the model's input (a hook on the input tensor, which fires after every layer but
the first is done) tells whether communication overlapped with backward.

Each case is a :class:`~ddpcourse.grading.checks.Case`: the ranks only record what they see (the
module's tensors, the collectives, the gradients of every step, and the rank's own gradient of
each step, which the grader computes on a copy of the model it owns before the student's hooks
synchronise anything). The judge holds no one-process reference: the right gradient of a step is
the mean of the ranks' own gradients (an invariant of the observations, equal to one process's
gradient on the whole batch since every rank has the same number of rows), and the right weights
are rank 0's initial state moved by those means, step by step. The bucket plan is the exercise's
answer, so this module does not compute it either: the visible cases' plans are written out
(:data:`VISIBLE_PLANS`); the hidden checks judge their own cases with the grader's reference
planner (:func:`judge_training` takes the planner).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, expect_close, judge_each_rank, observed,
                                      run_student, type_name)
from ddpcourse.grading.comm_audit import CommAudit
from ddpcourse.grading.salted_inputs import DTYPES  # a case names its dtype

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
# After a few SGD steps the bucketed average and the one-process gradient differ only by the order
# in which float32 sums are taken (a few ulps per step); DDP itself ends within 5e-8 of one
# process after 20 steps (chapter 01). A wrong average (a sum, a missed bucket, rank 0's gradient
# only) is off by more than 1e-2.
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-10, 1e-12)}
MIB = 1024 * 1024
ROWS_PER_RANK = 4
LR = 0.1
_MAX_TEXT = 500  # of a text a rank reports, in a message


class Net(nn.Module):
    """A small MLP with a buffer (a fixed output scale) and optional awkward parts.

    variants: "frozen" (the first layer's bias does not require grad), "unused" (a layer that takes
    part in no step), "tied" (two layers share one weight), "batchnorm" (running statistics and an
    int64 counter as buffers; only for broadcasting: per-shard statistics are not one process's).
    """

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.variant = variant
        self.inp = nn.Linear(6, 16)
        self.mid = nn.Linear(16, 16)
        self.mid2 = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)
        self.register_buffer("scale", torch.rand(3) + 0.5)
        if variant == "frozen":
            self.inp.bias.requires_grad_(False)
        if variant == "unused":
            self.aux = nn.Linear(16, 16)
        if variant == "tied":
            self.mid2.weight = self.mid.weight
        if variant == "batchnorm":
            self.norm = nn.BatchNorm1d(16)
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)
            self.norm.num_batches_tracked.fill_(int(torch.randint(1, 100, ())))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.variant == "batchnorm":
            h = self.norm(h)
        h = torch.tanh(self.mid2(torch.tanh(self.mid(h))))
        return self.out(h) * self.scale


def rank_seed(seed: int, rank: int) -> int:
    return seed * 7919 + 104729 * rank + 1


def make_net(variant: str, dtype: torch.dtype, seed: int) -> Net:
    torch.manual_seed(seed)
    return Net(variant).to(dtype)


def reference_net(variant: str, dtype: torch.dtype, seed: int) -> Net:
    """Rank 0's model, built by a judge without moving the caller's random state (in a notebook
    the judge runs in the student's kernel)."""
    with torch.random.fork_rng(devices=[]):
        return make_net(variant, dtype, rank_seed(seed, 0))


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (shared ones once), as the module holds them."""
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    return state


def copy_of(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached clones: what an observation holds instead of the module's own tensors."""
    return {name: t.detach().clone() for name, t in tensors.items()}


# --- reading what a rank reported (it may be anything: the rank ran the student's code) --------


def _text(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "..."


def reported_tensor(value: Any, what: str) -> torch.Tensor:
    if (not isinstance(value, torch.Tensor) or value.layout != torch.strided
            or value.device.type != "cpu"):
        raise CheckFailed(f"{what}: the rank's report has {type_name(value)} instead of a tensor")
    return value


def reported_ints(value: list, what: str) -> list[int]:
    if not all(isinstance(v, int) for v in value):
        raise CheckFailed(f"the rank's report has {what} that are not all integers")
    return value


def reported_names(report: dict, reference: dict, what: str) -> None:
    """The report names exactly the reference's parameters (and buffers)."""
    if set(report) != set(reference):
        raise CheckFailed(f"{what}: the module's parameters/buffers changed: "
                          f"{_text(sorted(map(str, report)))}")


def expect_rank0_state(state: dict, reference: dict[str, torch.Tensor], what: str) -> None:
    """Every tensor of ``state`` (reported by a rank) is exactly rank 0's, ``reference``."""
    reported_names(state, reference, what)
    for name, expected in reference.items():
        tensor = reported_tensor(state[name], f"{what}, {name!r}")
        expected = expected.detach()
        if tensor.shape != expected.shape or tensor.dtype != expected.dtype:
            raise CheckFailed(f"{what}: {name!r} is not rank 0's value (shape "
                              f"{tuple(tensor.shape)}, {tensor.dtype}; rank 0's: "
                              f"{tuple(expected.shape)}, {expected.dtype}); every parameter and "
                              "buffer must be rank 0's")
        if not torch.equal(tensor, expected):
            diff = (tensor.double() - expected.double()).abs().max()
            raise CheckFailed(f"{what}: {name!r} is not rank 0's value (largest difference "
                              f"{diff.item():.3g}); every parameter and buffer must be rank 0's")


# --- broadcast_parameters ---------------------------------------------------------------------


def probe_group(rank: int) -> torch.Tensor | str:
    """A real all-reduce after the student's call: its result, or what it raised (a rank that
    skipped or added a collective leaves its peers out of step). Only recorded: judged later."""
    probe = torch.arange(4, dtype=torch.float64) + rank
    try:
        dist.all_reduce(probe)
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        return f"{type(exc).__name__}: {exc}"
    return probe


def expect_usable_group(probe: Any, world_size: int, what: str) -> None:
    if isinstance(probe, str):
        raise CheckFailed(f"after {what}, the process group is unusable: a real all_reduce "
                          f"raised {_text(probe)}")
    probe = reported_tensor(probe, f"after {what}, a real all_reduce")
    expected = (world_size * torch.arange(4, dtype=torch.float64)
                + world_size * (world_size - 1) / 2)
    if not torch.equal(probe, expected):
        raise CheckFailed(f"after {what}, a real all_reduce gave {_text(probe.tolist())} instead "
                          f"of {expected.tolist()}: is a collective of yours still pending?")


def observe_broadcast(rank, world_size, broadcast_parameters, variant="plain",
                      dtype_name="float32", seed=0):
    """Every parameter and buffer after the call: its value, whether it kept its storage, its
    requires_grad, whether it got a .grad; what the call returned; a real all-reduce after it."""
    module = make_net(variant, DTYPES[dtype_name], rank_seed(seed, rank))
    storage = {name: t.data_ptr() for name, t in state_of(module).items()}
    result = broadcast_parameters(module)
    tensors = {name: {"value": t.detach().clone(),
                      "same_storage": storage.get(name) == t.data_ptr(),
                      "requires_grad": bool(t.requires_grad),
                      "grad": isinstance(t, nn.Parameter) and t.grad is not None}
               for name, t in state_of(module).items()}
    return {"returned": type_name(result), "tensors": tensors, "group_after": probe_group(rank)}


def judge_broadcast(observations, world_size, variant="plain", dtype_name="float32", seed=0):
    what = f"broadcast_parameters, {world_size} ranks ({variant} model, {dtype_name})"
    reference = state_of(reference_net(variant, DTYPES[dtype_name], seed))

    def judge_rank(rank, observation):
        returned = observed(observation, "returned", str)
        if returned != "None":
            raise CheckFailed(f"{what}: must return None (it works in place), returned "
                              f"{_text(returned)}")
        tensors = observed(observation, "tensors", dict)
        reported_names(tensors, reference, what)
        for name, expected in reference.items():
            entry = tensors[name]
            if (observed(entry, "same_storage", bool) is not True
                    or observed(entry, "requires_grad", bool) != expected.requires_grad):
                raise CheckFailed(f"{what}: {name!r} must be updated in place (same storage, "
                                  "same requires_grad): an optimizer built before holds these "
                                  "tensors")
            if isinstance(expected, nn.Parameter) and observed(entry, "grad", bool) is not False:
                raise CheckFailed(f"{what}: {name!r} got a .grad; broadcasting must not touch "
                                  "autograd")
        expect_rank0_state({name: observed(tensors[name], "value", torch.Tensor)
                            for name in reference}, reference, what)
        expect_usable_group(observed(observation, "group_after", (str, torch.Tensor)), world_size,
                            what)

    judge_each_rank(observations, judge_rank)


BROADCAST = Case(observe_broadcast, judge_broadcast)


def check_broadcast_parameters_two_ranks(broadcast_parameters) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(BROADCAST, 2, broadcast_parameters)


def check_broadcast_parameters_buffers_and_frozen(broadcast_parameters) -> None:
    """BatchNorm's running statistics and int64 counter, a frozen bias, a tied weight; 3 ranks."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for variant in ("batchnorm", "frozen", "tied"):
        run_student(BROADCAST, 3, broadcast_parameters, variant)


# --- BucketedDDP ------------------------------------------------------------------------------


def global_batch(world_size: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed + 17)
    x = torch.randn(world_size * ROWS_PER_RANK, 6, generator=generator, dtype=dtype)
    y = torch.randn(world_size * ROWS_PER_RANK, 3, generator=generator, dtype=dtype)
    return x, y


def with_rank0_state(BucketedDDP: Any, rank0_state: dict[str, torch.Tensor],
                     calls: list) -> Any:
    """The student's class, where its code calls ``broadcast_parameters`` by that global name,
    getting rank 0's initial state copied in instead (no communication: the grader built rank
    0's model itself, from its seed). So a mistake in ``broadcast_parameters`` costs its own
    tests' points and no others, and nothing here is a ``broadcast_parameters`` a student could
    hand in. Only in this rank: the class was rebuilt here from its pickle, with globals of its
    own. Each call is appended to ``calls``."""

    def rank0_state_copied_in(module: nn.Module) -> None:
        calls.append(True)
        with torch.no_grad():
            for name, tensor in state_of(module).items():  # the model, or a wrapper around it
                source = next((key for key in rank0_state
                               if name == key or name.endswith("." + key)), None)
                if source is None:
                    raise CheckFailed(f"broadcast_parameters was called on a module holding "
                                      f"{name!r}, which the model passed to BucketedDDP lacks")
                tensor.copy_(rank0_state[source])

    for klass in getattr(BucketedDDP, "__mro__", ()):
        if klass in (nn.Module, object):
            continue
        for attribute in vars(klass).values():
            namespace = getattr(getattr(attribute, "__func__", attribute), "__globals__", None)
            if isinstance(namespace, dict) and "broadcast_parameters" in namespace:
                namespace["broadcast_parameters"] = rank0_state_copied_in
    return BucketedDDP


# What a BucketedDDP case judges: "values" (rank 0's state after construction, every gradient,
# the weights: one process's), "buckets" (the all-reduces' number and sizes), "overlap" (the
# all-reduces started during backward), or "all" of them. Each visible test judges one, so that
# one mistake (a missing division, a wrong bucket plan) fails one test; the hidden cases judge
# "values and buckets" on other models and world sizes, leaving overlap to its visible test.
JUDGED = ("values", "buckets", "overlap", "values and buckets", "all")


def observe_bucketed_training(rank, world_size, BucketedDDP, bucket_cap_mb, variant="plain",
                              dtype_name="float32", seed=0, steps=3, judged="all"):
    """Train ``steps`` SGD steps with the student's wrapper (its ``broadcast_parameters`` replaced,
    see :func:`with_rank0_state`) and record, right after construction, after every step and at
    the end, what the judge compares with one process."""
    dtype = DTYPES[dtype_name]
    broadcast_calls: list = []
    BucketedDDP = with_rank0_state(BucketedDDP, state_of(reference_net(variant, dtype, seed)),
                                   broadcast_calls)
    model = make_net(variant, dtype, rank_seed(seed, rank))
    shadow = reference_net(variant, dtype, seed)  # the grader's copy, never seen by the student
    with CommAudit() as construction:
        wrapped = BucketedDDP(model, bucket_cap_mb)
    observation = {"is_module": isinstance(wrapped, nn.Module),
                   "construction_collectives": list(construction.record.collectives),
                   "broadcast_parameters_called": bool(broadcast_calls),
                   "state": copy_of(state_of(model)), "steps": [], "weights": {}}
    if not observation["is_module"]:
        return observation  # nothing to train: the judge says why

    x_all, y_all = global_batch(world_size, dtype, seed)
    share = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        own = own_gradients(shadow, model, x_all[share], y_all[share])
        x = x_all[share].clone().requires_grad_(True)
        with CommAudit(squares=True) as audit:
            launched_at_input = []
            x.register_hook(lambda grad: launched_at_input.append(
                len(audit.record.calls_of("all_reduce"))))
            nn.functional.mse_loss(wrapped(x), y_all[share]).backward()
            launched_in_backward = len(audit.record.calls_of("all_reduce"))
            result = wrapped.finish_gradient_synchronization()
        observation["steps"].append({
            "returned": type_name(result),
            "allreduce_bytes": audit.record.calls_of("all_reduce"),
            "allreduce_squares": list(audit.record.all_reduce_squares),
            "other_collectives": sorted(set(audit.record.collectives) - {"all_reduce"}),
            "launched_at_input": launched_at_input[:1],
            "launched_in_backward": launched_in_backward,
            "grads": {name: None if p.grad is None else p.grad.detach().clone()
                      for name, p in model.named_parameters()},
            "own_grads": own,
        })
        optimizer.step()
    observation["weights"] = copy_of(dict(model.named_parameters()))
    return observation


def own_gradients(shadow: Net, model: nn.Module, x: torch.Tensor,
                  y: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """This rank's own gradient of one step: ``model``'s current parameters and buffers copied
    into the grader's ``shadow`` (no hook of the student's on it), one forward and backward on
    the rank's share."""
    with torch.no_grad():
        mine = state_of(model)
        for name, tensor in state_of(shadow).items():
            tensor.copy_(mine[name])
    shadow.zero_grad(set_to_none=True)
    with torch.enable_grad():
        nn.functional.mse_loss(shadow(x), y).backward()
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in shadow.named_parameters()}


# A cap that the first bucket (out.bias, out.weight, mid2.bias, mid2.weight: 12 + 192 + 64 +
# 1024 bytes) fills exactly: a bucket may hold the cap itself (``>``, not ``>=``).
EXACT_CAP_MB = 1292 / MIB

# The contract's bucket plan for every (variant, dtype, bucket_cap_mb) the visible checks train,
# written out rather than computed, so that the public package does not hold the algorithm (the
# exercise's answer). tests/test_grading_bucketed_ddp.py holds each entry to the grader's
# reference planner. Bytes, in reverse order: out.bias 12, out.weight 192, mid2.bias 64,
# mid2.weight 1024, mid.bias 64, mid.weight 1024, inp.bias 64, inp.weight 384.
VISIBLE_PLANS: dict[tuple[str, str, float], list[list[str]]] = {
    ("plain", "float32", 0.001): [["out.bias", "out.weight", "mid2.bias"], ["mid2.weight"],
                                  ["mid.bias"], ["mid.weight"], ["inp.bias", "inp.weight"]],
    ("plain", "float32", 1e-6): [["out.bias"], ["out.weight"], ["mid2.bias"], ["mid2.weight"],
                                 ["mid.bias"], ["mid.weight"], ["inp.bias"], ["inp.weight"]],
    ("plain", "float32", EXACT_CAP_MB): [["out.bias", "out.weight", "mid2.bias", "mid2.weight"],
                                         ["mid.bias", "mid.weight", "inp.bias"], ["inp.weight"]],
    ("plain", "float32", 25.0): [["out.bias", "out.weight", "mid2.bias", "mid2.weight",
                                  "mid.bias", "mid.weight", "inp.bias", "inp.weight"]],
}

# ``planner(model, bucket_cap_mb)``: the contract's buckets for rank 0's model, as parameter names.
Planner = Callable[[Net, float], list[list[str]]]


def written_out_plan(model: Net, bucket_cap_mb: float) -> list[list[str]]:
    """The visible cases' planner: their plan from :data:`VISIBLE_PLANS`. Any other model or cap
    is a grader bug (a visible case added without its plan, or a hidden case judged without the
    hidden planner), never the student's: it raises LookupError instead of guessing."""
    key = (model.variant, str(next(model.parameters()).dtype).removeprefix("torch."),
           bucket_cap_mb)
    if key not in VISIBLE_PLANS:
        raise LookupError(f"grader bug: no written-out bucket plan for {key} (variant, dtype, "
                          "bucket_cap_mb): add it to VISIBLE_PLANS, or judge the case with the "
                          "hidden checks' planner")
    return [list(bucket) for bucket in VISIBLE_PLANS[key]]


class BucketPlan:
    """What the contract says must happen in every step, for one model and its ``buckets`` (the
    contract's bucket plan as parameter names, given by a :data:`Planner`)."""

    def __init__(self, model: nn.Module, buckets: list[list[str]]):
        params = dict(model.named_parameters())
        unused = {n for n in params if n.startswith("aux.")}
        self.with_grad = [b for b in buckets if set(b) - unused]
        self.bucket_bytes = sorted(sum(params[n].numel() * params[n].element_size() for n in b)
                                   for b in self.with_grad)
        self.exact_sizes = not unused  # a bucket with an unused parameter may leave it out
        # Buckets holding no first-layer (and no unused) parameter are complete before backward
        # reaches the input.
        late = {"inp.weight", "inp.bias"} | unused
        self.early = sum(1 for b in self.with_grad if not late & set(b))


def mean_of_own_gradients(observations: list, steps: int,
                          like: dict[str, torch.Tensor]) -> list[dict]:
    """Step by step, the mean of the ranks' own gradients (None where the ranks had none): what
    every rank must hold after ``finish_gradient_synchronization()``. ``like``: the model's
    parameters, whose names, dtypes and shapes every report must have. One CheckFailed naming
    every rank whose report of its own gradients is not what the grader's copy gives."""
    own: list[list[dict]] = [[] for _ in observations]

    def read(rank, observation):
        records = observed(observation, "steps", list)
        if len(records) != steps:
            raise CheckFailed(f"the rank's report has {len(records)} steps, not {steps}")
        for step, record in enumerate(records):
            grads = observed(record, "own_grads", dict)
            reported_names(grads, like, f"step {step + 1}: the rank's own gradients")
            mine = {}
            for name, grad in grads.items():
                if grad is not None:
                    grad = reported_tensor(grad, f"step {step + 1}: {name}")
                    if grad.dtype != like[name].dtype or grad.shape != like[name].shape:
                        raise CheckFailed(f"step {step + 1}: the rank's own gradient of {name!r} "
                                          "is not a tensor like the parameter")
                mine[name] = grad
            own[rank].append(mine)

    judge_each_rank(observations, read)
    means = []
    for step in range(steps):
        mean: dict[str, torch.Tensor | None] = {}
        for name in like:
            present = [own[r][step][name] for r in range(len(own))]
            if all(grad is None for grad in present):
                mean[name] = None
            elif any(grad is None for grad in present):
                raise CheckFailed(f"step {step + 1}: {name!r} has a gradient on some ranks only")
            else:
                mean[name] = sum(present[1:], present[0].clone()) / len(present)
        means.append(mean)
    return means


def sgd_from(state: dict[str, torch.Tensor], grads: list[dict]) -> dict[str, torch.Tensor]:
    """Rank 0's initial parameters moved by plain SGD (lr :data:`LR`) with each step's gradients:
    the weights every rank must end with."""
    weights = {name: state[name].clone() for name in grads[0]} if grads else {}
    for step in grads:
        for name, grad in step.items():
            if grad is not None:
                weights[name] = weights[name].add(grad, alpha=-LR)
    return weights


def judge_bucketed_training(observations, world_size, bucket_cap_mb, variant="plain",
                            dtype_name="float32", seed=0, steps=3, judged="all"):
    """The visible cases' judge: their bucket plans are written out (:data:`VISIBLE_PLANS`)."""
    judge_training(written_out_plan, observations, world_size, bucket_cap_mb, variant,
                   dtype_name, seed, steps, judged)


def judge_training(planner: Planner, observations, world_size, bucket_cap_mb, variant="plain",
                   dtype_name="float32", seed=0, steps=3, judged="all"):
    """Every rank's record against one process, with the bucket plan ``planner`` gives for rank
    0's model (the hidden checks pass the grader's reference planner)."""
    if judged not in JUDGED:
        raise ValueError(f"judged must be one of {JUDGED}, not {judged!r}")
    values = judged in ("values", "values and buckets", "all")
    dtype = DTYPES[dtype_name]
    what = f"{world_size} ranks, bucket_cap_mb={bucket_cap_mb:g}, {variant} model, {dtype_name}"
    rank0 = reference_net(variant, dtype, seed)
    plan = BucketPlan(rank0, planner(rank0, bucket_cap_mb))
    rank0_state = copy_of(state_of(rank0))
    tolerance = TOLERANCES[dtype]
    means = (mean_of_own_gradients(observations, steps, dict(rank0.named_parameters()))
             if values else [{}] * steps)
    final_weights = sgd_from(rank0_state, means) if values else {}

    def judge_rank(rank, observation):
        if observed(observation, "is_module", bool) is not True:
            raise CheckFailed(f"{what}: BucketedDDP must be a torch.nn.Module")
        called = observed(observation, "broadcast_parameters_called", bool)
        collectives = observed(observation, "construction_collectives", list)
        if values and not (called or collectives):
            raise CheckFailed(f"{what}: the constructor made no collective call; it must "
                              "broadcast rank 0's parameters and buffers: call "
                              "broadcast_parameters(module)")
        if values:
            expect_rank0_state(observed(observation, "state", dict), rank0_state,
                               f"{what}, right after BucketedDDP(...) (its broadcast_parameters "
                               "gets rank 0's state right here)")
        records = observed(observation, "steps", list)
        if len(records) != steps:
            raise CheckFailed(f"{what}: the rank's report has {len(records)} steps, not {steps}")
        for step, record in enumerate(records):
            expect_step(plan, record, means[step], judged, world_size,
                        f"{what}, step {step + 1}", tolerance)
        if values:
            expect_same_weights(observed(observation, "weights", dict), final_weights,
                                f"{what}: after {steps} steps", tolerance)

    judge_each_rank(observations, judge_rank)


BUCKETED_TRAINING = Case(observe_bucketed_training, judge_bucketed_training)


def expect_step(plan: BucketPlan, record: Any, expected_grads: dict, judged: str,
                world_size: int, where: str, tolerance: tuple[float, float]) -> None:
    """One step's record against the plan (``judged``: which of its properties, see JUDGED)."""
    if observed(record, "returned", str) != "None":
        raise CheckFailed(f"{where}: finish_gradient_synchronization() must return None")
    if judged in ("buckets", "values and buckets", "all"):
        expect_one_allreduce_per_bucket(plan, record, where, world_size)
    if judged in ("overlap", "all"):
        expect_overlap(plan, record, where)
    if judged in ("values", "values and buckets", "all"):
        expect_mean_gradients(record, expected_grads, world_size, where, tolerance)


def expect_one_allreduce_per_bucket(plan: BucketPlan, record: Any, where: str,
                                    world_size: int) -> None:
    calls = reported_ints(observed(record, "allreduce_bytes", list), "all-reduce sizes")
    others = sorted(map(_text, observed(record, "other_collectives", list)))
    if others:
        raise CheckFailed(f"{where}: only all-reduces are expected during a step, got "
                          f"{_text(others)}")
    if len(calls) != len(plan.with_grad):
        raise CheckFailed(f"{where}: expected {len(plan.with_grad)} all-reduce calls (one per "
                          f"bucket: {plan.with_grad}), got {len(calls)}")
    if plan.exact_sizes and sorted(calls) != plan.bucket_bytes:
        raise CheckFailed(f"{where}: all-reduced tensors of {sorted(calls)} bytes; the buckets "
                          f"hold {plan.bucket_bytes} bytes")
    expect_buckets_carry_own_gradients(plan, record, world_size, where)


def expect_buckets_carry_own_gradients(plan: BucketPlan, record: Any, world_size: int,
                                       where: str) -> None:
    """Each bucket's all-reduce handed over this rank's own gradients of that bucket (their sum
    of squares, whole or divided by the world size first), not another tensor of the same size:
    an all-reduce of zeros next to gradients exchanged some other way synchronises nothing."""
    squares = observed(record, "allreduce_squares", list)
    if len(squares) != len(plan.with_grad) or not all(
            type(sq) is float and math.isfinite(sq) for sq in squares):
        raise CheckFailed(f"{where}: the rank's record of its all-reduces is malformed")
    own = observed(record, "own_grads", dict)
    expected = []
    for bucket in plan.with_grad:
        total = 0.0
        for name in bucket:
            grad = own.get(name)
            if grad is not None:
                total += reported_tensor(grad, f"{where}: own gradient of {name}").double(
                    ).pow(2).sum().item()
        expected.append(total)
    got, expected = sorted(squares), sorted(expected)
    if any(all(math.isclose(g, e / factor, rel_tol=1e-3, abs_tol=1e-12)
               for g, e in zip(got, expected))
           for factor in (1, world_size ** 2)):
        return
    raise CheckFailed(
        f"{where}: the all-reduces did not carry this rank's gradients: they were handed tensors "
        f"whose sums of squares are [{', '.join(f'{g:.6g}' for g in got)}], and this rank's own "
        f"gradients of the buckets have [{', '.join(f'{e:.6g}' for e in expected)}] (or that "
        "divided by the world size squared, if you divide before the all-reduce). "
        "All-reduce each bucket's flattened gradients themselves: a tensor of the same size "
        "(of zeros, say) synchronises nothing")


def expect_overlap(plan: BucketPlan, record: Any, where: str) -> None:
    started = reported_ints(observed(record, "launched_at_input", list), "all-reduce counts")
    in_backward = observed(record, "launched_in_backward", int)
    if plan.early and started and started[0] < plan.early:
        raise CheckFailed(
            f"{where}: when backward reached the input only {started[0]} all-reduce(s) had "
            f"started, but {plan.early} bucket(s) were complete by then: each bucket's all-reduce "
            "must start (async_op=True) as soon as its last gradient is ready, during backward "
            f"({in_backward} started during backward in all)")


def expect_mean_gradients(record: Any, expected_grads: dict, world_size: int, where: str,
                          tolerance: tuple[float, float]) -> None:
    rtol, atol = tolerance
    grads = observed(record, "grads", dict)
    reported_names(grads, expected_grads, where)
    for name, expected in expected_grads.items():
        grad = grads[name]
        if expected is None:
            if grad is not None:
                raise CheckFailed(f"{where}: {name!r} got no gradient in this step; its .grad "
                                  "must stay None")
            continue
        if grad is None:
            raise CheckFailed(f"{where}: {name!r}.grad is None after "
                              "finish_gradient_synchronization()")
        expect_close(reported_tensor(grad, f"{where}: {name}.grad"), expected,
                     f"{where}: {name}.grad (mean over ranks = one process on the whole batch)",
                     rtol, atol, world_size)


def expect_same_weights(weights: dict, reference: dict[str, torch.Tensor], what: str,
                        tolerance: tuple[float, float]) -> None:
    reported_names(weights, reference, what)
    rtol, atol = tolerance
    for name, expected in reference.items():
        expect_close(reported_tensor(weights[name], f"{what}, {name}"), expected,
                     f"{what}, {name} (vs one process)", rtol, atol)


def check_bucketed_ddp_matches_one_process(BucketedDDP) -> None:
    """Rank 0's state after construction, every gradient (the mean), the weights after 3 steps."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(BUCKETED_TRAINING, 2, BucketedDDP, 0.001, "plain", "float32", 0, 3, "values")


def check_bucketed_ddp_one_allreduce_per_bucket(BucketedDDP) -> None:
    """Caps giving one parameter per bucket, a first bucket filled to the cap exactly, and one
    bucket for all; only the all-reduces' number and sizes are judged."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for bucket_cap_mb in (1e-6, EXACT_CAP_MB, 25.0):
        run_student(BUCKETED_TRAINING, 2, BucketedDDP, bucket_cap_mb, "plain", "float32", 1, 2,
                    "buckets")


def check_bucketed_ddp_overlaps_backward(BucketedDDP) -> None:
    """Only when the all-reduces start is judged."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(BUCKETED_TRAINING, 2, BucketedDDP, 1e-6, "plain", "float32", 2, 1, "overlap")
