"""The checks of exercise bucketed_ddp (chapter 05 part 2: broadcast_parameters, BucketedDDP) pass
the reference solution and catch plausible wrong ones (each wrong version is the solution with one
mistake a student could make). The exercise: solutions/05_allreduce/bucketed_ddp.nb.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autograder.hidden import bucketed_ddp as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import bucketed_ddp as checks

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


SOURCE = SOLUTIONS / "05_allreduce" / "bucketed_ddp.ipynb"
SOLUTION = (solution_code(SOURCE, "broadcast-parameters") + "\n"
            + solution_code(SOURCE, "bucketed-ddp"))


def build(*replacements: tuple[str, str]):
    """The solution's (broadcast_parameters, BucketedDDP), with each (old, new) applied once."""
    source = SOLUTION
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"torch": torch, "dist": dist}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["broadcast_parameters"], namespace["BucketedDDP"]


def test_the_reference_solution_passes_visible_and_hidden_checks():
    broadcast_parameters, BucketedDDP = build()
    checks.check_broadcast_parameters_two_ranks(broadcast_parameters)
    checks.check_broadcast_parameters_buffers_and_frozen(broadcast_parameters)
    hidden.check_broadcast_parameters(broadcast_parameters)
    checks.check_bucketed_ddp_matches_one_process(BucketedDDP)
    checks.check_bucketed_ddp_one_allreduce_per_bucket(BucketedDDP)
    checks.check_bucketed_ddp_overlaps_backward(BucketedDDP)
    hidden.check_bucketed_ddp(BucketedDDP)


def test_the_expected_buckets_follow_the_contract():
    model = checks.make_net("plain", torch.float32, 0)
    assert checks.expected_buckets(model, 1e-9) == [[n] for n, _ in
                                                    reversed(list(model.named_parameters()))]
    assert checks.expected_buckets(model, 25.0) == [[n for n, _ in
                                                     reversed(list(model.named_parameters()))]]
    # 0.0015 MiB = 1572 bytes: out.* + mid2.* + mid.bias = 1356 bytes, then mid.weight + inp.*
    assert checks.expected_buckets(model, 0.0015) == [
        ["out.bias", "out.weight", "mid2.bias", "mid2.weight", "mid.bias"],
        ["mid.weight", "inp.bias", "inp.weight"]]


@pytest.mark.parametrize("mistake, replacement, check, message", [
    ("buffers not broadcast", ("list(module.parameters()) + list(module.buffers())",
                               "list(module.parameters())"),
     checks.check_broadcast_parameters_two_ranks, "'scale' is not rank 0's value"),
    ("a copy is broadcast, then swapped in",
     ("dist.broadcast(tensor, src=0)",
      "copy = tensor.detach().clone(); dist.broadcast(copy, src=0); tensor.data = copy"),
     checks.check_broadcast_parameters_two_ranks, "must be updated in place"),
    ("only rank 1 broadcasts", ("dist.broadcast(tensor, src=0)",
                                "dist.broadcast(tensor, src=min(1, dist.get_world_size() - 1))"),
     checks.check_broadcast_parameters_two_ranks, "is not rank 0's value"),
])
def test_broadcast_checks_catch(mistake, replacement, check, message):
    broadcast_parameters, _ = build(replacement)
    with pytest.raises(CheckFailed, match=message):
        check(broadcast_parameters)


@pytest.mark.parametrize("mistake, replacement, check, message", [
    ("no broadcast at construction", ("        broadcast_parameters(module)\n", ""),
     checks.check_bucketed_ddp_matches_one_process, "must broadcast"),
    ("the sum, not the mean", ("            flat /= world_size\n", ""),
     checks.check_bucketed_ddp_matches_one_process, "largest difference"),
    ("buckets in forward order", ("reversed([p for p in module.parameters() if p.requires_grad])",
                                  "[p for p in module.parameters() if p.requires_grad]"),
     checks.check_bucketed_ddp_one_allreduce_per_bucket, "the buckets hold"),
    ("one all-reduce per parameter, cap ignored", ("if current and size + nbytes > cap:",
                                                   "if current:"),
     checks.check_bucketed_ddp_one_allreduce_per_bucket, "one per bucket"),
    ("all-reduces only after backward", ("if self._missing[index] == 0:\n            "
                                         "self._launch(index)", "pass"),
     checks.check_bucketed_ddp_overlaps_backward, "must start .async_op=True. as soon as"),
    ("incomplete buckets never all-reduced", (
        "        for index in range(len(self.buckets)):\n            if index not in "
        "self._in_flight:\n                self._launch(index)\n", ""),
     hidden.check_bucketed_ddp, "expected . all-reduce calls|largest difference"),
    ("frozen parameters hooked too", ("[p for p in module.parameters() if p.requires_grad]",
                                      "list(module.parameters())"),
     hidden.check_bucketed_ddp, "raised RuntimeError"),
])
def test_bucketed_ddp_checks_catch(mistake, replacement, check, message):
    _, BucketedDDP = build(replacement)
    with pytest.raises(CheckFailed, match=message):
        check(BucketedDDP)
