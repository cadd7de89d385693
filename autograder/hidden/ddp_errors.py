"""Hidden checks for chapter 09's ddp_errors, and the truth of every situation.

Grader-only (the sandbox hides this folder from the student's code): one process's training of
each lab (:func:`unused_reference`, :func:`resume_reference`, :func:`tower_reference`), which the
visible module must not hold (GRADING_DESIGN.md). The hidden situations: an aux head trained on
some steps only (3 and 2 ranks: freezing it, or static_graph=True, is then wrong), one rank; a
resume with SGD and momentum on 3 ranks and on one; a block applied twice per forward (4 ranks:
reentrant checkpointing then fails even without find_unused_parameters). Every situation runs the
visible module's ``observe_*``, judged here with these truths; the communication-audited ones (the
aux head) stay at 3 ranks or fewer, each rank a sandbox of its own when a class is graded.

Each lab's diagnosis (``diagnose_<lab>()``, its own hidden cell) is judged here only: the facts
of what the lab's given code does in its Run-it setting (:data:`DIAGNOSES`, which
tests/test_grading_ddp_errors.py derives again from runs of the given code), and the explanation
of each failure and of the fixes that work (:data:`EXPLANATIONS`), printed in the graded feedback
whether the diagnosis is right or wrong. A visible check that told a right diagnosis from a wrong
one would let a loop try every value of a small answer space before grading.

``python -m autograder.hidden.ddp_errors`` prints the visible cases' truths as the visible module
writes them out (``WRITTEN_OUT``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from typing import Any

from autograder.hidden.diagnoses import Diagnoses
from ddpcourse.grading.checks import Case, run_student, together
from ddpcourse.grading.exercises import ddp_errors as visible
from ddpcourse.grading.exercises.ddp_errors import (_rank_seed, _state, aux_batches, aux_loss,
                                                    make_net, make_optimizer, make_tower,
                                                    net_batch, resume_setting, tower_batches,
                                                    tower_setting, unused_setting)
from ddpcourse.grading.written_out import table_literal

UNUSED_SITUATIONS = [
    (3, unused_setting(seed=11, steps=5, rows=3, aux_steps=(1, 2))),
    (1, unused_setting(seed=12, steps=3)),
    (2, unused_setting(seed=13, steps=4, rows=2, aux_steps=(0, 3), lr=0.3)),
]
RESUME_SITUATIONS = [
    (3, resume_setting(seed=14, optimizer="sgd", steps=2, more=3)),
    (1, resume_setting(seed=15, steps=4, more=2)),
]
TOWER_SITUATIONS = [(4, tower_setting(seed=16, repeats=2, steps=3, rows=3))]


def unused_reference(s: dict, world_size: int) -> dict[str, torch.Tensor]:
    """One process: rank 0's initial model, plain SGD, each step's gradient the mean over the
    ranks of each rank's loss gradient (what DDP's average gives)."""
    model = visible.make_two_heads(_rank_seed(s["seed"], 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    every = [aux_batches(s, rank) for rank in range(world_size)]
    for step in range(s["steps"]):
        optimizer.zero_grad()
        total = sum(aux_loss(model, *every[rank][step]) for rank in range(world_size))
        (total / world_size).backward()
        optimizer.step()
    return _state(model)


def resume_reference(s: dict, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, ``steps`` steps: each rank's gradient divided by the world size, then summed
    in rank order, as DDP does (exact for one or two ranks)."""
    model = make_net(_rank_seed(s["seed"], 0))
    optimizer = make_optimizer(s["optimizer"], model)
    params = list(model.parameters())
    for step in range(steps):
        grads = []
        for rank in range(world_size):
            x, y = net_batch(s["seed"], step, rank)
            grads.append(torch.autograd.grad(F.cross_entropy(model(x), y), params))
        for index, param in enumerate(params):
            total = grads[0][index] / world_size
            for other in grads[1:]:
                total = total + other[index] / world_size
            param.grad = total
        optimizer.step()
    return _state(model)


def tower_reference(s: dict, world_size: int) -> dict[str, torch.Tensor]:
    model = make_tower(_rank_seed(s["seed"], 0), s["repeats"])
    optimizer = torch.optim.SGD(model.parameters(), lr=s["lr"])
    every = [tower_batches(s, rank) for rank in range(world_size)]
    for step in range(s["steps"]):
        optimizer.zero_grad()
        total = sum(F.cross_entropy(model(every[r][step][0]), every[r][step][1])
                    for r in range(world_size))
        (total / world_size).backward()
        optimizer.step()
    return _state(model)


