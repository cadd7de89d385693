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
# # Exercise 09: collectives that hang
#
# A collective (`all_reduce`, `broadcast`, `all_gather`, and the ones DDP makes for you) completes
# only when **every** rank calls it, in the same order, with tensors of the same size. Each lab
# below is a piece of a real training or evaluation job in which one rank calls a collective
# that another does not, or calls it with another size. None of them raises a friendly error:
# depending on what the other ranks do next, the job hangs, gloo kills a process, or the
# collectives pair up with the wrong partners and the job goes on.
#
# Per lab: read the given function (locked), run it (the "Run it" cell launches it on 2 real
# gloo ranks with a deadline of a few seconds, and shows what each rank was doing when it
# failed), write down your diagnosis (`diagnose_<lab>()`: the facts its docstring asks, each
# something the given code does in that run), then write the fixed function below it: same name
# without `buggy_`, same arguments, and the docstring is the contract.
#
# **How it is tested.** The tests call your function on every rank of a real gloo process group
# (as `run_ranks(fn, world_size)` does: use the default group, never `init_process_group` here),
# with a deadline of a few seconds. They require that every rank returns in time, the exact result
# the docstring asks for (steps, logged values, gathered rows; trained weights within 1e-5 of the
# ranks' DDP training, simulated where none of your code runs) and bit-identical parameters on all
# ranks at the end. The diagnoses have no visible test: each is graded when the notebook is
# graded, by a hidden test of its own, and that graded feedback explains what the given code did
# and the fixes that work, whether your diagnosis is right or not.
#
# **Points**: 13 for the fixes' visible tests, 4 for their hidden tests, and 1 for each lab's
# diagnosis (5), 22 in all.
#
# **Self-check** from the repository root: `pytest exercises/09_debugging/collectives_that_hang.ipynb`
# (the fixes' visible tests). The fixes' hidden tests (3 and 4 ranks, other shard lengths, a bad
# batch on another rank or on two ranks at once, an empty batch, no bad batch at all, a last batch
# of one row, equal sizes) and the diagnoses' tests run when the notebook is graded. Keep the
# names and signatures exactly as given, and do not reassign library functions (the tests check
# for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import collectives_that_hang as checks
from ddpcourse.launcher import RankError, run_ranks

setup_notebook("collectives_that_hang")

# %% nbgrader={"grade": false, "grade_id": "run-it", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: how the "Run it" cells launch a lab's function.
def run_it(fn, world_size=2, timeout=3):
    """Run ``fn(rank, world_size)`` on real gloo ranks; print what came back or what failed."""
    try:
        for rank, result in enumerate(run_ranks(fn, world_size, timeout=timeout,
                                                backend="gloo", relay_output=False)):
            print(f"rank {rank} returned {result}")
    except RankError as failed:
        print(failed)


# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-log", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 1: the loss is averaged for the log on rank 0 only
#
# Only rank 0 writes the log, so its author put the whole logging block under
# `if dist.get_rank() == 0`. Run (a), where the last step is a log step, and (b), where training
# goes on after a log step: the two runs fail in different ways. Read what each rank was doing
# (the stacks at the deadline, the exit codes, the message on the rank's stderr) and work out
# why: which collective of one rank met which of the other? Write your diagnosis in
# `diagnose_log`, then the fix, `train_and_log`. The visible test checks the fix; the diagnosis is
# graded when the notebook is graded, and that graded feedback explains what happened and the
# fixes that work.

# %% nbgrader={"grade": false, "grade_id": "given-log", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the given code. Do not fix it here; write `train_and_log` below.
def buggy_train_and_log(model, batches, lr, log_every, log):
    """Train `model` with DDP on this rank's batches; every `log_every` steps, rank 0 logs the
    loss averaged over the ranks."""
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for step, (x, y) in enumerate(batches, start=1):
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dist.get_rank() == 0 and step % log_every == 0:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # add the other ranks' losses
            log(step, mean_loss.item() / dist.get_world_size())


# %%
# Run it: 4 steps on 2 ranks, (a) logging every 4 steps, (b) every 2 steps.
def demo_log(rank, world_size, train_and_log, log_every):
    model = checks.make_linear(checks.model_seed(0, rank))
    logged = []
    train_and_log(model, checks.make_batches(0, rank, 4, 4), 0.1, log_every,
                  lambda step, value: logged.append((step, round(value, 4))))
    return logged


