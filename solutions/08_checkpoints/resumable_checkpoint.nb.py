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
# # Exercise 08: a resumable checkpoint, written once and safely
#
# A checkpoint that a run can resume from must hold more than the weights, must be written by one
# rank while the others wait, and must survive a crash in the middle of writing it: the job that
# dies while saving is exactly the job that needs the previous checkpoint (chapter 08, "Who
# writes", "What to save" and "Crash safety").
#
# You write `save_checkpoint` and `load_checkpoint`. The tests run them in **real process groups**
# of 1 to 4 ranks (gloo, CPU) that share a fresh directory; the ranks train with the tests' own
# loop and only save and load with your functions. Each test checks one property with the tests'
# own code for the other half (the load test reads a file the tests wrote), so one mistake fails
# one test.
#
# **How your code runs.** Every rank calls your function with the same arguments and a
# `DistributedDataParallel` model. Use the default process group as usual (`dist.get_rank()`,
# `dist.barrier()`); do not call `init_process_group` here.
#
# **Self-check** from the repository root: `pytest exercises/08_checkpoints/resumable_checkpoint.ipynb`.
# Hidden tests (1, 3 and 4 ranks, other optimizers, step 0, an existing checkpoint) run when the
# notebook is graded. Keep the names and signatures exactly as given, and do not reassign library
# functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import resumable_checkpoint as checks
from ddpcourse.launcher import run_ranks

setup_notebook("resumable_checkpoint")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-save", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `save_checkpoint(path, ddp_model, optimizer, step, **extra) -> None`
#
# What you need from the lesson:
#
# * `torch.save` is a plain local file write: one rank writes (rank 0), and the others wait at
#   `dist.barrier()` until the file is complete. Nothing in `torch.save` involves the other ranks.
# * `ddp_model.module.state_dict()` has the plain model's keys (no `module.` prefix), so the file
#   loads into a model that was never wrapped.
# * `torch.save(obj, path)` first truncates `path`, then writes: a crash in between destroys the
#   previous checkpoint. Write a temporary file **in the same directory** (`tempfile.mkstemp(dir=...)`),
#   flush and `os.fsync` it, then `os.replace(temporary, path)`: a rename within one file system
#   is atomic, so `path` names either the old complete file or the new complete file.
#
# **How it is tested.** Every rank passes an extra keyword argument that records, inside the rank,
# whether that rank serialised the checkpoint, and an audit hook records which files each rank
# opened for writing or renamed in the directory. Rank 0 is held in the middle of its write until
# the other ranks return (or a second passes), and each rank reads the file as soon as your call
# returns. A second save is given an extra value that raises while it is serialised, as a crash
# would stop the write; the previous checkpoint must still be there.

