"""Chapter 07, the training loop: visible checks for ``train_steps`` (gradient accumulation with
DDP), and the case the hidden checks reuse.

The contract is the docstring of ``train_steps`` in solutions/07_training_loop/train_steps.nb.py
(students: exercises/07_training_loop/train_steps.ipynb).

One :class:`~ddpcourse.grading.checks.Case`, ``TRAIN_STEPS``. Each rank builds the model from a
seed of its own (so only DDP's broadcast of rank 0's state makes the replicas start alike), wraps
it in ``DistributedDataParallel``, makes its own micro-batches and the optimizer, and calls the
student's function inside :func:`~ddpcourse.grading.checks.audited_traffic`. It reports what came
back, the parameters afterwards, and the communication. The judge, which never runs the student's
code, rebuilds rank 0's model and every rank's micro-batches and trains one process on the
equivalent large batches: for each optimizer step, the micro-batches of its group from every rank,
concatenated, with the same loss (a mean over rows) and the same optimizer. It decides:

* the gradients were all-reduced exactly once per optimizer step: the all-reduced bytes (DDP's
  buckets carry every gradient element once per synchronised backward) divided by the bytes of
  the model's gradients is the number of synchronised backwards. When a class is graded the bytes
  come from the grader's broker, which the student's code cannot bypass. The broker also sees
  what each rank handed over: the sum of squares of each gradient all-reduce's contribution must
  be that of the rank's own accumulated gradient (divided by the world size, as DDP hands it
  over, or not), so a tensor of zeros of the gradient's size does not count as a
  synchronisation (in a notebook, audited in the rank, only the bytes are counted);
* the returned losses are the global means of each step, the same list on every rank;
* every rank holds bit-identical parameters (DDP's all-reduce hands every rank the same average);
* they equal the one-process run within ``ATOL + RTOL * |w|``: the all-reduce and the accumulation
  add the same terms as one process does, in another order, and float32 addition is not
  associative. Measured for every case of these checks: at most 2.4e-7. Each plausible mistake
  (no division by the number of micro-batches, the tail divided by ``accumulation_steps``, a
  missing ``zero_grad``, one step too many or too few) moves some weight by 1e-3 or more.

This module holds no one-process run (the ranks import it, and it yields the answer of any
situation): the visible situations' expected weights (as digests, see
:mod:`ddpcourse.grading.written_out`) and losses are written out in :data:`VISIBLE_EXPECTED`,
which tests/test_grading_train_steps.py holds to the reference run of the hidden checks
(autograder/hidden/train_steps.py), where the hidden situations are judged with it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcourse.grading.checks import (Case, CheckFailed, audited_traffic, cut_text, expect_close,
                                      judge_each_rank, observed, run_student, safe_text, type_name)
from ddpcourse.grading.collective_names import all_reduce_bytes, reported_collective_calls
from ddpcourse.grading.raises_first import call_with_bad_argument, judge_raised_first
from ddpcourse.grading.written_out import expect_digest

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
AUDITED_CASES_BUILD_DDP = True  # the grader's one-rank hosts preload what DDP imports
ATOL, RTOL = 1e-5, 1e-5
LOSS_RTOL, LOSS_ATOL = 1e-5, 1e-6
IN_FEATURES, HIDDEN, OUT_FEATURES = 12, 32, 4
_MAX_TEXT = 300  # of a text a rank reports, in a message


class Net(nn.Module):
    """A small MLP (about 1,000 parameters: a gradient all-reduce is far larger than any loss
    a student may all-reduce for logging)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.mid = nn.Linear(HIDDEN, 16)
        self.out = nn.Linear(16, OUT_FEATURES)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def gradient_bytes(model: nn.Module) -> int:
    """What one synchronised backward all-reduces: every trainable parameter's gradient once."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def setting(micro: int, k: int, rows: int = 3, seed: int = 0, loss: str = "mse",
            momentum: float = 0.0, lr: float = 0.2) -> dict:
    """One situation of the case, as plain data (the ranks and the judge rebuild the rest)."""
    return {"micro": micro, "k": k, "rows": rows, "seed": seed, "loss": loss,
            "momentum": momentum, "lr": lr}


def make_model(seed: int) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net()


def rank_seed(seed: int, rank: int) -> int:
    return 7919 * seed + 104729 * rank + 17


def micro_batches(s: dict, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s micro-batches: ``s["micro"]`` of ``s["rows"]`` rows each."""
    generator = torch.Generator().manual_seed(rank_seed(s["seed"], rank) + 1)
    batches = []
    for _ in range(s["micro"]):
        x = torch.randn(s["rows"], IN_FEATURES, generator=generator)
        if s["loss"] == "cross_entropy":
            y = torch.randint(0, OUT_FEATURES, (s["rows"],), generator=generator)
        else:
            y = torch.randn(s["rows"], OUT_FEATURES, generator=generator)
        batches.append((x, y))
    return batches


