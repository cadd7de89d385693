"""The checks of exercise sharded_optimizer (chapter 11: ZeRO-1 by hand) pass the solution and
catch plausible wrong ones, in the student's kernel and judged by the trusted grader
(autograder/trusted.py). The exercise: solutions/11_beyond_ddp/sharded_optimizer.nb.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autograder.hidden import sharded_optimizer as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import sharded_optimizer as checks
from rank_lines import ranks_named
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")

SOURCE = SOLUTIONS / "11_beyond_ddp" / "sharded_optimizer.ipynb"
SOLUTION = solution_code(SOURCE, "sharded-optimizer")


def build(*replacements: tuple[str, str]):
    """The solution's ShardedOptimizer, with each (old, new) applied once."""
    source = SOLUTION
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"torch": torch, "dist": dist, "nn": nn}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["ShardedOptimizer"]


def test_the_solution_passes_visible_and_hidden_checks():
    solution = build()
    checks.check_same_weights_as_unsharded(solution)
    checks.check_state_is_sharded(solution)
    hidden.check_sharded_optimizer(solution)


WHOLE_PARAMETERS = '''
class ShardedOptimizer:
    """Greedy whole-tensor shares, as ZeroRedundancyOptimizer partitions (largest first)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        world_size, rank = dist.get_world_size(), dist.get_rank()
        loads, self.owner = [0] * world_size, {}
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            self.owner[i] = loads.index(min(loads))
            loads[self.owner[i]] += self.params[i].numel()
        mine = [p for i, p in enumerate(self.params) if self.owner[i] == rank]
        self.optimizer = optimizer_cls(mine or [torch.zeros(0, requires_grad=True)], **kwargs)

    def step(self):
        self.optimizer.step()
        with torch.no_grad():
            for i, p in enumerate(self.params):
                dist.broadcast(p, src=self.owner[i])
'''
EVERY_RANK_EVERYTHING = '''
class ShardedOptimizer:
    """No sharding: every rank keeps the whole state (what DDP does)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.optimizer = optimizer_cls(list(params), **kwargs)

    def step(self):
        self.optimizer.step()
'''
NO_EXCHANGE = ("            dist.all_gather(pieces, mine)\n", "")
KEEPS_A_FULL_BUFFER = ("            gathered = torch.cat(pieces)\n",
                       "            gathered = torch.cat(pieces)\n            self.buffer = gathered\n")


def from_source(source):
    namespace = {"torch": torch, "dist": dist, "nn": nn}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["ShardedOptimizer"]


@pytest.mark.parametrize("mistake, make, check, message", [
    ("whole parameters shared out", lambda: from_source(WHOLE_PARAMETERS),
     checks.check_state_is_sharded,
     r"rank 0: \.optimizer\.state holds 3076 bytes; the unsharded optimizer's state is 4160 "
     r"bytes, so a 1/4 share is at most 1208"),
    ("no sharding at all", lambda: from_source(EVERY_RANK_EVERYTHING),
     checks.check_state_is_sharded, r"shard the elements"),
    ("updated pieces never exchanged", lambda: build(NO_EXCHANGE),
     checks.check_same_weights_as_unsharded, "against the unsharded optimizer's"),
    ("a full-size buffer kept between steps", lambda: build(KEEPS_A_FULL_BUFFER),
     checks.check_state_is_sharded, "keep only this rank's share"),
])
def test_the_checks_catch(mistake, make, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(make())
    assert ranks_named(str(failed.value))


def test_whole_parameter_shares_still_give_the_right_weights():
    """Greedy partitioning is a correct optimizer: only its memory check fails."""
    checks.check_same_weights_as_unsharded(from_source(WHOLE_PARAMETERS))


def test_the_solution_passes_the_visible_checks_judged_outside_the_ranks(host):
    solution = submitted(build(), host)
    checks.check_same_weights_as_unsharded(solution)
    checks.check_state_is_sharded(solution)


def honest_report(rank: int, world_size: int = 2) -> dict:
    reference = checks.unsharded("uneven", "Adam", (("lr", 0.05),), 3, 0)
    return {"weights": [w.clone() for w in reference["weights"]], "has_optimizer": True,
            "inner_type": "Adam", "state_bytes": reference["state_bytes"] // world_size,
            "held_bytes": reference["state_bytes"] // world_size}


CASE = ("uneven", "Adam", (("lr", 0.05),), 3, 0)
DAMAGE = [((), None), ((), []), (("weights",), "x"), (("weights",), [1, 2, 3, 4]),
          (("weights", 0), torch.zeros(2, 2)), (("has_optimizer",), "yes"),
          (("state_bytes",), 10**9), (("state_bytes",), "x" * 1_000_000),
          (("held_bytes",), 10**9)]


def test_honest_reports_pass_the_judges():
    reports = [honest_report(0), honest_report(1)]
    checks.judge_weights(reports, 2, *CASE)
    checks.judge_memory(reports, 2, *CASE)


@pytest.mark.parametrize("path, value", DAMAGE, ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judges(path, value):
    reports = [honest_report(0), altered(honest_report(1), path, value)]
    for judge in (checks.judge_weights, checks.judge_memory):
        try:
            judge(reports, 2, *CASE)
        except CheckFailed as failed:
            message = str(failed).split("\n", 1)[-1]
            assert message.startswith("rank 1:") and "rank 0:" not in message
            assert len(message) < 5000
            return
    pytest.fail("no judge failed the damaged report")
