"""The checks of exercise sampler_by_hand (chapter 06: shard_indices, DistributedSampler by hand)
pass right solutions, catch plausible wrong ones (in the student's kernel and judged by the trusted
grader, autograder/trusted.py, where only the ranks' observations come back), read the ranks'
reports as untrusted data, and rest on facts about the sampler measured here. The exercise:
solutions/06_data_loading/sampler_by_hand.nb.py."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from autograder.hidden import sampler_by_hand as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import sampler_by_hand as checks
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


def make(order="randperm", pad="repeat", seed_with_epoch=True, share="strided", drop="honour",
         validate=True):
    """A shard_indices with one rule changed; the defaults give the right one."""
    def shard_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                      drop_last=False):
        if validate and not 0 <= rank < num_replicas:
            raise ValueError(rank)
        order_ = list(range(dataset_len))
        if shuffle and order == "randperm":
            g = torch.Generator()
            g.manual_seed(seed + epoch if seed_with_epoch else seed)
            order_ = torch.randperm(dataset_len, generator=g).tolist()
        elif shuffle:
            random.Random(seed + epoch).shuffle(order_)
        honour = drop_last and drop == "honour"
        per_rank = dataset_len // num_replicas if honour else math.ceil(dataset_len / num_replicas)
        total = per_rank * num_replicas
        if total > dataset_len:
            filler = {"repeat": order_ * total, "zeros": [0] * total,
                      "last": order_[-1:] * total}[pad]
            order_ = order_ + filler[:total - dataset_len]
        order_ = order_[:total]
        if share == "strided":
            return order_[rank:total:num_replicas]
        return order_[rank * per_rank:(rank + 1) * per_rank]
    return shard_indices


def uses_the_sampler(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                     drop_last=False):
    sampler = DistributedSampler(range(dataset_len), num_replicas, rank, shuffle, seed, drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def uses_the_sampler_from_torch_utils_data(dataset_len, num_replicas, rank, shuffle=True, seed=0,
                                           epoch=0, drop_last=False):
    from torch.utils.data import DistributedSampler as Imported

    sampler = Imported(range(dataset_len), num_replicas, rank, shuffle, seed, drop_last)
    sampler.set_epoch(epoch)
    return [int(i) for i in sampler]


def no_padding(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False):
    return make()(dataset_len, 1, 0, shuffle, seed, epoch)[rank::num_replicas]


def seeded_per_rank(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                    drop_last=False):
    """Each rank its own permutation: the shares overlap and miss samples."""
    return make()(dataset_len, num_replicas, rank, shuffle, seed + 1000 * rank, epoch, drop_last)


def sampler_in_a_thread(*args, **kwargs):
    import threading

    out = []
    worker = threading.Thread(target=lambda: out.append(uses_the_sampler(*args, **kwargs)))
    worker.start()
    worker.join()
    return out[0]


def switches_the_hook_off(*args, **kwargs):
    import sys

    sys.setprofile(None)
    return uses_the_sampler(*args, **kwargs)


def sampler_on_the_last_rank_only(dataset_len, num_replicas, rank, *args, **kwargs):
    fn = uses_the_sampler if rank == num_replicas - 1 else make()
    return fn(dataset_len, num_replicas, rank, *args, **kwargs)


def returns_a_tensor(dataset_len, num_replicas, rank, **kwargs):
    return torch.tensor(make()(dataset_len, num_replicas, rank, **kwargs), dtype=torch.long)


def test_the_reference_solution_passes_every_check():
    right = make()
    checks.check_shard_indices_without_shuffle(right)
    checks.check_shard_indices_shuffled(right)
    checks.check_shard_indices_drop_last_and_bad_ranks(right)
    hidden.check_shard_indices(right)


VISIBLE = {"no_shuffle": checks.check_shard_indices_without_shuffle,
           "shuffled": checks.check_shard_indices_shuffled,
           "drop_last": checks.check_shard_indices_drop_last_and_bad_ranks}


def no_error_for_zero_replicas(dataset_len, num_replicas, rank, **kwargs):
    if num_replicas < 1:
        return []
    return make()(dataset_len, num_replicas, rank, **kwargs)


@pytest.mark.parametrize("wrong, check, message", [
    (make(pad="zeros"), "no_shuffle", r"shard_indices\(10, 3, 2, shuffle=False\): expected "
                                      r"\[2, 5, 8, 1\], got \[2, 5, 8, 0\]"),
    (make(pad="zeros"), "shuffled", "first difference at position"),
    (make(pad="last"), "no_shuffle", r"position 5: expected 0, got 10"),
    (make(seed_with_epoch=False), "shuffled", r"epoch=1.*first difference"),
    (make(share="contiguous"), "no_shuffle", r"expected \[1, 3, 5, 7, 9\], got \[5, 6, 7, 8, 9\]"),
    (make(order="random.shuffle"), "shuffled", "first difference at position"),
    (uses_the_sampler, "no_shuffle", r"ran code of torch/utils/data/distributed.py.*__init__"),
    (uses_the_sampler_from_torch_utils_data, "shuffled", "ran code of torch/utils/data/distrib"),
    (make(drop="ignored"), "drop_last", r"drop_last=True.*lengths differ: expected 5 indices, "
                                        r"got 6"),
    (make(validate=False), "drop_last", r"\(rank == num_replicas\): expected ValueError"),
    (sampler_in_a_thread, "shuffled", r"ran code of torch/utils/data/distributed.py.*__init__"),
    (sampler_on_the_last_rank_only, "no_shuffle", r"^rank 1: shard_indices\(10, 2, 1, shuffle="
                                                  r"False\) ran code of torch/utils/data/[^\n]*$"),
    (switches_the_hook_off, "drop_last", "changed the profiler hook"),
    (returns_a_tensor, "no_shuffle", "expected a list of Python ints"),
    (no_padding, "no_shuffle", r"\(11, 2, rank, shuffle=False\) on every rank: the ranks got "
                               r"different numbers of indices \[6, 5\]"),
    (seeded_per_rank, "shuffled", r"together the ranks must cover every index of range\(10\)"),
    # every bad argument the task names has a visible case
    (no_error_for_zero_replicas, "drop_last", r"\(num_replicas 0\): expected ValueError"),
])
def test_the_visible_checks_catch_wrong_samplers(wrong, check, message):
    with pytest.raises(CheckFailed, match=message):
        VISIBLE[check](wrong)


def pads_once(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False):
    """Repeats the start, but only one pass: wrong when the dataset is smaller than the world."""
    right = make()
    if drop_last or dataset_len == 0 or dataset_len >= num_replicas:
        return right(dataset_len, num_replicas, rank, shuffle, seed, epoch, drop_last)
    order = right(dataset_len, 1, 0, shuffle, seed, epoch)
    padded = order + order[:num_replicas - dataset_len]
    return padded[rank::num_replicas]


def crashes_on_empty(dataset_len, num_replicas, rank, **kwargs):
    return make()(dataset_len, num_replicas, rank, **kwargs) if dataset_len else [None]


def test_the_hidden_checks_catch_what_the_visible_ones_miss():
    for wrong, message in [
        (pads_once, r"\(1, 4, rank\) on every rank: the ranks got different numbers of "
                    r"indices \[1, 1, 0, 0\]"),
        (crashes_on_empty, r"shard_indices\(0, 1, 0\): expected a list of Python ints"),
    ]:
        for visible in VISIBLE.values():
            visible(wrong)
        with pytest.raises(CheckFailed, match=message):
            hidden.check_shard_indices(wrong)


def test_every_written_out_list_is_the_samplers():
    """The visible checks hold no sampler (it is the answer): the lists of their situations are
    written out, held here to torch's own; and every situation they run has its lists."""
    keys = set()
    for cases in (checks.NO_SHUFFLE, checks.SHUFFLED, checks.DROP_LAST):
        for world_size in (2, 3):
            for n, kwargs in cases:
                for rank in range(world_size):
                    key = checks.situation_key(n, world_size, rank, kwargs)
                    assert checks.VISIBLE_SHARDS[key] == hidden.reference_indices(
                        n, world_size, rank, **kwargs), key
                    keys.add(key)
    assert keys == set(checks.VISIBLE_SHARDS)
    assert not hasattr(checks, "reference_indices")
    with pytest.raises(LookupError, match="grader bug: no written-out index list"):
        checks.written_out_indices(12, 2, 0, {})