def unused_truth(s: dict, world_size: int) -> dict:
    return {"weights": unused_reference(s, world_size)}


def resume_truth(s: dict, world_size: int) -> dict:
    return {"saved": resume_reference(s, world_size, s["steps"]),
            "final": resume_reference(s, world_size, s["steps"] + s["more"])}


def tower_truth(s: dict, world_size: int) -> dict:
    return {"weights": tower_reference(s, world_size)}


def judge_unused(observations, world_size, s):
    visible.judge_unused_against(unused_truth, observations, world_size, s)


def judge_resume(observations, world_size, s):
    visible.judge_resume_against(resume_truth, observations, world_size, s)


def judge_checkpointed(observations, world_size, s):
    visible.judge_checkpointed_against(tower_truth, observations, world_size, s)


UNUSED = Case(visible.observe_unused, judge_unused, audit_traffic=True)
RESUME = Case(visible.observe_resume, judge_resume)
CHECKPOINTED = Case(visible.observe_checkpointed, judge_checkpointed)


def check_ddp_errors(train_with_aux, save_checkpoint, resume, train_tower) -> None:
    __tracebackhide__ = True  # noqa: F841
    for world_size, s in UNUSED_SITUATIONS:
        run_student(UNUSED, world_size, train_with_aux, s, hide_internals=True)
    for world_size, s in RESUME_SITUATIONS:
        run_student(RESUME, world_size, together(save_checkpoint, resume), s, hide_internals=True)
    for world_size, s in TOWER_SITUATIONS:
        run_student(CHECKPOINTED, world_size, train_tower, s, hide_internals=True)


# --- the diagnoses ----------------------------------------------------------------------------

# What each lab's given code does in the lab's Run-it setting (2 gloo ranks), field by field:
# the diagnosis the student's diagnose_<lab>() must return. tests/test_grading_ddp_errors.py
# derives every value again from a run of the given code, so a torch that changes the failure
# turns the test red, not a student's grade.
DIAGNOSES: dict[str, dict[str, Any]] = {
    "unused_head": {
        "iteration": 2,  # the second forward raises "Expected to have finished reduction..."
        "unused_parameters": ["aux.weight", "aux.bias"],  # the error's indices 4 and 5
        "gradient_all_reduces": 0,  # the bucket waited for aux's gradients: never all-reduced
        "replicas_agree": False,  # step 1 applied each rank's own gradients
    },
    "checkpoint": {
        "key_prefix": "module.",  # the wrapper's state_dict() names every tensor module.<name>
        "ranks_that_wrote": 2,  # no rank test: every rank torch.saves the same path
        "resumed_adam_step": 1,  # a fresh Adam after one step; the uninterrupted one is at 4
    },
    "reentrant": {
        "backward": 1,  # the first loss.backward() raises "marked as ready twice"
        "parameter": "block.0.bias",  # "Parameter at index 3 with name block.0.bias"
        "block_forwards": 2,  # once in the forward, once recomputed in the backward
    },
}
# How a field's value is compared ("int": an int, not a bool; "bool"; "name": a string, spaces
# and DDP's "module." prefix ignored; "prefix": a string, a trailing "." optional; "names": a
# list of names in any order).
KINDS = {
    "iteration": "int", "unused_parameters": "names", "gradient_all_reduces": "int",
    "replicas_agree": "bool", "key_prefix": "prefix", "ranks_that_wrote": "int",
    "resumed_adam_step": "int", "backward": "int", "parameter": "name", "block_forwards": "int",
}
# Where the evidence is, for a field that is wrong; never its value.
HINTS = {
    ("unused_head", "iteration"): "the run prints it; the error's own words ('in the prior "
        "iteration before starting a new one') say which call checks it",
    ("unused_head", "unused_parameters"): "the error lists the parameter indices that got no "
        "gradient; the index is the position in model.named_parameters()",
    ("unused_head", "gradient_all_reduces"): "count the all_reduce entries with "
        "audited_traffic() around the given loop, or reason: DDP all-reduces a bucket only once "
        "every parameter in it has its gradient",
    ("unused_head", "replicas_agree"): "compare the ranks' backbone weight sums after step 1",
    ("checkpoint", "key_prefix"): "the 'Unexpected key(s)' of the error: what the saved names "
        "have in front of the plain model's",
    ("checkpoint", "ranks_that_wrote"): "read given_save_checkpoint: which ranks reach its "
        "torch.save?",
    ("checkpoint", "resumed_adam_step"): "the file holds the weights only: what does the Adam "
        "built over the resumed model start from?",
    ("reentrant", "backward"): "run it with one step, then two: when does the error come?",
    ("reentrant", "parameter"): "the error's last line names the parameter",
    ("reentrant", "block_forwards"): "the block counts its forwards (model.block[1].forwards): "
        "what does reentrant checkpointing do in the backward before DDP's hook complains?",
}
_EXPECTED_TYPE = {"int": "an int", "bool": "True or False", "name": "a string",
                  "prefix": "a string", "names": "a list of strings"}


