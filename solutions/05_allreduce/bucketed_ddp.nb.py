# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise 05 (part 2): your own DistributedDataParallel
#
# `average_gradients` (part 1) is the *naive* design of the PyTorch DDP paper (Li et al., VLDB 2020):
# wait for the whole backward pass, then all-reduce every gradient, one call per parameter. Real DDP
# does better in two ways, and you will build both:
#
# * **buckets**: many small all-reduces cost a latency each; DDP packs gradients into buckets of
#   about `bucket_cap_mb` MiB (25 by default) and all-reduces one flat tensor per bucket;
# * **overlap**: a bucket's all-reduce starts, asynchronously, the moment its last gradient is
#   ready, while autograd is still computing the gradients of earlier layers. Gradients become
#   ready roughly in *reverse* order of `model.parameters()` (the last layer's first), so buckets
#   are filled in reverse order.
#
# Before any of that, DDP's constructor **broadcasts rank 0's parameters and buffers**: replicas
# initialised from different seeds would otherwise train different models with averaged gradients.
#
# As in part 1, the tests run your code in real process groups (`run_ranks`; do not call
# `init_process_group` here). **Self-check:** `pytest exercises/05_allreduce/bucketed_ddp.ipynb`
# (`pytest exercises/05_allreduce` runs part 1 too).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import bucketed_ddp as checks
from ddpcourse.launcher import run_ranks

setup_notebook("bucketed_ddp")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-broadcast-parameters", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 3. `broadcast_parameters(module)` (3 points)
#
# What DDP's constructor does first (see above): every rank starts from rank 0's model. Implement
# `broadcast_parameters` as its docstring below says.

# %% nbgrader={"grade": false, "grade_id": "broadcast-parameters", "locked": false, "schema_version": 3, "solution": true, "task": false}
def broadcast_parameters(module: torch.nn.Module) -> None:
    """Give every parameter and buffer rank 0's value, in place.

    Make every parameter and buffer of `module` equal to rank 0's, on every rank of the default
    group. In place: the tensors keep their storage, so an optimizer created before the call must
    see the new values. Frozen parameters (`requires_grad=False`) and integer buffers (such as
    BatchNorm's `num_batches_tracked`) are included; a weight shared by two layers is one tensor.
    Do not create gradients.

    The tests seed every rank differently and compare with rank 0's initial values, exactly.

    Args:
        module: this rank's module.

    Returns:
        None.
    """
    ### BEGIN SOLUTION
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src=0)
    ### END SOLUTION


# %%
# Try it: each rank starts from its own seed, and ends with rank 0's weight.
def try_broadcast(rank, world_size):
    torch.manual_seed(rank)
    layer = torch.nn.Linear(2, 1)
    broadcast_parameters(layer)
    return layer.weight.detach()

run_ranks(try_broadcast, 3, timeout=15, backend="gloo")  # CPU tensors: gloo, also on GPUs

# %% nbgrader={"grade": true, "grade_id": "test-broadcast-parameters-two-ranks", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): two ranks seeded differently end with rank 0's parameters and buffer.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import bucketed_ddp as checks
integrity.assert_untampered()
checks.check_broadcast_parameters_two_ranks(broadcast_parameters)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-broadcast-parameters-buffers-and-frozen", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): 3 ranks: BatchNorm buffers (int64 too), a frozen bias, a tied weight.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import bucketed_ddp as checks
integrity.assert_untampered()
checks.check_broadcast_parameters_buffers_and_frozen(broadcast_parameters)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-broadcast-parameters-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) world sizes 1 and 4, float64, unused and tied layers.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import bucketed_ddp as hidden
hidden.check_broadcast_parameters(broadcast_parameters)
print("passed")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-bucketed-ddp", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 4. `class BucketedDDP(torch.nn.Module)` (10 points)
#
# Your own DDP, with both of the introduction's improvements: buckets, and all-reduces that overlap
# backward. Implement `BucketedDDP` as the docstrings below say: the class's (how it is used, what
# happens during `backward()`, what the tests check), `__init__`'s (the buckets) and
# `finish_gradient_synchronization`'s (the end of a step).
#
# Why the comparison with one process has a tolerance: the two differ only in the order float sums
# are taken, a few units in the last place per step; a wrong average, such as a sum, is off by more
# than 1e-2 somewhere.

