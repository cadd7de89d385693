"""The checks of exercise memory_per_rank (chapter 02: bytes_per_rank, DDP vs FSDP2) catch
plausible wrong solutions, each with a message that says what was expected and what came back; in
the student's kernel and judged by the trusted grader (autograder/trusted.py), where only the
ranks' predictions come back and the judge measures on its own.
The exercise: solutions/02_dp_ddp_fsdp/memory_per_rank.nb.py."""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch

from autograder.hidden import memory_per_rank as hidden
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import memory_per_rank as checks
from rank_lines import names_ranks_first, ranks_named
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")
# This module's functions travel to the ranks by value, as a notebook's do: a rank never imports
# this module (and, through it, the grader's heavy imports).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
    assert {0, 1} <= set(ranks_named(message))
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


def predictor_that_fakes_the_measurement(model, world_size, rank, strategy):
    """Attack: a wrong prediction (no step counters), and the rank's measurement replaced by one
    that agrees with it (where the old checks measured): the judge measures in its own ranks."""
    import ddpcourse.grading.exercises.memory_per_rank as case

    wrong = predictor(step_bytes=0)
    case.measure_ddp = lambda spec, rank: wrong(case.build_model(spec), 1, 0, "ddp")
    case.measure_fsdp = lambda spec, rank, n: wrong(case.build_model(spec), n, rank, "fsdp")
    return wrong(model, world_size, rank, strategy)


def test_what_the_class_changes_inside_the_ranks_cannot_change_the_verdict():
    with pytest.raises(CheckFailed, match="adam_state: measured 2552, you predicted 2528") as info:
        checks.check_bytes_per_rank_even_model(predictor_that_fakes_the_measurement)
    assert {0, 1} <= set(ranks_named(str(info.value)))


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("wrong, check, message", [
    (predictor_that_fakes_the_measurement, checks.check_bytes_per_rank_even_model,
     "adam_state: measured 2552, you predicted 2528"),
    (predictor(shard="divide", as_float=True), checks.check_bytes_per_rank_even_model,
     "must be an int"),
    (predictor(validate=False), checks.check_bytes_per_rank_rejects_bad_arguments,
     r"strategy='zero3'\): expected ValueError"),
    (predictor(shard="padded"), hidden.check_bytes_per_rank, "fsdp, world size 3"),
], ids=["fakes-the-measurement", "floats", "no-value-error", "padded"])
def test_the_trusted_grader_catches(host, wrong, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(wrong, host))
    assert names_ranks_first(str(failed.value))  # each failed rank is named


# --- the judges read the ranks' reports as untrusted data ----------------------------------


def test_the_written_out_measurement_is_a_fresh_one():
    """The visible checks hold no measurement (it yields the answer of any model): the visible
    case's bytes are written out, held here to the hidden checks' measurement."""
    for (names, strategies, world_size), written in checks.VISIBLE_MEASURED.items():
        specs = [{"even": checks.EVEN, "uneven": checks.UNEVEN,
                  "float64": checks.DOUBLE}[name] for name in names]
        assert written == hidden.measured_bytes(specs, strategies, world_size)
    assert ((("even",), checks.STRATEGIES, 2)) in checks.VISIBLE_MEASURED
    for name in ("measured_bytes", "measure_ddp", "measure_fsdp", "count_held"):
        assert not hasattr(checks, name)


def honest_memory_report(world_size, rank):
    measured = hidden.measured_bytes([checks.EVEN], checks.STRATEGIES, world_size)[rank]
    return {"predictions": {key: {"raised": None, "type": "dict", "repr": repr(held),
                                  "entries": [[k, "int", v] for k, v in held.items()]}
                            for key, held in measured.items()}}


def honest_errors_report():
    return {"calls": [{"raised": "ValueError", "value_error": True, "message": "bad"}
                      for _ in checks.VISIBLE_ERRORS]}


EVEN_DDP = ("predictions", "even/ddp")
MEMORY_DAMAGE = [
    ((), None), ((), {}), ((), [1]), (("predictions",), "x"), (("predictions",), {}),
    (EVEN_DDP, None), (EVEN_DDP, {}), ((*EVEN_DDP, "raised"), 3),
    ((*EVEN_DDP, "raised"), "x" * 1_000_000), ((*EVEN_DDP, "type"), None),
    ((*EVEN_DDP, "entries"), "many"), ((*EVEN_DDP, "entries"), None),
    ((*EVEN_DDP, "entries"), [[1, 2, 3]]), ((*EVEN_DDP, "entries"), [["params"]]),
    ((*EVEN_DDP, "entries", 0), ["params", "int", "1264"]),
    ((*EVEN_DDP, "entries", 0), ["params", "int", 1263]),
    ((*EVEN_DDP, "entries", 0), ["params", "float", 1264.0]),
    ((*EVEN_DDP, "entries", 0), ["x" * 100_000, "int", 1]),
    ((*EVEN_DDP, "entries", 0), ["params", "int", torch.tensor(1264)]),
]
ERRORS_DAMAGE = [
    ((), None), ((), {}), (("calls",), "x"), (("calls",), []), (("calls", 0), None),
    (("calls", 0, "raised"), None), (("calls", 0, "raised"), 5),
    (("calls", 0, "value_error"), "yes"), (("calls", 0, "message"), None),
]


def test_honest_reports_pass_the_judges():
    checks.judge_memory([honest_memory_report(2, rank) for rank in range(2)], 2, (checks.EVEN,),
                        checks.STRATEGIES)
    checks.judge_errors([honest_errors_report()] * 2, 2, checks.VISIBLE_ERRORS)


@pytest.mark.parametrize("case, path, value",
                         [("memory", *damage) for damage in MEMORY_DAMAGE]
                         + [("errors", *damage) for damage in ERRORS_DAMAGE],
                         ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(case, path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    if case == "memory":
        reports = [honest_memory_report(2, rank) for rank in range(2)]
        judge, args = checks.judge_memory, ((checks.EVEN,), checks.STRATEGIES)
    else:
        reports = [honest_errors_report(), honest_errors_report()]
        judge, args = checks.judge_errors, (checks.VISIBLE_ERRORS,)
    reports[1] = altered(reports[1], path, value)
    with pytest.raises(CheckFailed) as failed:
        judge(reports, 2, *args)
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
