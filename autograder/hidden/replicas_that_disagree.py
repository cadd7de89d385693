"""Hidden checks for chapter 09's replicas_that_disagree: 3 and 4 processes; processes of two
machines (local ranks differ from ranks) under torchrun, srun and torchrun started by srun;
temperatures that start different on every rank (a fix must sync the start too, as DDP's
constructor does); more steps, other batch sizes, learning rates and seeds; one rank. The tempting
fixes (a temperature averaged once at the end or copied from rank 0 after each step, running
statistics averaged at the end, an evaluation that bypasses the wrapper) fail here as in the
visible checks, each named by the judge. Every situation runs the visible module's ``observe_*``,
judged here with the truths computed here, which the visible module must not hold
(GRADING_DESIGN.md): ONE process's training of rank 0's model on the global batches, and every
known mistake replayed in one process.

Each lab's diagnosis (``diagnose_join``, ``diagnose_temperature``, ``diagnose_batchnorm``: facts
of what the lab's given code does, asked before the fix) is judged here only, against
:data:`DIAGNOSES`: the answer space of each fact is small, so no check a student can run may tell
a right one from a wrong one. Its feedback, right or wrong, is the lab's explanation
(:data:`EXPLANATIONS`). tests/test_grading_replicas_that_disagree.py derives every value of
:data:`DIAGNOSES` from runs of the given code.

``python -m autograder.hidden.replicas_that_disagree`` prints the visible cases' truths as the
visible module writes them out (``WRITTEN_OUT``)."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autograder.hidden.diagnoses import Diagnoses
from ddpcourse.grading.checks import Case, run_student
from ddpcourse.grading.exercises import replicas_that_disagree as visible
from ddpcourse.grading.exercises.replicas_that_disagree import (
    BATCHNORM_MISTAKES, TEMPERATURE_MISTAKES, Situation, _state, eval_inputs,
    make_batches, make_batchnorm_model, make_criterion, make_model, model_seed, run_join)
from ddpcourse.grading.written_out import table_literal

JOIN_SITUATIONS = {
    3: [("torchrun", 1), ("srun", 1), ("none", 1)],
    4: [("torchrun", 2), ("srun", 2), ("torchrun-in-srun", 2), ("none", 2)],
}
TRAINING_SITUATIONS = {
    1: [tuple(Situation(steps=3, rows=5, lr=0.3, seed=21, temperatures=True))],
    3: [tuple(Situation(steps=7, rows=6, lr=0.4, seed=22, temperatures=True))],
    4: [tuple(Situation(steps=6, rows=4, lr=0.6, seed=23, temperatures=True))],
}


def one_process_temperature(s: Situation, world_size: int) -> dict:
    """ONE process: rank 0's initial model and temperature, the global batch of each step (every
    rank's batch, concatenated), the mean loss, plain SGD."""
    model, criterion = make_model(model_seed(s, 0)), make_criterion(s, 0)
    everyone = [make_batches(s, rank) for rank in range(world_size)]
    params = [*model.parameters(), *criterion.parameters()]
    for step in range(s.steps):
        x = torch.cat([batches[step][0] for batches in everyone])
        y = torch.cat([batches[step][1] for batches in everyone])
        grads = torch.autograd.grad(criterion(model(x), y), params)
        _sgd_step(params, grads, s.lr)
    return {"model": _state(model), "criterion": _state(criterion)}


def _sgd_step(params, grads, lr: float) -> None:
    """What plain ``torch.optim.SGD`` does (no momentum, no weight decay), without importing
    the optimizers (their first import costs the judge seconds)."""
    with torch.no_grad():
        for p, grad in zip(params, grads):
            p.add_(grad, alpha=-lr)


def replay_temperature(s: Situation, world_size: int, mistake: str) -> list[dict]:
    """Every rank's final state for a known mistake, replayed in one process: the model's
    gradients averaged (it is inside DDP), the temperature's gradients not ("outside"), or the
    temperature then averaged once at the end ("averaged at the end"), or rank 0's temperature
    copied to every rank after each step ("broadcast each step")."""
    model = make_model(model_seed(s, 0))
    temperatures = [make_criterion(s, rank) for rank in range(world_size)]
    everyone = [make_batches(s, rank) for rank in range(world_size)]
    params = list(model.parameters())
    with torch.no_grad():
        for step in range(s.steps):
            model_grads = [torch.zeros_like(p) for p in params]
            for rank, criterion in enumerate(temperatures):
                x, y = everyone[rank][step]
                with torch.enable_grad():
                    loss = criterion(model(x), y)
                    grads = torch.autograd.grad(loss, [*params, criterion.log_temperature])
                for total, grad in zip(model_grads, grads[:-1]):
                    total += grad / world_size
                criterion.log_temperature.add_(grads[-1], alpha=-s.lr)
            _sgd_step(params, model_grads, s.lr)
            if mistake == "broadcast each step":
                for criterion in temperatures[1:]:
                    criterion.log_temperature.copy_(temperatures[0].log_temperature)
        if mistake == "averaged at the end":
            mean = torch.stack([c.log_temperature for c in temperatures]).mean()
            for criterion in temperatures:
                criterion.log_temperature.copy_(mean)
    return [{"model": _state(model), "criterion": _state(c)} for c in temperatures]