# %% nbgrader={"grade": false, "grade_id": "bucketed-ddp", "locked": false, "schema_version": 3, "solution": true, "task": false}
class BucketedDDP(torch.nn.Module):
    """Gradient averaging in buckets, each all-reduced as soon as backward has filled it.

    Usage:

        wrapped = BucketedDDP(module, bucket_cap_mb)  # wraps module; module keeps its parameters
        wrapped(*args, **kwargs)                      # = module(*args, **kwargs)
        wrapped.finish_gradient_synchronization()     # after loss.backward(),
                                                      # before optimizer.step()

    During `backward()`: when the last gradient of a bucket has been accumulated (see
    `Tensor.register_post_accumulate_grad_hook`), flatten the bucket's gradients into one tensor
    and start `dist.all_reduce(flat, async_op=True)` on it, right there: one all-reduce per
    bucket, while autograd goes on with earlier layers.

    What the tests check: they train the wrapper for a few SGD steps and compare with one process
    training rank 0's model on all ranks' data at once (tolerance `rtol=1e-5, atol=1e-6` in
    float32). They record your all-reduce calls: their number and sizes must match the buckets,
    each must be handed its bucket's gradients (whole, or already divided by the world size: the
    tests compare sums of squares), and they count how many had started when backward reached the
    model's input: by then every bucket that holds no first-layer parameter is complete, so its
    all-reduce must already be on its way. The tests use
    models with frozen parameters, unused layers and a weight shared by two layers.
    """

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float):
        """Wrap `module`: broadcast rank 0's state, then put the parameters into buckets.

        First call `broadcast_parameters(module)` (by that name: the tests of this class put
        rank 0's state in place of it, so that a mistake there costs only part 3's points). Then
        put the parameters that require gradients into buckets, walking `module.parameters()` in
        reverse order: add parameters to the current bucket until the next one would take it
        over `bucket_cap_mb` MiB (`bucket_cap_mb * 1024 * 1024` bytes, as DDP counts), then
        start a new bucket. A bucket may hold exactly the cap: start a new one only when the
        bucket's bytes plus the next parameter's would be *more* than the cap (`>`, not `>=`).
        A parameter larger than the cap gets a bucket of its own (so a tiny cap means one
        parameter per bucket). All of a model's parameters have one dtype. Keep the buckets
        however you like: the tests look at your all-reduces, not at your attributes.

        Args:
            module: the model to wrap; it keeps its parameters.
            bucket_cap_mb: the most a bucket may hold, in MiB.
        """
        super().__init__()
        self.module = module
        ### BEGIN SOLUTION
        broadcast_parameters(module)
        cap = bucket_cap_mb * 1024 * 1024
        self.buckets, current, size = [], [], 0
        for parameter in reversed([p for p in module.parameters() if p.requires_grad]):
            nbytes = parameter.numel() * parameter.element_size()
            if current and size + nbytes > cap:
                self.buckets.append(current)
                current, size = [], 0
            current.append(parameter)
            size += nbytes
        if current:
            self.buckets.append(current)
        self._bucket_of = {}
        for index, bucket in enumerate(self.buckets):
            for parameter in bucket:
                self._bucket_of[parameter] = index
                parameter.register_post_accumulate_grad_hook(self._gradient_ready)
        self._start_step()

    def _start_step(self):
        self._missing = [len(bucket) for bucket in self.buckets]
        self._in_flight = {}  # bucket index -> (work, flat gradients, parameters)

    def _gradient_ready(self, parameter):
        index = self._bucket_of[parameter]
        self._missing[index] -= 1
        if self._missing[index] == 0:
            self._launch(index)

    def _launch(self, index):
        ready = [p for p in self.buckets[index] if p.grad is not None]
        if ready:
            flat = torch.cat([p.grad.reshape(-1) for p in ready])
            self._in_flight[index] = (dist.all_reduce(flat, async_op=True), flat, ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """After `loss.backward()`, before `optimizer.step()`: every `.grad` becomes its mean.

        All-reduce the buckets that never became complete (a parameter got no gradient in this
        step: its `.grad` stays `None`; the bucket's other gradients are still averaged; a bucket
        with no gradient at all is skipped), wait for every all-reduce, and write the mean over
        ranks back into each `.grad`. Then be ready for the next step
        (`optimizer.zero_grad(set_to_none=True)` runs between steps).

        Returns:
            None.
        """
        ### BEGIN SOLUTION
        for index in range(len(self.buckets)):
            if index not in self._in_flight:
                self._launch(index)
        world_size = dist.get_world_size()
        for work, flat, parameters in self._in_flight.values():
            work.wait()
            flat /= world_size
            for parameter, mean in zip(parameters, flat.split([p.numel() for p in parameters])):
                parameter.grad.copy_(mean.view_as(parameter.grad))
        self._start_step()
        ### END SOLUTION


# %%
# Try it: two ranks, different data; after the step both hold the same averaged gradient.
def try_bucketed(rank, world_size):
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    wrapped = BucketedDDP(model, bucket_cap_mb=0.0001)
    wrapped(torch.randn(3, 4)).sum().backward()
    wrapped.finish_gradient_synchronization()
    return model[0].weight.grad[0]

first_rows = run_ranks(try_bucketed, 2, timeout=15, backend="gloo")  # CPU tensors: gloo, also on GPUs
print(first_rows, "same on both ranks:", torch.equal(*first_rows))

# %% nbgrader={"grade": true, "grade_id": "test-bucketed-ddp-matches-one-process", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, 3 SGD steps: rank 0's state after construction, then gradients and
# weights equal one process on the whole batch.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import bucketed_ddp as checks
integrity.assert_untampered()
checks.check_bucketed_ddp_matches_one_process(BucketedDDP)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-bucketed-ddp-one-allreduce-per-bucket", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): caps of 1e-6 MiB, exactly 1292 bytes (the first bucket fills it) and 25 MiB:
# one all-reduce per bucket, of the bucket's size, handed the bucket's gradients (the averaged
# gradients' values are the test above's).
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import bucketed_ddp as checks
integrity.assert_untampered()
checks.check_bucketed_ddp_one_allreduce_per_bucket(BucketedDDP)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-bucketed-ddp-overlaps-backward", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): complete buckets are all-reduced during backward, not after it (only when they start is judged).
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import bucketed_ddp as checks
integrity.assert_untampered()
checks.check_bucketed_ddp_overlaps_backward(BucketedDDP)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-bucketed-ddp-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) world sizes 1, 3 and 4, frozen, unused and tied parameters, a cap far below one parameter, float64.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import bucketed_ddp as hidden
hidden.check_bucketed_ddp(BucketedDDP)
print("passed")
### END HIDDEN TESTS
