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
# # Exercise 09: replicas that disagree
#
# DDP's promise is that N processes are one job: one group, one model, the same weights on
# every rank after every step. Three real jobs below break that promise without a word of
# warning in the training loop:
#
# 1. **Who am I?** A job written for SLURM is started with `torchrun`: its group never forms.
# 2. **A learnable temperature.** The loss has a parameter of its own, and after training the
#    ranks no longer hold the same model.
# 3. **`broadcast_buffers=False` with BatchNorm.** The same weights evaluate differently on
#    every rank.
#
# For each lab: read the locked given code (as you would meet it in a job), run it and watch the
# symptom, **diagnose** it (`diagnose_<lab>()` returns the facts its docstring asks for: what
# the given code did, which you read off the output or reason out), then write the fixed
# function. Each docstring is the contract.
#
# **How it is tested.** Every check of a fix runs your function in real gloo process groups (2
# processes here; 1, 3 and 4 in the hidden tests), with a deadline. Lab 1 starts the processes with
# no process group and the variables of a launcher: torchrun's, srun's, torchrun started by srun, or
# none. Labs 2 and 3 train for a few steps, every rank starting from weights and data of its own,
# and the check requires **everything that learns (and every buffer) to be identical on all ranks**
# and equal to a reference the check computes where none of your code runs: one process on the
# global batch (lab 2), the ranks replayed with DDP's rules (lab 3).
#
# Each diagnosis (1 point per lab) is graded only when the notebook is graded: no check you can
# run tells a right diagnosis from a wrong one. Its graded feedback, right or wrong, names every
# wrong or missing fact and explains what the given code did and the fixes that work. The
# visible test of a fix says only whether it passed.
#
# **Self-check** from the repository root:
# `pytest exercises/09_debugging/replicas_that_disagree.ipynb` (the fixes). Hidden tests (3
# and 4 processes, two machines' worth of local ranks, temperatures that start different on
# every rank, more steps, other seeds, and the tempting fixes that only hide the symptom) run
# when the notebook is graded. Keep the names and signatures exactly as given, and do not
# reassign library functions (the tests check for it).

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import replicas_that_disagree as checks
from ddpcourse.launcher import RankError, run_ranks

TemperedLoss = checks.TemperedLoss

setup_notebook("replicas_that_disagree")


# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-join", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 1: every process is rank 0
#
# The job's first function was written for SLURM, where `srun` starts one task per process and
# sets `SLURM_PROCID` (the global rank), `SLURM_LOCALID` (the rank on its machine) and
# `SLURM_NTASKS`. When the job moved to `torchrun`, someone added `WORLD_SIZE`, and the defaults
# "make it work when run by hand". Run it as torchrun would start it: the group never forms, and
# with the short timeout below every process fails. What does each process believe it is, and
# which rank's address is the store waiting for? (And what would happen if the world size were
# read the same way?) Diagnose it in `diagnose_join`, then fix it in `join_the_job`.

# %% nbgrader={"grade": false, "grade_id": "given-join", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the job's setup as it was found. Do not fix it here; write `join_the_job` below.
def given_join_the_job(init_method, timeout):
    rank = int(os.environ.get("SLURM_PROCID", 0))  # 0 when run by hand
    local_rank = int(os.environ.get("SLURM_LOCALID", 0))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, local_rank, world_size


# %%
# Run it: two processes started the way torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE set,
# no SLURM_*), no process group yet, a shared file:// store and a 3-second timeout.
def try_join(rank, world_size, join, path):
    try:
        who = join(f"file://{path}", timedelta(seconds=3))
    except Exception as exc:
        return f"process {rank}: raised {type(exc).__name__}: {exc}"
    reached = torch.zeros(world_size)
    reached[rank] = 1
    dist.all_reduce(reached)
    dist.destroy_process_group()
    return f"process {rank}: answered {who}; its all-reduce reached processes {reached.tolist()}"