def replay_batchnorm(s: Situation, world_size: int, buffers: str) -> list[dict]:
    """Every rank's final state and evaluation output, replayed in one process: gradients
    averaged over the ranks (DDP), each rank normalising with its own batch's statistics; the
    running statistics are

    * ``"rank 0"``: rank 0's, broadcast before every forward through the wrapper, the last time
      before the evaluation (DDP's default): the reference;
    * ``"own"``: each rank's own (``broadcast_buffers=False``, ``forward_sync_buffers=False``);
    * ``"own last step"``: rank 0's broadcast before each training forward, then each rank's
      last forward updated its own, and the evaluation bypassed the wrapper;
    * ``"averaged"``: each rank's own, then the mean over the ranks."""
    model = make_batchnorm_model(model_seed(s, 0))
    everyone = [make_batches(s, rank) for rank in range(world_size)]
    params = list(model.parameters())
    names = [name for name, _ in model.named_buffers()]
    held = [{n: b.clone() for n, b in model.named_buffers()} for _ in range(world_size)]
    model.train()
    for step in range(s.steps):
        if buffers not in ("own", "averaged"):
            held = [{n: b.clone() for n, b in held[0].items()} for _ in range(world_size)]
        totals = [torch.zeros_like(p) for p in params]
        for rank in range(world_size):
            _load_buffers(model, held[rank])
            x, y = everyone[rank][step]
            grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
            held[rank] = {n: b.clone() for n, b in model.named_buffers()}
            for total, grad in zip(totals, grads):
                total += grad / world_size
        _sgd_step(params, totals, s.lr)
    if buffers == "rank 0":
        held = [dict(held[0]) for _ in range(world_size)]
    elif buffers == "averaged":
        mean = {n: (torch.stack([h[n].double() for h in held]).mean(0).to(held[0][n].dtype)
                    if held[0][n].is_floating_point() else held[0][n]) for n in names}
        held = [dict(mean) for _ in range(world_size)]
    results = []
    model.eval()
    for rank in range(world_size):
        _load_buffers(model, held[rank])
        with torch.no_grad():
            output = model(eval_inputs(s))
        results.append({"model": _state(model), "output": output})
    return results


def _load_buffers(model: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])


# --- each situation's truth, as the judges take it ----------------------------------------------


def temperature_truth(s: Situation, world_size: int) -> dict:
    return {"reference": one_process_temperature(s, world_size),
            "replays": {m: replay_temperature(s, world_size, m) for m in TEMPERATURE_MISTAKES}}


def _as_judged(replayed: dict) -> dict:
    return {"model": replayed["model"], "evaluation": {"output": replayed["output"]}}


def batchnorm_truth(s: Situation, world_size: int) -> dict:
    return {"reference": _as_judged(replay_batchnorm(s, world_size, "rank 0")[0]),
            "replays": {m: [_as_judged(r) for r in replay_batchnorm(s, world_size, m)]
                        for m in BATCHNORM_MISTAKES}}


def judge_temperature(observations, world_size, situations):
    visible.judge_temperature_against(temperature_truth, observations, world_size, situations)


def judge_batchnorm(observations, world_size, situations):
    visible.judge_batchnorm_against(batchnorm_truth, observations, world_size, situations)


TEMPERATURE = Case(visible.observe_temperature, judge_temperature)
BATCHNORM = Case(visible.observe_batchnorm, judge_batchnorm)


def check_replicas_that_disagree(join_the_job, train_with_temperature,
                                 train_and_evaluate) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, situations in JOIN_SITUATIONS.items():
        run_join(join_the_job, world_size, situations, hide_internals=True)
    for world_size, situations in TRAINING_SITUATIONS.items():
        run_student(TEMPERATURE, world_size, train_with_temperature, situations,
                    hide_internals=True)
        run_student(BATCHNORM, world_size, train_and_evaluate, situations, hide_internals=True)


# --- the diagnoses ------------------------------------------------------------------------------

