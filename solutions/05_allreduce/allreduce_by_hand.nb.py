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
# # Exercise 05: AllReduce by hand
#
# You will write the two pieces of communication at the heart of DDP, and the tests will run your
# code in **real process groups** of 1 to 4 ranks (gloo, with CPU tensors, also on GPU machines).
#
# **How your code runs.** Each test calls your function inside `run_ranks(fn, world_size)`, which
# starts `world_size` processes, joins them in a process group, and calls `fn(rank, world_size)` in
# each. Inside your function use the default group as usual: `dist.get_rank()`,
# `dist.get_world_size()`, `dist.send(...)`. Do **not** call `init_process_group` in this notebook:
# `run_ranks` does it in every rank (in the notebook's own kernel it would wait forever, so the setup
# cell makes it raise instead).
#
# **Self-check** from the repository root: `pytest exercises/05_allreduce/allreduce_by_hand.ipynb` runs this
# notebook and reports each visible test (`pytest exercises/05_allreduce` runs part 2 too). Hidden tests (edge cases) run when the notebook is graded.
#
# **Rules.** Keep the function names and signatures exactly as given (they are the grading contract).
# Do not reassign library functions (`dist.all_reduce = ...`, `run_ranks = ...`): the tests check
# for it and fail.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import allreduce_by_hand as checks
from ddpcourse.launcher import run_ranks

setup_notebook("allreduce_by_hand")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-average-gradients", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 1. `average_gradients(model)` (4 points)
#
# After `loss.backward()`, each rank holds gradients computed from *its own* data. Averaging them
# over all ranks is DDP's gradient synchronisation in its simplest form (part 2, `bucketed_ddp`,
# builds the real one). Implement `average_gradients` as its docstring below says.

# %% nbgrader={"grade": false, "grade_id": "average-gradients", "locked": false, "schema_version": 3, "solution": true, "task": false}
def average_gradients(model: torch.nn.Module) -> None:
    """Replace each parameter's .grad with its mean over all ranks (skip .grad None).

    Called after `loss.backward()`, when each rank holds gradients computed from its own data.
    Replace every parameter's `.grad` by its mean over all ranks, in place. Parameters whose
    `.grad` is `None` (frozen, or not used in this step) are skipped and must stay `None`. A weight
    shared by two layers appears once in `model.parameters()`: average it once. You may use
    `dist.all_reduce`.

    Args:
        model: this rank's model, after `backward()`.

    Returns:
        None: the gradients change in place.
    """
    ### BEGIN SOLUTION
    world_size = dist.get_world_size()
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            parameter.grad /= world_size
    ### END SOLUTION


# %%
# Try it: two ranks, different data, then compare the averaged gradient on both ranks.
def try_average(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    torch.manual_seed(rank)
    model(torch.randn(4, 3)).sum().backward()
    average_gradients(model)
    return model.weight.grad

run_ranks(try_average, 2, timeout=15, backend="gloo")  # CPU tensors: gloo, also on GPUs

# %% nbgrader={"grade": true, "grade_id": "test-average-gradients-two-ranks", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): two ranks, every parameter has a gradient.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import allreduce_by_hand as checks
integrity.assert_untampered()
checks.check_average_gradients_two_ranks(average_gradients)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-average-gradients-skips-missing", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Test (1 point): a frozen bias and an unused layer keep .grad None.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import allreduce_by_hand as checks
integrity.assert_untampered()
checks.check_average_gradients_skips_missing(average_gradients)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-average-gradients-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) world sizes 1, 3 and 4, float64, and a weight shared by two layers.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import allreduce_by_hand as hidden
hidden.check_average_gradients(average_gradients)
print("passed")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-ring-allreduce", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 2. `ring_allreduce(tensor)` (9 points)
#
# Now the all-reduce itself, built from point-to-point messages around a ring of ranks: implement
# `ring_allreduce` as its docstring below says. It lists the calls you may use, the cases it must
# handle, and how little each rank may send.
#
# Hint: `tensor.view(-1).tensor_split(N)` gives N views that write through to `tensor`. In each step,
# post the send to your right neighbour with `dist.isend` *before* the blocking `dist.recv` from
# your left one: a blocking `dist.send` returns only once its receiver has posted the `recv`, so with
# two blocking calls in the same order on every rank the ring deadlocks, and the tests say so.

