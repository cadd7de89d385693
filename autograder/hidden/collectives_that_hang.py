"""Hidden checks for chapter 09's collectives_that_hang, and the truth of every situation.

Grader-only (the sandbox hides this folder from the student's code): the ranks simulated in one
process (each rank's own batch, gradients averaged as DDP averages them, rank 0's buffers
broadcast before a forward as DDP does), which gives each situation's truth, and the expected
gather; the visible module holds none of it (GRADING_DESIGN.md).

The hidden situations: 3 and 4 ranks for every lab, and the situations a 2-rank fix can get
right by luck: other shard lengths (one of them empty, all equal), a bad batch on rank 0 or on two
ranks at once, an empty batch, a batch whose loss is inf (not finite, though not NaN), no bad
batch at all, an early stop decided by the mean although one rank's own loss is already below the
threshold, a last batch of one row, equal sizes. They run the visible module's ``observe_*``,
judged here with these truths, only in the trusted grader.

Each lab's diagnosis (``diagnose_<lab>()``, its own hidden cell) is judged here only: the facts
of what the lab's given code does in its Run-it setting (:data:`DIAGNOSES`, which
tests/test_grading_collectives_that_hang.py derives again from runs of the given code), and the
explanation of each failure and of the fixes that work (:data:`EXPLANATIONS`), printed in the
graded feedback whether the diagnosis is right or wrong. A visible check that told a right
diagnosis from a wrong one would let a loop try every value of a small answer space before
grading.

``python -m autograder.hidden.collectives_that_hang`` prints the visible cases' truths as the
visible module writes them out (``WRITTEN_OUT``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch.nn import functional as F

from autograder.hidden.diagnoses import Diagnoses
from ddpcourse.grading.checks import Case
from ddpcourse.grading.exercises import collectives_that_hang as visible
from ddpcourse.grading.exercises.collectives_that_hang import (
    HINTS, _run, _state, digest, lab4_batches, make_batch, make_batches, make_bn_model,
    make_linear, model_seed, predictions, shard_batches)
from ddpcourse.grading.written_out import table_literal

LOG_SITUATIONS = {3: [(3, 5, 0.1, 2, 2)], 4: [(2, 3, 0.2, 1, 3)]}
EVALUATE_SITUATIONS = {3: [(4, 2, 3, 0.1, 4)], 4: [(3, 2, 1, 0.2, 5)]}
SHARD_SITUATIONS = {
    3: [([5, 9, 12], 2, 0.1, 6), ([6, 6, 6], 3, 0.1, 7)],
    4: [([8, 3, 8, 10], 4, 0.2, 8), ([4, 0, 5, 6], 2, 0.1, 9)],
}
SKIP_SITUATIONS = {
    3: [(4, 6, 0.1, 0.05, [[0, 1, "nan"], [2, 1, "nan"]], 2),
        (4, 5, 0.1, 0.05, [[2, 3, "empty"], [0, 2, "inf"]], 3),
        (4, 8, 0.3, 0.25, [], 4)],
    4: [(3, 6, 0.2, 0.05, [[3, 2, "nan"], [1, 4, "empty"]], 5),
        (3, 8, 0.3, 0.2, [[0, 1, "nan"]], 6)],
}
GATHER_SITUATIONS = {
    3: [([3, 3, 1], "labels", 2), ([2, 4, 3], "scores", 3)],
    4: [([3, 3, 2, 2], "labels", 4), ([5, 5, 5, 5], "scores", 5), ([1, 2, 1, 4], "labels", 6)],
}


def _ddp_step(modules: list, batches: list, lr: float, sync_buffers: bool = False) -> list:
    """One DDP step of every simulated rank: rank 0's buffers first (DDP's pre-forward
    broadcast), each rank's forward and backward on its own batch, gradients averaged, plain
    SGD. Returns each rank's loss (before the step)."""
    with torch.no_grad():
        if sync_buffers:
            for module in modules[1:]:
                for mine, rank0s in zip(module.buffers(), modules[0].buffers()):
                    mine.copy_(rank0s)
    losses = []
    for module, (x, y) in zip(modules, batches):
        module.zero_grad()
        loss = F.mse_loss(module(x), y)
        loss.backward()
        losses.append(loss.item())
    with torch.no_grad():
        for params in zip(*(list(m.parameters()) for m in modules)):
            mean = torch.stack([p.grad for p in params]).mean(0)
            for p in params:
                p.add_(mean, alpha=-lr)
    return losses


