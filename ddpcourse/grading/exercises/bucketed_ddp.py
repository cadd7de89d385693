"""Chapter 05, from all-reduce to DDP: visible checks for ``broadcast_parameters`` and
``BucketedDDP``, and the rank-side cases the hidden checks reuse.

The contract is the docstrings of ``broadcast_parameters`` and ``BucketedDDP`` (the class and its
methods) in solutions/05_allreduce/bucketed_ddp.nb.py (students:
exercises/05_allreduce/bucketed_ddp.ipynb).

Every rank builds its model from a different seed, so only rank 0's initial state is right; the
reference is one process training rank 0's model on the whole batch (the concatenation of every
rank's share). The all-reduces are recorded with :class:`~ddpcourse.grading.comm_audit.CommAudit`,
and the moment backward reaches the model's input (a hook on the input tensor, which fires after
every layer but the first is done) tells whether communication overlapped with backward.
"""

from __future__ import annotations

import torch
from torch import nn

from ddpcourse.grading.checks import (CheckFailed, agree_on, expect_close, group_problem,
                                      run_student)
from ddpcourse.grading.comm_audit import CommAudit

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# After a few SGD steps the bucketed average and the one-process gradient differ only by the order
# in which float32 sums are taken (a few ulps per step); DDP itself ends within 5e-8 of one
# process after 20 steps (chapter 01). A wrong average (a sum, a missed bucket, rank 0's gradient
# only) is off by more than 1e-2.
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-10, 1e-12)}
MIB = 1024 * 1024
ROWS_PER_RANK = 4
LR = 0.1


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


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (shared ones once), as the module holds them."""
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    return state


def expect_rank0_state(module: nn.Module, rank0: nn.Module, what: str) -> None:
    reference = state_of(rank0)
    for name, tensor in state_of(module).items():
        if not torch.equal(tensor.detach(), reference[name].detach()):
            diff = (tensor.detach().double() - reference[name].detach().double()).abs().max()
            raise CheckFailed(f"{what}: {name!r} is not rank 0's value (largest difference "
                              f"{diff.item():.3g}); every parameter and buffer must be rank 0's")


def expected_buckets(module: nn.Module, bucket_cap_mb: float) -> list[list[str]]:
    """The contract's bucket assignment, as parameter names: reverse order, greedy by bytes."""
    cap = bucket_cap_mb * MIB
    buckets, current, size = [], [], 0
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


# --- broadcast_parameters ---------------------------------------------------------------------


def broadcast_case(rank, world_size, broadcast_parameters, variant="plain", dtype_name="float32",
                   seed=0):
    dtype = DTYPES[dtype_name]
    module = make_net(variant, dtype, rank_seed(seed, rank))
    rank0 = make_net(variant, dtype, rank_seed(seed, 0))
    before = {name: (t.data_ptr(), t.requires_grad) for name, t in state_of(module).items()}
    result = broadcast_parameters(module)
    what = f"broadcast_parameters, {world_size} ranks ({variant} model, {dtype_name})"
    agree_on(expect_broadcast, module, rank0, before, result, what)
    unusable = group_problem(rank, world_size, what)
    if unusable:
        raise CheckFailed(unusable)
    return sorted(state_of(module))


def expect_broadcast(module, rank0, before, result, what) -> None:
    if result is not None:
        raise CheckFailed(f"{what}: must return None (it works in place), returned "
                          f"{type(result).__name__}")
    after = state_of(module)
    if set(after) != set(before):
        raise CheckFailed(f"{what}: the module's parameters/buffers changed: {sorted(after)}")
    for name, tensor in after.items():
        if (tensor.data_ptr(), tensor.requires_grad) != before[name]:
            raise CheckFailed(f"{what}: {name!r} must be updated in place (same storage, same "
                              "requires_grad): an optimizer built before holds these tensors")
        if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
            raise CheckFailed(f"{what}: {name!r} got a .grad; broadcasting must not touch autograd")
    expect_rank0_state(module, rank0, what)


def check_broadcast_parameters_two_ranks(broadcast_parameters) -> None:
    run_student(broadcast_case, 2, broadcast_parameters)


def check_broadcast_parameters_buffers_and_frozen(broadcast_parameters) -> None:
    """BatchNorm's running statistics and int64 counter, a frozen bias, a tied weight; 3 ranks."""
    for variant in ("batchnorm", "frozen", "tied"):
        run_student(broadcast_case, 3, broadcast_parameters, variant)


# --- BucketedDDP ------------------------------------------------------------------------------


def global_batch(world_size: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed + 17)
    x = torch.randn(world_size * ROWS_PER_RANK, 6, generator=generator, dtype=dtype)
    y = torch.randn(world_size * ROWS_PER_RANK, 3, generator=generator, dtype=dtype)
    return x, y


