"""The shared judge of "a bad argument raises ValueError first" (ddpcourse/grading/raises_first.py),
which train_steps and tune_this_job both use: each way a call can fall short is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.raises_first import call_with_bad_argument, judge_raised_first


def judge(calls, values=(0,)):
    judge_raised_first(calls, list(values), lambda k: f"f(k={k!r})", "k must be >= 1",
                       "check k first")


def test_a_call_that_raises_value_error_before_changing_the_model_passes():
    model = nn.Linear(2, 2)

    def checks_first():
        raise ValueError("k must be >= 1")

    judge([call_with_bad_argument(checks_first, model)])


@pytest.mark.parametrize("body, message", [
    (lambda model: None, r"f\(k=0\): expected ValueError \(k must be >= 1\), it returned None"),
    (lambda model: 1 / 0, r"expected ValueError .*it raised ZeroDivisionError"),
    (lambda model: (model.weight.data.add_(1), (_ for _ in ()).throw(ValueError("late"))),
     r"f\(k=0\): the model changed before the ValueError; check k first"),
])
def test_each_way_to_fall_short_is_named(body, message):
    model = nn.Linear(2, 2)
    call = call_with_bad_argument(lambda: body(model), model)
    with pytest.raises(CheckFailed, match=message):
        judge([call])


@pytest.mark.parametrize("calls", [[], "calls", [{"value_error": "yes"}]])
def test_a_report_of_the_wrong_shape_fails(calls):
    with pytest.raises(CheckFailed):
        judge(calls)


def test_the_model_is_compared_exactly():
    model = nn.Linear(2, 2)

    def nudges_then_raises():
        with torch.no_grad():
            model.bias.add_(1e-30 if model.bias[0] == 0 else model.bias[0] * 1e-6)
        raise ValueError

    assert call_with_bad_argument(nudges_then_raises, model)["unchanged"] is False