store = os.path.join(tempfile.mkdtemp(), "store")
for line in run_ranks(try_join, 2, given_join_the_job, store, init_process_group=False, timeout=30):
    print(line)


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-join-diagnosis", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `diagnose_join() -> dict` (1 point)
#
# Before the fix, say what went wrong: what the given function does in the cell above, as the
# docstring's keys. Read the output, the given code and the variables torchrun sets; reason out
# what is not printed.
#
# **Graded when the notebook is graded, not before**: no check you can run tells a right
# diagnosis from a wrong one. The graded feedback then explains what the given code did and the
# fixes that work.

# %% nbgrader={"grade": false, "grade_id": "diagnose-join", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_join() -> dict:
    """What `given_join_the_job` does in the "Run it" cell above (two processes started as
    torchrun starts them: `RANK`, `LOCAL_RANK`, `WORLD_SIZE` set, no `SLURM_*`), as a dict with
    the keys:

    * "claimed_rank" (int): the rank every process passes to `init_process_group`;
    * "world_size" (int): the world size every process passes to it;
    * "unclaimed_rank" (int): the rank of the group that no process claims (the one whose
      address the store waits for);
    * "raised_in" (str): the torch.distributed function, called by the given code, that raises,
      e.g. "barrier".
    """
    ### BEGIN SOLUTION
    return {"claimed_rank": 0, "world_size": 2, "unclaimed_rank": 1,
            "raised_in": "init_process_group"}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-join-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_join's four facts are what the given code does under torchrun.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import replicas_that_disagree as hidden
hidden.check_join_diagnosis(diagnose_join)
print("passed")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-join", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `join_the_job(init_method, timeout) -> (rank, local_rank, world_size)` (2 points)
#
# Read the variables of the launcher that is actually there, join the group with them, and
# **never guess**: a process that does not know its rank must stop, loudly, before it joins
# anything. (Chapter 04's `ranks_from_env` checks every variable; here the point is the job.)
#
# **How it is tested.** Two processes, with no process group, get the variables of: torchrun;
# srun; torchrun started by srun with one task per machine (so `SLURM_PROCID` is the *machine's*
# task, 0 on every process of the first machine, while torchrun's `RANK` is the process's); no
# launcher at all. Each calls your function with a `file://` store they share and a 3-second
# timeout; the test then checks the identity you returned, the rank and size of the group you
# joined, and that an all-reduce reaches every process exactly once.

# %% nbgrader={"grade": false, "grade_id": "join-the-job", "locked": false, "schema_version": 3, "solution": true, "task": false}
def join_the_job(init_method: str, timeout: timedelta) -> tuple[int, int, int]:
    """Join this process's job as the launcher that started it says; return its identity.

    Called once in every process of a job that has no process group yet.

    1. If torchrun's `RANK` is set (torchrun, also when torchrun itself was started by srun),
       the identity is `RANK`, `LOCAL_RANK`, `WORLD_SIZE`.
    2. Otherwise, if `SLURM_PROCID` is set (srun starting every process), it is
       `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`.
    3. Otherwise raise `RuntimeError`, whose message names the variables looked for (at least
       `RANK` and `SLURM_PROCID`), without joining any group.

    Then join the default process group: `dist.init_process_group("gloo",
    init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)`.

    Returns:
        `(rank, local_rank, world_size)`, three `int`s.
    """
    ### BEGIN SOLUTION
    if "RANK" in os.environ:
        names = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    elif "SLURM_PROCID" in os.environ:
        names = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
    else:
        raise RuntimeError("no launcher says who this process is: neither torchrun's RANK nor "
                           "srun's SLURM_PROCID is set (start it with torchrun or srun)")
    rank, local_rank, world_size = (int(os.environ[name]) for name in names)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timeout)
    return rank, local_rank, world_size
    ### END SOLUTION


# %%
# Try it: the same two torchrun-like processes.
store = os.path.join(tempfile.mkdtemp(), "store")
for line in run_ranks(try_join, 2, join_the_job, store, init_process_group=False, timeout=30):
    print(line)

# %% nbgrader={"grade": true, "grade_id": "test-join-the-job", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): 2 processes under torchrun, srun, torchrun started by srun, and no launcher.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import replicas_that_disagree as checks
integrity.assert_untampered()
checks.check_join_the_job(join_the_job)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-temperature", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 2: a learnable temperature outside the wrapper
#
# The model is wrapped in DDP, and the loss is `TemperedLoss` (from the setup cell): the
# cross-entropy of `logits / exp(log_temperature)`, where `log_temperature` is an
# `nn.Parameter`, created after wrapping and handed to the optimizer. Run it and compare what the
# ranks hold after training: the wrapped model, and everything else that learns. Diagnose it in
# `diagnose_temperature`, then fix it in `train_with_temperature`.