# %% nbgrader={"grade": false, "grade_id": "save-checkpoint", "locked": false, "schema_version": 3, "solution": true, "task": false}
def save_checkpoint(path: str, ddp_model: DDP, optimizer: torch.optim.Optimizer, step: int,
                    **extra) -> None:
    """Save a checkpoint that a run can resume from. Called on every rank, same arguments.

    The file at `path` is one dict written with `torch.save`:
    `{"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
    **extra}` (each extra keyword argument is a key of its own; its values may be any picklable
    object, so let any error in saving them propagate).

    * Only rank 0 writes, and it writes the checkpoint once: a temporary file in the same
      directory as `path`, then ONE `os.replace(temporary, path)`. Other ranks open no file in
      that directory.
    * Atomic: if the save fails or the process dies at any moment, `path` still holds the
      previous complete checkpoint (or nothing, if there was none).
    * Every rank returns only once the new file is complete at `path` (a barrier after the
      write).
    """
    ### BEGIN SOLUTION
    if dist.get_rank() == 0:
        state = {"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                 "step": step, **extra}
        directory = os.path.dirname(os.path.abspath(path))
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".checkpoint-")
        try:
            with os.fdopen(handle, "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            if os.path.exists(temporary):
                os.remove(temporary)
            raise
    dist.barrier()
    ### END SOLUTION


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-load", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## `load_checkpoint(path, ddp_model, optimizer) -> int`
#
# What you need from the lesson:
#
# * Load with `map_location` (here `"cpu"`; on GPUs the rank's own device), so that no rank
#   touches another rank's GPU.
# * The model can be loaded into `ddp_model.module` on every rank. (Loading *before* wrapping on
#   rank 0 alone also works for the model, since DDP's constructor broadcasts rank 0's state; here
#   the model is wrapped already, and no constructor will run again.)
# * The optimizer's state (momentum, Adam's moments and step counts) is never broadcast by DDP:
#   every rank loads it.
#
# **How it is tested.** The tests write the file themselves (the format of `save_checkpoint`),
# give every rank a model and an optimizer that started elsewhere, call your function, and compare
# each rank's model and optimizer state with the file's, exactly; one more training step must keep
# the replicas identical. Then a run that saves after 2 steps and runs 2 more is compared, bit for
# bit, with a fresh model that loads the file and runs the same 2 steps.

# %% nbgrader={"grade": false, "grade_id": "load-checkpoint", "locked": false, "schema_version": 3, "solution": true, "task": false}
def load_checkpoint(path: str, ddp_model: DDP, optimizer: torch.optim.Optimizer) -> int:
    """Load what `save_checkpoint` wrote into `ddp_model` and `optimizer`, on every rank; return
    the saved `step` (an int). Called on every rank, same arguments.

    Afterwards every rank's model (`ddp_model.module`, parameters and buffers) and optimizer state
    equal the file's exactly, so that continuing from the returned step gives the same weights,
    bit for bit, as a run that never stopped. Read the file only; do not change it.
    """
    ### BEGIN SOLUTION
    state = torch.load(path, map_location="cpu", weights_only=True)
    ddp_model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
    ### END SOLUTION


# %%
# Try it: 2 ranks save after one step, then a fresh model and optimizer load it.
def try_it(rank, world_size, folder):
    torch.manual_seed(rank)  # different on each rank: DDP copies rank 0's weights
    model = DDP(nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(os.path.join(folder, "demo.pt"), model, optimizer, 1, note="try it")
    fresh = DDP(nn.Linear(4, 2))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    step = load_checkpoint(os.path.join(folder, "demo.pt"), fresh, fresh_optimizer)
    same = torch.equal(fresh.module.weight, model.module.weight)
    return step, same, sorted(os.listdir(folder))

with tempfile.TemporaryDirectory() as folder:
    for rank, (step, same, files) in enumerate(run_ranks(try_it, 2, folder, timeout=30)):
        print(f"rank {rank}: resumes at step {step}; same weights: {same}; files: {files}")

# %% nbgrader={"grade": true, "grade_id": "test-save-writes-the-contract", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks: the file holds the model (plain keys), the optimizer, the step and the extras; only rank 0 wrote it, with one os.replace from the same directory; no rank returned before it was complete.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import resumable_checkpoint as checks
integrity.assert_untampered()
checks.check_save_writes_the_contract(save_checkpoint, load_checkpoint)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-a-crash-keeps-the-previous-checkpoint", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 1 rank: a save that crashes while it writes leaves the previous checkpoint loadable and unchanged.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import resumable_checkpoint as checks
integrity.assert_untampered()
checks.check_a_crash_keeps_the_previous_checkpoint(save_checkpoint, load_checkpoint)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-load-restores-every-rank", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks: after loading the tests' own file, every rank's model and optimizer equal the file's, and the step comes back.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import resumable_checkpoint as checks
integrity.assert_untampered()
checks.check_load_restores_every_rank(save_checkpoint, load_checkpoint)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-resume-is-bit-exact", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks: save after 2 steps, 2 more; a fresh model that loads the file and runs the same 2 steps ends bit for bit equal.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import resumable_checkpoint as checks
integrity.assert_untampered()
checks.check_resume_is_bit_exact(save_checkpoint, load_checkpoint)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-resumable-checkpoint-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 1, 3 and 4 ranks; SGD with momentum and AdamW; step 0; a save over an existing checkpoint; the crash and the resume with other optimizers.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import resumable_checkpoint as hidden
hidden.check_resumable_checkpoint(save_checkpoint, load_checkpoint)
print("passed")
### END HIDDEN TESTS