# What each lab's given code does in its "Run it" setting (2 processes; VISIBLE_TRAINING's
# situation for labs 2 and 3), as each lab's diagnose_<lab>() docstring asks it. Every value is
# derived from a run of the given code in tests/test_grading_replicas_that_disagree.py.
DIAGNOSES: dict[str, dict[str, Any]] = {
    "join": {"claimed_rank": 0, "world_size": 2, "unclaimed_rank": 1,
             "raised_in": "init_process_group"},
    "temperature": {"parameter": "log_temperature", "first_step": 1, "averaged_tensors": 4},
    "batchnorm": {"differing": ["running_mean", "running_var"], "first_step": 1,
                  "default_syncs": 5},
}

# How each field is compared: "int" (an int, not a bool); "name" (a str: a torch.distributed
# function or a parameter, its prefix and case ignored: "dist.init_process_group",
# "criterion.log_temperature"); "names" (a list of such names, in any order).
DIAGNOSIS_KINDS = {
    "claimed_rank": "int", "world_size": "int", "unclaimed_rank": "int", "raised_in": "name",
    "parameter": "name", "first_step": "int", "averaged_tensors": "int", "differing": "names",
    "default_syncs": "int",
}
_EXPECTED_TYPE = {"int": "an int", "name": "a str", "names": "a list of str"}
_PREFIX = re.compile(r"^(torch\.distributed\.|dist\.)")


def normalize_diagnosis(kind: str, value: Any) -> Any:
    """The comparable form of one field's value, or None when it has the wrong type."""
    if kind == "int":
        return value if type(value) is int else None
    if kind == "names":
        if type(value) is not list or not all(type(item) is str for item in value):
            return None
        return sorted({normalize_diagnosis("name", item) for item in value})
    if type(value) is not str:
        return None
    return _PREFIX.sub("", value.strip()).rsplit(".", 1)[-1].removesuffix("()").lower()


