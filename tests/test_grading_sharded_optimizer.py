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


SEGMENTS = '''
class ShardedOptimizer:
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        n = sum(p.numel() for p in self.params)
        self.size = -(-n // dist.get_world_size())
        low = min(dist.get_rank() * self.size, n)
        high = min(low + self.size, n)
        self.segments, offset = [], 0  # (parameter index, start, end, leaf tensor)
        for i, p in enumerate(self.params):
            start, end = max(low - offset, 0), min(high - offset, p.numel())
            if start < end:
                leaf = p.detach().reshape(-1)[start:end].clone().requires_grad_(True)
                self.segments.append((i, start, end, leaf))
            offset += p.numel()
        leaves = [leaf for *_, leaf in self.segments]
        self.optimizer = optimizer_cls(leaves or [torch.zeros(0, requires_grad=True)], **kwargs)

    @torch.no_grad()
    def step(self):
        for i, start, end, leaf in self.segments:
            leaf.grad = self.params[i].grad.reshape(-1)[start:end].clone()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dtype = self.params[0].dtype
        mine = torch.cat([leaf.detach() for *_, leaf in self.segments]
                         or [torch.zeros(0, dtype=dtype)])
        padded = torch.nn.functional.pad(mine, (0, self.size - mine.numel()))
        everyone = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, padded)
        flat = torch.cat(everyone)
        offset = 0
        for p in self.params:
            p.view(-1).copy_(flat[offset:offset + p.numel()])
            offset += p.numel()
'''


def test_a_differently_written_answer_passes_every_check_judged_outside_the_ranks(host):
    answer = submitted(from_source(SEGMENTS), host)
    checks.check_same_weights_as_unsharded(answer)
    checks.check_state_is_sharded(answer)
    hidden.check_sharded_optimizer(answer)


# Pieces cut another way than the contract's, and the whole state kept in a module global: the
# visible checks (every rank with the same gradients) cannot tell these from the contract's.
OTHER_CUT = '''
class ShardedOptimizer:
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        n, size = sum(p.numel() for p in self.params), dist.get_world_size()
        rank = dist.get_rank()
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            self.shard = flat[self.piece(rank, n, size)].clone().requires_grad_(True)
        self.optimizer = optimizer_cls([self.shard], **kwargs)

    @staticmethod
    def piece(rank, n, size):
        PIECE

    def step(self):
        n, size = sum(p.numel() for p in self.params), dist.get_world_size()
        with torch.no_grad():
            grads = torch.cat([p.grad.reshape(-1) for p in self.params])
            self.shard.grad = grads[self.piece(dist.get_rank(), n, size)].clone()
            self.optimizer.step()
            self.shard.grad = None
            mine = torch.zeros(n // size + n % size + 1, dtype=self.shard.dtype)
            mine[:self.shard.numel()] = self.shard
            pieces = [torch.zeros_like(mine) for _ in range(size)]
            dist.all_gather(pieces, mine)
            flat = torch.cat([p.reshape(-1) for p in self.params])
            for rank, values in enumerate(pieces):
                where = self.piece(rank, n, size)
                flat[where] = values[:flat[where].numel()]
            offset = 0
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
'''
FLOOR_SIZED = OTHER_CUT.replace("PIECE", "f = n // size\n        return slice(rank * f, "
                                "n if rank == size - 1 else (rank + 1) * f)")
ROUND_ROBIN = OTHER_CUT.replace("PIECE", "return slice(rank, n, size)")
FULL_STATE_IN_A_GLOBAL = '''
_FULL = {}


class ShardedOptimizer:
    """The solution's pieces, state and exchange, and the whole optimizer in a module global."""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = list(params)
        world_size, rank = dist.get_world_size(), dist.get_rank()
        total = sum(p.numel() for p in self.params)
        self.piece = -(-total // world_size)
        start = min(rank * self.piece, total)
        self.mine = slice(start, min(start + self.piece, total))
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            self.shard = flat[self.mine].clone().requires_grad_(True)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        _FULL["optimizer"] = optimizer_cls(self.params, **kwargs)

    def step(self):
        with torch.no_grad():
            grads = torch.cat([p.grad.reshape(-1) for p in self.params])
            self.shard.grad = grads[self.mine].clone()
            self.optimizer.step()
            self.shard.grad = None
        _FULL["optimizer"].step()
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in self.params])
            mine = torch.zeros(self.piece, dtype=flat.dtype)
            mine[:self.shard.numel()] = flat[self.mine]
            pieces = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(pieces, mine)
            gathered = torch.cat(pieces)
            offset = 0
            for p in self.params:
                p.copy_(gathered[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
'''


@pytest.mark.parametrize("mistake, source, check, message", [
    ("floor-sized pieces", FLOOR_SIZED, hidden.check_sharded_optimizer,
     r"outside its own piece .*\n.*parameter \d .* against the unsharded optimizer's"),
    ("round-robin pieces", ROUND_ROBIN, hidden.check_sharded_optimizer,
     r"outside its own piece .*\n.*parameter \d .* against the unsharded optimizer's"),
    ("the whole state in a module global", FULL_STATE_IN_A_GLOBAL,
     checks.check_state_is_sharded,
     r"ranks 0, 1 and 2: the rank's process holds 5724 bytes of tensors made since "
     r"ShardedOptimizer was built.* at most 2347"),
])
def test_the_graded_run_catches(mistake, source, check, message, host):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(from_source(source), host))
    assert ranks_named(str(failed.value))


def honest_report(rank: int, world_size: int = 2) -> dict:
    reference = checks.unsharded("uneven", "Adam", (("lr", 0.05),), 3, 0)
    return {"weights": [w.clone() for w in reference["weights"]], "has_optimizer": True,
            "inner_type": "Adam", "state_bytes": reference["state_bytes"] // world_size,
            "held_bytes": reference["state_bytes"] // world_size,
            "process_bytes": reference["state_bytes"] // world_size}


CASE = ("uneven", "Adam", (("lr", 0.05),), 3, 0)
DAMAGE = [((), None), ((), []), (("weights",), "x"), (("weights",), [1, 2, 3, 4]),
          (("weights", 0), torch.zeros(2, 2)), (("has_optimizer",), "yes"),
          (("state_bytes",), 10**9), (("state_bytes",), "x" * 1_000_000),
          (("held_bytes",), 10**9), (("process_bytes",), 10**9),
          (("process_bytes",), None)]


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