# %% nbgrader={"grade": false, "grade_id": "given-temperature", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the loop as it was found. Do not fix it here; write `train_with_temperature` below.
def given_train_with_temperature(model, criterion, batches, lr):
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD([*ddp_model.parameters(), *criterion.parameters()], lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        loss = criterion(ddp_model(x), y)
        loss.backward()
        optimizer.step()


# %%
# Run it: 2 ranks, each with its own data (as in the tests); compare what learned across ranks.
def watch_temperature(rank, world_size, train):
    s = checks.Situation(*checks.VISIBLE_TRAINING[0])
    model, criterion = checks.make_model(checks.model_seed(s, rank)), checks.make_criterion(s, rank)
    train(model, criterion, checks.make_batches(s, rank), s.lr)
    return model[0].weight.detach().clone(), criterion.log_temperature.item()


def show_temperature(results):
    weights, temperatures = zip(*results)
    identical = all(torch.equal(w, weights[0]) for w in weights)
    print("model weights identical on every rank:", identical)
    print("log_temperature per rank:", temperatures)


show_temperature(run_ranks(watch_temperature, 2, given_train_with_temperature, timeout=60))


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-temperature-diagnosis", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `diagnose_temperature() -> dict` (1 point)
#
# Before the fix, say what went wrong, as the docstring's keys. The output above shows the end
# of training only: reason out (or measure, in a cell of your own) when and why the ranks part.
#
# **Graded when the notebook is graded, not before**: no check you can run tells a right
# diagnosis from a wrong one. The graded feedback then explains what the given code did and the
# fixes that work.

# %% nbgrader={"grade": false, "grade_id": "diagnose-temperature", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_temperature() -> dict:
    """What `given_train_with_temperature` does in the "Run it" cell above (2 ranks, 4 steps, each
    rank's own data, `log_temperature` starting at 0 on both), as a dict with the keys:

    * "parameter" (str): the name of the parameter whose values differ between the ranks after
      training (as `named_parameters()` of its module names it);
    * "first_step" (int): after how many optimizer steps the ranks first hold different values
      of it (1: right after the first step);
    * "averaged_tensors" (int): of the parameter tensors the optimizer steps, how many have
      their gradients averaged over the ranks (all-reduced) by DDP.
    """
    ### BEGIN SOLUTION
    return {"parameter": "log_temperature", "first_step": 1, "averaged_tensors": 4}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-temperature-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_temperature's three facts are what the given code does on 2 ranks.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import replicas_that_disagree as hidden
hidden.check_temperature_diagnosis(diagnose_temperature)
print("passed")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-temperature", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `train_with_temperature(model, criterion, batches, lr) -> None` (3 points)
#
# **How it is tested.** 2 ranks, 4 steps, each rank's model initialised from its own seed and its
# own batches. Afterwards the model's and the criterion's parameters must be bit-identical on
# every rank and equal (within `1e-5 + 1e-5 * |w|`) to ONE process training rank 0's initial model
# and temperature on the global batch of each step (every rank's batch, concatenated). When wrong,
# the message names the known mistake that reproduces your weights.

# %% nbgrader={"grade": false, "grade_id": "train-with-temperature", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_with_temperature(model: nn.Module, criterion: nn.Module, batches: list,
                           lr: float) -> None:
    """Train `model` and the learnable loss `criterion` with DDP on this rank's batches.

    Called on every rank of the default process group (gloo, CPU). Every rank gets its own
    `model` and `criterion` (a `TemperedLoss`: `criterion(logits, targets)` is the loss, and its
    `log_temperature` is a parameter), initialised differently on every rank: only rank 0's
    initial weights may count. `batches[s] = (x, y)` is this rank's batch of step s (the same
    number of rows on every rank).

    At each step: one forward of `criterion(model(x), y)`, backward, and one step of plain
    `torch.optim.SGD(..., lr=lr)` (no momentum, no weight decay) on the parameters of both.

    Afterwards, on every rank, `model` and `criterion` (the objects handed in, trained in place)
    hold bit-identical parameters, which are those ONE process gets by training rank 0's initial
    `model` and `criterion` the same way on the global batch of each step (all ranks' `batches[s]`
    concatenated, the loss's mean over all its rows).
    """
    ### BEGIN SOLUTION
    class ModelAndLoss(nn.Module):
        """One module that owns everything that learns, so DDP syncs and averages all of it."""

        def __init__(self):
            super().__init__()
            self.model, self.criterion = model, criterion

        def forward(self, x, y):
            return self.criterion(self.model(x), y)

    ddp = DDP(ModelAndLoss())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        loss = ddp(x, y)
        loss.backward()
        optimizer.step()
    ### END SOLUTION


