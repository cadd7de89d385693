"""The checks of exercise memory_per_rank (chapter 02: bytes_per_rank, DDP vs FSDP2) catch
plausible wrong solutions, each with a message that says what was expected and what came back.
The exercise: solutions/02_dp_ddp_fsdp/memory_per_rank.nb.py."""

from __future__ import annotations

import math

import pytest

from autograder.hidden import memory_per_rank as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import memory_per_rank as checks

pytestmark = pytest.mark.usefixtures("integrity_snapshot")


def predictor(shard="chunk", step_bytes=4, frozen_state=False, ddp_share=False, as_float=False,
              step_like_param=False, validate=True):
    """A bytes_per_rank built from one rule per argument; the defaults give the right answer."""

    def bytes_per_rank(model, world_size, rank, strategy):
        if validate and (strategy not in ("ddp", "fsdp") or not 0 <= rank < world_size):
            raise ValueError("bad arguments")
        held = {"params": 0, "grads": 0, "adam_state": 0}
        for p in model.parameters():
            rows, numel = p.shape[0], p.numel()
            if strategy == "fsdp" or ddp_share:
                if shard == "chunk":
                    per = math.ceil(rows / world_size)
                    mine = max(0, min(per, rows - rank * per))
                elif shard == "padded":
                    mine = math.ceil(rows / world_size)
                elif shard == "tensor_split":
                    mine = rows // world_size + (rank < rows % world_size)
                else:  # "divide": numel / world_size, no rule for rows
                    mine = rows / world_size
                numel = mine * (numel // rows)
            nbytes = numel * p.element_size()
            held["params"] += nbytes
            if p.requires_grad or frozen_state:
                held["grads"] += nbytes
                held["adam_state"] += 2 * nbytes + (p.element_size() if step_like_param
                                                    else step_bytes)
        return {k: v if as_float else int(v) for k, v in held.items()}

    return bytes_per_rank


def test_the_reference_rule_passes_visible_and_hidden():
    right = predictor()
    checks.check_bytes_per_rank_even_model(right)
    checks.check_bytes_per_rank_rejects_bad_arguments(right)
    hidden.check_bytes_per_rank(right)


def test_forgetting_adams_step_counters_is_caught_by_the_visible_check():
    with pytest.raises(CheckFailed) as info:
        checks.check_bytes_per_rank_even_model(predictor(step_bytes=0))
    message = str(info.value)
    assert "rank 0:" in message and "rank 1:" in message
    # 6 parameters, 4 bytes each: 24 bytes short, under both strategies
    assert "ddp, world size 2" in message and "adam_state: measured 2552, you predicted 2528" in message


def test_the_articles_ddp_share_is_caught_by_the_visible_check():
    with pytest.raises(CheckFailed, match=r"ddp, world size 2.*params: measured 1264, you "
                                          r"predicted 632"):
        checks.check_bytes_per_rank_even_model(predictor(ddp_share=True))


def test_floats_and_missing_value_errors_are_caught_by_the_visible_checks():
    with pytest.raises(CheckFailed, match="must be an int"):
        checks.check_bytes_per_rank_even_model(predictor(shard="divide", as_float=True))
    with pytest.raises(CheckFailed, match=r"strategy='zero3'\): expected ValueError"):
        checks.check_bytes_per_rank_rejects_bad_arguments(predictor(validate=False))


@pytest.mark.parametrize("wrong, expected", [
    (predictor(shard="divide"), "fsdp, world size 3"),  # 7 rows / 3 is not a shard
    (predictor(shard="tensor_split"), "fsdp, world size 3"),  # 7 rows: 3 + 2 + 2, not 3 + 3 + 1
    (predictor(shard="padded"), "fsdp, world size 3"),  # counts FSDP2's padding
    (predictor(frozen_state=True), "ddp, world size 1"),  # grads + Adam state for frozen layers
    (predictor(step_like_param=True), "model 'float64'"),  # step is float32 for float64 params
])
def test_uneven_frozen_and_float64_mistakes_pass_visible_but_fail_hidden(wrong, expected):
    checks.check_bytes_per_rank_even_model(wrong)  # rows divide evenly, float32, nothing frozen
    with pytest.raises(CheckFailed, match=expected):
        hidden.check_bytes_per_rank(wrong)
