"""Chapter 10, tune this job: visible checks for ``tune_this_job``, and the cases the hidden checks
reuse.

The contract is the docstring of ``tune_this_job`` in solutions/10_performance/tune_this_job.nb.py
(students: exercises/10_performance/tune_this_job.ipynb): train like the given ``slow_job``
(same numerics) within a communication budget.

The main :class:`~ddpcourse.grading.checks.Case`, ``JOB``, is audited (``audit_traffic=True``).
Each rank builds the model from a seed of its own (only DDP's broadcast of rank 0's state makes
the replicas start alike) and its own micro-batches, and calls the student's function, which
wraps the model in DDP itself (the knobs are the exercise). It reports the parameters afterwards
and the communication: in the student's notebook what an in-rank audit saw; when a class is
graded what the grader's broker carried (autograder/relayed.py), which the student's code cannot
bypass, and beside it what an in-rank audit saw that the broker did not carry. A process group of
the student's own (``dist.new_group(backend="gloo")``) never reaches the broker: with several
ranks it cannot form (each sandbox has its own store and network), but with one rank it can,
and its collectives (a logged loss) would otherwise go uncounted.

The judge, which never runs the student's code, decides:

* the budget: over the call, the all-reduces carried exactly the model's trainable gradient
  bytes once per optimizer step (world size 1: at most that), in at most :func:`call_budget`
  calls per optimizer step. Each slow knob breaks it in its own way, which the message names:
  a sync per micro-batch (no ``no_sync``) multiplies the bytes; ``find_unused_parameters=True``
  adds an all-reduce of the reducer's used-parameter map (4 bytes per parameter) per sync; a
  logged global loss adds 4-byte all-reduces; tiny buckets multiply the calls;
* the replicas are identical bit for bit;
* the weights are the slow job's: one process training rank 0's initial model on every rank's
  micro-batches. That reference run is not in this module: the visible cases' final weights are
  written out as a digest (:data:`VISIBLE_DIGESTS`: per parameter, its sum and its dot product
  with a fixed random probe), held to the reference of autograder/hidden/tune_this_job.py by
  tests/test_grading_tune_this_job.py; the hidden checks compare every weight with the reference.

The hidden cases also draw every rank's data from a seed the rank picks at random and reports,
so no rank can rebuild another's micro-batches: the gradients must travel.

``BAD_STEPS``, also audited, run by the hidden checks: ``accumulation_steps`` < 1 raises
ValueError on every rank, before the model changes (each rank's model starts from its own seed,
so a DDP built first shows on rank 1) and before anything is sent.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, audited_traffic, cut_text,
                                      judge_each_rank, observed, run_student, safe_text, type_name)
from ddpcourse.grading.collective_names import read_collective_calls
from ddpcourse.grading.comm_audit import CommAudit
from ddpcourse.grading.raises_first import call_with_bad_argument, judge_raised_first

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
AUDITED_CASES_BUILD_DDP = True  # the grader's one-rank hosts preload what DDP imports
IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 32, 4
MIB = 1024 * 1024
# float32 sums in another order (DDP's buckets, the accumulation) move a weight by a few 1e-7 at
# most after these few steps; every mistake of the tests moves some weight by 1e-3 or more.
ATOL, RTOL = 1e-5, 1e-5
DIGEST_ATOL = 1e-4  # on a parameter's sum and its probe product (a few dozen weights each)
_MAX_TEXT = 300  # of a text a rank reports, in a message


class Net(nn.Module):
    """A small MLP. Every parameter takes part in every step (``find_unused_parameters`` is
    never needed), and it has no buffers (the contract says so: DDP broadcasts a model's buffers
    before every synchronised forward, which the setup budget does not cover); variant "frozen":
    the first layer's bias does not require grad."""

    def __init__(self, variant: str = "plain"):
        super().__init__()
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)
        if variant == "frozen":
            self.inp.bias.requires_grad_(False)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def setting(micro: int, k: int, rows: int = 4, seed: int | None = 0, lr: float = 0.1,
            variant: str = "plain") -> dict:
    """One situation, as plain data. ``seed=None``: every rank draws its data from a random seed
    of its own (reported, so the judge can rebuild the data)."""
    return {"micro": micro, "k": k, "rows": rows, "seed": seed, "lr": lr, "variant": variant}


def rank_seed(seed: int, rank: int) -> int:
    return 7919 * seed + 104729 * rank + 31


def make_model(variant: str, seed: int) -> Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Net(variant)