def test_the_sampler_behaves_as_the_task_says():
    """Backs the task text: padding repeats the start (several passes when needed), drop_last
    keeps len // n per rank, an empty dataset is accepted, num_replicas < 1 is a ValueError."""
    def shards(n, world, **kwargs):
        return [hidden.reference_indices(n, world, r, **kwargs) for r in range(world)]

    assert shards(10, 3, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert shards(1, 4) == [[0]] * 4
    assert shards(2, 4, shuffle=False, drop_last=True) == [[]] * 4
    assert shards(11, 2, shuffle=False, drop_last=True) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert shards(0, 3) == [[]] * 3
    g = torch.Generator()
    g.manual_seed(5 + 2)
    permutation = torch.randperm(7, generator=g).tolist()
    assert hidden.reference_indices(7, 1, 0, seed=5, epoch=2) == permutation
    for args in [(10, 0, 0), (10, -2, 0), (10, 2, 2), (10, 2, -1)]:
        with pytest.raises(ValueError):
            hidden.reference_indices(*args)


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


def pads_with_zeros_and_rebinds_the_checks(dataset_len, num_replicas, rank, **kwargs):
    """Wrong padding, and every comparison of the check module rebound in its rank."""
    import ddpcourse.grading.checks as grading
    import ddpcourse.grading.exercises.sampler_by_hand as case

    case._judge_result = case._judge_shards = case._judge_hook = lambda *args, **kw: None
    case.reference_indices = lambda *args, **kw: [0]
    grading.judge_each_rank = case.judge_each_rank = lambda *args, **kw: None
    return make(pad="zeros")(dataset_len, num_replicas, rank, **kwargs)


@pytest.mark.parametrize("wrong, check, message", [
    (make(pad="zeros"), checks.check_shard_indices_without_shuffle,
     r"shard_indices\(10, 3, 2, shuffle=False\): expected \[2, 5, 8, 1\], got \[2, 5, 8, 0\]"),
    (pads_with_zeros_and_rebinds_the_checks, checks.check_shard_indices_without_shuffle,
     r"shard_indices\(10, 3, 2, shuffle=False\): expected \[2, 5, 8, 1\], got \[2, 5, 8, 0\]"),
    (uses_the_sampler, checks.check_shard_indices_shuffled,
     r"ran code of torch/utils/data/distributed.py.*__init__"),
    (switches_the_hook_off, checks.check_shard_indices_drop_last_and_bad_ranks,
     "changed the profiler hook"),
    (make(validate=False), checks.check_shard_indices_drop_last_and_bad_ranks,
     r"\(rank == num_replicas\): expected ValueError"),
    (pads_once, hidden.check_shard_indices,
     r"\(1, 4, rank\) on every rank: the ranks got different numbers of indices \[1, 1, 0, 0\]"),
    (no_error_for_zero_replicas, hidden.check_shard_indices,
     r"\(num_replicas 0\): expected ValueError"),
], ids=lambda v: getattr(v, "__name__", "")[:40])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message):
        check(submitted(wrong, host))