# %% nbgrader={"grade": false, "grade_id": "ring-allreduce", "locked": false, "schema_version": 3, "solution": true, "task": false}
def ring_allreduce(tensor: torch.Tensor) -> None:
    """In-place SUM all-reduce over the default group with send/recv only.

    An in-place SUM all-reduce of `tensor` over the default group, as a ring, using only
    point-to-point calls: `dist.send`, `dist.recv`, `dist.isend`, `dist.irecv` (or
    `dist.batch_isend_irecv`). No collective of any kind (`all_reduce`, `reduce_scatter`,
    `all_gather`, `broadcast`, `barrier`, ...): the tests record every communication call your ranks
    make.

    Requirements the tests check:

    * correct for world sizes 1 to 4, any number of elements (also fewer elements than ranks, and
      lengths that do not divide by the world size), any shape (the tensor is contiguous), and
      `float32`, `float64` and `int64`;
    * in place: after the call, `tensor` itself holds the sum;
    * bandwidth-optimal: each rank sends about `2(N-1)/N` of the tensor's bytes - split the tensor
      into N chunks, reduce-scatter them around the ring (N-1 steps), then all-gather them (N-1 more
      steps). Sending the whole tensor to every peer moves `N/2` times more data and fails.
    * deadlock-free: a blocking `dist.send` returns only once the receiving rank has posted its
      `recv` (on gloo and NCCL, at every message size, and in the graded runs), so a ring in which
      every rank sends before it receives never starts; post each send with `dist.isend` before
      the blocking `dist.recv`, and `wait()` for it afterwards.

    Args:
        tensor: this rank's contribution, contiguous; it receives the sum.

    Returns:
        None: `tensor` itself holds the sum.
    """
    ### BEGIN SOLUTION
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size == 1:
        return
    chunks = list(tensor.view(-1).tensor_split(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size

    def exchange(send_index, recv_index):
        incoming = torch.empty_like(chunks[recv_index])
        request = dist.isend(chunks[send_index].contiguous(), right)
        dist.recv(incoming, left)
        request.wait()
        return incoming

    for step in range(world_size - 1):  # reduce-scatter: chunk (rank + 1) ends complete here
        recv_index = (rank - step - 1) % world_size
        chunks[recv_index] += exchange((rank - step) % world_size, recv_index)
    for step in range(world_size - 1):  # all-gather: pass the complete chunks around
        recv_index = (rank - step) % world_size
        chunks[recv_index].copy_(exchange((rank + 1 - step) % world_size, recv_index))
    ### END SOLUTION


# %%
# Try it: compare with dist.all_reduce on 3 ranks.
def try_ring(rank, world_size):
    t = torch.arange(7.0) * (rank + 1)
    expected = t.clone()
    dist.all_reduce(expected)
    ring_allreduce(t)
    return t, torch.equal(t, expected)

run_ranks(try_ring, 3, timeout=15, backend="gloo")  # CPU tensors: gloo, also on GPUs

# %% nbgrader={"grade": true, "grade_id": "test-ring-allreduce-two-ranks", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): two ranks, even and odd lengths.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import allreduce_by_hand as checks
integrity.assert_untampered()
checks.check_ring_allreduce_two_ranks(ring_allreduce)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-ring-allreduce-world-sizes", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 3 and 4 ranks, lengths 10, 2 (fewer elements than ranks) and 5N.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import allreduce_by_hand as checks
integrity.assert_untampered()
checks.check_ring_allreduce_world_sizes(ring_allreduce)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-ring-allreduce-bandwidth", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 4 ranks, 1000 float32: point-to-point only, ~2(N-1)/N of the bytes per rank.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import allreduce_by_hand as checks
integrity.assert_untampered()
checks.check_ring_allreduce_is_bandwidth_optimal(ring_allreduce)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-ring-allreduce-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) world sizes 1-4, int64 / float64 / 2-D tensors, seeds, uneven chunks, traffic.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import allreduce_by_hand as hidden
hidden.check_ring_allreduce(ring_allreduce)
print("passed")
### END HIDDEN TESTS