# %%
# Try it: the same comparison with your loop.
show_temperature(run_ranks(watch_temperature, 2, train_with_temperature, timeout=60))

# %% nbgrader={"grade": true, "grade_id": "test-train-with-temperature", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, 4 steps: everything that learns is identical on all ranks and equals one process on the global batch.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import replicas_that_disagree as checks
integrity.assert_untampered()
checks.check_train_with_temperature(train_with_temperature)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "lab-batchnorm", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## Lab 3: `broadcast_buffers=False` with BatchNorm
#
# BatchNorm keeps buffers, not parameters: `running_mean`, `running_var`, `num_batches_tracked`.
# Training forwards update them from each rank's own batch, and evaluation normalises with them.
# The given job turns DDP's `broadcast_buffers` off (the cell prints torch 2.13's
# `FutureWarning` about that name). Run it: the same weights evaluate differently on every rank.
# Which of the model's tensors differ between the ranks, and from which step on? Read
# `DistributedDataParallel._pre_forward` and `_post_forward` (torch/nn/parallel/distributed.py)
# to find out when DDP would have made them agree: the fix depends on it. Diagnose it in
# `diagnose_batchnorm`, then fix it in `train_and_evaluate`.

# %% nbgrader={"grade": false, "grade_id": "given-batchnorm", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the loop as it was found. Do not fix it here; write `train_and_evaluate` below.
def given_train_and_evaluate(model, batches, lr, eval_x):
    ddp_model = DDP(model, broadcast_buffers=False)  # "saves a broadcast every step"
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
    ddp_model.eval()
    with torch.no_grad():
        return ddp_model(eval_x)


# %%
# Run it: 2 ranks, each with its own data; compare the buffers and the evaluation across ranks.
def watch_batchnorm(rank, world_size, train):
    s = checks.Situation(*checks.VISIBLE_TRAINING[0])
    model = checks.make_batchnorm_model(checks.model_seed(s, rank))
    output = train(model, checks.make_batches(s, rank), s.lr, checks.eval_inputs(s))
    return model[1].running_mean.clone(), output.detach().clone()


def show_batchnorm(results):
    means, outputs = zip(*results)
    print("running_mean identical on every rank:", all(torch.equal(m, means[0]) for m in means))
    print("evaluation identical on every rank:", all(torch.equal(o, outputs[0]) for o in outputs))
    print("first evaluation row per rank:", [o[0].tolist() for o in outputs])


show_batchnorm(run_ranks(watch_batchnorm, 2, given_train_and_evaluate, timeout=60))


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-batchnorm-diagnosis", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `diagnose_batchnorm() -> dict` (1 point)
#
# Before the fix, say what went wrong, as the docstring's keys. The output above compares
# `running_mean` only: look at every tensor of the model, and read `_pre_forward` and
# `_post_forward` for the last key.
#
# **Graded when the notebook is graded, not before**: no check you can run tells a right
# diagnosis from a wrong one. The graded feedback then explains what the given code did and the
# fixes that work.