def initial_model(s: dict, rank: int) -> Net:
    """Rank ``rank``'s model before DDP: a seed of its own."""
    return make_model(s["variant"], rank_seed(s["seed"] or 0, rank))


def micro_batches(s: dict, data_seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(data_seed)
    return [(torch.randn(s["rows"], IN_FEATURES, generator=generator),
             torch.randn(s["rows"], OUT_FEATURES, generator=generator))
            for _ in range(s["micro"])]


def data_seed_of(s: dict, rank: int) -> int:
    return rank_seed(s["seed"], rank) + 1 if s["seed"] is not None else secrets.randbits(48)


def gradient_bytes(s: dict) -> int:
    """What one synchronised backward must all-reduce: every trainable gradient once."""
    return sum(p.numel() * p.element_size() for p in initial_model(s, 0).parameters()
               if p.requires_grad)


def parameter_bytes(s: dict) -> int:
    """The model's parameters: what DDP's constructor broadcasts from rank 0 (the models have no
    buffers)."""
    return sum(p.numel() * p.element_size() for p in initial_model(s, 0).parameters())


# What DDP communicates for its own setup (torch 2.13, gloo, counted): in the constructor an
# all-gather of 16 bytes checking the parameters' shapes and two broadcasts of rank 0's state
# (the parameters: the models have no buffers, which DDP would also broadcast before every
# synchronised forward, ``DistributedDataParallel._pre_forward``, outside this budget);
# before the second step's forward a broadcast of the rebuilt buckets' order from rank 0
# (``Reducer::sync_bucket_indices``). Under their public names (the in-rank audit and the
# grader's broker give the same: ddpcourse/grading/collective_names.py), with a little room for
# other torch versions.
CONSTRUCTION_COLLECTIVES = {"broadcast", "all_gather"}
CONSTRUCTION_CALLS = 6
CONSTRUCTION_EXTRA_BYTES = 1024


def optimizer_steps(s: dict) -> int:
    return math.ceil(s["micro"] / s["k"])


def call_budget(s: dict) -> int:
    """All-reduce calls allowed per optimizer step: one per MiB of gradient, at least one (DDP's
    default buckets need fewer)."""
    return max(1, math.ceil(gradient_bytes(s) / MIB))


# --- in the rank -------------------------------------------------------------------------------


def observe_job(rank, world_size, tune_this_job, s):
    """A fresh model (rank-seeded), this rank's micro-batches; the student's call, audited."""
    model = initial_model(s, rank)
    data_seed = data_seed_of(s, rank)
    batches = micro_batches(s, data_seed)
    raised = None
    with unrelayed_calls() as unrelayed, audited_traffic() as traffic:
        try:
            returned = tune_this_job(model, batches, s["k"], s["lr"])
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            returned, raised = None, exc
    return {
        "raised": None if raised is None else {
            "type": type(raised).__name__, "message": safe_text(lambda: raised, _MAX_TEXT)},
        "returned": type_name(returned),
        "data_seed": data_seed,
        "weights": {name: p.detach().clone() for name, p in model.named_parameters()},
        "traffic": traffic,
        "unrelayed_calls": unrelayed or None,
    }


@contextlib.contextmanager
def unrelayed_calls():
    """On the relay backend (a class graded): ``with unrelayed_calls() as calls: ...`` leaves in
    ``calls`` ``[[name, bytes]]`` of every collective the block dispatched in this rank on a
    process group other than the relay's (the relay's own go past the dispatcher, to the broker,
    which counts them). Elsewhere ``calls`` stays empty: ``audited_traffic`` sees every group."""
    calls: list = []
    if not (dist.is_initialized() and dist.get_backend() == "relay"):
        yield calls
        return
    with CommAudit() as audit:
        yield calls
    calls += [[name, nbytes] for name, nbytes in audit.record.collective_calls]


# --- in the judge ------------------------------------------------------------------------------


def _shown(s: dict, world_size: int) -> str:
    extra = "" if s["variant"] == "plain" else f", {s['variant']} model"
    return (f"tune_this_job with {s['micro']} micro-batches of {s['rows']} rows per rank, "
            f"accumulation_steps={s['k']}, lr={s['lr']}, {world_size} rank(s){extra}")


def all_reduces(call: Any, what: str) -> tuple[list[int], list[tuple[str, int]]]:
    """The bytes of every all-reduce of the call, and the other collectives (name, bytes)."""
    return split_calls(observed(observed(call, "traffic", dict), "collective_calls", list), what)


def split_calls(calls: list, what: str) -> tuple[list[int], list[tuple[str, int]]]:
    sizes, others = [], []
    for name, nbytes in read_collective_calls(calls, what):
        if name == "all_reduce":
            sizes.append(nbytes)
        else:
            others.append((cut_text(name, 40), nbytes))
    return sizes, others


def budget_advice(sizes: list[int], per_sync: int, steps: int, n_params: int) -> str:
    """Which slow knob the counted all-reduces point to."""
    tips = []
    if sum(1 for b in sizes if b == 4 * n_params):
        tips.append(f"all-reduces of {4 * n_params} bytes (4 per parameter) are DDP's map of "
                    "used parameters: find_unused_parameters=True is not needed here")
    if any(b <= 8 for b in sizes):
        tips.append("all-reduces of one number: a logged global loss (drop it, or log this "
                    "rank's loss without communicating)")
    big = sum(b for b in sizes if b > 8 and b != 4 * n_params)
    if big > per_sync * steps:
        tips.append(f"{big / per_sync:g} gradients' worth of bytes for {steps} optimizer "
                    "step(s): every micro-batch but the last of a group must run its forward "
                    "and backward inside ddp_model.no_sync()")
    if len(sizes) > steps and not tips:
        tips.append("many calls of part of the gradient each: the buckets are too small "
                    "(DDP's default bucket_cap_mb gives one bucket per MiB)")
    return "; ".join(tips) if tips else "every gradient element must be all-reduced once per " \
        "optimizer step"


def judge_unrelayed(call: Any, what: str) -> None:
    """When a class is graded: every collective the rank saw itself must be one the broker
    carried (an all-reduce of the same size; as many other collectives at least)."""
    unrelayed = observed(call, "unrelayed_calls", (list, type(None)))
    if not unrelayed:
        return
    own_sizes, own_others = split_calls(unrelayed, what)
    sizes, others = all_reduces(call, what)
    missing = Counter(own_sizes) - Counter(sizes)
    if missing or len(own_others) > len(others):
        shown = sorted(missing.elements()) or sorted(name for name, _ in own_others)
        raise CheckFailed(
            f"{what}: your rank made collectives that the grader's relay between the ranks never "
            f"carried ({cut_text(shown, 200)}; all-reduces by their bytes): they went over a "
            "process group of your own (dist.new_group), and the budget counts every collective "
            "on any group: no logged loss")


def judge_budget(call: Any, s: dict, world_size: int, what: str) -> None:
    judge_unrelayed(call, what)
    sizes, others = all_reduces(call, what)
    steps = optimizer_steps(s)
    per_sync = gradient_bytes(s)
    model = initial_model(s, 0)
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    calls_allowed = steps * call_budget(s)
    bytes_due = steps * per_sync
    total = sum(sizes)
    right_bytes = total == bytes_due or (world_size == 1 and total <= bytes_due)
    if not right_bytes or len(sizes) > calls_allowed:
        raise CheckFailed(
            f"{what}: over the job, the all-reduces must carry exactly the gradients' "
            f"{per_sync} bytes once per optimizer step ({bytes_due} bytes for {steps} step(s)) in "
            f"at most {calls_allowed} call(s); counted: {len(sizes)} call(s), {total} bytes "
            f"({cut_text(sizes, 200)}). {budget_advice(sizes, per_sync, steps, n_params)}")
    unexpected = sorted(set(name for name, _ in others) - CONSTRUCTION_COLLECTIVES)
    other_bytes = sum(nbytes for _, nbytes in others)
    allowed_bytes = parameter_bytes(s) + CONSTRUCTION_EXTRA_BYTES
    if unexpected or len(others) > CONSTRUCTION_CALLS or other_bytes > allowed_bytes:
        raise CheckFailed(
            f"{what}: besides all-reduces, only DDP's own setup may communicate (broadcasts of "
            f"rank 0's state and of the bucket order, an all-gather of shapes: at most "
            f"{CONSTRUCTION_CALLS} calls and "
            f"{allowed_bytes} bytes); counted {len(others)} call(s) of "
            f"{cut_text(sorted(set(name for name, _ in others)), 200)}, {other_bytes} bytes")


def judge_call(call: Any, s: dict, world_size: int, reference_names: list[str],
               what: str) -> dict[str, torch.Tensor]:
    raised = observed(call, "raised", (dict, type(None)))
    if raised is not None:
        raise CheckFailed(f"{what}: your code raised {cut_text(observed(raised, 'type', str), 80)}"
                          f": {cut_text(observed(raised, 'message', str), _MAX_TEXT)}")
    returned = observed(call, "returned", str)
    if returned != "None":
        raise CheckFailed(f"{what}: tune_this_job must return None (it trains the model in "
                          f"place), it returned {cut_text(returned, 80)}")
    judge_budget(call, s, world_size, what)
    weights = observed(call, "weights", dict)
    if sorted(map(str, weights)) != sorted(reference_names) or not all(
            isinstance(w, torch.Tensor) and w.layout == torch.strided and w.dtype == torch.float32
            for w in weights.values()):
        raise CheckFailed(f"{what}: the report of the model's parameters is not "
                          f"{sorted(reference_names)} as float32 tensors")
    return weights


def judge_replicas(weights: list[dict], what: str) -> None:
    for rank, mine in enumerate(weights[1:], start=1):
        for name, tensor in mine.items():
            first = weights[0][name]
            if tensor.shape != first.shape or not torch.equal(tensor, first):
                raise CheckFailed(f"{what}: rank {rank}'s {name!r} differs from rank 0's: the "
                                  "replicas are no longer identical (DDP's all-reduce hands every "
                                  "rank the same average)")


def probe(name: str, shape: tuple) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(map(ord, name)) * 7 + len(shape))
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def digest(weights: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per parameter: its sum and its dot product with a fixed random probe (float64)."""
    return {name: (w.double().sum().item(), (w.double() * probe(name, tuple(w.shape))).sum().item())
            for name, w in sorted(weights.items())}


# Expect(weights of rank 0, setting, world size, the ranks' data seeds, what) raises CheckFailed.
Expect = Callable[[dict, dict, int, list, str], None]

# The digest of the slow job's final weights for each visible case (setting as a key), written
# out: this module holds no reference run. Held to autograder/hidden/tune_this_job.py's by
# tests/test_grading_tune_this_job.py.
VISIBLE_DIGESTS: dict[tuple, dict[str, tuple[float, float]]] = {
    (2, 6, 3, 4, 1, 0.1, 'plain'): {
        'inp.bias': (1.4276732, 2.4636101),
        'inp.weight': (-5.1573567, 6.6470753),
        'mid.bias': (0.1251458, 0.88028),
        'mid.weight': (1.626359, -3.5746794),
        'out.bias': (0.0036827, -0.1379237),
        'out.weight': (0.6950273, 0.3783509),
    },
    (2, 5, 2, 4, 3, 0.05, 'plain'): {
        'inp.bias': (-1.8142935, -1.1811457),
        'inp.weight': (-0.2929748, -2.4796277),
        'mid.bias': (0.1281362, 0.9884096),
        'mid.weight': (-4.4040447, 1.814124),
        'out.bias': (-0.0758337, -0.2596562),
        'out.weight': (0.038348, -0.5078679),
    },
    (3, 3, 1, 2, 4, 0.1, 'plain'): {
        'inp.bias': (-1.2494402, 1.4595798),
        'inp.weight': (-6.5908173, 1.4415439),
        'mid.bias': (0.3934246, -0.3137724),
        'mid.weight': (1.6819772, 1.1368023),
        'out.bias': (-0.2512591, 0.1220491),
        'out.weight': (2.4603023, -0.7365826),
    },
}


def case_key(s: dict, world_size: int) -> tuple:
    return (world_size, *(s[k] for k in ("micro", "k", "rows", "seed", "lr", "variant")))


def expect_written_out(weights: dict, s: dict, world_size: int, seeds: list, what: str) -> None:
    key = case_key(s, world_size)
    if key not in VISIBLE_DIGESTS:
        raise LookupError(f"grader bug: no written-out digest for {key}: add it to "
                          "VISIBLE_DIGESTS, or judge the case with the hidden checks' reference")
    for name, (want_sum, want_probe) in VISIBLE_DIGESTS[key].items():
        got_sum, got_probe = digest({name: weights[name]})[name]
        if not (math.isclose(got_sum, want_sum, abs_tol=DIGEST_ATOL)
                and math.isclose(got_probe, want_probe, abs_tol=DIGEST_ATOL)):
            raise CheckFailed(
                f"{what}: parameter {name!r} after training is not the slow job's (its sum "
                f"{got_sum:.6f}, expected {want_sum:.6f}; its product with a fixed random probe "
                f"{got_probe:.6f}, expected {want_probe:.6f}): the numerics must stay the same "
                "(the same SGD steps on the mean gradient of each group of micro-batches over "
                "all ranks)")


def judge_job(expect: Expect, observations, world_size, s) -> None:
    what = _shown(s, world_size)
    names = [n for n, _ in initial_model(s, 0).named_parameters()]
    reported: list = []
    judge_each_rank(observations, lambda rank, call: reported.append(
        judge_call(call, s, world_size, names, what)))
    judge_replicas(reported, what)
    seeds = [observed(call, "data_seed", int) for call in observations]
    if s["seed"] is not None and seeds != [data_seed_of(s, r) for r in range(world_size)]:
        raise CheckFailed(f"{what}: the ranks report data seeds {seeds} that are not the case's")
    expect(reported[0], s, world_size, seeds, what)


def judge_visible_job(observations, world_size, s) -> None:
    judge_job(expect_written_out, observations, world_size, s)


JOB = Case(observe_job, judge_visible_job, audit_traffic=True)


def observe_bad_steps(rank, world_size, tune_this_job, values):
    """``tune_this_job`` with each bad ``accumulation_steps``, on a fresh model each: what it
    raised, and whether the model was left as it was; the traffic of all the calls together."""
    s = setting(2, 1, seed=0)
    calls = []
    with audited_traffic() as traffic:
        for k in values:
            model = initial_model(s, rank)
            calls.append(call_with_bad_argument(
                lambda: tune_this_job(model, micro_batches(s, data_seed_of(s, rank)), k, s["lr"]),
                model))
    return {"calls": calls, "traffic": traffic}


def judge_bad_steps(observations, world_size, values):
    def judge_rank(rank, observation):
        judge_raised_first(observed(observation, "calls", list), list(values),
                           lambda k: f"tune_this_job(..., accumulation_steps={k!r})",
                           "accumulation_steps must be an int >= 1",
                           "was it wrapped in DDP first? check the argument first")
        sent = observed(observed(observation, "traffic", dict), "collective_calls", list)
        if sent:
            raise CheckFailed(f"tune_this_job with accumulation_steps {list(values)}: "
                              f"{len(sent)} collective call(s) before the ValueError: check the "
                              "argument first, before anything is sent")

    judge_each_rank(observations, judge_rank)


BAD_STEPS = Case(observe_bad_steps, judge_bad_steps, audit_traffic=True)


def run_settings(case: Case, tune_this_job, world_size: int, settings: list[dict],
                 **kwargs) -> None:
    """One case per situation: the communication the grader counts is the whole case's."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for s in settings:
        run_student(case, world_size, tune_this_job, s, **kwargs)


VISIBLE_SETTINGS = {
    "budget": [setting(6, 3, seed=1)],
    "numerics": [setting(5, 2, seed=3, lr=0.05)],
    "accumulation": [setting(3, 1, rows=2, seed=4)],
}
VISIBLE_WORLD_SIZES = {"budget": 2, "numerics": 2, "accumulation": 3}


def check_job_within_budget(tune_this_job) -> None:
    """2 ranks, 6 micro-batches in groups of 3: the all-reduces counted, and the weights."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_settings(JOB, tune_this_job, VISIBLE_WORLD_SIZES["budget"], VISIBLE_SETTINGS["budget"])


def check_job_numerics_unchanged(tune_this_job) -> None:
    """2 ranks, 5 micro-batches in groups of 2: a short last group."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_settings(JOB, tune_this_job, VISIBLE_WORLD_SIZES["numerics"], VISIBLE_SETTINGS["numerics"])


def check_job_without_accumulation(tune_this_job) -> None:
    """3 ranks, one micro-batch per optimizer step."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_settings(JOB, tune_this_job, VISIBLE_WORLD_SIZES["accumulation"],
                 VISIBLE_SETTINGS["accumulation"])


def count_communication(job, world_size: int = 2, s: dict | None = None) -> dict:
    """Run ``job`` (``slow_job`` or yours) on ``world_size`` ranks in the situation ``s`` and say
    what it communicated, counted as the tests count it, beside the budget. For trying things
    out: it judges nothing."""
    from ddpcourse.launcher import run_ranks

    s = s or VISIBLE_SETTINGS["budget"][0]
    reports = run_ranks(observe_job, world_size, job, s, backend="gloo", timeout=120)
    sizes, others = all_reduces(reports[0], "count_communication")
    return {"optimizer_steps": optimizer_steps(s), "all_reduce_calls": len(sizes),
            "all_reduce_bytes": sum(sizes),
            "other_collectives": [list(other) for other in others],
            "budget": {"calls": optimizer_steps(s) * call_budget(s),
                       "bytes": optimizer_steps(s) * gradient_bytes(s)}}