def _replicas(make, world_size: int, seed: int) -> list:
    """Every simulated rank's module, all with rank 0's initial parameters (DDP's constructor
    broadcasts them, buffers included)."""
    rank0 = make(model_seed(seed, 0)).state_dict()
    modules = []
    for _ in range(world_size):
        module = make(0)
        module.load_state_dict(rank0)
        modules.append(module)
    return modules


def _one_thread(fn):
    def wrapped(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapped


@_one_thread
def expected_log(world_size, situation) -> tuple[list, dict]:
    """Lab 1: rank 0's log ``[[step, global mean loss], ...]`` and the final state."""
    rows, steps, lr, log_every, seed = situation
    modules = _replicas(make_linear, world_size, seed)
    batches = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
    logged = []
    for step in range(1, steps + 1):
        losses = _ddp_step(modules, [b[step - 1] for b in batches], lr)
        if step % log_every == 0:
            logged.append([step, sum(losses) / world_size])
    return logged, _state(modules[0])


@_one_thread
def expected_evaluate(world_size, situation) -> tuple[list, list]:
    """Lab 2: rank 0's validation losses (eval mode, rank 0's running statistics) after each
    epoch, and every rank's final state. Only rank 0's buffers are judged: the others' last
    forward updated their own running statistics after DDP's last broadcast, unless an
    evaluation through the wrapper on every rank broadcast rank 0's once more."""
    rows, steps, epochs, lr, seed = situation
    modules = _replicas(make_bn_model, world_size, seed)
    batches = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
    x_eval, y_eval = make_batch(seed, 99, 0, 2 * rows)
    history = []
    for _ in range(epochs):
        for step in range(steps):
            _ddp_step(modules, [b[step] for b in batches], lr, sync_buffers=True)
        modules[0].eval()
        with torch.no_grad():
            history.append(F.mse_loss(modules[0](x_eval), y_eval).item())
        modules[0].train()
    return history, [_state(m) for m in modules]


@_one_thread
def expected_shard(world_size, situation) -> tuple[int, dict]:
    """Lab 3: the steps every rank can take (the fewest batches of any shard) and the state."""
    lengths, batch_size, lr, seed = situation
    batches = [shard_batches(seed, rank, lengths[rank], batch_size) for rank in range(world_size)]
    steps = min(len(b) for b in batches)
    modules = _replicas(make_linear, world_size, seed)
    for step in range(steps):
        _ddp_step(modules, [b[step] for b in batches], lr)
    return steps, _state(modules[0])


def _lab4_losses(modules, batches) -> list[float]:
    with torch.no_grad():
        return [F.mse_loss(m(x), y).item() for m, (x, y) in zip(modules, batches)]


@_one_thread
def expected_skip(world_size, situation) -> tuple[list, dict, float]:
    """Lab 4: the steps applied, the state, and how close any step's global mean loss came to
    ``stop_below`` (relative), so that a situation is never decided by rounding."""
    rows, steps, lr, stop_below, bad, seed = situation
    modules = _replicas(make_linear, world_size, seed)
    batches = [lab4_batches(seed, rank, steps, rows, bad) for rank in range(world_size)]
    applied, margin = [], math.inf
    for step in range(1, steps + 1):
        mine = [b[step - 1] for b in batches]
        losses = _lab4_losses(modules, mine)
        if not all(math.isfinite(v) for v in losses):
            continue
        _ddp_step(modules, mine, lr)
        applied.append(step)
        mean = sum(losses) / world_size
        margin = min(margin, abs(mean - stop_below) / stop_below)
        if mean < stop_below:
            break
    return applied, _state(modules[0]), margin


def expected_gather(world_size, situation) -> torch.Tensor:
    rows, kind, seed = situation
    return torch.cat([predictions(seed, rank, rows[rank], kind) for rank in range(world_size)])


# --- each situation's truth, as the judges take it ----------------------------------------------


def log_truth(world_size, situation) -> dict:
    logged, state = expected_log(world_size, situation)
    return {"logged": logged, "state": state}


def evaluate_truth(world_size, situation) -> dict:
    history, states = expected_evaluate(world_size, situation)
    return {"history": history, "state": states[0]}


def shard_truth(world_size, situation) -> dict:
    steps, state = expected_shard(world_size, situation)
    return {"steps": steps, "state": state}


def skip_truth(world_size, situation) -> dict:
    applied, state, _ = expected_skip(world_size, situation)
    return {"applied": applied, "state": state}


def gather_truth(world_size, situation) -> dict:
    return {"gathered": expected_gather(world_size, situation)}


def judge_log(observations, world_size, situations) -> None:
    visible.judge_log_against(log_truth, observations, world_size, situations)


def judge_evaluate(observations, world_size, situations) -> None:
    visible.judge_evaluate_against(evaluate_truth, observations, world_size, situations)


def judge_shard(observations, world_size, situations) -> None:
    visible.judge_shard_against(shard_truth, observations, world_size, situations)


def judge_skip(observations, world_size, situations) -> None:
    visible.judge_skip_against(skip_truth, observations, world_size, situations)


def judge_gather(observations, world_size, situations) -> None:
    visible.judge_gather_against(gather_truth, observations, world_size, situations)


LOG = Case(visible.observe_log, judge_log)
EVALUATE = Case(visible.observe_evaluate, judge_evaluate)
SHARD = Case(visible.observe_shard, judge_shard)
SKIP = Case(visible.observe_skip, judge_skip)
GATHER = Case(visible.observe_gather, judge_gather)


def check_collectives_that_hang(train_and_log, fit_and_evaluate, train_on_shard,
                                train_skipping_bad_batches, gather_predictions) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for case, fn, situations, hint in (
            (LOG, train_and_log, LOG_SITUATIONS, HINTS["log"]),
            (EVALUATE, fit_and_evaluate, EVALUATE_SITUATIONS, HINTS["evaluate"]),
            (SHARD, train_on_shard, SHARD_SITUATIONS, HINTS["shard"]),
            (SKIP, train_skipping_bad_batches, SKIP_SITUATIONS, HINTS["skip"]),
            (GATHER, gather_predictions, GATHER_SITUATIONS, HINTS["gather"])):
        for world_size, cases in situations.items():
            _run(case, world_size, fn, cases, hint, timeout=None, hide_internals=True)


# --- the diagnoses ------------------------------------------------------------------------------

# What each lab's given code does in the lab's Run-it setting (2 gloo ranks), field by field: the
# diagnosis the student's diagnose_<lab>() must return. tests/test_grading_collectives_that_hang.py
# derives every value again from runs of the given code (the gradient all-reduces traced with the
# step each rank was in), so a torch that changes the failure turns the test red, not a grade.
DIAGNOSES: dict[str, dict[str, Any]] = {
    "log": {
        "hung_rank": 0,  # run (a): the log all-reduce after the last step has no partner
        "hung_in": "all_reduce",
        "aborted_rank": 0,  # run (b): its one-float all-reduce receives a gradient chunk
        "paired_with_step": 3,  # rank 1's gradient all-reduce of step 3 met it
    },
    "evaluate": {
        "hung_rank": 0,
        "collective": "broadcast",  # DDP's buffer broadcast (_sync_buffers), in the eval forward
        "evaluations_completed": 1,  # epoch 1's met rank 1's broadcast of step 4
        "hangs_without_buffers": False,  # no buffers: no collective in a no_grad forward
    },
    "shard": {
        "hung_rank": 0,  # 10 samples: 4 batches; rank 1's 7: 3 batches
        "hung_in": "backward",  # DDP's gradient all-reduce of step 4
        "hung_at_step": 4,
    },
    "skip": {
        "hung_rank": 0,
        "hung_at_step": 6,  # rank 1 returned after 5 backwards, rank 0 is in its sixth
        "mixed_steps": [2, 3, 4, 5],  # each met rank 1's all-reduce of the next step
    },
    "gather": {
        "aborted_rank": 1,  # the smaller tensor receives more bytes than it holds
        "exitcode": -6,  # SIGABRT
        "aborted_rank_swapped": 0,
    },
}
# How a field's value is compared ("int": an int, not a bool; "bool"; "ints": a list of ints, in
# order; "function": a string, any "torch.distributed." / "dist." / "loss." in front, a trailing
# "()", case and underscores ignored).
KINDS = {
    "hung_rank": "int", "hung_in": "function", "aborted_rank": "int", "paired_with_step": "int",
    "collective": "function", "evaluations_completed": "int", "hangs_without_buffers": "bool",
    "hung_at_step": "int", "mixed_steps": "ints", "exitcode": "int",
    "aborted_rank_swapped": "int",
}
# Where the evidence is, for a field that is wrong; never its value.
HINTS_BY_FIELD = {
    ("log", "hung_rank"): "run (a): the report at the deadline names the ranks that did not "
        "finish",
    ("log", "hung_in"): "the innermost frame of torch/distributed/distributed_c10d.py in that "
        "rank's stack",
    ("log", "aborted_rank"): "run (b): which rank 'was killed by SIGABRT'?",
    ("log", "paired_with_step"): "collectives pair up by their order on each rank, not by what "
        "they carry: write down each rank's collectives after the last one they made together "
        "(DDP all-reduces the gradients in every backward)",
    ("evaluate", "hung_rank"): "the report at the deadline names the ranks that did not finish",
    ("evaluate", "collective"): "the innermost frame of torch/nn/parallel/distributed.py in that "
        "rank's stack, and the DDP function that called it",
    ("evaluate", "evaluations_completed"): "an evaluation's forward returns once its collective "
        "is met: what does the other rank call after the first epoch, and after the last?",
    ("evaluate", "hangs_without_buffers"): "read DistributedDataParallel.will_sync_module_buffers "
        "in torch/nn/parallel/distributed.py, or try it: checks.make_linear in place of "
        "checks.make_bn_model in the Run-it cell",
    ("shard", "hung_rank"): "which rank's shard gives more batches?",
    ("shard", "hung_in"): "the frame right above the given function's own frame in that rank's "
        "stack: the call on the given code's line",
    ("shard", "hung_at_step"): "count the batches DataLoader(shard, batch_size=3) gives from 10 "
        "samples and from 7",
    ("skip", "hung_rank"): "the report at the deadline names the ranks that did not finish",
    ("skip", "hung_at_step"): "count each rank's backwards (a skipped step has none): which one "
        "has no partner?",
    ("skip", "mixed_steps"): "each rank's k-th gradient all-reduce meets the other's k-th: write "
        "both ranks' steps with a backward side by side",
    ("gather", "aborted_rank"): "which rank 'was killed by SIGABRT'?",
    ("gather", "exitcode"): "the exit code the report gives for that rank",
    ("gather", "aborted_rank_swapped"): "which rank receives more bytes than its tensor holds? "
        "Or try it with the sizes swapped",
}
_EXPECTED_TYPE = {"int": "an int", "bool": "True or False", "ints": "a list of ints",
                  "function": "a string"}


def normalize(kind: str, value: Any) -> Any:
    """The comparable form of an answer's value (plain data), or None when its type is wrong."""
    if kind == "int":
        return value if type(value) is int else None
    if kind == "bool":
        return value if type(value) is bool else None
    if kind == "ints":
        return value if type(value) is list and all(type(v) is int for v in value) else None
    if type(value) is not str:
        return None
    text = value.strip().strip("'\"`").strip().lower()
    text = re.sub(r"^(torch\.distributed\.|dist\.|loss\.)", "", text).removesuffix("()")
    return text.replace("_", "")


# What each lab's given code did, and the fixes: the graded feedback of its diagnosis.
EXPLANATIONS = {
    "log": """\
**What happened.** Only rank 0 writes the log, so its author put the whole logging block,
all-reduce included, under `if dist.get_rank() == 0`. Rank 0 now makes one collective more than
the others, and what happens depends on what the others call next:

* **nothing** (the log step was the last step, run (a)): rank 0 waits in `all_reduce` forever;
  rank 1 finishes.
* **DDP's gradient all-reduce of their next step** (run (b)): after the gradient all-reduce of
  step 2, which both ranks made together, rank 0's next collective is its one-float log
  all-reduce and rank 1's is DDP's all-reduce of the gradients in the backward of step 3. gloo
  pairs them: collectives are matched by their order on each rank, not by what they hold. The
  sizes differ, and gloo (torch 2.13) **aborts** rank 0, which receives more bytes than its one
  float holds, with SIGABRT, exit code -6: `Received data size doesn't match expected size. Is
  there a distributed collective mismatch in your code?` (`gloo/transport/tcp/pair.cc`). No
  Python exception: no `try` can catch it.
* a collective **of the same size**: nothing fails, and each side gets the other's data for its
  own purpose (labs 2 and 4 show such silent pairings).

**The fix.** Every rank makes the same collectives in the same order; only what is done with the
result (printing, writing) may depend on the rank: every rank all-reduces the loss on a log
step, and rank 0 alone calls `log`.
""",
    "evaluate": """\
**What happened.** After each epoch rank 0 alone computes a validation loss, in eval mode and
under `torch.no_grad()`, by calling the DDP wrapper. The model has a BatchNorm layer, and its
running statistics are **buffers**. With `forward_sync_buffers=True` (the default; torch 2.13's
name for the deprecated `broadcast_buffers`) DDP's forward broadcasts the buffers from rank 0
before running the module (`DistributedDataParallel._pre_forward` -> `_sync_buffers` ->
`_distributed_broadcast_coalesced`, torch/nn/parallel/distributed.py) whenever
`require_forward_param_sync` is set: at the first forward and after every forward that ran
with gradients enabled outside `no_sync()` (`_post_forward` sets it to
`torch.is_grad_enabled() and self.require_backward_grad_sync`). It does not look at `train()` /
`eval()` at all: eval mode does not stop the broadcast. A model without buffers makes no
collective in a `no_grad` forward (`will_sync_module_buffers()` asks for at least one buffer):
with `nn.Linear` the same run returns on both ranks, which is why this bug hides in some models
and not in others.

So rank 0's evaluation forward makes a broadcast the other rank does not make. After epoch 1 it
pairs with the broadcast of rank 1's next training forward (step 4, the first of epoch 2: same
buffers, same sizes), and rank 0, whose `no_grad` forward cleared the flag, makes none in its own
step 4: the ranks are back in step and the job goes on, by luck (rank 1 even received the
buffers it would have received at step 4: an eval-mode forward does not update them). After
the **last** epoch nobody joins: rank 0 completed one evaluation and waits in the broadcast of
the second forever; rank 1 returned.

**Two fixes:** every rank evaluates (through the wrapper; everyone makes the broadcast), or rank
0 evaluates `ddp_model.module`, the plain module, which makes no collective (in eval mode, so
BatchNorm uses and keeps its running statistics, then back to train mode).
""",
    "shard": """\
**What happened.** The data is a stream (an `IterableDataset`) sharded by rank, and shards are
rarely the same length. Each rank loops until its own shard runs out. With batches of 3, rank 1's
7 samples give 3 batches (3, 3, 1) and rank 0's 10 give 4 (3, 3, 3, 1): rank 1 returns after
step 3, and rank 0 starts a step 4, whose `loss.backward()` waits in DDP's gradient all-reduce
for a rank that will never join. It is blocked in `backward` at the deadline.

**The fix.** The stream does not know its length (`len(shard)` raises), so the ranks must agree as
they go: before each step, every rank says whether it still has a batch, and an `all_reduce`
with `ReduceOp.MIN` tells every rank whether **all** of them do. The steps then stop together at
the shortest shard; the longer shards' extra batches are dropped (as `DistributedSampler` with
`drop_last=True` drops samples so that every rank has as many).

Why not `torch.distributed.algorithms.Join`? `with Join([ddp_model]):` also ends the hang: a
rank that ran out "shadows" the others' all-reduces with zeros, and the longer shards are
trained on to their end. But those extra steps average fewer real gradients, still divided by
the full world size (`divide_by_initial_world_size=True`, the default of
`DistributedDataParallel.join`), so the weights are not those of `train_on_shard`'s contract,
and the tests reject it: they ask for the dropped-batches training, which is the same math as
every earlier step. Use Join when every sample must be seen and you accept those smaller last
steps.
""",
    "skip": """\
**What happened.** Two decisions in this loop are taken by each rank on its own numbers: skip a
step whose loss is not finite (a corrupt batch gives NaN, an empty one too: the mean of no
values), and stop once the loss is low enough. A rank that skips makes no backward, so no
gradient all-reduce. Rank 1 skipped step 2, so its next all-reduce, of step 3, met rank 0's of
step 2 (same sizes: no error), and from then on each of rank 0's steps 2, 3, 4 and 5 averaged its
gradients with rank 1's of the **next** step: wrong numbers, silently. Rank 1 returned after its
fifth backward (step 6), and rank 0's all-reduce of step 6 waits for a partner that never
comes: rank 0 is blocked in `backward` at the deadline. A rank that stops alone because its own
loss is low leaves the others the same way.

**The fix.** Decide together: every rank computes its own flag (my loss is not finite; my loss),
one `all_reduce` combines them, and every rank acts on the same combined value.
""",
    "gather": """\
**What happened.** Evaluation sharded without padding gives the ranks different numbers of
predictions (10 samples on 4 ranks: 3, 3, 2, 2), and the last batch of an epoch is often
smaller. `all_gather` needs the same shape on every rank. On gloo (torch 2.13) a mismatch is not
a Python error you can catch: the rank whose tensor is smaller (rank 1, 3 labels; rank 0 when
the sizes are swapped) receives more bytes than it has room for, and gloo aborts that process
(SIGABRT, exit code -6) with `Received data size doesn't match expected size`. What the other
rank reports depends on timing (gloo's "Connection reset by peer", or nothing before the
launcher stops it). (Output tensors of another size than the input raise an ordinary
`RuntimeError` instead: `ProcessGroupGloo::allgather: invalid tensor size at index 0`.)

**The fix.** Gather the sizes first (one element per rank), pad every tensor to the largest,
gather, and cut each rank's padding off. (`dist.all_gather_object` does the same for any
picklable object, through pickling: fine for small results, slow for large tensors.)
""",
}


DIAGNOSED = Diagnoses(DIAGNOSES, KINDS, normalize, _EXPECTED_TYPE,
                      "ints, bools, strings and lists of ints", EXPLANATIONS,
                      "Why the given code failed, and the fixes:", HINTS_BY_FIELD)
check_log_diagnosis = DIAGNOSED.checker("log")
check_evaluate_diagnosis = DIAGNOSED.checker("evaluate")
check_shard_diagnosis = DIAGNOSED.checker("shard")
check_skip_diagnosis = DIAGNOSED.checker("skip")
check_gather_diagnosis = DIAGNOSED.checker("gather")


# --- the visible cases' truths, written out -----------------------------------------------------


def written_out() -> dict[str, dict[str, dict]]:
    """The visible cases' truths as ``visible.WRITTEN_OUT`` holds them."""
    def digests(state: dict) -> dict:
        return {name: digest(tensor) for name, tensor in state.items()}

    out: dict[str, dict[str, dict]] = {}
    for lab, situations, truth in (("log", visible.VISIBLE_LOG, log_truth),
                                   ("evaluate", visible.VISIBLE_EVALUATE, evaluate_truth),
                                   ("shard", visible.VISIBLE_SHARD, shard_truth),
                                   ("skip", visible.VISIBLE_SKIP, skip_truth)):
        out[lab] = {}
        for situation in situations:
            known = truth(2, situation)
            out[lab][visible.situation_key(2, situation)] = {
                **{k: v for k, v in known.items() if k != "state"},
                "state": digests(known["state"])}
    out["gather"] = {}
    for situation in visible.VISIBLE_GATHER:
        gathered = gather_truth(2, situation)["gathered"]
        out["gather"][visible.situation_key(2, situation)] = {
            "dtype": str(gathered.dtype).removeprefix("torch."), "values": gathered.tolist()}
    return out


if __name__ == "__main__":
    print(table_literal(written_out()))