print("(a) logging every 4 steps:")
run_it(lambda rank, world_size: demo_log(rank, world_size, buggy_train_and_log, 4))
print("\n(b) logging every 2 steps:")
run_it(lambda rank, world_size: demo_log(rank, world_size, buggy_train_and_log, 2))


# %% nbgrader={"grade": false, "grade_id": "diagnose-log", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_log() -> dict:
    """Your diagnosis of the two runs above (the given loop, 2 ranks, 4 steps), a dict with the
    keys:

    * "hung_rank" (int): in run (a), the rank still running at the deadline;
    * "hung_in" (str): the torch.distributed function that rank is blocked in, e.g. "barrier";
    * "aborted_rank" (int): in run (b), the rank gloo aborts;
    * "paired_with_step" (int): in run (b), the aborted rank's last collective was met by one of
      the other rank: DDP's gradient all-reduce of which of that rank's steps (1, 2, ...)?
    """
    ### BEGIN SOLUTION
    return {"hung_rank": 0, "hung_in": "all_reduce", "aborted_rank": 0, "paired_with_step": 3}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-log-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_log(): the rank that hangs in run (a) and the function it waits in, the rank gloo aborts in run (b) and the step of the other rank's all-reduce that met its last one.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import collectives_that_hang as hidden
hidden.check_log_diagnosis(diagnose_log)
print("passed")
### END HIDDEN TESTS


# %% nbgrader={"grade": false, "grade_id": "train_and_log", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_and_log(model, batches, lr, log_every, log) -> None:
    """Train `model` with DDP on this rank's batches; rank 0 logs the loss averaged over the ranks.

    Called on every rank of the default process group (gloo, CPU), each with its own `model`
    (an `nn.Module`, initialised differently on every rank) and its own `batches` (one `(x, y)`
    per step, the same number on every rank).

    * Step s (1, 2, ...): wrap `model` in DDP once (it is trained in place), then per batch
      `loss = F.mse_loss(ddp_model(x), y)`, zero_grad, backward, and one step of plain
      `torch.optim.SGD(..., lr=lr)`.
    * After every step s that is a multiple of `log_every`, rank 0 calls `log(s, value)` once,
      where `value` (a Python float) is the mean over the ranks of their step-s losses. The
      other ranks never call `log`.
    * Every rank returns (nothing) within the deadline, with bit-identical parameters.
    """
    ### BEGIN SOLUTION
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for step, (x, y) in enumerate(batches, start=1):
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % log_every == 0:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # every rank joins; only rank 0 writes
            if dist.get_rank() == 0:
                log(step, mean_loss.item() / dist.get_world_size())
    ### END SOLUTION


# %%
# Try yours: the same two runs.
run_it(lambda rank, world_size: demo_log(rank, world_size, train_and_log, 4))
run_it(lambda rank, world_size: demo_log(rank, world_size, train_and_log, 2))

# %% nbgrader={"grade": true, "grade_id": "test-train-and-log", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, 4 steps, logging every 2: rank 0 logs the mean loss over the ranks at steps 2 and 4; identical replicas.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import collectives_that_hang as checks
integrity.assert_untampered()
checks.check_train_and_log(train_and_log)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-evaluate", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 2: rank 0 evaluates through the DDP wrapper
#
# After each epoch rank 0 alone computes a validation loss, in eval mode and under
# `torch.no_grad()`, by calling the DDP wrapper. The model has a BatchNorm layer. Run it: the
# first epochs go by, and after the last one rank 0 never returns. Where is it waiting, and for
# what? (Its stack at the deadline names the function; torch/nn/parallel/distributed.py holds
# it.) Why did the earlier epochs not hang too? Write your diagnosis in `diagnose_evaluate`, then
# the fix, `fit_and_evaluate`. The visible test checks the fix; the diagnosis is graded when the
# notebook is graded, and that graded feedback explains what happened and the fixes that work.

