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
# # Exercise 09: DDP's own errors
#
# Three failures that DDP itself reports, each met in real jobs: an error on the second
# iteration from a head the loss never uses, a checkpoint that cannot be resumed the way it was
# saved, and "marked ready twice" from activation checkpointing. For each lab: run the code you
# are given and read the failure, write down your diagnosis (`diagnose_<lab>()`: the facts its
# docstring asks, each something the given code does in that run), then write the fixed function
# (its docstring is the contract).
#
# **How it is tested.** The tests call your function on every rank of a real gloo process group
# (2 ranks in the visible tests), with a deadline, and check behaviour: the weights of one process
# trained on every rank's batches, identical replicas, what the ranks all-reduce (lab 1), who
# writes the checkpoint and whether the resumed run continues the uninterrupted one bit for bit
# (lab 10), and that activation checkpointing still recomputes the block (lab 11). Use the
# default group as usual; never call `init_process_group` here. The diagnoses have no visible
# test: each is graded when the notebook is graded, by a hidden test of its own, and that graded
# feedback explains what the given code did and the fixes that work, whether your diagnosis is
# right or not.
#
# **Points**: 8 for the fixes' visible tests, 3 for their hidden tests, and 1 for each lab's
# diagnosis (3), 14 in all.
#
# **Self-check** from the repository root: `pytest exercises/09_debugging/ddp_errors.ipynb`.
# Hidden tests (1, 3 and 4 ranks; an aux head used on some steps only; SGD with momentum; a block
# applied twice per forward) run when the notebook is graded. Keep the names and signatures
# exactly as given, and do not reassign library functions (the tests check for it).

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
from ddpcourse.grading.checks import audited_traffic
from ddpcourse.grading.exercises import ddp_errors as checks
from ddpcourse.launcher import run_ranks

setup_notebook("ddp_errors")


# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-unused-head", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 1: a head the loss does not use
#
# The model (`checks.TwoHeads`) has a backbone, the task's `head`, and an `aux` head with a loss
# of its own, `model(x, with_aux=True)` returning both outputs. This fine-tuning run has no aux
# labels (`aux_y` is `None` in every batch), so the forward skips the aux head.

