"""The checks of exercise bucketed_ddp (chapter 05 part 2: broadcast_parameters, BucketedDDP) pass
the reference solution and catch plausible wrong ones (each wrong version is the solution with one
mistake a student could make), in the student's kernel and judged by the trusted grader
(autograder/trusted.py), where only the ranks' observations come back. The exercise:
solutions/05_allreduce/bucketed_ddp.nb.py."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from autograder.hidden import bucketed_ddp as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import bucketed_ddp as checks
from rank_lines import names_ranks_first, ranks_named
from trusted_path import altered, submitted

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


def test_the_reference_buckets_follow_the_contract():
    model = checks.make_net("plain", torch.float32, 0)
    assert hidden.reference_buckets(model, 1e-9) == [[n] for n, _ in
                                                     reversed(list(model.named_parameters()))]
    assert hidden.reference_buckets(model, 25.0) == [[n for n, _ in
                                                      reversed(list(model.named_parameters()))]]
    # 0.0015 MiB = 1572 bytes: out.* + mid2.* + mid.bias = 1356 bytes, then mid.weight + inp.*
    assert hidden.reference_buckets(model, 0.0015) == [
        ["out.bias", "out.weight", "mid2.bias", "mid2.weight", "mid.bias"],
        ["mid.weight", "inp.bias", "inp.weight"]]
    frozen = checks.make_net("frozen", torch.float32, 0)
    assert "inp.bias" not in sum(hidden.reference_buckets(frozen, 25.0), [])


def test_every_written_out_plan_is_the_reference_plan():
    """The visible checks hold no bucket planner (it is the exercise's answer): each visible
    case's plan is written out, held here to the reference planner of the hidden checks."""
    for (variant, dtype_name, bucket_cap_mb), buckets in checks.VISIBLE_PLANS.items():
        model = checks.reference_net(variant, checks.DTYPES[dtype_name], 0)
        assert buckets == hidden.reference_buckets(model, bucket_cap_mb), (variant, bucket_cap_mb)
    assert not hasattr(checks, "expected_buckets")


def test_the_visible_judge_refuses_a_case_without_a_written_out_plan():
    """A grader bug (a case with no plan) is said as such, not blamed on the student."""
    for variant, dtype_name, bucket_cap_mb in [("plain", "float32", 0.0015),
                                               ("tied", "float32", 0.001),
                                               ("plain", "float64", 0.001)]:
        with pytest.raises(LookupError, match="grader bug: no written-out bucket plan"):
            checks.judge_bucketed_training([None, None], 2, bucket_cap_mb, variant, dtype_name)


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


SUM_NOT_MEAN = ("            flat /= world_size\n", "")
ONLY_RANK_1_BROADCASTS = ("dist.broadcast(tensor, src=0)",
                          "dist.broadcast(tensor, src=min(1, dist.get_world_size() - 1))")


# Each bucket's all-reduce is handed a tensor of zeros of the bucket's size, and the gradients are
# summed point to point instead: the right mean, the right all-reduces by number and size, started
# during backward. Only what the all-reduces carried tells it apart.
ZEROS_ALL_REDUCED = ("            self._in_flight[index] = (dist.all_reduce(flat, async_op=True), "
                     "flat, ready)\n",
                     "            work = dist.all_reduce(torch.zeros_like(flat), async_op=True)\n"
                     "            total = flat.clone()\n"
                     "            for other in range(dist.get_world_size()):\n"
                     "                if other != dist.get_rank():\n"
                     "                    got = torch.empty_like(flat)\n"
                     "                    for request in (dist.isend(flat, other), "
                     "dist.irecv(got, other)):\n"
                     "                        request.wait()\n"
                     "                    total += got\n"
                     "            flat.copy_(total)\n"
                     "            self._in_flight[index] = (work, flat, ready)\n")


def test_an_all_reduce_of_zeros_beside_the_real_exchange_is_caught():
    """It passes the values and the overlap; the test of the buckets names what was reduced."""
    _, BucketedDDP = build(ZEROS_ALL_REDUCED)
    checks.check_bucketed_ddp_matches_one_process(BucketedDDP)
    checks.check_bucketed_ddp_overlaps_backward(BucketedDDP)
    with pytest.raises(CheckFailed, match="did not carry this rank's gradients") as failed:
        checks.check_bucketed_ddp_one_allreduce_per_bucket(BucketedDDP)
    assert {0, 1} <= set(ranks_named(str(failed.value)))
    with pytest.raises(CheckFailed, match="did not carry this rank's gradients"):
        hidden.check_bucketed_ddp(BucketedDDP)


def test_dividing_before_the_all_reduce_is_accepted():
    """Handing over the gradients divided by the world size is a synchronisation too."""
    _, BucketedDDP = build(
        ("            flat = torch.cat([p.grad.reshape(-1) for p in ready])\n",
         "            flat = torch.cat([p.grad.reshape(-1) for p in ready]) / dist.get_world_size()\n"),
        SUM_NOT_MEAN)
    checks.check_bucketed_ddp_matches_one_process(BucketedDDP)
    checks.check_bucketed_ddp_one_allreduce_per_bucket(BucketedDDP)


def test_one_mistake_fails_one_test():
    """A wrong broadcast_parameters and a missing division: the BucketedDDP tests put rank 0's
    state in place of broadcast_parameters, and only the test of the values sees the sum (and
    says so)."""
    _, BucketedDDP = build(ONLY_RANK_1_BROADCASTS, SUM_NOT_MEAN)
    with pytest.raises(CheckFailed) as failed:
        checks.check_bucketed_ddp_matches_one_process(BucketedDDP)
    message = str(failed.value)
    assert "did you divide the sum?" in message and "rank 0's value" not in message, message
    checks.check_bucketed_ddp_one_allreduce_per_bucket(BucketedDDP)
    checks.check_bucketed_ddp_overlaps_backward(BucketedDDP)


def test_a_bucket_may_hold_exactly_the_cap():
    model = checks.make_net("plain", torch.float32, 0)
    assert hidden.reference_buckets(model, checks.EXACT_CAP_MB)[0] == [
        "out.bias", "out.weight", "mid2.bias", "mid2.weight"]  # 12 + 192 + 64 + 1024 bytes
    _, closes_at_the_cap = build(("if current and size + nbytes > cap:",
                                  "if current and size + nbytes >= cap:"))
    with pytest.raises(CheckFailed,
                       match=r"bucket_cap_mb=0\.00123215.*expected 3 all-reduce calls"):
        checks.check_bucketed_ddp_one_allreduce_per_bucket(closes_at_the_cap)
REBINDS_THE_CHECKS = ("        broadcast_parameters(module)\n", """\
        broadcast_parameters(module)
        import ddpcourse.grading.checks as grading
        import ddpcourse.grading.exercises.bucketed_ddp as case
        grading.expect_close = case.expect_close = lambda *args, **kwargs: None
        torch.allclose = lambda *args, **kwargs: True
        torch.equal = lambda *args, **kwargs: True
""")


def test_what_the_class_changes_inside_the_ranks_cannot_change_the_verdict():
    """The sum instead of the mean, and a constructor that rebinds the comparisons in its rank:
    the judge runs outside the ranks (here: in this process), so the rebinding changes nothing."""
    _, BucketedDDP = build(SUM_NOT_MEAN, REBINDS_THE_CHECKS)
    with pytest.raises(CheckFailed, match="largest difference") as failed:
        checks.check_bucketed_ddp_matches_one_process(BucketedDDP)
    assert {0, 1} <= set(ranks_named(str(failed.value)))


# --- judged by the trusted grader: the ranks run in autograder's observation host ------------


@pytest.mark.parametrize("mistake, replacements, check, message", [
    ("only rank 1 broadcasts", [("dist.broadcast(tensor, src=0)",
                                 "dist.broadcast(tensor, src=min(1, dist.get_world_size() - 1))")],
     checks.check_broadcast_parameters_two_ranks, "is not rank 0's value"),
    ("the sum, and the checks rebound in the ranks", [SUM_NOT_MEAN, REBINDS_THE_CHECKS],
     checks.check_bucketed_ddp_matches_one_process, "largest difference"),
    ("a wrong broadcast_parameters: replaced by rank 0's state for the class's tests",
     [ONLY_RANK_1_BROADCASTS, SUM_NOT_MEAN], checks.check_bucketed_ddp_matches_one_process,
     "did you divide the sum"),
    ("all-reduces only after backward", [("if self._missing[index] == 0:\n            "
                                          "self._launch(index)", "pass")],
     checks.check_bucketed_ddp_overlaps_backward, "must start .async_op=True. as soon as"),
    ("frozen parameters hooked too", [("[p for p in module.parameters() if p.requires_grad]",
                                       "list(module.parameters())")],
     hidden.check_bucketed_ddp, "raised RuntimeError"),
    ("zeros all-reduced, the gradients summed point to point", [ZEROS_ALL_REDUCED],
     checks.check_bucketed_ddp_one_allreduce_per_bucket, "did not carry this rank's gradients"),
])
def test_the_trusted_grader_catches(host, mistake, replacements, check, message):
    broadcast_parameters, BucketedDDP = build(*replacements)
    graded = broadcast_parameters if "broadcast" in check.__name__ else BucketedDDP
    with pytest.raises(CheckFailed, match=message) as failed:
        check(submitted(graded, host))
    assert names_ranks_first(str(failed.value))  # each failed rank is named


# --- the judges read the ranks' reports as untrusted data ----------------------------------


def honest_broadcast_report(world_size):
    reference = checks.state_of(checks.reference_net("plain", torch.float32, 0))
    return {"returned": "None",
            "tensors": {name: {"value": t.detach().clone(), "same_storage": True,
                               "requires_grad": t.requires_grad, "grad": False}
                        for name, t in reference.items()},
            "group_after": (world_size * torch.arange(4, dtype=torch.float64)
                            + world_size * (world_size - 1) / 2)}


def honest_training_report(world_size, bucket_cap_mb, steps, planner=checks.written_out_plan):
    """What every rank reports when right: each rank's own gradient here is one process's (the
    same on every rank, so their mean is one process's gradient too)."""
    state, grads, weights = hidden.one_process(world_size, "plain", torch.float32, 0, steps)
    rank0 = checks.reference_net("plain", torch.float32, 0)
    buckets = planner(rank0, bucket_cap_mb)
    plan = checks.BucketPlan(rank0, buckets)

    def squares(step_grads):  # what each bucket's all-reduce is handed: its gradients, whole
        return [sum(step_grads[name].double().pow(2).sum().item() for name in bucket)
                for bucket in buckets]

    return {"is_module": True, "construction_collectives": ["broadcast"],
            "broadcast_parameters_called": True,
            "state": state, "weights": weights,
            "steps": [{"returned": "None", "allreduce_bytes": list(plan.bucket_bytes),
                       "allreduce_squares": squares(step_grads),
                       "other_collectives": [], "launched_at_input": [plan.early],
                       "launched_in_backward": len(plan.with_grad), "grads": step_grads,
                       "own_grads": {name: None if g is None else g.clone()
                                     for name, g in step_grads.items()}}
                      for step_grads in grads]}


BROADCAST_DAMAGE = [
    ((), None), ((), {}), (("returned",), 3), (("returned",), "Module"), (("tensors",), []),
    (("tensors", "scale"), "x"), (("tensors", "scale", "value"), [1.0, 2.0, 3.0]),
    (("tensors", "scale", "value"), torch.zeros(5)), (("tensors", "out.bias", "grad"), "no"),
    (("tensors", "out.bias", "same_storage"), 1), (("tensors", "extra"), {}),
    (("group_after",), 5), (("group_after",), "x" * 1_000_000), (("group_after",), torch.ones(2)),
]
TRAINING_DAMAGE = [
    ((), None), ((), [1, 2]), (("is_module",), "yes"), (("construction_collectives",), "all"),
    (("state",), {"inp.weight": "x"}), (("state", "scale"), torch.zeros(3, dtype=torch.int64)),
    (("steps",), "many"), (("steps",), []), (("steps", 0), None),
    (("steps", 0, "returned"), None), (("steps", 0, "allreduce_bytes"), ["a", 3]),
    (("steps", 0, "allreduce_bytes"), {}), (("steps", 0, "other_collectives"), [1, None]),
    (("steps", 0, "launched_at_input"), ["x"]), (("steps", 0, "launched_in_backward"), "1"),
    (("steps", 0, "grads"), []), (("steps", 0, "grads", "out.bias"), "nan"),
    (("steps", 0, "grads", "out.bias"), torch.zeros(2, 2, dtype=torch.complex64)),
    (("steps", 1, "grads", "out.bias"), torch.zeros(3).to_sparse()),
    (("weights",), [1]), (("weights", "out.bias"), None),
    (("steps", 0, "own_grads"), None), (("steps", 1, "own_grads", "out.bias"), "x"),
    (("steps", 0, "allreduce_squares"), None), (("steps", 0, "allreduce_squares"), [1.0]),
    (("steps", 1, "allreduce_squares"), ["x"] * 5), (("steps", 1, "allreduce_squares", 0), 0.0),
    (("steps", 0, "allreduce_squares", 2), float("nan")),
]


def test_the_mean_of_the_ranks_own_gradients_is_one_process():
    """The visible judge holds no one-process run: it expects the mean of the gradients each
    rank's grader-owned copy computes on the rank's share, and rank 0's state moved by them. Here
    that is held to one process on the whole batch (3 ranks, 2 steps)."""
    world_size, steps = 3, 2
    state, grads, weights = hidden.one_process(world_size, "plain", torch.float32, 0, steps)
    x_all, y_all = checks.global_batch(world_size, torch.float32, 0)
    models = [checks.reference_net("plain", torch.float32, 0) for _ in range(world_size)]
    shadow = checks.reference_net("plain", torch.float32, 0)
    reports = [{"steps": []} for _ in range(world_size)]
    for _ in range(steps):
        for rank, model in enumerate(models):
            share = slice(rank * checks.ROWS_PER_RANK, (rank + 1) * checks.ROWS_PER_RANK)
            own = checks.own_gradients(shadow, model, x_all[share], y_all[share])
            reports[rank]["steps"].append({"own_grads": own})
        mean = checks.mean_of_own_gradients(reports, len(reports[0]["steps"]),
                                            dict(shadow.named_parameters()))[-1]
        for model in models:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.add_(mean[name], alpha=-checks.LR)
    means = checks.mean_of_own_gradients(reports, steps, dict(shadow.named_parameters()))
    for step in range(steps):
        for name, grad in grads[step].items():
            torch.testing.assert_close(means[step][name], grad, rtol=1e-5, atol=1e-6)
    final = checks.sgd_from(state, means)
    for name, tensor in weights.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
    assert not hasattr(checks, "one_process")


def test_honest_reports_pass_the_judges():
    checks.judge_broadcast([honest_broadcast_report(2)] * 2, 2)
    checks.judge_bucketed_training([honest_training_report(2, 0.001, 2)] * 2, 2, 0.001,
                                   "plain", "float32", 0, 2, "all")
    hidden.judge_with_reference_plan(
        [honest_training_report(2, 0.0015, 2, hidden.reference_buckets)] * 2, 2, 0.0015,
        "plain", "float32", 0, 2, "all")


def test_the_hidden_judge_catches_a_wrong_plan():
    """All-reduces of the buckets in forward order (0.0015 MiB: 1536 + 1292 bytes; the
    reference's are 1356 + 1472), judged against the reference planner."""
    report = honest_training_report(2, 0.0015, 1, hidden.reference_buckets)
    report["steps"][0]["allreduce_bytes"] = [1536, 1292]
    with pytest.raises(CheckFailed, match=r"the buckets hold \[1356, 1472\] bytes"):
        hidden.judge_with_reference_plan([report] * 2, 2, 0.0015, "plain", "float32", 0, 1,
                                         "buckets")


@pytest.mark.parametrize("case, path, value",
                         [("broadcast", *damage) for damage in BROADCAST_DAMAGE]
                         + [("training", *damage) for damage in TRAINING_DAMAGE],
                         ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(case, path, value):
    """Rank 1's report is damaged (what a hostile rank may send): the verdict names rank 1 only,
    in a message of bounded size."""
    if case == "broadcast":
        honest, judge, args = honest_broadcast_report(2), checks.judge_broadcast, ()
    else:
        honest, judge = honest_training_report(2, 0.001, 2), checks.judge_bucketed_training
        args = (0.001, "plain", "float32", 0, 2, "all")
    with pytest.raises(CheckFailed) as failed:
        judge([honest, altered(honest, path, value)], 2, *args)
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