# %% nbgrader={"grade": false, "grade_id": "given-evaluate", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the given code. Do not fix it here; write `fit_and_evaluate` below.
def buggy_fit_and_evaluate(model, batches, eval_batch, epochs, lr):
    """Train `model` with DDP for `epochs` epochs; after each, rank 0 records the validation
    loss on `eval_batch`."""
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    history = []
    for epoch in range(epochs):
        for x, y in batches:
            loss = F.mse_loss(ddp_model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:  # one rank is enough to evaluate
            ddp_model.eval()
            with torch.no_grad():
                x, y = eval_batch
                history.append(F.mse_loss(ddp_model(x), y).item())
            ddp_model.train()
    return history


# %%
# Run it: 2 ranks, 2 epochs of 3 steps.
def demo_evaluate(rank, world_size, fit_and_evaluate):
    model = checks.make_bn_model(checks.model_seed(0, rank))
    history = fit_and_evaluate(model, checks.make_batches(0, rank, 3, 6),
                               checks.make_batch(0, 99, 0, 12), 2, 0.1)
    return [round(value, 4) for value in history]


run_it(lambda rank, world_size: demo_evaluate(rank, world_size, buggy_fit_and_evaluate))


# %% nbgrader={"grade": false, "grade_id": "diagnose-evaluate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_evaluate() -> dict:
    """Your diagnosis of the run above (the given loop, 2 ranks, 2 epochs of 3 steps), a dict
    with the keys:

    * "hung_rank" (int): the rank still running at the deadline;
    * "collective" (str): the kind of collective it waits in: "all_reduce", "broadcast",
      "all_gather" or "barrier";
    * "evaluations_completed" (int): how many evaluations that rank completed (appended to its
      history) before it hung;
    * "hangs_without_buffers" (bool): whether the same run hangs when the model has no buffers
      (`checks.make_linear`, a plain `nn.Linear(4, 1)`, in place of `checks.make_bn_model`).
    """
    ### BEGIN SOLUTION
    return {"hung_rank": 0, "collective": "broadcast", "evaluations_completed": 1,
            "hangs_without_buffers": False}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-evaluate-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_evaluate(): the rank that hangs, the kind of collective it waits in, the evaluations it completed, whether a model without buffers hangs too.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import collectives_that_hang as hidden
hidden.check_evaluate_diagnosis(diagnose_evaluate)
print("passed")
### END HIDDEN TESTS


# %% nbgrader={"grade": false, "grade_id": "fit_and_evaluate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fit_and_evaluate(model, batches, eval_batch, epochs, lr) -> list:
    """Train `model` (it has BatchNorm) with DDP for `epochs` epochs; rank 0 returns the
    validation loss after each epoch.

    Called on every rank of the default process group (gloo, CPU), each with its own `model`
    (initialised differently on every rank), its own `batches` (a list of `(x, y)`, the same
    number on every rank) and the same `eval_batch = (x, y)`.

    * Wrap `model` in DDP once, with the default arguments (it is trained in place). An epoch
      is one step per batch, in order: `loss = F.mse_loss(ddp_model(x), y)`, zero_grad,
      backward, one step of plain `torch.optim.SGD(..., lr=lr)`.
    * After every epoch (the last one too), rank 0 computes `F.mse_loss(prediction, y)` on
      `eval_batch` with the model in eval mode (BatchNorm uses its running statistics and does
      not update them), without gradients, and appends it (a Python float) to its list. The
      evaluation must not change the training: afterwards the model trains in train mode again.
    * Rank 0 returns its list; every other rank returns `[]`. Every rank returns within the
      deadline, with bit-identical parameters, and the model handed in left in train mode.
    """
    ### BEGIN SOLUTION
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    history = []
    for epoch in range(epochs):
        for x, y in batches:
            loss = F.mse_loss(ddp_model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            # The plain module: no buffer broadcast, no collective at all.
            ddp_model.module.eval()
            with torch.no_grad():
                x, y = eval_batch
                history.append(F.mse_loss(ddp_model.module(x), y).item())
            ddp_model.module.train()
    return history
    ### END SOLUTION


# %%
# Try yours.
run_it(lambda rank, world_size: demo_evaluate(rank, world_size, fit_and_evaluate))

# %% nbgrader={"grade": true, "grade_id": "test-fit-and-evaluate", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, 2 epochs: rank 0's validation loss after each epoch (eval mode), [] elsewhere; training untouched; identical replicas.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import collectives_that_hang as checks
integrity.assert_untampered()
checks.check_fit_and_evaluate(fit_and_evaluate)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-shard", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 3: shards of different lengths
#
# The data is a stream (an `IterableDataset`) sharded by rank, and shards are rarely the same
# length. Each rank loops until its own shard runs out. Run it: one rank returns, the other does
# not. Which one waits, in what, and in which step? Note that the stream does not know its
# length (`len(shard)` raises). Write your diagnosis in `diagnose_shard`, then the fix,
# `train_on_shard`. The visible test checks the fix; the diagnosis is graded when the notebook is
# graded, and that graded feedback explains what happened and the fixes that work.

# %% nbgrader={"grade": false, "grade_id": "given-shard", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the given code. Do not fix it here; write `train_on_shard` below.
def buggy_train_on_shard(model, shard, batch_size, lr):
    """Train `model` with DDP on this rank's shard of the stream; return the number of steps."""
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    steps = 0
    for x, y in DataLoader(shard, batch_size=batch_size):
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    return steps


# %%
# Run it: shards of 10 and 7 samples, batches of 3.
def demo_shard(rank, world_size, train_on_shard, lengths=(10, 7)):
    model = checks.make_linear(checks.model_seed(0, rank))
    return train_on_shard(model, checks.Shard(0, rank, lengths[rank]), 3, 0.1)


run_it(lambda rank, world_size: demo_shard(rank, world_size, buggy_train_on_shard))


# %% nbgrader={"grade": false, "grade_id": "diagnose-shard", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_shard() -> dict:
    """Your diagnosis of the run above (the given loop, 2 ranks, shards of 10 and 7 samples,
    batches of 3), a dict with the keys:

    * "hung_rank" (int): the rank still running at the deadline;
    * "hung_in" (str): the call on the given code's line that rank is blocked in (the frame
      right above the given function's own in its stack), by its function's name, e.g. "step";
    * "hung_at_step" (int): the step (1, 2, ...) that rank is in at the deadline.
    """
    ### BEGIN SOLUTION
    return {"hung_rank": 0, "hung_in": "backward", "hung_at_step": 4}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-shard-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_shard(): the rank that hangs, the call it is blocked in, the step it is in.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import collectives_that_hang as hidden
hidden.check_shard_diagnosis(diagnose_shard)
print("passed")
### END HIDDEN TESTS


# %% nbgrader={"grade": false, "grade_id": "train_on_shard", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_on_shard(model, shard, batch_size, lr) -> int:
    """Train `model` with DDP on this rank's shard of a stream, as many steps as EVERY rank can
    take; return that number of steps.

    Called on every rank of the default process group (gloo, CPU), each with its own `model`
    (initialised differently on every rank) and its own `shard`: an `IterableDataset` of
    `(x, y)` samples whose length differs between ranks and is unknown in advance (no `len`).

    * The batches are those of `DataLoader(shard, batch_size=batch_size)` in order (the last
      may be smaller). Wrap `model` in DDP once (it is trained in place); one step per batch:
      `loss = F.mse_loss(ddp_model(x), y)`, zero_grad, backward, one step of plain
      `torch.optim.SGD(..., lr=lr)`.
    * Every rank takes the same number of steps: the number of batches of the SHORTEST shard
      (0 if a shard is empty). The other ranks' remaining batches are not trained on.
    * Every rank returns that number (an int) within the deadline, with bit-identical parameters.
    """
    ### BEGIN SOLUTION
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    batches = iter(DataLoader(shard, batch_size=batch_size))
    steps = 0
    while True:
        batch = next(batches, None)
        # 1 while this rank has a batch; the minimum over the ranks: does every rank have one?
        everyone_has_one = torch.tensor([0 if batch is None else 1])
        dist.all_reduce(everyone_has_one, op=dist.ReduceOp.MIN)
        if everyone_has_one.item() == 0:
            return steps
        x, y = batch
        loss = F.mse_loss(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    ### END SOLUTION


# %%
# Try yours.
run_it(lambda rank, world_size: demo_shard(rank, world_size, train_on_shard))

# %% nbgrader={"grade": true, "grade_id": "test-train-on-shard", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, shards of 10 and 7 samples in batches of 3: 3 steps on every rank, the weights of those steps, identical replicas.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import collectives_that_hang as checks
integrity.assert_untampered()
checks.check_train_on_shard(train_on_shard)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-skip", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 4: one rank skips a bad batch, or stops early, alone
#
# Two decisions in this loop are taken by each rank on its own numbers: skip a step whose loss
# is not finite (a corrupt batch, an empty one), and stop once the loss is low enough. Run it:
# rank 1 has a NaN at step 2. Which rank is left waiting at the deadline, and in which step?
# What did the steps between the bad batch and the hang average? Write your diagnosis in
# `diagnose_skip`, then the fix, `train_skipping_bad_batches`. The visible test checks the fix;
# the diagnosis is graded when the notebook is graded, and that graded feedback explains what
# happened and the fixes that work.

# %% nbgrader={"grade": false, "grade_id": "given-skip", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the given code. Do not fix it here; write `train_skipping_bad_batches` below.
def buggy_train_skipping_bad_batches(model, batches, lr, stop_below):
    """Train `model` with DDP, skipping bad batches and stopping early; return the steps
    applied."""
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    applied = []
    for step, (x, y) in enumerate(batches, start=1):
        loss = F.mse_loss(ddp_model(x), y)
        if not torch.isfinite(loss):  # a corrupt batch: skip it
            continue
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        applied.append(step)
        if loss.item() < stop_below:  # good enough
            break
    return applied


# %%
# Run it: 2 ranks, 6 steps, rank 1's batch of step 2 holds a NaN.
def demo_skip(rank, world_size, train_skipping_bad_batches):
    model = checks.make_linear(checks.model_seed(0, rank))
    batches = checks.lab4_batches(0, rank, 6, 4, [[1, 2, "nan"]])
    return train_skipping_bad_batches(model, batches, 0.1, 0.05)


run_it(lambda rank, world_size: demo_skip(rank, world_size, buggy_train_skipping_bad_batches))


# %% nbgrader={"grade": false, "grade_id": "diagnose-skip", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_skip() -> dict:
    """Your diagnosis of the run above (the given loop, 2 ranks, 6 steps, a NaN in rank 1's batch
    of step 2), a dict with the keys:

    * "hung_rank" (int): the rank still running at the deadline;
    * "hung_at_step" (int): the step (1, 2, ...: the number of the batch) that rank is in at
      the deadline;
    * "mixed_steps" (list of int): that rank's steps, in order, whose gradient all-reduce
      averaged its gradients with the other rank's gradients of a DIFFERENT step.
    """
    ### BEGIN SOLUTION
    return {"hung_rank": 0, "hung_at_step": 6, "mixed_steps": [2, 3, 4, 5]}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-skip-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_skip(): the rank that hangs, the step it is in, its steps that averaged gradients of two different steps.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import collectives_that_hang as hidden
hidden.check_skip_diagnosis(diagnose_skip)
print("passed")
### END HIDDEN TESTS


# %% nbgrader={"grade": false, "grade_id": "train_skipping_bad_batches", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_skipping_bad_batches(model, batches, lr, stop_below) -> list:
    """Train `model` with DDP; skip a step on every rank when any rank's batch is bad, stop on
    every rank once the loss over the ranks is low enough; return the steps applied.

    Called on every rank of the default process group (gloo, CPU), each with its own `model`
    (initialised differently on every rank) and its own `batches` (one `(x, y)` per step, the
    same number on every rank; a batch may hold a NaN, or no rows).

    * Wrap `model` in DDP once (it is trained in place). At step s (1, 2, ...) every rank
      computes `loss = F.mse_loss(ddp_model(x), y)` on its batch.
    * If ANY rank's loss is not finite, EVERY rank skips step s: no backward, no optimizer step.
    * Otherwise every rank does zero_grad, backward and one step of plain
      `torch.optim.SGD(..., lr=lr)`, and appends s to its list. Then, if the mean over the ranks
      of their step-s losses is below `stop_below`, every rank stops: no further step.
    * Every rank returns the same list of applied steps (ints, in order) within the deadline,
      with bit-identical parameters.
    """
    ### BEGIN SOLUTION
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    world_size = dist.get_world_size()
    applied = []
    for step, (x, y) in enumerate(batches, start=1):
        loss = F.mse_loss(ddp_model(x), y)
        bad_ranks = torch.tensor([0 if torch.isfinite(loss) else 1])
        dist.all_reduce(bad_ranks)  # how many ranks have a bad batch: the same everywhere
        if bad_ranks.item() > 0:
            continue
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        applied.append(step)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if mean_loss.item() / world_size < stop_below:
            break
    return applied
    ### END SOLUTION


# %%
# Try yours.
run_it(lambda rank, world_size: demo_skip(rank, world_size, train_skipping_bad_batches))

# %% nbgrader={"grade": true, "grade_id": "test-train-skipping-bad-batches", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks: a NaN in rank 1's batch of step 2, then a run that stops early; the same applied steps on every rank, their weights, identical replicas.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import collectives_that_hang as checks
integrity.assert_untampered()
checks.check_train_skipping_bad_batches(train_skipping_bad_batches)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-gather", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 5: `all_gather` of a smaller last batch
#
# Evaluation sharded without padding gives the ranks different numbers of predictions (10
# samples on 4 ranks: 3, 3, 2, 2), and the last batch of an epoch is often smaller. Run it, and
# read the exit code and the message on the failing rank's stderr: that rank raises no Python
# exception. Which rank fails, and which would with the sizes swapped? Write your diagnosis in
# `diagnose_gather`, then the fix, `gather_predictions`. The visible test checks the fix; the
# diagnosis is graded when the notebook is graded, and that graded feedback explains what
# happened and the fixes that work.

# %% nbgrader={"grade": false, "grade_id": "given-gather", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the given code. Do not fix it here; write `gather_predictions` below.
def buggy_gather_predictions(local):
    """Every rank's predictions, concatenated in rank order, on every rank."""
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)
    return torch.cat(everyone)


# %%
# Run it: rank 0 holds 4 predicted labels, rank 1 holds 3.
def demo_gather(rank, world_size, gather_predictions):
    return gather_predictions(checks.predictions(0, rank, [4, 3][rank], "labels")).tolist()


run_it(lambda rank, world_size: demo_gather(rank, world_size, buggy_gather_predictions))


# %% nbgrader={"grade": false, "grade_id": "diagnose-gather", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_gather() -> dict:
    """Your diagnosis of the run above (the given gather, rank 0 holds 4 labels, rank 1 holds 3),
    a dict with the keys:

    * "aborted_rank" (int): the rank gloo aborts;
    * "exitcode" (int): the exit code of that rank's process;
    * "aborted_rank_swapped" (int): the rank gloo aborts when the sizes are swapped (rank 0
      holds 3 labels, rank 1 holds 4).
    """
    ### BEGIN SOLUTION
    return {"aborted_rank": 1, "exitcode": -6, "aborted_rank_swapped": 0}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-gather-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_gather(): the rank gloo aborts, its exit code, the rank it aborts with the sizes swapped.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import collectives_that_hang as hidden
hidden.check_gather_diagnosis(diagnose_gather)
print("passed")
### END HIDDEN TESTS


# %% nbgrader={"grade": false, "grade_id": "gather_predictions", "locked": false, "schema_version": 3, "solution": true, "task": false}
def gather_predictions(local: torch.Tensor) -> torch.Tensor:
    """Every rank's predictions, concatenated in rank order, on every rank.

    Called on every rank of the default process group (gloo, CPU). `local` is this rank's
    tensor of predictions: any number of rows (dimension 0, possibly different on every rank,
    at least 1), the other dimensions and the dtype (int64 labels or float32 scores) the same on
    every rank.

    Every rank returns `torch.cat([local of rank 0, local of rank 1, ...])`: a tensor of that
    dtype holding every rank's rows exactly once, in rank order, without padding, within the
    deadline.
    """
    ### BEGIN SOLUTION
    world_size = dist.get_world_size()
    size = torch.tensor([local.shape[0]])
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    largest = max(int(n) for n in sizes)
    padded = local.new_zeros((largest, *local.shape[1:]))
    padded[:local.shape[0]] = local
    everyone = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(everyone, padded)
    return torch.cat([rows[:int(n)] for rows, n in zip(everyone, sizes)])
    ### END SOLUTION


# %%
# Try yours.
run_it(lambda rank, world_size: demo_gather(rank, world_size, gather_predictions))

# %% nbgrader={"grade": true, "grade_id": "test-gather-predictions", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks holding 4 and 3 labels, then 5 and 1 rows of scores: every rank gets every row, in rank order.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import collectives_that_hang as checks
integrity.assert_untampered()
checks.check_gather_predictions(gather_predictions)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-collectives-that-hang-hidden", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (4 points) 3 and 4 ranks for every lab: other shard lengths (one empty), bad batches on other ranks, two at once, an empty batch, none at all, a last batch of one row, equal sizes.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import collectives_that_hang as hidden
hidden.check_collectives_that_hang(train_and_log, fit_and_evaluate, train_on_shard,
                                   train_skipping_bad_batches, gather_predictions)
print("passed")
### END HIDDEN TESTS