# %% nbgrader={"grade": false, "grade_id": "given-unused-head", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the loop as the job runs it. Copy it into a cell of your own to experiment.
def given_train_with_aux(model, batches, lr):
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y, aux_y in batches:
        out, aux = ddp_model(x, with_aux=aux_y is not None)
        loss = F.cross_entropy(out, y)
        if aux_y is not None:
            loss = loss + F.cross_entropy(aux, aux_y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# %%
# Run it: 2 ranks, 4 steps, no aux labels. Which iteration raises, and what did step 1 do?
def run_unused(rank, world_size, train_with_aux):
    s = checks.unused_setting(seed=1, steps=4)
    model = checks.make_two_heads(seed=rank)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    error = None
    try:
        train_with_aux(model, checks.aux_batches(s, rank), s["lr"])
    except RuntimeError as exc:
        error = str(exc)
    return {"iteration that raised": len(forwards) + 1 if error else None,
            "backbone weight sum": round(model.backbone.weight.sum().item(), 6),
            "error": error}


for rank, seen in enumerate(run_ranks(run_unused, 2, given_train_with_aux, timeout=30)):
    print(f"rank {rank}:", {k: v for k, v in seen.items() if k != "error"})
print(seen["error"])

# %% [markdown] nbgrader={"grade": false, "grade_id": "read-unused-head", "locked": true, "schema_version": 3, "solution": false, "task": false}
# **Read the run before you fix it.** Which iteration raised, and which parameters does the
# error name (by index; `TORCH_DISTRIBUTED_DEBUG=INFO` names them)? What did step 1 do: how many
# gradient all-reduces were there before the error (`audited_traffic()`, imported above, records
# the collectives a block of code calls, DDP's own included), and do the ranks' weights still
# agree? Write your diagnosis in `diagnose_unused_head`, then `train_with_aux` without
# `find_unused_parameters=True` (its docstring is the contract). The visible test checks the fix;
# the diagnosis is graded when the notebook is graded, and that graded feedback explains what
# happened and the fixes that work.

# %% nbgrader={"grade": false, "grade_id": "diagnose-unused-head", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_unused_head() -> dict:
    """Your diagnosis of the run above (the given loop, 2 ranks, 4 steps, no aux labels), a dict
    with the keys:

    * "iteration" (int): the iteration, counting from 1, in which the error was raised;
    * "unused_parameters" (list of str): the parameters whose indices the error lists, by their
      names in `model.named_parameters()` (such as "head.weight");
    * "gradient_all_reduces" (int): how many gradient all-reduces DDP ran before the error;
    * "replicas_agree" (bool): whether the ranks' weights were still identical after step 1.
    """
    ### BEGIN SOLUTION
    return {"iteration": 2, "unused_parameters": ["aux.weight", "aux.bias"],
            "gradient_all_reduces": 0, "replicas_agree": False}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-unused-head-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_unused_head(): the iteration that raised, the parameters the error names, the all-reduces before it, whether the replicas still agree.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import ddp_errors as hidden
hidden.check_unused_head_diagnosis(diagnose_unused_head)
print("passed")
### END HIDDEN TESTS

# %% nbgrader={"grade": false, "grade_id": "train_with_aux", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_with_aux(model: nn.Module, batches: list, lr: float) -> None:
    """Train `model` (a `checks.TwoHeads`, this rank's) with DDP and plain SGD on this rank's
    batches, without `find_unused_parameters=True`.

    Called on every rank of the default process group (gloo, CPU); every rank's model starts
    from other weights (DDP's constructor gives every rank rank 0's). `batches[s] = (x, y,
    aux_y)` is this rank's batch of step s; `aux_y` is `None` on the steps without aux labels,
    the same steps on every rank. Step s: one optimizer step of
    `torch.optim.SGD(..., lr=lr)` (no momentum, no weight decay) on the loss
    `F.cross_entropy(out, y)`, plus `F.cross_entropy(aux, aux_y)` when `aux_y` is given, where
    `out, aux = model(x, with_aux=...)`.

    Afterwards, on every rank: `model` itself is trained (wrap it, do not copy it); all ranks hold
    bit-identical parameters, the weights of one process training rank 0's initial model on
    every rank's batches (each step's gradient the mean of the ranks' loss gradients; to
    1e-6 + 1e-5 * |w|). What the ranks all-reduce is gradients only: no map of used parameters on
    every step, which is what `find_unused_parameters=True` adds (the check counts the bytes).
    """
    ### BEGIN SOLUTION
    # No aux labels in the whole run: nothing to train there, so DDP must not wait for it.
    if all(aux_y is None for _, _, aux_y in batches):
        model.aux.requires_grad_(False)
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD([p for p in ddp_model.parameters() if p.requires_grad], lr=lr)
    for x, y, aux_y in batches:
        out, aux = ddp_model(x, with_aux=model.aux.weight.requires_grad)
        loss = F.cross_entropy(out, y)
        if aux_y is not None:
            loss = loss + F.cross_entropy(aux, aux_y)
        elif aux is not None:
            loss = loss + 0 * aux.sum()  # a zero gradient: plain SGD leaves the head unchanged
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ### END SOLUTION


# %%
# Try it: the same run with your function.
for rank, seen in enumerate(run_ranks(run_unused, 2, train_with_aux, timeout=30)):
    print(f"rank {rank}:", {k: v for k, v in seen.items() if k != "error"}, seen["error"])

# %% nbgrader={"grade": true, "grade_id": "test-unused-head", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, 4 steps, no aux labels: no error, equal replicas, one process's weights, gradients only on the wire.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ddp_errors as checks
integrity.assert_untampered()
checks.check_aux_head_never_used(train_with_aux)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-checkpoint", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 10: a checkpoint that does not resume
#
# The job saves after step 3 and a new job resumes from the file: it builds the plain model
# (`checks.Net`) and its Adam optimizer, calls `resume`, wraps the model in DDP and trains on.
# Chapter 08 builds a complete checkpoint; this lab is about recognising the broken one.

# %% nbgrader={"grade": false, "grade_id": "given-checkpoint", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the save and the resume as the job has them.
def given_save_checkpoint(ddp_model, optimizer, path):
    torch.save(ddp_model.state_dict(), path)


def given_resume(model, optimizer, path):
    model.load_state_dict(torch.load(path))


# %%
# Run it: 2 ranks train 3 steps and save; a resume into the plain model; a resume into the
# wrapper (whose keys match) with a fresh Adam; then both runs go on for 3 steps.
def run_checkpoint(rank, world_size, folder, save_checkpoint, resume):
    path = os.path.join(folder, "checkpoint.pt")
    ddp_model = DDP(checks.make_net(0))
    optimizer = checks.make_optimizer("adam", ddp_model)
    checks.grader_steps(ddp_model, optimizer, 0, range(3), rank)
    save_checkpoint(ddp_model, optimizer, path)
    dist.barrier()
    try:
        resume(checks.make_net(1), checks.make_optimizer("adam", ddp_model), path)
        plain = "loaded"
    except RuntimeError as exc:
        plain = str(exc).strip()
    resumed = DDP(checks.make_net(1))
    resumed.load_state_dict(torch.load(path))
    fresh_adam = checks.make_optimizer("adam", resumed)
    checks.grader_steps(resumed, fresh_adam, 0, range(3, 6), rank)
    checks.grader_steps(ddp_model, optimizer, 0, range(3, 6), rank)
    gap = max((a - b).abs().max().item() for a, b in zip(resumed.parameters(),
                                                           ddp_model.parameters()))
    return plain, gap


with tempfile.TemporaryDirectory() as folder:
    plain, gap = run_ranks(run_checkpoint, 2, folder, given_save_checkpoint, given_resume,
                           timeout=30)[0]
print("into the plain model:", plain)
print(f"resumed through the wrapper, 3 steps later: {gap:.3g} from the uninterrupted weights")

# %% [markdown] nbgrader={"grade": false, "grade_id": "read-checkpoint", "locked": true, "schema_version": 3, "solution": false, "task": false}
# **Read the run before you fix it.** What does the new job's `resume` raise, and what do the
# file's keys say? Once the model loads, compare the loss of the resumed run with the
# uninterrupted one over the first steps after the resume: what does the resumed Adam start
# from? And look at who wrote the file. Write your diagnosis in `diagnose_checkpoint`, then fix
# the save and the resume: there is more than one mistake, and the visible test checks each (the
# docstrings are the contract). The diagnosis is graded when the notebook is graded, and that
# graded feedback explains the mistakes and the fixes that work.

# %% nbgrader={"grade": false, "grade_id": "diagnose-checkpoint", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_checkpoint() -> dict:
    """Your diagnosis of the run above (the given save and resume, 2 ranks, Adam, saved after
    step 3), a dict with the keys:

    * "key_prefix" (str): what the names of the file's tensors have in front of the names the
      plain model expects;
    * "ranks_that_wrote" (int): how many of the 2 ranks call `torch.save` on the checkpoint's
      path;
    * "resumed_adam_step" (int): the `step` count in the state of the resumed run's Adam (the
      one built fresh after loading through the wrapper) after its first step.
    """
    ### BEGIN SOLUTION
    return {"key_prefix": "module.", "ranks_that_wrote": 2, "resumed_adam_step": 1}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-checkpoint-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_checkpoint(): the prefix of the saved names, how many ranks write the file, the resumed Adam's step count after its first step.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import ddp_errors as hidden
hidden.check_checkpoint_diagnosis(diagnose_checkpoint)
print("passed")
### END HIDDEN TESTS

# %% nbgrader={"grade": false, "grade_id": "save_checkpoint", "locked": false, "schema_version": 3, "solution": true, "task": false}
def save_checkpoint(ddp_model: DDP, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Save what a new job needs to continue exactly, at `path`.

    Called on every rank, same arguments, after the same step. Only rank 0 writes; every rank
    returns only once the file is complete. The file loads with
    `torch.load(path, weights_only=True)` into a dict with `"model"`, the plain model's
    `state_dict()` (no `module.` prefix: it loads into the unwrapped model), and `"optimizer"`,
    the optimizer's `state_dict()`; other keys are allowed.
    """
    ### BEGIN SOLUTION
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(),
                    "optimizer": optimizer.state_dict()}, path)
    dist.barrier()
    ### END SOLUTION


# %% nbgrader={"grade": false, "grade_id": "resume", "locked": false, "schema_version": 3, "solution": true, "task": false}
def resume(model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Restore `model` (the plain, unwrapped model of a new job: DDP wraps it afterwards) and
    `optimizer` (built over its parameters) from the file `save_checkpoint` wrote at `path`.

    Called on every rank. Training on from here must give, bit for bit, the weights of a run
    that was never interrupted.
    """
    ### BEGIN SOLUTION
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    ### END SOLUTION


# %%
# Try it: the new job's view (the save's file into a plain model) and the resumed run's gap.
def try_checkpoint(rank, world_size, folder):
    path = os.path.join(folder, "checkpoint.pt")
    ddp_model = DDP(checks.make_net(0))
    optimizer = checks.make_optimizer("adam", ddp_model)
    checks.grader_steps(ddp_model, optimizer, 0, range(3), rank)
    save_checkpoint(ddp_model, optimizer, path)
    model = checks.make_net(1)
    new_optimizer = checks.make_optimizer("adam", model)
    resume(model, new_optimizer, path)
    checks.grader_steps(DDP(model), new_optimizer, 0, range(3, 6), rank)
    checks.grader_steps(ddp_model, optimizer, 0, range(3, 6), rank)
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), ddp_model.parameters()))