def normalize(kind: str, value: Any) -> Any:
    """The comparable form of an answer's value (plain data), or None when its type is wrong."""
    if kind == "int":
        return value if type(value) is int else None
    if kind == "bool":
        return value if type(value) is bool else None
    if kind == "names":
        if type(value) is not list or not all(type(item) is str for item in value):
            return None
        return sorted(normalize("name", item) for item in value)
    if type(value) is not str:
        return None
    text = value.strip().strip("'\"`").strip()
    if kind == "prefix":
        return text.rstrip(".")
    return text.removeprefix("module.")


# What each lab's given code did, and the fixes: the graded feedback of its diagnosis.
EXPLANATIONS = {
    "unused_head": """\
**What happened.** DDP's reducer waits, in every backward, for a gradient of *every* parameter
it wraps before it all-reduces the bucket that holds it (this small model's six tensors share
one bucket). The aux head got none, so the bucket was never all-reduced: step 1's
`optimizer.step()` used each rank's **own** gradients (0 gradient all-reduces, and the replicas,
equal after DDP's broadcast, already differ: see the weight sums), and the error comes only at
the **next** forward, the second iteration: "Expected to have finished reduction in the prior
iteration before starting a new one", naming the parameter indices that got no gradient (4 and
5, the positions of `aux.weight` and `aux.bias` in `model.named_parameters()`;
`TORCH_DISTRIBUTED_DEBUG=INFO` names them). Had the aux head been used on step 1 and skipped on
step 2, the error would come at the third iteration.

**The fixes.** The error suggests `find_unused_parameters=True`, which works, at a price on every
step: DDP traverses the autograd graph after each forward to find the unused parameters and
all-reduces a map of which parameters each rank used (`Reducer::all_reduce_local_used_map` in
torch/csrc/distributed/c10d/reducer.cpp), 4 bytes per parameter tensor per step. This lab asks
for a fix without it (the test counts what the ranks all-reduce):

* **Give DDP nothing to wait for**: freeze the head before wrapping
  (`model.aux.requires_grad_(False)`: DDP waits only for parameters that require a gradient,
  and still broadcasts the frozen ones from rank 0 when it wraps). Right when the head is not
  trained in this run. Wrapping only the parts the loss uses (`DDP(nn.Sequential(backbone,
  tanh, head))`) also stops the error, but DDP then never broadcasts the aux head: every rank
  keeps its own initial aux weights, and the test's ranks, which start from different
  weights, end with replicas that differ.
* **Give it a part in every loss**: `loss + 0 * aux.sum()` on the steps without aux labels. Its
  gradient is then zero, which plain SGD (no momentum, no weight decay) turns into no change at
  all: SGD skips a parameter whose `.grad` is `None` and subtracts `lr * 0` from one whose
  gradient is zero (torch/optim/sgd.py, `_init_group` and `_single_tensor_sgd`). With weight
  decay or momentum a zero gradient still moves the weights, so the trick changes the result
  there. It costs the head's forward, backward and gradient all-reduce on every step, and it is
  the fix that still works when the head **is** trained on some steps.
* **`static_graph=True`** tells DDP that the same parameters are used on every iteration: it
  records the unused ones on the first iteration (all-reducing the map once) and marks them
  ready itself afterwards. Right when the head is never used; when it is used on some steps
  only, DDP raises ("Your training graph has changed in this iteration...").
""",
    "checkpoint": """\
**What happened.** Three mistakes, two of which show:

* The wrapper's `state_dict()` names every tensor `module.<name>` (the prefix is the attribute
  `module` of the DDP wrapper), so the plain model of the new job refuses it: "Error(s) in
  loading state_dict ... Missing key(s) ... Unexpected key(s) ... module.inp.weight". Save
  `ddp_model.module.state_dict()`.
* Only the weights were saved: the resumed Adam starts with no moments and step count 0, so
  after its first step its `step` is 1 where the uninterrupted run's is 4. Adam's first,
  bias-corrected update moves each weight by about `lr` (the sign of its gradient times `lr`),
  more than the uninterrupted run's update there, and the runs part (the gap above). Save and
  restore `optimizer.state_dict()` too, on every rank (DDP broadcasts the weights when it
  wraps, never the optimizer).
* Every rank writes the same file: nothing in `given_save_checkpoint` tests the rank, so both
  ranks call `torch.save` on the same path. Replicas are identical, so this is one file written
  N times, at once: on a shared filesystem the writes race, and a reader can meet a
  half-written file. Rank 0 writes, then every rank waits (`dist.barrier()`) so that no rank
  goes on (or resumes) before the file is complete. One file per rank (`checkpoint-{rank}.pt`)
  avoids the race but is not accepted here either: N copies of the same bytes, N times the I/O,
  and a job resumed on another number of ranks has no file for its new ranks.
""",
    "reentrant": """\
**What happened.** On the first backward: "Expected to mark a variable ready only once ...
Parameter at index 3 with name block.0.bias has been marked as ready twice". No parameter is
shared and the block is applied once per forward: the combination of the two flags is enough.
Reentrant checkpointing (`use_reentrant=True`) runs the block under `no_grad` in the forward and,
in the backward, runs its forward again (the block's second forward, before the error) and a
backward of its own through it. The block's parameters are not in the graph that
`find_unused_parameters=True` traverses after the forward, so DDP takes them for unused and
marks them ready itself during the backward, and then the inner backward's gradient hooks mark
them ready again. (The same error, without `find_unused_parameters`, comes from a
reentrant-checkpointed block applied twice in one forward: the hidden tests have one.)

**The fixes**, each shown to pass these tests:

* `use_reentrant=False`: the non-reentrant implementation records the recomputation in the
  same autograd graph (saved-tensor hooks), so DDP sees the block's parameters used once. The
  PyTorch docs recommend it (torch.utils.checkpoint.checkpoint); keep
  `find_unused_parameters=True` for the pooler.
* `static_graph=True` in place of `find_unused_parameters=True`: DDP learns on the first
  iteration which parameters are used and how often their hooks fire, and marks them
  accordingly, so reentrant checkpointing and the unused pooler both work, as long as the
  graph is the same on every iteration.
* Dropping `find_unused_parameters` alone is no fix: the pooler's missing gradient then raises
  lab 1's error on the second iteration; and dropping the checkpointing gives back the memory
  it saved (the test counts the block's recomputations).
""",
}