# What each lab's given code did, and the fixes that work: the feedback of the lab's graded
# diagnosis, right or wrong (the lab gives the symptom only; working out the cause is the task).
EXPLANATIONS = {
    'join': """\
The job's first function was written for SLURM, where `srun` starts one task per process and
sets `SLURM_PROCID` (the global rank), `SLURM_LOCALID` (the rank on its machine) and
`SLURM_NTASKS`. When the job moved to `torchrun`, someone added `WORLD_SIZE`, and the defaults
"make it work when run by hand". But torchrun sets `RANK`, `LOCAL_RANK` and `WORLD_SIZE`, and
no `SLURM_*` at all: `os.environ.get("SLURM_PROCID", 0)` gives 0 in **every** process, while
the world size is right (2, from `WORLD_SIZE`).

Two processes that both claim rank 0 of 2 cannot form a group: no process claims rank 1, each
writes its address as rank 0's and waits for rank 1's, which nobody writes. With the default
timeout (30 minutes for gloo) the job just hangs; with a short one `init_process_group` raises
in every process (in `ProcessGroupGloo`'s constructor) when the store gives up: the `file://`
store of the lab says `RuntimeError: Wait timeout`; under `torchrun` (its agent's TCP store,
`env://`) every process says `DistStoreError: wait timeout after 1000ms, keys:
/default_pg/0//cpu//0/1` for a one-second timeout: the key of rank 1, who never came. Worse
is when the world size is read the same way (`SLURM_NTASKS` with a default of 1): then every
process forms a group **of its own**, as rank 0 of 1, nothing fails, every all-reduce returns
the process's own value, and N processes train N separate models, all logging and saving as
rank 0.

The fix reads the identity from the launcher that is there: torchrun's `RANK`, `LOCAL_RANK`
and `WORLD_SIZE` when `RANK` is set (also when srun started torchrun: then `SLURM_PROCID`
numbers the machines' tasks, not the processes), else srun's `SLURM_PROCID`, `SLURM_LOCALID`
and `SLURM_NTASKS`, and raises before joining anything when neither is set. Reading
`SLURM_PROCID` first is wrong under torchrun started by srun, and a default of 0 for the rank
is a guess that turns a hang into a silent job of its own.
""",
    'temperature': """\
The model is wrapped in DDP, and the loss is `TemperedLoss` (from the setup cell): the
cross-entropy of `logits / exp(log_temperature)`, where `log_temperature` is an
`nn.Parameter`. It is created after wrapping and handed to the optimizer, so it learns; but
DDP only averages the gradients of the parameters of the module it wraps: its reducer
all-reduces 4 of the 5 tensors the optimizer steps (the model's two weights and two biases),
never `log_temperature`. Each rank's temperature follows its own rank's data, and the ranks
hold different temperatures from the first step on (they start equal, at 0). The model's own
weights still agree (DDP averages their gradients), so a check of the wrapped model alone sees
nothing wrong: compare everything that learns.

The fix puts everything that learns inside one DDP: a module that owns the model and the
criterion (its forward returns the loss), wrapped in DDP, whose parameters the optimizer
steps; wrapping the criterion in a DDP of its own works too. Both also broadcast rank 0's
initial temperature when the wrapper is built. Averaging the temperature's gradient by hand
after each backward only works while every rank's temperature starts equal.

Two tempting fixes do not work: seeding before creating the temperature (it already starts
equal: the problem is its gradients, not its start), and averaging the parameters once at the
end (the ranks then agree, but every step before used a temperature of its own, so they agree
on the wrong weights).
""",
    'batchnorm': """\
BatchNorm keeps buffers, not parameters: `running_mean`, `running_var`, `num_batches_tracked`.
Training forwards update them from each rank's own batch, and evaluation normalises with them.
By default DDP copies rank 0's buffers to every rank at the start of a forward through the
wrapper whenever the previous forward ran with gradients on and outside `no_sync()` (and at the
first forward after wrapping): `DistributedDataParallel._pre_forward` calls `_sync_buffers`,
which broadcasts from rank 0, when `will_sync_module_buffers()` holds, and `_post_forward`
re-arms it only after such a forward (chapter 07 counts the broadcasts). In the given function
that would be 5 broadcasts: before each of the 4 training forwards and before the evaluation's.
The switch is `forward_sync_buffers` in torch 2.13; its older name `broadcast_buffers`, the one
in the given code, is deprecated there and warns (the `FutureWarning` the cell prints;
`broadcast_buffers=False` also skips the sync of the buffers when the wrapper is built,
`forward_sync_buffers=False` does not). Turned off, the ranks' `running_mean` and
`running_var` differ from the first step on, while the parameters (their gradients are
averaged) and `num_batches_tracked` (a count of training forwards) agree, and the same weights
evaluate differently on every rank.

The fix keeps DDP's default (no `broadcast_buffers=False`) and evaluates through the wrapper;
broadcasting rank 0's buffers by hand before the evaluation gives the same numbers too, since a
training forward normalises with its own batch's statistics and never reads the running ones.

Two things that are easy to get wrong:

* Even with the sync on, the buffers are broadcast **before** a forward, so after the last
  training step every rank still holds the statistics its own last batch updated. They agree
  again only after the next forward through the wrapper (the first evaluation forward through
  `ddp_model`, which broadcasts rank 0's: `will_sync_module_buffers` is true after a forward
  with gradients): evaluating `ddp_model.module` (or the plain model) skips that, and the ranks
  disagree. Averaging the ranks' statistics at the end makes them agree, on other numbers than
  DDP's.
* `nn.SyncBatchNorm` (batch statistics over all ranks) does not run here: on the CPU, DDP's
  constructor refuses it with `ValueError: SyncBatchNorm layers only work with GPU modules`,
  and its forward in training raises `SyncBatchNorm expected input tensor to be on GPU or XPU
  or ...` (torch/nn/modules/batchnorm.py, `SyncBatchNorm.forward`). It is a fix on GPUs with
  NCCL, and it changes the training itself (normalisation with the global batch's
  statistics); this lab keeps DDP's default rules.
""",
}


DIAGNOSED = Diagnoses(DIAGNOSES, DIAGNOSIS_KINDS, normalize_diagnosis, _EXPECTED_TYPE,
                      "ints, strings and lists of strings", EXPLANATIONS,
                      "What the given code did:")
check_join_diagnosis = DIAGNOSED.checker("join")
check_temperature_diagnosis = DIAGNOSED.checker("temperature")
check_batchnorm_diagnosis = DIAGNOSED.checker("batchnorm")


# --- the visible cases' truths, written out -----------------------------------------------------


def _digests(value):
    if isinstance(value, torch.Tensor):
        return visible.digest(value)
    if isinstance(value, dict):
        return {key: _digests(item) for key, item in value.items()}
    return [_digests(item) for item in value]


def written_out() -> dict[str, dict[str, dict]]:
    """The visible cases' truths as ``visible.WRITTEN_OUT`` holds them: each tensor as its
    :func:`~ddpcourse.grading.exercises.replicas_that_disagree.digest`."""
    out: dict[str, dict[str, dict]] = {"temperature": {}, "batchnorm": {}}
    with visible._one_thread():
        for situation in visible.VISIBLE_TRAINING:
            s = Situation(*situation)
            key = visible.situation_key(s, 2)
            out["temperature"][key] = _digests(temperature_truth(s, 2))
            out["batchnorm"][key] = _digests(batchnorm_truth(s, 2))
    return out


if __name__ == "__main__":
    print(table_literal(written_out()))
