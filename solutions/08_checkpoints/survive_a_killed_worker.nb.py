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
# # Exercise 08: survive a killed worker
#
# `torchrun --max_restarts 1` restarts the **whole** worker group when one worker dies: every
# process starts again from the top of the script, with a freshly built model, a new optimizer
# and freshly seeded random numbers. Whether the job then *continues* or quietly trains from
# scratch (or, worse, continues from the wrong place) is up to the training loop (chapter 08,
# "Fault tolerance with torchrun").
#
# Below is the training loop of a job that saves checkpoints but cannot resume from them. Make it
# resume correctly: after a restart, it must finish with **the same weights, bit for bit**, as a
# run that was never interrupted, redoing only the steps after the last checkpoint.
#
# **How it is tested.** The tests launch your `train` for real:
# `python -m torch.distributed.run --standalone --nproc_per_node 2 --max_restarts 1`, with one
# worker **SIGKILLed** (no Python handler runs, no `finally`) right after a chosen step; torchrun
# restarts both workers, and your `train` runs again in fresh processes. A quicker test stops
# every rank after a step and calls `train` again on a fresh model and optimizer, as a restart
# would. Each compares the final weights with an uninterrupted run computed by the tests, and
# checks which steps ran after the restart.
#
# **Self-check** from the repository root: `pytest exercises/08_checkpoints/survive_a_killed_worker.ipynb`.
# Hidden tests (a worker that raises instead, rank 0 failing, rank 0 killed while it writes a
# checkpoint, a fault right at a checkpoint or before the first one, two interruptions, SGD with
# momentum, one rank) run when the notebook is graded. Keep the name and signature exactly as
# given, and do not reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import survive_a_killed_worker as checks
from ddpcourse.launcher import run_ranks

setup_notebook("survive_a_killed_worker")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-given", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## The loop you are given
#
# It trains and saves a checkpoint every `checkpoint_every` steps, yet a restart starts it over
# from step 1, its file holds only the weights (with DDP's `module.` prefix), and a crash while
# rank 0 writes the file destroys the previous one.

