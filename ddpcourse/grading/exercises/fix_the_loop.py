"""Chapter 07, the DDP training loop: visible checks for ``train`` (exercise fix_the_loop), and
the case the hidden checks reuse.

The contract is the docstring of ``train`` in solutions/07_training_loop/fix_the_loop.nb.py
(students: exercises/07_training_loop/fix_the_loop.ipynb). It runs on every rank of a gloo group;
every rank gets a ``backbone`` and a ``head`` initialised differently (only rank 0's initial
weights may count) and batches of its own.

One :class:`~ddpcourse.grading.checks.Case`. Around each call of the student's function a rank
records only data: the input of every forward of the backbone (a forward pre-hook), how often the
head's forward ran, what the call returned (the logged losses) and both modules' parameters
afterwards. The judge, which never runs the student's code, rebuilds every rank's modules and
batches itself (the inputs), compares with one process trained on the global batches, and decides,
situation by situation:

* (in place) the modules handed in were trained, not copies of them;
* (rows) at step s the backbone's forward ran once, on exactly this rank's batch of step s (no
  extra forward, no other rank's rows);
* (agree) all ranks hold bit-identical backbones and heads: DDP replicas take identical steps;
* (weights) they equal one process training rank 0's initial modules with plain SGD on the global
  batch of each step (all ranks' batches concatenated, mean cross-entropy), within
  ``ATOL + RTOL * |w|``. The ranks add the same numbers in another order than one process does,
  and float32 addition is not associative. Measured for every situation of these checks with three
  right loops (one DDP around both modules, two DDPs, the head averaged by hand): at most 6e-8,
  the replicas bit-identical; the closest wrong loop of the grading tests is off by 2.7e-2
  (the loss divided by the world size), a summed loss by 0.12, a head outside DDP by 0.04;
* (losses) the returned list holds, at every step, the global batch's mean loss before the
  step, on every rank (one process's loss), within ``LOSS_ATOL + LOSS_RTOL * |loss|``: measured
  at most 1.2e-7 off; a rank's own loss is off by 1.6e-2 or more, a sum over the ranks by 0.99.

When something is wrong, the judge names the plausible mistake (a head outside DDP, a head wrapped
but bypassed, gradients summed instead of averaged, rank 0's head broadcast after each step, a
summed loss...: :data:`MISTAKES`) whose loop ends with what every rank holds.

This module holds neither the one-process training nor the replay of the mistakes (the ranks
import it, and replaying the right loop is the answer): for the visible situations, one process's
weights (as digests, see :mod:`ddpcourse.grading.written_out`), losses, each rank's own losses and
the digest of every rank's modules after each mistake are written out (:data:`VISIBLE_EXPECTED`),
held by tests/test_grading_fix_the_loop.py to the grader's reference and replay in
autograder/hidden/fix_the_loop.py, which judges the hidden situations with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpcourse.grading.checks import (Case, CheckFailed, cut_text, every_ranks_calls,
                                      judge_each_rank, observed, reported_tensors, run_student,
                                      safe_text, type_name)
from ddpcourse.grading.written_out import differs_from

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
ATOL, RTOL = 1e-5, 1e-5  # on the weights
LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-5  # on the logged losses
IN_FEATURES, HIDDEN, CLASSES = 6, 16, 3
MAX_RECORDED_FORWARDS = 64  # of one call; more is reported as a count only
MAX_RECORDED_ROWS = 256  # of one forward's input; a larger input is reported by its shape only
MAX_LOSSES = 64  # of one call's returned list
MAX_TEXT = 300
ALL_CHECKS = ("in_place", "rows", "agree", "weights", "losses")
MODULES = ("backbone", "head")


@dataclass(frozen=True)
class Situation:
    """One call of ``train``: every rank gets ``steps`` batches of ``rows`` rows; ``seed`` picks
    the modules and the data. Travels to the ranks as a plain tuple (rows, steps, lr, seed)."""

    rows: int
    steps: int
    lr: float
    seed: int

    def describe(self, world_size: int) -> str:
        return (f"{world_size} rank{'s' if world_size > 1 else ''}, {self.steps} steps of "
                f"{self.rows} rows per rank, lr {self.lr:g}, seed {self.seed}")


# --- the modules and the data: built the same way in the ranks, the judge and the notebook -----


class Backbone(nn.Module):
    """A small feature extractor; the head maps its HIDDEN features to CLASSES logits."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(),
                                 nn.Linear(HIDDEN, HIDDEN), nn.Tanh())

    def forward(self, x):
        return self.net(x)


def make_backbone(seed: int) -> Backbone:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Backbone()