# --- the judges read the ranks' reports as untrusted data ----------------------------------

REPORT_CASES = [(11, {"shuffle": False}), (10, {"epoch": 1})]


def honest_reports(world_size=2):
    return [checks.observe_shards(rank, world_size, make(), REPORT_CASES)
            for rank in range(world_size)]


def honest_error_reports():
    return [checks.observe_errors(0, 1, make(), checks.BAD_RANKS)] * 2


DAMAGE = [
    ((), None), ((), []), ((), {"calls": "many"}), (("calls",), []), (("calls",), [None, None]),
    (("calls", 0), "x"), (("calls", 0), {}), (("calls", 0, "forbidden_calls"), "x"),
    (("calls", 0, "forbidden_calls"), ["x" * 1_000_000] * 1000),
    (("calls", 0, "forbidden_calls"), [torch.zeros(3), None]),
    (("calls", 0, "hook_removed"), 1), (("calls", 0, "hook_removed"), True),
    (("calls", 0, "indices"), "0, 2, 4"), (("calls", 0, "indices"), [0.0, 2.0]),
    (("calls", 0, "indices"), [True, False]), (("calls", 0, "indices"), torch.arange(6)),
    (("calls", 1, "indices"), [None]), (("calls", 1, "raised"), "ValueError"),
    (("calls", 1, "raised"), {"raised": 3, "message": "m"}),
    (("calls", 1, "raised"), {"raised": "E" * 1_000_000, "message": "m" * 1_000_000}),
    (("calls", 1, "indices"), None),
    (("calls", 1), {"forbidden_calls": [], "hook_removed": False, "indices": None, "type": None,
                    "text": "", "raised": None}),
]
ERROR_DAMAGE = [
    ((), None), (("calls",), [{}]), (("calls", 0, "raised"), None),
    (("calls", 0, "raised"), {"raised": "ValueError"}), (("calls", 0, "value_error"), "yes"),
    (("calls", 0, "value_error"), False),
    (("calls", 0), {"forbidden_calls": [], "hook_removed": False, "raised": None, "repr": None}),
    (("calls", 1, "forbidden_calls"), ["torch.utils.data.distributed.__init__"]),
]


def test_honest_reports_pass_the_judges():
    checks.judge_shards(honest_reports(), 2, REPORT_CASES)
    checks.judge_errors(honest_error_reports(), 2, checks.BAD_RANKS)


@pytest.mark.parametrize("case, path, value",
                         [("shards", *damage) for damage in DAMAGE]
                         + [("errors", *damage) for damage in ERROR_DAMAGE],
                         ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(case, path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    if case == "shards":
        honest, judge, args = honest_reports(), checks.judge_shards, (REPORT_CASES,)
    else:
        honest, judge, args = honest_error_reports(), checks.judge_errors, (checks.BAD_RANKS,)
    with pytest.raises(CheckFailed) as failed:
        judge([honest[0], altered(honest[1], path, value)], 2, *args)
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000


def test_a_wrong_list_from_one_rank_is_judged_with_every_rank_and_bounded():
    """A valid but wrong (and huge) list: the ranks no longer agree on lengths, said of all."""
    honest = honest_reports()
    damaged = altered(honest[1], ("calls", 0, "indices"), list(range(1_000_000)))
    with pytest.raises(CheckFailed, match=r"different numbers of indices \[6, 1000000\]") as failed:
        checks.judge_shards([honest[0], damaged], 2, REPORT_CASES)
    assert len(str(failed.value)) < 5000