def bucketed_training_case(rank, world_size, BucketedDDP, bucket_cap_mb, variant="plain",
                           dtype_name="float32", seed=0, steps=3, check_overlap=False):
    """Train ``steps`` SGD steps with the student's wrapper; after every step compare the call
    count, the bucket sizes, the gradients and (at the end) the weights with one process."""
    dtype = DTYPES[dtype_name]
    what = f"{world_size} ranks, bucket_cap_mb={bucket_cap_mb:g}, {variant} model, {dtype_name}"
    model = make_net(variant, dtype, rank_seed(seed, rank))
    single = make_net(variant, dtype, rank_seed(seed, 0))
    with CommAudit() as construction:
        wrapped = BucketedDDP(model, bucket_cap_mb)
    agree_on(expect_construction, wrapped, construction.record, model, single, what)
    plan = BucketPlan(model, bucket_cap_mb)

    x_all, y_all = global_batch(world_size, dtype, seed)
    share = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    single_optimizer = torch.optim.SGD(single.parameters(), lr=LR)
    for step in range(steps):
        single_optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(single(x_all), y_all).backward()

        optimizer.zero_grad(set_to_none=True)
        x = x_all[share].clone().requires_grad_(True)
        with CommAudit() as audit:
            launched_at_input = []
            x.register_hook(lambda grad: launched_at_input.append(
                len(audit.record.calls_of("allreduce_"))))
            nn.functional.mse_loss(wrapped(x), y_all[share]).backward()
            launched_in_backward = len(audit.record.calls_of("allreduce_"))
            result = wrapped.finish_gradient_synchronization()
        observed = StepRecord(result, audit.record, launched_at_input[:1],
                              launched_in_backward)
        agree_on(expect_step, plan, observed, model, single, check_overlap,
                 f"{what}, step {step + 1}")
        optimizer.step()
        single_optimizer.step()
    agree_on(expect_same_weights, model, single, f"{what}: after {steps} steps")
    return len(plan.with_grad)


class BucketPlan:
    """What the contract says must happen in every step, for one model and cap."""

    def __init__(self, model: nn.Module, bucket_cap_mb: float):
        params = dict(model.named_parameters())
        unused = {n for n in params if n.startswith("aux.")}
        self.with_grad = [b for b in expected_buckets(model, bucket_cap_mb) if set(b) - unused]
        self.bucket_bytes = sorted(sum(params[n].numel() * params[n].element_size() for n in b)
                                   for b in self.with_grad)
        self.exact_sizes = not unused  # a bucket with an unused parameter may leave it out
        # Buckets holding no first-layer (and no unused) parameter are complete before backward
        # reaches the input.
        late = {"inp.weight", "inp.bias"} | unused
        self.early = sum(1 for b in self.with_grad if not late & set(b))


class StepRecord:
    def __init__(self, result, record, launched_at_input, launched_in_backward):
        self.result, self.record = result, record
        self.launched_at_input = launched_at_input
        self.launched_in_backward = launched_in_backward


def expect_construction(wrapped, record, model, single, what) -> None:
    if not isinstance(wrapped, nn.Module):
        raise CheckFailed(f"{what}: BucketedDDP must be a torch.nn.Module")
    if not record.collectives:
        raise CheckFailed(f"{what}: the constructor made no collective call; it must broadcast "
                          "rank 0's parameters and buffers")
    expect_rank0_state(model, single, f"{what}, right after BucketedDDP(...)")


def expect_step(plan: BucketPlan, observed: StepRecord, model, single, check_overlap,
                where) -> None:
    if observed.result is not None:
        raise CheckFailed(f"{where}: finish_gradient_synchronization() must return None")
    calls = observed.record.calls_of("allreduce_")
    others = sorted(set(observed.record.collectives) - {"allreduce_"})
    if others:
        raise CheckFailed(f"{where}: only all-reduces are expected during a step, got {others}")
    if len(calls) != len(plan.with_grad):
        raise CheckFailed(f"{where}: expected {len(plan.with_grad)} all-reduce calls (one per "
                          f"bucket: {plan.with_grad}), got {len(calls)}")
    if plan.exact_sizes and sorted(calls) != plan.bucket_bytes:
        raise CheckFailed(f"{where}: all-reduced tensors of {sorted(calls)} bytes; the buckets "
                          f"hold {plan.bucket_bytes} bytes")
    started = observed.launched_at_input
    if check_overlap and plan.early and started and started[0] < plan.early:
        raise CheckFailed(
            f"{where}: when backward reached the input only {started[0]} all-reduce(s) had "
            f"started, but {plan.early} bucket(s) were complete by then: each bucket's all-reduce "
            "must start (async_op=True) as soon as its last gradient is ready, during backward "
            f"({observed.launched_in_backward} started during backward in all)")
    rtol, atol = TOLERANCES[next(model.parameters()).dtype]
    reference = dict(single.named_parameters())
    for name, p in model.named_parameters():
        expected = reference[name].grad
        if expected is None:
            if p.grad is not None:
                raise CheckFailed(f"{where}: {name!r} got no gradient in this step; its .grad "
                                  "must stay None")
            continue
        if p.grad is None:
            raise CheckFailed(f"{where}: {name!r}.grad is None after "
                              "finish_gradient_synchronization()")
        expect_close(p.grad, expected, f"{where}: {name}.grad (mean over ranks = one process on "
                     "the whole batch)", rtol, atol)


def expect_same_weights(model, single, what) -> None:
    reference = dict(single.named_parameters())
    for name, p in model.named_parameters():
        rtol, atol = TOLERANCES[p.dtype]
        expect_close(p.detach(), reference[name].detach(), f"{what}, {name} (vs one process)",
                     rtol, atol)


def check_bucketed_ddp_matches_one_process(BucketedDDP) -> None:
    run_student(bucketed_training_case, 2, BucketedDDP, 0.001)


def check_bucketed_ddp_one_allreduce_per_bucket(BucketedDDP) -> None:
    """Caps giving one parameter per bucket, several per bucket, and one bucket for all."""
    for bucket_cap_mb in (1e-6, 0.0015, 25.0):
        run_student(bucketed_training_case, 2, BucketedDDP, bucket_cap_mb, "plain", "float32", 1,
                    2, False)


def check_bucketed_ddp_overlaps_backward(BucketedDDP) -> None:
    run_student(bucketed_training_case, 2, BucketedDDP, 1e-6, "plain", "float32", 2, 1, True)