DIAGNOSED = Diagnoses(DIAGNOSES, KINDS, normalize, _EXPECTED_TYPE,
                      "ints, bools, strings and lists of strings", EXPLANATIONS,
                      "What the given code did, and the fixes:", HINTS)
check_unused_head_diagnosis = DIAGNOSED.checker("unused_head")
check_checkpoint_diagnosis = DIAGNOSED.checker("checkpoint")
check_reentrant_diagnosis = DIAGNOSED.checker("reentrant")


# --- the visible cases' truths, written out -----------------------------------------------------


def written_out() -> dict[str, dict[str, dict]]:
    """The visible cases' truths as ``visible.WRITTEN_OUT`` holds them: each tensor as its
    :func:`~ddpcourse.grading.exercises.ddp_errors.digest`."""
    def digests(truth: dict) -> dict:
        return {key: {name: visible.digest(t) for name, t in state.items()}
                for key, state in truth.items()}

    return {"unused": {visible.situation_key(visible.VISIBLE_UNUSED, 2):
                       digests(unused_truth(visible.VISIBLE_UNUSED, 2))},
            "resume": {visible.situation_key(visible.VISIBLE_RESUME, 2):
                       digests(resume_truth(visible.VISIBLE_RESUME, 2))},
            "tower": {visible.situation_key(visible.VISIBLE_TOWER, 2):
                      digests(tower_truth(visible.VISIBLE_TOWER, 2))}}


if __name__ == "__main__":
    print(table_literal(written_out()))