# %% nbgrader={"grade": false, "grade_id": "diagnose-batchnorm", "locked": false, "schema_version": 3, "solution": true, "task": false}
def diagnose_batchnorm() -> dict:
    """What `given_train_and_evaluate` does in the "Run it" cell above (2 ranks, 4 training steps,
    then one evaluation), as a dict with the keys:

    * "differing" (list of str): the names (as `model.state_dict()` names them, e.g. "1.weight")
      of every tensor of the model that differs between the ranks after training;
    * "first_step" (int): after how many training steps the ranks first hold different values
      in them (1: right after the first step);
    * "default_syncs" (int): how many of the function's forwards through the wrapper (the
      training ones and the evaluation's) would start by broadcasting rank 0's buffers with
      DDP's default, `forward_sync_buffers=True`, instead of `broadcast_buffers=False`.
    """
    ### BEGIN SOLUTION
    return {"differing": ["1.running_mean", "1.running_var"], "first_step": 1,
            "default_syncs": 5}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-batchnorm-diagnosis-hidden", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (1 point) diagnose_batchnorm's three facts are what the given code does on 2 ranks.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import replicas_that_disagree as hidden
hidden.check_batchnorm_diagnosis(diagnose_batchnorm)
print("passed")
### END HIDDEN TESTS

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-batchnorm", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ### `train_and_evaluate(model, batches, lr, eval_x) -> Tensor` (3 points)
#
# Make every rank hold, and evaluate with, the running statistics DDP keeps by default.
#
# **How it is tested.** 2 ranks, 4 steps, each rank's model initialised from its own seed and its
# own batches (drawn around a centre of its own, so each rank's statistics really differ). The
# check replays the ranks in one process with DDP's rules (gradients averaged, each rank
# normalising with its own batch in training, rank 0's running statistics) and requires, on every
# rank, bit-identical parameters and buffers and the same evaluation output, all equal to the
# replay's (within `1e-5 + 1e-5 * |w|`). Averaging the ranks' statistics at the end makes the
# ranks agree, but on other numbers than DDP's: the message says so. (The sync of parameters and
# buffers when DDP's constructor runs is on here, as it is by default.)

# %% nbgrader={"grade": false, "grade_id": "train-and-evaluate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def train_and_evaluate(model: nn.Module, batches: list, lr: float,
                       eval_x: torch.Tensor) -> torch.Tensor:
    """Train `model` (it has BatchNorm) with DDP on this rank's batches, then evaluate it.

    Called on every rank of the default process group (gloo, CPU). Every rank gets its own
    `model`, initialised differently (only rank 0's initial weights may count), and its own
    `batches[s] = (x, y)` for step s; `eval_x` is the same on every rank.

    Training: at each step one forward of the model in training mode on `x`, the mean
    cross-entropy against `y`, backward, and one step of plain `torch.optim.SGD(..., lr=lr)`
    (no momentum, no weight decay).

    Afterwards, on every rank, `model` (the object handed in, trained in place) holds
    bit-identical parameters AND buffers: the running statistics are rank 0's, as DDP keeps them
    by default (`forward_sync_buffers=True`, formerly `broadcast_buffers=True`: rank 0's buffers
    are broadcast to every rank before the forward that follows a training forward).

    Returns:
        The model's output on `eval_x` in evaluation mode (normalised with the running
        statistics), the same tensor on every rank.
    """
    ### BEGIN SOLUTION
    ddp_model = DDP(model)  # forward_sync_buffers=True, the default
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
    ddp_model.eval()
    with torch.no_grad():
        # Through the wrapper: its forward first broadcasts rank 0's buffers, which the last
        # training step left different on every rank.
        return ddp_model(eval_x)
    ### END SOLUTION


# %%
# Try it: the same comparison with your loop.
show_batchnorm(run_ranks(watch_batchnorm, 2, train_and_evaluate, timeout=60))

# %% nbgrader={"grade": true, "grade_id": "test-train-and-evaluate", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Test (3 points): 2 ranks, 4 steps: identical parameters, buffers and evaluation on all ranks, equal to DDP's rules replayed.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import replicas_that_disagree as checks
integrity.assert_untampered()
checks.check_train_and_evaluate(train_and_evaluate)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-replicas-that-disagree-hidden", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (3 points) 3 and 4 processes, local ranks of two machines, temperatures that start different, more steps, other seeds, and the fixes that only hide the symptom.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import replicas_that_disagree as hidden
hidden.check_replicas_that_disagree(join_the_job, train_with_temperature, train_and_evaluate)
print("passed")
### END HIDDEN TESTS