# %% nbgrader={"grade": false, "grade_id": "given-loop", "locked": true, "schema_version": 3, "solution": false, "task": false}
def train_from_scratch(ddp_model, optimizer, batch_at, total_steps, checkpoint_dir,
                       checkpoint_every, on_step):
    """The given loop: it saves, but it never resumes."""
    for step in range(1, total_steps + 1):
        inputs, targets = batch_at(step)
        loss = F.mse_loss(ddp_model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % checkpoint_every == 0 and dist.get_rank() == 0:
            torch.save(ddp_model.state_dict(), os.path.join(checkpoint_dir, "checkpoint.pt"))
        on_step(step)


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-train", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `train(ddp_model, optimizer, batch_at, total_steps, checkpoint_dir, checkpoint_every, on_step) -> None`
#
# What you need from the lesson:
#
# * After a restart nothing of the old processes is left but the files: the model, optimizer and
#   random state your function receives are brand new. Everything the rest of the run depends on
#   must be in the checkpoint and restored from it: the weights, the optimizer's state (Adam's
#   moments and step counts), the step, and **each rank's** random-number state (this model has
#   dropout, and every rank draws its own masks: `torch.get_rng_state()` differs per rank, so
#   gather them, e.g. with `dist.all_gather_object`).
# * One rank writes (rank 0), atomically (a temporary file in the same directory, then
#   `os.replace`), and every rank waits (`dist.barrier()`) before going on, so that a rank killed
#   right after a step never leaves a checkpoint half written or missing.
# * Every rank loads (with `map_location`): DDP broadcasts nothing when a model is loaded into
#   `ddp_model.module` after wrapping, and never the optimizer.

# %% nbgrader={"grade": false, "grade_id": "train", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train(ddp_model, optimizer, batch_at, total_steps: int, checkpoint_dir: str,
          checkpoint_every: int, on_step) -> None:
    """Train for `total_steps` optimizer steps, resuming from `checkpoint_dir` if a checkpoint is
    there. Called on every rank of a running process group, same arguments, possibly again in
    fresh processes after a restart.

    * Step `step` (1, 2, ..., `total_steps`) trains as the given loop does: this rank's batch
      `inputs, targets = batch_at(step)`, the loss `F.mse_loss(ddp_model(inputs), targets)`,
      `optimizer.zero_grad()`, `loss.backward()`, `optimizer.step()`.
    * After every step that is a multiple of `checkpoint_every`, save a checkpoint in
      `checkpoint_dir` (the directory exists; its files are yours) holding everything needed to
      continue exactly: rank 0 writes it atomically, and every rank waits until it is complete.
    * Then, after every step (and after that step's checkpoint, if any), call `on_step(step)` on
      every rank. The tests may stop or kill a rank inside it.
    * On entry, if `checkpoint_dir` holds a checkpoint, restore the model, the optimizer, each
      rank's random-number state and the step from it on every rank, and continue with the step
      after it; otherwise start at step 1.

    A run interrupted after any step and restarted (fresh processes, fresh model, optimizer and
    seeds) must end with the same weights, bit for bit, as a run never interrupted, and must run
    each step after the last checkpoint exactly once more, and no other.
    """
    ### BEGIN SOLUTION
    rank = dist.get_rank()
    path = os.path.join(checkpoint_dir, "checkpoint.pt")
    done = 0
    if os.path.exists(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        ddp_model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"][rank])
        done = int(state["step"])
    for step in range(done + 1, total_steps + 1):
        inputs, targets = batch_at(step)
        loss = F.mse_loss(ddp_model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % checkpoint_every == 0:
            rng = [None] * dist.get_world_size()
            dist.all_gather_object(rng, torch.get_rng_state())
            if rank == 0:
                state = {"model": ddp_model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "rng": rng, "step": step}
                handle, temporary = tempfile.mkstemp(dir=checkpoint_dir, prefix=".checkpoint-")
                with os.fdopen(handle, "wb") as file:
                    torch.save(state, file)
                    file.flush()
                    os.fsync(file.fileno())
                os.replace(temporary, path)
            dist.barrier()
        on_step(step)
    ### END SOLUTION


# %%
# Try it: 2 ranks stop after step 5 (the last checkpoint is step 4) and start again from scratch,
# as torchrun's restart would; then compare with a run that was never stopped.
class Stop(Exception):
    pass


def try_it(rank, world_size, folder, stop_at):
    ran = []

    def on_step(step):
        ran.append(step)
        if step == stop_at:
            raise Stop()

    def batch_at(step):
        generator = torch.Generator().manual_seed(100 * step + rank)
        inputs = torch.randn(8, 6, generator=generator)
        return inputs, inputs.sum(dim=1, keepdim=True).sin()

    for attempt in range(2):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 1)))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        torch.manual_seed(1 + rank)  # each rank's dropout stream, as a fresh process seeds it
        try:
            train(model, optimizer, batch_at, 8, folder, 2, on_step)
        except Stop:
            continue
        break
    return ran, model.module[0].weight.detach().clone()

with tempfile.TemporaryDirectory() as stopped, tempfile.TemporaryDirectory() as straight:
    interrupted = run_ranks(try_it, 2, stopped, 5, timeout=60)
    uninterrupted = run_ranks(try_it, 2, straight, None, timeout=60)
print("steps run on rank 0:", interrupted[0][0])
print("same weights as the uninterrupted run:", torch.equal(interrupted[0][1], uninterrupted[0][1]))

# %% nbgrader={"grade": true, "grade_id": "test-resumes-after-a-stop", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks stop after step 5 (checkpoints every 2 steps) and call train again on a fresh model: steps 5-7 run once more, and the final weights equal an uninterrupted run's, bit for bit.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import survive_a_killed_worker as checks
integrity.assert_untampered()
checks.check_resumes_after_a_stop(train)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-survives-a-killed-worker", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
# Test (4 points): torchrun --max_restarts 1 with 2 workers; rank 1 is SIGKILLed after step 5 (checkpoints every 3 steps); the restarted workers run steps 4-8 and end with the uninterrupted run's weights, bit for bit.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import survive_a_killed_worker as checks
integrity.assert_untampered()
checks.check_survives_a_killed_worker(train)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-survive-a-killed-worker-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) rank 0 raising right after a checkpoint under torchrun; rank 0 killed while it writes a checkpoint; a stop before the first checkpoint; two stops; SGD with momentum; one rank.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import survive_a_killed_worker as hidden
hidden.check_survive_a_killed_worker(train)
print("passed")
### END HIDDEN TESTS