with tempfile.TemporaryDirectory() as folder:
    print("resumed == uninterrupted, bit for bit:",
          run_ranks(try_checkpoint, 2, folder, timeout=30))

# %% nbgrader={"grade": true, "grade_id": "test-checkpoint", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, Adam: rank 0 alone writes, every rank waits for it, the file loads into the plain model, and the resumed run ends bit for bit where the uninterrupted one does.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ddp_errors as checks
integrity.assert_untampered()
checks.check_resume(save_checkpoint, resume)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-reentrant", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 11: activation checkpointing, "marked ready twice"
#
# The model (`checks.Tower`) has a block whose activations it can recompute in the backward
# instead of keeping them (`model.enable_checkpointing(use_reentrant=...)`, as Hugging Face's
# `gradient_checkpointing_enable` does), and a `pooler` this job does not use, which is why its
# author passed `find_unused_parameters=True`.

# %% nbgrader={"grade": false, "grade_id": "given-reentrant", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the loop as the job runs it.
def given_train_tower(model, batches, lr):
    model.enable_checkpointing(use_reentrant=True)  # saves the block's activation memory
    ddp_model = DDP(model, find_unused_parameters=True)  # the pooler is unused
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        loss = F.cross_entropy(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# %%
# Run it: 2 ranks, the block applied once per forward.
def run_tower(rank, world_size, train_tower, repeats):
    s = checks.tower_setting(seed=3, repeats=repeats)
    try:
        train_tower(checks.make_tower(rank, repeats), checks.tower_batches(s, rank), s["lr"])
    except RuntimeError as exc:
        return str(exc)
    return "no error"


message = run_ranks(run_tower, 2, given_train_tower, 1, timeout=30)[0]
print(message[:200], "...\n...", message.splitlines()[-1])

# %% [markdown] nbgrader={"grade": false, "grade_id": "read-reentrant", "locked": true, "schema_version": 3, "solution": false, "task": false}
# **Read the run before you fix it.** Which backward raises, which parameter does the error name,
# and how often had the block's forward run when it did? Neither flag alone is the problem. Write
# your diagnosis in `diagnose_reentrant`, then fix the loop without giving up the checkpointing
# (the visible test counts the block's recomputations). The diagnosis is graded when the
# notebook is graded, and that graded feedback explains what happened and the fixes that work.

# %% nbgrader={"grade": false, "grade_id": "diagnose-reentrant", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_reentrant() -> dict:
    """Your diagnosis of the run above (the given loop, 2 ranks, the block applied once per
    forward), a dict with the keys:

    * "backward" (int): which `loss.backward()` call raised the error, counting from 1;
    * "parameter" (str): the name of the parameter the error says was marked ready twice;
    * "block_forwards" (int): how many times the block's forward had run on a rank when the
      error was raised (`model.block[1].forwards` counts them).
    """
    ### BEGIN SOLUTION
    return {"backward": 1, "parameter": "block.0.bias", "block_forwards": 2}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-reentrant-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_reentrant(): which backward raised, the parameter the error names, how often the block's forward had run.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import ddp_errors as hidden
hidden.check_reentrant_diagnosis(diagnose_reentrant)
print("passed")
### END HIDDEN TESTS

# %% nbgrader={"grade": false, "grade_id": "train_tower", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_tower(model: nn.Module, batches: list, lr: float) -> None:
    """Train `model` (a `checks.Tower`, this rank's) with DDP and plain SGD, its block's
    activations checkpointed.

    Called on every rank of the default process group (gloo, CPU); every rank's model starts
    from other weights. `batches[s] = (x, y)` is this rank's batch of step s; step s is one step
    of `torch.optim.SGD(..., lr=lr)` on `F.cross_entropy(model(x), y)`. The model may apply its
    block more than once per forward (`model.repeats`, shared weights); its pooler is unused.

    Afterwards, on every rank: the block's forward ran twice per application (once in the
    forward, once recomputed in the backward: `model.enable_checkpointing(...)` is on); `model`
    itself is trained; all ranks hold bit-identical parameters, the weights of one process
    training rank 0's initial model on every rank's batches (to 1e-6 + 1e-5 * |w|).
    """
    ### BEGIN SOLUTION
    model.enable_checkpointing(use_reentrant=False)
    ddp_model = DDP(model, find_unused_parameters=True)  # the pooler is unused
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        loss = F.cross_entropy(ddp_model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ### END SOLUTION


# %%
# Try it: once and twice per forward.
for repeats in (1, 2):
    print(f"block applied {repeats}x:", run_ranks(run_tower, 2, train_tower, repeats, timeout=30))

# %% nbgrader={"grade": true, "grade_id": "test-reentrant", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 ranks, the block applied once per forward: no error, the block recomputed in every backward, equal replicas, one process's weights.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import ddp_errors as checks
integrity.assert_untampered()
checks.check_checkpointed_tower(train_tower)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-ddp-errors-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) an aux head trained on some steps only (3 and 2 ranks), and one rank; a resume with SGD and momentum on 3 ranks, and on 1; a block applied twice per forward (4 ranks).
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import ddp_errors as hidden
hidden.check_ddp_errors(train_with_aux, save_checkpoint, resume, train_tower)
print("passed")
### END HIDDEN TESTS
