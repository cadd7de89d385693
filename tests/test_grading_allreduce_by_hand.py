"""The checks of exercise allreduce_by_hand (chapter 05: average_gradients, ring_allreduce): the
traffic bounds a ring must fit, and failure messages that say per rank what was expected.
The exercise: solutions/05_allreduce/allreduce_by_hand.nb.py. (Its solution and wrong submissions
graded end to end: tests/test_autograder.py.)"""

from __future__ import annotations

import pytest
import torch

from ddpcourse.grading.checks import CheckFailed, ring_traffic_bounds
from ddpcourse.grading.exercises import allreduce_by_hand as checks
from rank_lines import ranks_named

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


@pytest.mark.parametrize("numel, world_size", [(1000, 4), (999, 3), (7, 4), (2, 4), (10, 2)])
def test_a_ring_fits_the_traffic_bounds_and_sending_everything_does_not(numel, world_size):
    lower, upper = ring_traffic_bounds(numel, world_size, 4)
    chunks = [len(c) for c in torch.arange(numel).tensor_split(world_size)]
    for skipped in chunks:  # a ring sends every chunk but one, twice
        assert lower <= 2 * (numel - skipped) * 4 <= upper
    naive = (world_size - 1) * numel * 4
    if world_size >= 3 and numel >= 100:
        assert naive > upper
    assert ring_traffic_bounds(numel, 1, 4) == (0, 0)


def test_a_check_explains_per_rank_what_was_expected_and_what_came_back():
    def off_by_one(tensor):
        tensor += 1  # not an all-reduce at all

    with pytest.raises(CheckFailed) as info:
        checks.check_ring_allreduce_two_ranks(off_by_one)
    message = str(info.value)
    assert {0, 1} <= set(ranks_named(message)) and "expected [" in message


def test_a_sum_where_the_mean_was_due_is_named_as_such():
    def sums_only(model):
        for parameter in model.parameters():
            if parameter.grad is not None:
                torch.distributed.all_reduce(parameter.grad)  # no division by the world size

    with pytest.raises(CheckFailed) as info:
        checks.check_average_gradients_two_ranks(sums_only)
    message = str(info.value)
    assert "exactly 2 times the expected value, and 2 is the world size: did you divide the sum?" \
        in message, message