def make_loss_fn(s: dict) -> nn.Module:
    return nn.CrossEntropyLoss() if s["loss"] == "cross_entropy" else nn.MSELoss()


def make_optimizer(s: dict, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=s["lr"], momentum=s["momentum"])


def optimizer_steps(micro: int, k: int) -> int:
    return math.ceil(micro / k) if k >= 1 else 0


# --- in the rank: what the call did, as data ---------------------------------------------------


def _losses_as_data(value: Any) -> list[float] | None:
    if type(value) is not list or not all(type(v) is float for v in value):
        return None
    return list(value)


def observe_train_steps(rank, world_size, train_steps, s):
    """One situation: a fresh DDP model (rank-seeded: DDP's constructor broadcasts rank 0's),
    this rank's micro-batches, the optimizer; the student's call, its communication audited."""
    ddp_model = DistributedDataParallel(make_model(rank_seed(s["seed"], rank)))
    batches = micro_batches(s, rank)
    optimizer = make_optimizer(s, ddp_model)
    raised = None
    with audited_traffic() as traffic:
        try:
            returned = train_steps(ddp_model, batches, optimizer, make_loss_fn(s), s["k"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            returned, raised = None, exc
    return {
        "raised": None if raised is None else {
            "type": type(raised).__name__, "message": safe_text(lambda: raised, _MAX_TEXT)},
        "returned": type_name(returned),
        "returned_text": safe_text(lambda: repr(returned), _MAX_TEXT),
        "losses": _losses_as_data(returned),
        "weights": {name: p.detach().clone() for name, p in ddp_model.module.named_parameters()},
        "traffic": traffic,
    }


# --- in the judge: the one-process reference, and the verdict --------------------------------


def situation_key(s: dict, world_size: int) -> tuple:
    """How :data:`VISIBLE_EXPECTED` names a situation."""
    return (world_size,) + tuple(s[key] for key in sorted(s))


# One process's result for every situation the visible checks run: (the digest of every weight,
# see ddpcourse.grading.written_out; the losses; at each optimizer step, each rank's own
# accumulated gradient's sum of squares), keyed by :func:`situation_key`. Held to the hidden
# checks' reference run by tests/test_grading_train_steps.py.
VISIBLE_EXPECTED: dict[tuple, tuple[dict[str, tuple[float, ...]], list[float],
                                 list[list[float]]]] = {
    (2, 2, 'mse', 0.2, 4, 0.0, 3, 0): ({
            'inp.weight': (-4.09629307623, 2.47367521346, -2.40622278181, 0.547016162134),
            'inp.bias': (0.409900139086, 0.0746541777626, -0.897509400733, 0.475157898851),
            'mid.weight': (0.676291667391, 3.04913995368, -3.9756732923, -0.0485721589066),
            'mid.bias': (0.0594476992264, 0.117152543738, 0.758137697354, 0.225055770017),
            'out.weight': (0.445192876621, -1.28792870732, 0.0545262178639, 0.470320670516),
            'out.bias': (0.0829944908619, 0.187825664878, -0.284362822771, -0.187825664878),
        },
        [1.00627791882, 1.47228753567],
        [[1.29893642734, 1.04856341078], [1.9574820746, 1.23647589622]]),
    (2, 3, 'mse', 0.2, 6, 0.0, 3, 1): ({
            'inp.weight': (-0.958365009254, 2.68972581674, 2.54595086191, 6.22588590995),
            'inp.bias': (-0.388455873705, -0.00255013850983, 0.514117465937, 1.02242827264),
            'mid.weight': (0.939294803073, -0.521756133414, 0.68288957933, 0.877440823009),
            'mid.bias': (0.093290342018, 0.0736367311329, 0.637129439041, -0.456137696281),
            'out.weight': (0.0297883562744, -0.503039609641, 0.583272315562, -0.226659484208),
            'out.bias': (0.282763503492, 0.219611428678, 0.310754396021, -0.219611428678),
        },
        [1.08228468895, 1.11158692837],
        [[0.411819888912, 0.449481546177], [0.585674315332, 0.465878475231]]),
    (2, 3, 'mse', 0.2, 6, 0.0, 3, 2): ({
            'inp.weight': (-1.04222668917, 0.421284653945, -5.51429824089, 5.02859452902),
            'inp.bias': (0.713275579736, 0.055736200884, -0.997536906973, -0.48378479667),
            'mid.weight': (0.793797904887, 0.857143300847, -4.14139462993, 1.12660829342),
            'mid.bias': (0.313936890278, 0.654082032095, 0.212261290464, -0.296986690548),
            'out.weight': (-0.367205342278, -0.221640265314, -0.523681924911, 1.16375698452),
            'out.bias': (0.315616890788, 0.0189998224378, -0.292883753777, -0.0189998224378),
        },
        [1.24656832218, 1.04216945171],
        [[1.12298887209, 0.959380185473], [0.351397647622, 0.586430496536]]),
    (2, 1, 'mse', 0.2, 3, 0.0, 3, 3): ({
            'inp.weight': (3.27027035289, 1.57346609764, 4.30186781456, 8.16983698652),
            'inp.bias': (-0.0742398202419, -0.523250453174, 0.547016842291, 0.753596369177),
            'mid.weight': (-1.17234216339, 1.61424795107, 0.406554040732, -6.4802264563),
            'mid.bias': (0.596036372939, 1.31044335826, -0.538124216953, -0.966183174169),
            'out.weight': (-0.329724701121, -0.993381872773, -0.592552145943, 1.32984329015),
            'out.bias': (-0.645544336177, 0.376537307166, 0.121178521775, -0.376537307166),
        },
        [1.49474585056, 0.915474653244, 0.925748825073],
        [[4.10504926811, 2.52340373908], [0.754317421668, 2.17170744428], [1.65053327857,
            0.81872434826]]),
    (2, 2, 'mse', 0.2, 5, 0.0, 3, 4): ({
            'inp.weight': (-1.37595019864, -0.244315488893, -1.36705300082, 0.0431310226961),
            'inp.bias': (-0.635978105478, 0.244488942437, 1.88400152605, 2.43104293663),
            'mid.weight': (-2.00618465705, 0.135464543418, 0.503230552247, -1.61824973632),
            'mid.bias': (0.089727813378, 0.0877049323171, 0.02758670412, 0.025133183226),
            'out.weight': (1.15201632329, 0.741256125504, 0.656110034557, 0.0510077776853),
            'out.bias': (-0.211831565946, -0.537199560553, -0.306053604931, 0.537199560553),
        },
        [0.669126689434, 0.546796619892, 0.732799351215],
        [[0.80145491691, 0.471322589086], [0.283300150955, 0.741420659088], [0.983691913254,
            1.86074205071]]),
    (2, 3, 'mse', 0.2, 7, 0.0, 3, 5): ({
            'inp.weight': (-2.32509959996, -0.370808398176, 2.16976587818, -0.150486054423),
            'inp.bias': (-0.135975767393, -0.470556556713, -1.25161085324, 0.041889290791),
            'mid.weight': (4.19574348838, -6.12644802476, 0.938256033347, -2.65745851817),
            'mid.bias': (-0.437597889453, -0.0241872631013, 0.171498153359, -0.0415229015052),
            'out.weight': (-0.162458266364, 0.29938589572, 1.02871599724, 0.938245748868),
            'out.bias': (-0.294952623546, 0.179460458457, 0.354620881379, -0.179460458457),
        },
        [1.07386207581, 0.775370538235, 1.34137713909],
        [[0.487047245976, 1.06867353206], [0.377663346719, 0.630674795275], [1.98109152149,
            2.2738319179]]),
}


def written_out(s: dict, world_size: int) -> tuple[dict, list[float], list[list[float]]]:
    """A visible situation's expected weights (digests), losses and gradients' sums of squares."""
    key = situation_key(s, world_size)
    if key not in VISIBLE_EXPECTED:
        raise LookupError(f"grader bug: no written-out result for {key}: add it to "
                          "VISIBLE_EXPECTED, or judge the situation with the hidden checks")
    weights, losses, own = VISIBLE_EXPECTED[key]
    return dict(weights), list(losses), [list(step) for step in own]


def _shown(s: dict, world_size: int) -> str:
    extra = [f"{key}={s[key]}" for key in ("loss", "momentum") if s[key] != setting(1, 1)[key]]
    return (f"train_steps with {s['micro']} micro-batches of {s['rows']} rows per rank, "
            f"accumulation_steps={s['k']}, {world_size} rank(s)"
            + (f" ({', '.join(extra)})" if extra else ""))


def _gradient_syncs(call: dict, per_sync: int, what: str) -> int:
    """Synchronised backwards: the bytes all-reduced, in units of one full gradient exchange.
    Losses all-reduced for logging are far smaller than one unit, so they do not count."""
    traffic = observed(call, "traffic", dict)
    return sum(all_reduce_bytes(reported_collective_calls(traffic, what))) // per_sync


def _judge_call(call: Any, s: dict, reference: dict, ref_losses: list[float], per_sync: int,
                what: str) -> list[float]:
    """What one rank's call did on its own: raised, returned, communicated."""
    raised = observed(call, "raised", (dict, type(None)))
    if raised is not None:
        raise CheckFailed(f"{what}: your code raised {cut_text(observed(raised, 'type', str), 80)}"
                          f": {cut_text(observed(raised, 'message', str), _MAX_TEXT)}")
    losses = observed(call, "losses", (list, type(None)))
    if losses is None or not all(type(v) is float for v in losses):
        raise CheckFailed(f"{what}: expected a list of Python floats (one per optimizer step; "
                          "`loss.item()` gives one), got "
                          f"{cut_text(observed(call, 'returned', str), 80)}: "
                          f"{cut_text(observed(call, 'returned_text', str), 200)}")
    steps = len(ref_losses)
    syncs = _gradient_syncs(call, per_sync, what)
    if syncs != steps:
        advice = ("a micro-batch whose forward AND backward run outside `ddp_model.no_sync()` "
                  "all-reduces the gradients; only the last micro-batch of each group may"
                  if syncs > steps else
                  "the last micro-batch of every group (the tail's too) must run its forward and "
                  "backward outside `no_sync()`, so that DDP all-reduces the accumulated "
                  "gradients before `optimizer.step()`")
        raise CheckFailed(f"{what}: expected {steps} gradient all-reduce(s), one per optimizer "
                          f"step, but the ranks all-reduced the gradients {syncs} time(s): "
                          f"{advice}")
    if len(losses) != steps:
        raise CheckFailed(f"{what}: expected {steps} losses (one per optimizer step: "
                          f"ceil({s['micro']} / {s['k']})), got {len(losses)}")
    weights = observed(call, "weights", dict)
    if set(weights) != set(reference) or not all(
            isinstance(w, torch.Tensor) for w in weights.values()):
        raise CheckFailed(f"{what}: the report of the model's parameters is not "
                          f"{sorted(reference)} as tensors")
    return losses


def _judge_weights(call: Any, reference: dict, what: str) -> None:
    """``reference``: one process's weights, each a tensor or its written-out digest."""
    weights = observed(call, "weights", dict)
    for name, expected in reference.items():
        shown = (f"{what}: parameter {name!r} after training, compared with one process on the "
                 "same micro-batches of every rank")
        if isinstance(expected, torch.Tensor):
            expect_close(weights[name], expected, shown, RTOL, ATOL)
        else:
            expect_digest(weights[name], expected, shown + " differs", RTOL, ATOL)


def _judge_losses(losses: list[float], ref_losses: list[float], what: str) -> None:
    for step, (got, expected) in enumerate(zip(losses, ref_losses)):
        if not math.isclose(got, expected, rel_tol=LOSS_RTOL, abs_tol=LOSS_ATOL):
            raise CheckFailed(f"{what}: the loss of optimizer step {step} should be {expected:.6g}"
                              f" (the mean over that step's micro-batches on every rank), got "
                              f"{got:.6g}. Losses expected {[round(v, 6) for v in ref_losses]}, "
                              f"got {[round(v, 6) for v in losses]}")


def judge_train_steps(observations, world_size, s):
    """The visible situations' judge: their expected results are written out."""
    judge_train_steps_with(written_out, observations, world_size, s)


def judge_train_steps_with(expected, observations, world_size, s):
    """Each rank's own call; the replicas; the weights against one process; the losses against
    one process, and alike on every rank; what each gradient all-reduce carried.
    ``expected(s, world_size)``: one process's weights (tensors or digests), its losses, and at
    each optimizer step each rank's own accumulated gradient's sum of squares."""
    what = _shown(s, world_size)
    reference, ref_losses, own_sq = expected(s, world_size)
    per_sync = gradient_bytes(make_model(0))
    returned: list = []
    judge_each_rank(observations, lambda rank, call: returned.append(
        _judge_call(call, s, reference, ref_losses, per_sync, what)))
    _judge_replicas(observations, what)
    judge_each_rank(observations, lambda rank, call: _judge_weights(call, reference, what))
    judge_each_rank(returned, lambda rank, losses: _judge_losses(losses, ref_losses, what))
    if any(losses != returned[0] for losses in returned):
        raise CheckFailed(f"{what}: every rank must return the same global losses, got "
                          f"{[[round(v, 6) for v in losses] for losses in returned]}")
    judge_each_rank(observations, lambda rank, call: _judge_contributions(
        call, [step[rank] for step in own_sq], per_sync, world_size, what))


def gradient_syncs_carried(calls: list, contributions: list, per_sync: int) -> list[float] | None:
    """The sum of squares each gradient synchronisation handed over, in order: the all-reduce
    calls that make up exactly ``per_sync`` bytes (one DDP bucket, or consecutive ones); smaller
    calls between them (a loss all-reduced for logging) are left out. None where the calls
    cannot be told apart that way (judged by their bytes only)."""
    syncs, run_bytes, run_sq = [], 0, 0.0
    for (_, nbytes), sq in zip(calls, contributions):
        if run_bytes + nbytes > per_sync:
            run_bytes, run_sq = 0, 0.0  # what came before was not part of a synchronisation
        if nbytes > per_sync or sq is None:
            return None
        run_bytes, run_sq = run_bytes + nbytes, run_sq + sq
        if run_bytes == per_sync:
            syncs.append(run_sq)
            run_bytes, run_sq = 0, 0.0
    return syncs


def _judge_contributions(call: Any, own_sq: list[float], per_sync: int, world_size: int,
                         what: str) -> None:
    """Each gradient all-reduce carried this rank's own accumulated gradient (its sum of squares:
    divided by the world size as DDP hands it over, or whole), not a stand-in of the same size.
    Only where the grader's broker saw the contributions."""
    traffic = observed(call, "traffic", dict)
    if "all_reduce_contributions" not in traffic:
        return  # audited in the rank (a notebook): the bytes were judged, nothing more is known
    contributions = observed(traffic, "all_reduce_contributions", list)
    calls = [entry for entry in observed(traffic, "collective_calls", list)
             if isinstance(entry, list) and entry and entry[0] == "all_reduce"]
    if len(contributions) != len(calls) or not all(
            c is None or type(c) is float for c in contributions):
        raise CheckFailed(f"{what}: the rank's communication record is malformed")
    carried = gradient_syncs_carried(calls, contributions, per_sync)
    if carried is None or len(carried) != len(own_sq):
        return
    for step, (got, want) in enumerate(zip(carried, own_sq)):
        if not any(math.isclose(got, want / factor, rel_tol=1e-3, abs_tol=1e-12)
                   for factor in {1, world_size ** 2}):
            raise CheckFailed(
                f"{what}: the gradient all-reduce of optimizer step {step} did not carry this "
                f"rank's gradient: the grader's broker saw a sum of squares of {got:.6g}, and "
                f"this rank's accumulated gradient has {want:.6g} ({want / world_size ** 2:.6g} "
                "once divided by the world size, as DDP hands it over). All-reduce the "
                "gradients themselves (DDP does, outside no_sync()): a tensor of the same size "
                "(of zeros, say) synchronises nothing")


def _judge_replicas(calls: list, what: str) -> None:
    """Bit for bit: every rank applied the same averaged gradients."""
    first = observed(calls[0], "weights", dict)
    for rank, call in enumerate(calls[1:], start=1):
        for name, tensor in observed(call, "weights", dict).items():
            if not torch.equal(tensor, first[name]):
                diff = (tensor.double() - first[name].double()).abs().max().item()
                raise CheckFailed(f"{what}: rank {rank}'s {name!r} differs from rank 0's by up "
                                  f"to {diff:.3g}: the replicas are no longer identical (did "
                                  "every rank's optimizer step use all-reduced gradients?)")


def observe_bad_steps(rank, world_size, train_steps, values):
    """``train_steps`` with each bad ``accumulation_steps``: what it raised."""
    calls = []
    for k in values:
        s = setting(2, 1)
        ddp_model = DistributedDataParallel(make_model(rank_seed(0, rank)))
        calls.append(call_with_bad_argument(
            lambda: train_steps(ddp_model, micro_batches(s, rank), make_optimizer(s, ddp_model),
                                make_loss_fn(s), k), ddp_model.module))
    return {"calls": calls}


def judge_bad_steps(observations, world_size, values):
    def judge_rank(rank, observation):
        judge_raised_first(observed(observation, "calls", list), list(values), lambda k: f"train_steps(..., accumulation_steps={k!r})",
                           "accumulation_steps must be an int >= 1", "check the argument first")

    judge_each_rank(observations, judge_rank)


TRAIN_STEPS = Case(observe_train_steps, judge_train_steps, audit_traffic=True)
BAD_STEPS = Case(observe_bad_steps, judge_bad_steps)


def run_settings(train_steps, world_size: int, settings: list[dict], case: Case = TRAIN_STEPS,
                 **kwargs) -> None:
    """One case per situation: the communication the grader counts is the whole case's."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for s in settings:
        run_student(case, world_size, train_steps, s, **kwargs)


def check_accumulation_matches_one_process(train_steps) -> None:
    run_settings(train_steps, 2, [setting(4, 2), setting(6, 3, seed=1)])


def check_one_all_reduce_per_optimizer_step(train_steps) -> None:
    run_settings(train_steps, 2, [setting(6, 3, seed=2), setting(3, 1, seed=3)])


def check_the_tail(train_steps) -> None:
    """5 micro-batches in groups of 2: the last optimizer step has one micro-batch."""
    run_settings(train_steps, 2, [setting(5, 2, seed=4), setting(7, 3, seed=5)])