def make_head(seed: int) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(HIDDEN, CLASSES)


def module_seeds(seed: int, rank: int) -> tuple[int, int]:
    """(backbone, head) seeds: every rank starts from other modules; rank 0's are the ones that
    count."""
    return 1000 * seed + 17 * rank + 1, 1000 * seed + 17 * rank + 501


def make_batches(seed: int, rank: int, steps: int, rows: int) -> list:
    """``batches[step] = (x, y)``: rank ``rank``'s batch of each step. The labels come from one
    linear teacher, the same on every rank, so there is something to learn."""
    teacher = torch.randn(IN_FEATURES, CLASSES, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(100_003 * seed + 7919 * rank + 11)
    batches = []
    for _ in range(steps):
        x = torch.randn(rows, IN_FEATURES, generator=generator)
        batches.append((x, (x @ teacher).argmax(dim=1)))
    return batches


def global_batches(world_size: int, rows: int, steps: int, seed: int) -> list:
    """The one-process view: at each step, every rank's batch, concatenated in rank order."""
    per_rank = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
    return [(torch.cat([batches[step][0] for batches in per_rank]),
             torch.cat([batches[step][1] for batches in per_rank])) for step in range(steps)]


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


# --- in the ranks: record only -----------------------------------------------------------------


def _recorded_input(args: tuple) -> torch.Tensor | str:
    first = args[0] if args else None
    if (isinstance(first, torch.Tensor) and first.layout == torch.strided and first.dim() == 2
            and first.shape[0] <= MAX_RECORDED_ROWS and first.shape[1] == IN_FEATURES):
        return first.detach().to("cpu").clone()
    if isinstance(first, torch.Tensor):
        return f"a tensor of shape {tuple(first.shape)}"
    return type_name(first)


def _reported_losses(result: Any) -> list[float] | None:
    """The returned losses as floats, when it is a list (or tuple) of real numbers."""
    if not isinstance(result, (list, tuple)):
        return None
    values = []
    for value in result[:MAX_LOSSES]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        values.append(float(value))
    return values


def observe_call(rank: int, train, situation: tuple) -> dict:
    """Build this rank's modules and batches, call ``train`` once, report what it did."""
    rows, steps, lr, seed = situation
    backbone_seed, head_seed = module_seeds(seed, rank)
    backbone, head = make_backbone(backbone_seed), make_head(head_seed)
    batches = make_batches(seed, rank, steps, rows)
    inputs: list = []
    calls = {"backbone": 0, "head": 0}

    def record_backbone(module, args):
        calls["backbone"] += 1
        if len(inputs) < MAX_RECORDED_FORWARDS:
            inputs.append(_recorded_input(args))

    def count_head(module, args):
        calls["head"] += 1

    hooks = [backbone.register_forward_pre_hook(record_backbone),
             head.register_forward_pre_hook(count_head)]
    try:
        result = train(backbone, head, [(x.clone(), y.clone()) for x, y in batches], lr)
    finally:
        for hook in hooks:
            hook.remove()
    return {"backbone_calls": calls["backbone"], "head_calls": calls["head"], "inputs": inputs,
            "losses": _reported_losses(result),
            "returned": type_name(result),
            "returned_length": len(result) if isinstance(result, (list, tuple)) else -1,
            "returned_text": safe_text(lambda: repr(result), 120),
            "backbone": _state(backbone), "head": _state(head)}


def observe_training(rank, world_size, train, situations, checks=ALL_CHECKS):
    """Every situation in turn, in this rank; ``checks`` only matters to the judge."""
    return {"calls": [observe_call(rank, train, situation) for situation in situations]}


# --- in the judge: the reference, the replays and the verdict ------------------------------------


def _text(value: Any) -> str:
    return cut_text(value, MAX_TEXT)


@dataclass
class Expected:
    """What the judge compares a situation with, without any of the student's code."""

    batches: list  # batches[rank][step] = (x, y): inputs, rebuilt by the judge
    starts: list  # starts[rank] = {"backbone": state, "head": state}, as handed in
    reference: dict  # {"backbone": ..., "head": ...} of one process: tensors, or their digests
    losses: list[float]  # one process's loss at each step
    own_losses: list[list[float]]  # own_losses[rank][step]: the rank's batch, right weights
    moved: float  # how far training moves the reference's weights (max over parameters)
    # diagnose(states, replicas_agree): the plausible mistake that ends with ``states``, in
    # words, or ''
    diagnose: Callable[[list[dict], bool], str]


def inputs_for(world_size: int, situation: Situation) -> tuple[list, list]:
    """Every rank's batches and initial modules' states, as the ranks build them."""
    rows, steps, seed = situation.rows, situation.steps, situation.seed
    with torch.random.fork_rng(devices=[]):
        batches = [make_batches(seed, rank, steps, rows) for rank in range(world_size)]
        starts = []
        for rank in range(world_size):
            backbone_seed, head_seed = module_seeds(seed, rank)
            starts.append({"backbone": _state(make_backbone(backbone_seed)),
                           "head": _state(make_head(head_seed))})
    return batches, starts


def flat_state(state: dict) -> torch.Tensor:
    """Both modules' tensors in one flat float64 vector (modules, then names, in order)."""
    return torch.cat([state[m][name].detach().reshape(-1).double()
                      for m in MODULES for name in sorted(state[m])])


def situation_key(world_size: int, situation: Situation) -> tuple:
    return (world_size, situation.rows, situation.steps, situation.lr, situation.seed)


# For every situation the visible checks run, keyed by :func:`situation_key`: one process's
# weights ("reference": each tensor's digest), its losses, each rank's own losses, how far
# training moves the weights, and, for each plausible mistake that ends elsewhere than the right
# loop, (its index in MISTAKES, the digest of every rank's modules after it, see flat_state).
# Written out by autograder/hidden/fix_the_loop.py's written_out_entry and held to it by
# tests/test_grading_fix_the_loop.py.
VISIBLE_EXPECTED: dict[tuple, dict] = {
    (2, 4, 4, 0.5, 0): {
        "reference": {
            'backbone': {
                'net.0.weight': (0.401483147638, 0.592874522554, 1.80485791271, -0.550189610338),
                'net.0.bias': (1.16228471044, 0.45447292272, -0.267221755348, -1.32047770079),
                'net.2.weight': (-0.656218929682, -3.44485448906, -2.42601208901, 0.193919361103),
                'net.2.bias': (0.166977725923, -0.0646916255355, -0.43656770885, -0.590113066137),
            },
            'head': {
                'weight': (0.292928012088, -0.844708206132, -1.54360016994, 1.03689219244),
                'bias': (-0.00531568005681, -0.0605304948986, -0.0259499885142, 0.0605304948986),
            },
        },
        "losses": [0.985044121742, 0.990487933159, 0.935421764851, 0.895382165909],
        "own_losses": [[1.01305806637, 0.850417852402, 0.776681900024, 0.929838478565],
            [0.957030057907, 1.13055801392, 1.09416162968, 0.860925972462]],
        "moved": 0.15565389581,
        "mistakes": [
            (0, [(-1.3663193183, -2.72188234236, -5.25928630214, 3.50691405777), (-1.3663193183,
                -2.72188234236, -5.25928630214, 3.50691405777)]),
            (1, [(1.71757389861, 3.59712615726, -4.39558223705, 2.75203604321), (1.71757389861,
                3.59712615726, -4.39558223705, 2.75203604321)]),
            (2, [(0.625477149617, 2.43308749283, -4.43738508737, 3.14001856139), (0.625477149617,
                2.43308749283, -4.43738508737, 3.14001856139)]),
            (3, [(1.32079906133, 2.54298645281, -3.89781036903, 2.94892075169), (1.32079906133,
                2.54298645281, -3.89781036903, 2.94892075169)]),
            (4, [(-1.16650631605, -9.53359400528, -2.28508162173, -0.0434753675945),
                (-1.16650631605, -9.53359400528, -2.28508162173, -0.0434753675945)]),
            (5, [(1.24989761808, 3.71802252042, -4.95892004413, 2.30343232607), (1.24989761808,
                3.71802252042, -4.95892004413, 2.30343232607)]),
            (6, [(-0.0422357041389, 3.24653966911, -8.8611106053, 3.3373859264),
                (-0.0422357041389, 3.24653966911, -8.8611106053, 3.3373859264)]),
            (7, [(1.53186745453, 3.90148531343, -4.87303392892, 2.17686854093), (1.53186745453,
                3.90148531343, -4.87303392892, 2.17686854093)]),
            (8, [(-0.805076016113, 5.53599373251, -7.14800988138, -0.964518412948),
                (-0.805076016113, 5.53599373251, -7.14800988138, -0.964518412948)]),
            (9, [(2.09485347709, 2.96323814476, -4.73936373973, 2.09440459358), (2.00136602903,
                2.82055399334, -5.67496367125, 2.85694188206)]),
            (10, [(-4.7764165448, -4.68489991594, -7.15911313426, 4.46770516876), (-4.86990369949,
                -5.18763688672, -7.69613296073, 8.27258985955)]),
            (11, [(1.3358665097, 3.53200909845, -5.0443462173, 2.52493954287), (1.33586650784,
                2.56196101173, -3.96893559233, 3.29643687629)]),
            (12, [(-5.69343188405, -4.85946455225, -6.50692804903, 5.53293244541),
                (-5.69343185797, -8.90364094824, -4.4397505559, 8.73118665442)]),
            (13, [(2.18750651367, 2.69237118773, -4.32190173678, 2.26310739852), (2.09401915129,
                3.23379318882, -6.05991568509, 2.41713463236)]),
            (14, [(1.09918163391, 0.092685802374, -4.33350687055, 1.326028232), (1.00569447549,
                0.63410778949, -6.07152078627, 1.48005543323)]),
            (15, [(2.04767196975, 2.27602832881, -3.95206812979, 2.29975329363), (1.9541845934,
                2.81745023956, -5.69008207344, 2.45378080592)]),
            (16, [(1.130020021, 3.11415049573, -4.90418774681, 2.24775895802), (1.70851898217,
                -3.56465005665, -1.14708248503, 0.416433730396)]),
            (17, [(-3.64252369106, -5.10607006215, -8.84041721746, -2.47471797653),
                (-3.70789360534, -4.71142506879, 9.97845844645, 1.90497205127)]),
        ],
    },
    (2, 6, 3, 0.2, 1): {
        "reference": {
            'backbone': {
                'net.0.weight': (0.00619811555953, 4.97064140075, -2.38743505636, 4.74047232055),
                'net.0.bias': (1.28850728017, 1.08053207886, 0.302533733426, 1.48113303888),
                'net.2.weight': (-1.7604348429, 2.41936885542, 1.60859254911, 1.80112274433),
                'net.2.bias': (-0.71466198191, -0.208837881684, -0.269947059453, -0.418147966266),
            },
            'head': {
                'weight': (0.567495892756, 2.00869807135, 1.6669710679, 1.7943551084),
                'bias': (0.244700185023, 0.144066817127, -0.137142547406, -0.144066817127),
            },
        },
        "losses": [1.08778429031, 1.05449128151, 1.04408884048],
        "own_losses": [[1.0963331461, 1.02451229095, 1.04535877705], [1.07923543453,
            1.08447039127, 1.0428186655]],
        "moved": 0.059441447258,
        "mistakes": [
            (0, [(-0.464744293859, -0.0134926086466, -0.11984721644, 0.0562555853103),
                (-0.464744293859, -0.0134926086466, -0.11984721644, 0.0562555853103)]),
            (1, [(-0.358908479167, 1.99031060187, 0.609566905747, 0.0294382606444),
                (-0.358908479167, 1.99031060187, 0.609566905747, 0.0294382606444)]),
            (2, [(-0.408483989206, 1.05048100008, 0.360501943524, -0.0990594174764),
                (-0.408483989206, 1.05048100008, 0.360501943524, -0.0990594174764)]),
            (3, [(-0.373278372288, 1.78064974705, 0.366965825036, 0.0644665777872),
                (-0.373278372288, 1.78064974705, 0.366965825036, 0.0644665777872)]),
            (4, [(-0.647623728757, -0.679200246377, -0.999626108649, 0.887914879277),
                (-0.647623728757, -0.679200246377, -0.999626108649, 0.887914879277)]),
            (5, [(-0.363772223776, 1.80312587011, 0.673983999601, 0.160922873838),
                (-0.363772223776, 1.80312587011, 0.673983999601, 0.160922873838)]),
            (6, [(-0.251446419948, 0.291775696824, -0.00714142559445, 1.04993529213),
                (-0.251446419948, 0.291775696824, -0.00714142559445, 1.04993529213)]),
            (7, [(-0.3271907745, 1.9549958473, 0.554656313274, 0.179092842627), (-0.3271907745,
                1.9549958473, 0.554656313274, 0.179092842627)]),
            (8, [(-0.180449719119, 1.12859931188, -0.549149116807, 0.940860333198),
                (-0.180449719119, 1.12859931188, -0.549149116807, 0.940860333198)]),
            (9, [(-0.323955599451, 2.17955386417, 0.541322888457, 0.30447024235), (-1.7962881389,
                4.47952019743, -0.345899090113, 0.556720174209)]),
            (10, [(-0.306129574515, 2.0012371389, -0.0301999373178, 1.02081894895),
                (-1.77846187094, 3.51266851535, -2.21349282635, 0.259996344074)]),
            (11, [(-0.363027742482, 1.81268595922, 0.679630581173, 0.162860496319),
                (-0.363027784624, 1.81552123179, 0.449701605947, -0.207512349705)]),
            (12, [(-0.217740900931, 0.2947434698, 0.285872071399, 0.861371864681),
                (-0.217740771477, -0.121779024717, -0.856360156671, -0.699610201526)]),
            (13, [(-0.325664724485, 2.13355985071, 0.348261633626, 0.123792229482),
                (-1.7979972584, 4.52450405827, -0.172914529016, 0.740180249122)]),
            (14, [(-0.517466828693, 1.59843838913, -1.12008918542, 0.410671517719),
                (-1.98979919613, 3.9893825294, -1.64126536786, 1.02705946681)]),
            (15, [(-0.333504134178, 2.07042276746, 0.0817761475046, 0.194223737431),
                (-1.80583655983, 4.46136702321, -0.439400068455, 0.8106117438)]),
            (16, [(-0.403948056861, 1.83882997918, 0.625297680148, 0.200427278993),
                (3.29498706365, 3.04755119586, 1.74335013123, -3.95676868016)]),
            (17, [(-0.0766567541286, 0.873600034975, -0.460736011504, 0.901827385998),
                (2.81836892718, 4.67762069889, -0.845311188648, -5.076626009)]),
        ],
    },
}


def written_out_expected(world_size: int, situation: Situation) -> Expected:
    """A visible situation's :class:`Expected`, from :data:`VISIBLE_EXPECTED`."""
    key = situation_key(world_size, situation)
    if key not in VISIBLE_EXPECTED:
        raise LookupError(f"grader bug: no written-out result for {key}: add it to "
                          "VISIBLE_EXPECTED, or judge the situation with the hidden checks")
    entry = VISIBLE_EXPECTED[key]
    batches, starts = inputs_for(world_size, situation)

    def diagnose(states: list[dict], replicas_agree: bool) -> str:
        for index, digests in entry["mistakes"]:
            mistake = MISTAKES[index]
            if mistake.agrees == replicas_agree and all(
                    differs_from(flat_state(state), digest, RTOL, ATOL) is None
                    for state, digest in zip(states, digests)):
                return mistake.explain(world_size, situation)
        return ""

    return Expected(batches, starts, entry["reference"], list(entry["losses"]),
                    [list(own) for own in entry["own_losses"]], entry["moved"], diagnose)


def _close_tensor(got: torch.Tensor, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return torch.allclose(got, want, rtol=RTOL, atol=ATOL)
    return differs_from(got, want, RTOL, ATOL) is None


def _close(got: dict, want: dict) -> bool:
    """``want``: each tensor itself, or its written-out digest."""
    return all(_close_tensor(got[m][n], want[m][n]) for m in MODULES for n in want[m])


def _identical(a: dict, b: dict) -> bool:
    return all(torch.equal(a[m][n], b[m][n]) for m in MODULES for n in a[m])


def _largest_difference(got: dict, want: dict) -> tuple[float, str]:
    """The largest difference and where; against a digest, how far its signed sums are off."""
    worst, where = -1.0, ""
    for m in MODULES:
        for name in want[m]:
            if isinstance(want[m][name], torch.Tensor):
                diff = (got[m][name].double() - want[m][name].double()).abs().max().item()
            else:
                diff = differs_from(got[m][name], want[m][name], RTOL, ATOL) or 0.0
            if diff > worst:
                worst, where = diff, f"{m}'s {name!r}"
    return worst, where


def judge_training(observations, world_size, situations, checks=ALL_CHECKS):
    """The visible situations' judge: what they are compared with is written out."""
    judge_training_with(written_out_expected, observations, world_size, situations, checks)


def judge_training_with(expected_for, observations, world_size, situations, checks=ALL_CHECKS):
    """``expected_for(world_size, situation)``: the :class:`Expected` of a situation."""
    reports = every_ranks_calls(observations, len(situations))
    for number, situation in enumerate(situations):
        judge_situation([report[number] for report in reports], world_size,
                        Situation(*situation), checks, expected_for)


def judge_situation(calls: list, world_size: int, situation: Situation, checks,
                    expected_for=written_out_expected) -> None:
    what = situation.describe(world_size)
    expected = expected_for(world_size, situation)
    states: list[dict] = []

    def judge_rank(rank, call):
        if not isinstance(call, dict):
            raise CheckFailed(f"the rank's report of a call is a {type_name(call)}")
        state = {m: reported_tensors(observed(call, m, dict), expected.starts[0][m],
                                     f"{what}: after training, the {m}'s") for m in MODULES}
        if "in_place" in checks:
            _judge_in_place(rank, state, expected, situation, what)
        if "rows" in checks:
            _judge_rows(rank, world_size, call, expected, situation, what)
        states.append(state)

    judge_each_rank(calls, judge_rank)
    # Every rank's report is sound from here on; what follows compares ranks, then each rank
    # with one process (replicas that disagree say more than weights that differ).
    agree = all(_identical(s, states[0]) for s in states)
    if "agree" in checks and not agree:
        why = expected.diagnose(states, False)
        judge_each_rank(states, lambda rank, state: _judge_replicas(states, rank, state, what,
                                                                    why))
    if "weights" in checks and not all(_close(s, expected.reference) for s in states):
        why = expected.diagnose(states, agree)
        judge_each_rank(states, lambda rank, state: _judge_weights(state, expected, what, why))
    if "losses" in checks:  # last: wrong weights make wrong losses, and say more
        judge_each_rank(calls, lambda rank, call: _judge_losses(rank, call, expected, situation,
                                                                what))


def _judge_in_place(rank: int, state: dict, expected: Expected, situation: Situation,
                    what: str) -> None:
    if situation.steps == 0:
        return
    for module in MODULES:
        start = expected.starts[rank][module]
        if all(torch.equal(state[module][name], start[name]) for name in start):
            raise CheckFailed(
                f"{what}: the {module} handed to train still has its initial weights: train "
                "the modules you were given, in place (DDP trains the module it wraps; do not "
                "train a copy)")


def _judge_rows(rank: int, world_size: int, call: dict, expected: Expected,
                situation: Situation, what: str) -> None:
    steps = situation.steps
    backbone_calls = observed(call, "backbone_calls", int)
    head_calls = observed(call, "head_calls", int)
    inputs = observed(call, "inputs", list)
    if backbone_calls != steps:
        raise CheckFailed(
            f"{what}: the backbone's forward ran {backbone_calls} times on this rank; expected "
            f"{steps}, once per step (no extra forward, e.g. to log a loss)")
    if head_calls != steps:
        raise CheckFailed(f"{what}: the head's forward ran {head_calls} times on this rank; "
                          f"expected {steps}, once per step, on the backbone's output")
    if len(inputs) != min(steps, MAX_RECORDED_FORWARDS):
        raise CheckFailed(f"{what}: the rank's report has {len(inputs)} forward inputs, not "
                          f"{min(steps, MAX_RECORDED_FORWARDS)}")
    for step, recorded in enumerate(inputs):
        if not isinstance(recorded, torch.Tensor):
            raise CheckFailed(f"{what}: at step {step} the backbone got {_text(recorded)}, not "
                              "this rank's batch x (pass x as it is)")
        if (recorded.layout != torch.strided or recorded.dtype != torch.float32
                or recorded.dim() != 2):
            raise CheckFailed(f"{what}: at step {step} the backbone got a {recorded.dtype} "
                              f"tensor of shape {tuple(recorded.shape)}, not this rank's x")
        if recorded.shape[0] != situation.rows:
            hint = (" - every rank trained on every rank's rows: each rank must take only its "
                    "own batch (DDP shares what the ranks learn by averaging gradients)"
                    if world_size > 1 and recorded.shape[0] == situation.rows * world_size
                    else "")
            raise CheckFailed(f"{what}: at step {step} the backbone's forward got "
                              f"{recorded.shape[0]} rows; this rank's batch has "
                              f"{situation.rows}{hint}")
        if torch.equal(recorded, expected.batches[rank][step][0]):
            continue
        source = next((f"rank {other}'s batch of step {s}"
                       for other, batches in enumerate(expected.batches)
                       for s, (x, _) in enumerate(batches) if torch.equal(recorded, x)), None)
        if source is None:
            raise CheckFailed(f"{what}: at step {step} the backbone got rows that are not "
                              "this rank's batch of that step (pass each x as it is)")
        hint = (" - each rank trains only on its own batches" if not
                source.startswith(f"rank {rank}'s") else " - at step s, use batches[s]")
        raise CheckFailed(f"{what}: at step {step} the backbone got {source}{hint}")


def _judge_replicas(states, rank, state, what, why) -> None:
    for other, other_state in enumerate(states):
        for module in MODULES:
            for name, tensor in other_state[module].items():
                if not torch.equal(tensor, state[module][name]):
                    diff = (tensor.double() - state[module][name].double()).abs().max().item()
                    raise CheckFailed(
                        f"{what}: after training, the {module}'s {name!r} differs between "
                        f"rank {rank} and rank {other} (max difference {diff:.3g}); DDP "
                        "replicas take identical steps, bit for bit. "
                        + (why or "Are both modules' gradients averaged over the ranks, "
                                  "from rank 0's initial weights?"))


def _judge_weights(state, expected: Expected, what: str, why: str) -> None:
    if _close(state, expected.reference):
        return
    diff, where = _largest_difference(state, expected.reference)
    digest = not isinstance(next(iter(expected.reference["head"].values())), torch.Tensor)
    measure = "a signed sum off by" if digest else "largest difference"
    raise CheckFailed(
        f"{what}: the weights are not what one process gets by training rank 0's initial "
        f"modules on each step's global batch ({measure} {diff:.3g}, in the {where}; "
        f"allowed {ATOL:g} + {RTOL:g} * |w|; training itself moves the weights by up to "
        f"{expected.moved:.3g}). "
        + (why or "Check: a mean (not summed) loss over the rank's batch, gradients averaged "
                  "over the ranks (not summed), plain SGD with this lr, one step per batch"))


def _judge_losses(rank: int, call: dict, expected: Expected, situation: Situation,
                  what: str) -> None:
    world_size = len(expected.batches)
    losses = observed(call, "losses", (list, type(None)))
    returned, text = observed(call, "returned", str), observed(call, "returned_text", str)
    length = observed(call, "returned_length", int)
    want = expected.losses
    if losses is None:
        raise CheckFailed(f"{what}: train must return a list of {len(want)} Python floats (one "
                          f"loss per step, `loss.item()`); it returned {_text(returned)}: "
                          f"{_text(text)}")
    if length != len(want) or len(losses) != min(len(want), MAX_LOSSES):
        raise CheckFailed(f"{what}: train returned {length} losses; expected {len(want)}, one "
                          "per step")
    if not all(isinstance(v, float) and math.isfinite(v) for v in losses):
        raise CheckFailed(f"{what}: the returned losses are not all finite floats: "
                          f"{_text(losses)}")
    got, reference = torch.tensor(losses, dtype=torch.float64), torch.tensor(want[:len(losses)],
                                                                            dtype=torch.float64)
    if torch.allclose(got, reference, rtol=LOSS_RTOL, atol=LOSS_ATOL):
        return
    step = int((got - reference).abs().argmax())
    shown = (f"at step {step} it logged {losses[step]:.6g}, one process's loss on the global "
             f"batch is {want[step]:.6g}")
    own = torch.tensor(expected.own_losses[rank][:len(losses)], dtype=torch.float64)
    for guess, words in (
            (own, "this rank's own loss, on its batch only: each rank's loss is its own (DDP "
                  "averages gradients, never the loss); all-reduce it and divide by the world "
                  "size to log the global batch's mean"),
            (reference * world_size, f"{world_size} times the global mean: all_reduce adds, "
                                     "divide by the world size"),
            (own * situation.rows, "this rank's loss summed over its rows (reduction='sum')"),
            (reference * situation.rows * world_size, "the loss summed over the global batch "
                                                      "(reduction='sum'): log the mean")):
        if torch.allclose(got, guess, rtol=LOSS_RTOL, atol=LOSS_ATOL):
            raise CheckFailed(f"{what}: the logged losses are not the global batch's mean "
                              f"loss ({shown}); they are {words}")
    raise CheckFailed(f"{what}: the logged losses are not the global batch's mean loss before "
                      f"each step ({shown}); log the mean cross-entropy over all ranks' rows, "
                      "the same number on every rank (if the weights are wrong too, fix them "
                      "first: the losses follow the weights)")


# --- the plausible mistakes (replayed by the hidden checks, autograder/hidden/fix_the_loop.py) -----


@dataclass(frozen=True)
class Sync:
    """How one module is kept in step across the ranks: ``init`` "rank0" (DDP's constructor, or
    a broadcast) or "own"; ``grad`` "mean" (DDP), "sum" or "local"; ``after`` "none" or "rank0"
    (rank 0's weights broadcast after every step)."""

    init: str = "rank0"
    grad: str = "mean"
    after: str = "none"


RIGHT = Sync()
_OUTSIDE, _BYPASSED = Sync("own", "local"), Sync("rank0", "local")


@dataclass(frozen=True)
class Mistake:
    head: Sync = RIGHT
    backbone: Sync = RIGHT
    loss: str = "mean"  # "mean" (right), "sum" (reduction='sum'), "mean/N", "sum/N"
    agrees: bool = True  # the replicas end identical

    def explain(self, world_size: int, situation: Situation) -> str:
        parts = [_SYNC_WORDS[(module, sync)] for module, sync in
                 (("backbone", self.backbone), ("head", self.head)) if sync != RIGHT]
        if self.loss != "mean":
            parts.append(_LOSS_WORDS[self.loss].format(n=world_size, rows=situation.rows))
        return "These are exactly the weights of a loop where " + "; and where ".join(parts) + "."


_SYNC_WORDS = {
    ("head", _OUTSIDE):
        "the head is outside DDP: every rank keeps its own initial head and trains it with its "
        "own gradients only (DDP broadcasts rank 0's weights and averages the gradients of the "
        "module it wraps, and of no other): wrap backbone and head together, e.g. "
        "DDP(nn.Sequential(backbone, head))",
    ("head", _BYPASSED):
        "the head starts from rank 0's weights on every rank (a DDP constructor or a broadcast "
        "ran) but its gradients are never averaged: with a DDP wrapper of its own, the forward "
        "must call the wrapper, not the plain head (the wrapper's forward is what arms its "
        "all-reduce for the next backward)",
    ("head", Sync("own", "mean")):
        "the head's gradients are averaged, but every rank's head starts from its own initial "
        "weights: start from rank 0's (DDP's constructor broadcasts them, unless "
        "init_sync=False)",
    ("head", Sync("rank0", "sum")):
        "the head's gradients are summed over the ranks, not averaged: world size times too "
        "large (all_reduce adds by default; DDP divides by the world size)",
    ("head", Sync("own", "sum")):
        "the head's gradients are summed over the ranks (not averaged) and every rank's head "
        "starts from its own initial weights",
    ("head", Sync("rank0", "local", "rank0")):
        "rank 0's head is broadcast after every step: the replicas agree, but the head learns "
        "from rank 0's batches only, and the other ranks' backbone gradients came through heads "
        "that had moved apart from rank 0's; average the gradients before the step instead",
    ("head", Sync("own", "local", "rank0")):
        "rank 0's head is broadcast after every step (and not before the first): the replicas "
        "agree, but the head learns from rank 0's batches only; average the gradients before "
        "the step instead",
    ("backbone", _OUTSIDE):
        "the backbone is not in DDP either: its gradients are never averaged",
}
_LOSS_WORDS = {
    "sum":
        "the loss is summed over each rank's {rows} rows (reduction='sum'), so every gradient "
        "is {rows} times the mean's: DDP averages the gradients over the ranks, not over the "
        "rows, so the loss still needs its own mean",
    "mean/N":
        "the loss is divided by the world size {n}: DDP already averages over the ranks, so "
        "the gradient is {n} times too small",
    "sum/N":
        "the loss is summed over the rows (reduction='sum') and divided by the world size {n}",
}
MISTAKES = [
    Mistake(loss="sum"),
    Mistake(loss="mean/N"),
    Mistake(loss="sum/N"),
    Mistake(head=Sync("rank0", "sum")),
    Mistake(head=Sync("rank0", "sum"), loss="sum"),
    Mistake(head=Sync("rank0", "local", "rank0")),
    Mistake(head=Sync("rank0", "local", "rank0"), loss="sum"),
    Mistake(head=Sync("own", "local", "rank0")),
    Mistake(head=Sync("own", "local", "rank0"), loss="sum"),
    Mistake(head=_OUTSIDE, agrees=False),
    Mistake(head=_OUTSIDE, loss="sum", agrees=False),
    Mistake(head=_BYPASSED, agrees=False),
    Mistake(head=_BYPASSED, loss="sum", agrees=False),
    Mistake(head=Sync("own", "mean"), agrees=False),
    Mistake(head=Sync("own", "mean"), loss="sum", agrees=False),
    Mistake(head=Sync("own", "sum"), agrees=False),
    Mistake(head=_OUTSIDE, backbone=_OUTSIDE, agrees=False),
    Mistake(head=_OUTSIDE, backbone=_OUTSIDE, loss="sum", agrees=False),
]


TRAINING = Case(observe_training, judge_training)

# --- the visible checks ---------------------------------------------------------------------------

# Situations travel to the ranks as plain tuples: (rows, steps, lr, seed).
VISIBLE = [(4, 4, 0.5, 0), (6, 3, 0.2, 1)]


def check_train_keeps_replicas_identical(train) -> None:
    """2 ranks: the modules handed in are trained, each backbone forward gets the rank's own
    batch, and both modules end bit-identical on every rank."""
    run_student(TRAINING, 2, train, VISIBLE, ("in_place", "rows", "agree"))


def check_train_matches_one_process(train) -> None:
    """2 ranks: the weights one process gets from each step's global batch."""
    run_student(TRAINING, 2, train, VISIBLE, ("in_place", "weights"))


def check_train_logs_the_global_loss(train) -> None:
    """2 ranks: every rank returns the global batch's mean loss at each step."""
    run_student(TRAINING, 2, train, VISIBLE, ("losses",))
