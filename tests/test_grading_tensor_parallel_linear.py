"""The checks of exercise tensor_parallel_linear (chapter 11: ColumnParallelLinear and
RowParallelLinear by hand) pass the solution and catch plausible wrong ones, in the student's
kernel and judged by the trusted grader (autograder/trusted.py). The exercise:
solutions/11_beyond_ddp/tensor_parallel_linear.nb.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autograder.hidden import tensor_parallel_linear as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed, together
from ddpcourse.grading.exercises import tensor_parallel_linear as checks
from rank_lines import ranks_named
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")

SOURCE = SOLUTIONS / "11_beyond_ddp" / "tensor_parallel_linear.ipynb"
SOLUTION = solution_code(SOURCE, "tensor-parallel-linear")


def build(*replacements: tuple[str, str]):
    """The solution's (ColumnParallelLinear, RowParallelLinear), each (old, new) applied once."""
    source = SOLUTION
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"torch": torch, "dist": dist, "nn": nn}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["ColumnParallelLinear"], namespace["RowParallelLinear"]


def test_the_solution_passes_visible_and_hidden_checks():
    classes = together(*build())
    checks.check_column_parallel(classes)
    checks.check_row_parallel(classes)
    checks.check_mlp(classes)
    hidden.check_tensor_parallel_linear(classes)


NO_BACKWARD_SUM = ("                dist.all_reduce(grad, group=ctx.group)\n", "")
BIAS_ON_EVERY_RANK = ("        out = SumInForward.apply(nn.functional.linear(x, self.weight), "
                      "self.group)\n        return out if self.bias is None else out + self.bias",
                      "        return SumInForward.apply(nn.functional.linear(x, self.weight, "
                      "self.bias), self.group)")
DEFAULT_GROUP = ("                dist.all_reduce(x, group=group)", "                dist.all_reduce(x)")
KEEPS_DENSE = ("        self.group = group\n        mine = slice(",
               "        self.group = group\n        self.dense = linear\n        mine = slice(")
A_VIEW = ("nn.Parameter(linear.weight.detach()[mine].clone())",
          "nn.Parameter(linear.weight.detach()[mine])")
STASHED = ("        self.group = group\n        mine = slice(",
           "        self.group = group\n        self.stash = [linear.weight.detach()]\n"
           "        mine = slice(")
OUT_OF_AUTOGRAD = ("        out = SumInForward.apply(nn.functional.linear(x, self.weight), "
                   "self.group)\n",
                   "        out = nn.functional.linear(x, self.weight).detach()\n"
                   "        dist.all_reduce(out, group=self.group)\n")


@pytest.mark.parametrize("mistake, replacement, check, message", [
    ("column: input gradient not summed", NO_BACKWARD_SUM, checks.check_column_parallel,
     r"the input's gradient \(the whole input\)"),
    ("row: bias added on every rank", BIAS_ON_EVERY_RANK, checks.check_row_parallel,
     r"the output: .*|bias"),
    ("column: keeps the dense layer", KEEPS_DENSE, checks.check_column_parallel,
     "keeps 45 elements in tensors; its share of the dense layer is 15"),
    ("column: a view of the dense weight", A_VIEW, checks.check_column_parallel,
     "keeps 27 elements in tensors; its share of the dense layer is 15"),
    ("column: the dense weight in a list", STASHED, checks.check_column_parallel,
     "keeps 39 elements in tensors"),
    ("row: all-reduce outside autograd", OUT_OF_AUTOGRAD, checks.check_row_parallel,
     "got no gradient"),
    ("row: default group instead of the layer's", DEFAULT_GROUP,
     hidden.check_tensor_parallel_linear, "the (output|column-parallel layer's weight gradient)"),
])
def test_the_checks_catch(mistake, replacement, check, message):
    with pytest.raises(CheckFailed, match=message) as failed:
        check(together(*build(replacement)))
    assert ranks_named(str(failed.value))


def test_the_trusted_grader_catches_a_missing_backward_sum(host):
    column, row = build(NO_BACKWARD_SUM)
    with pytest.raises(CheckFailed, match="the input's gradient"):
        checks.check_column_parallel(together(submitted(column, host), submitted(row, host)))


# A differently written correct answer: gradient hooks and in-place all-reduces on detached
# aliases instead of autograd.Functions. The contract is behaviour, so it passes every check.
HOOKS = '''
class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        k = linear.out_features // n
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach()[r * k:(r + 1) * k].clone())
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach()[r * k:(r + 1) * k].clone()))

    def forward(self, x):
        if x.requires_grad:
            x = x.view_as(x)  # this call's own alias: the hook sees only this call's gradient
            group = self.group

            def hook(grad):
                dist.all_reduce(grad.detach(), group=group)
                return grad

            x.register_hook(hook)
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, linear, group):
        super().__init__()
        n, r = dist.get_world_size(group), dist.get_rank(group)
        k = linear.in_features // n
        self.group = group
        self.weight = nn.Parameter(linear.weight.detach()[:, r * k:(r + 1) * k].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        out = nn.functional.linear(x, self.weight)
        dist.all_reduce(out.detach(), group=self.group)  # autograd sees the identity
        return out if self.bias is None else out + self.bias
'''
HOOK_ON_CALLERS_INPUT = ("            x = x.view_as(x)  # this call's own alias: the hook sees "
                         "only this call's gradient\n", "")
HOOKED_ONCE = ("        if x.requires_grad:\n",
               "        if x.requires_grad and not getattr(self, 'hooked', False):\n"
               "            self.hooked = True\n")


def from_source(source, *replacements):
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"torch": torch, "dist": dist, "nn": nn}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["ColumnParallelLinear"], namespace["RowParallelLinear"]


def test_a_hook_based_answer_passes_every_check_judged_outside_the_ranks(host):
    column, row = from_source(HOOKS)
    classes = together(submitted(column, host), submitted(row, host))
    checks.check_column_parallel(classes)
    checks.check_row_parallel(classes)
    checks.check_mlp(classes)
    hidden.check_tensor_parallel_linear(classes)


@pytest.mark.parametrize("mistake, replacement", [
    ("the hook on the caller's input tensor: the residual's gradient is summed too",
     HOOK_ON_CALLERS_INPUT),
    ("the hook registered on the first call only", HOOKED_ONCE),
])
def test_the_graded_run_catches_hooks_that_are_not_per_call(mistake, replacement, host):
    column, row = from_source(HOOKS, replacement)
    classes = together(submitted(column, host), submitted(row, host))
    # the visible checks call each layer once on an input nothing else uses: these pass them
    with pytest.raises(CheckFailed, match=r"called twice before one backward.*\n.*rank 0: the "
                       r"(column-parallel layer's weight gradient|input's gradient)") as failed:
        hidden.check_tensor_parallel_linear(classes)
    assert ranks_named(str(failed.value))


def honest_report(rank: int) -> dict:
    """What rank ``rank`` of 2 reports for check_column_parallel's case, made here."""
    sizes, seed = (4, 6, 2), 0
    expected = checks.expected_of("column", sizes, True, seed, 2, 0)
    grads = {name: {"is_parameter": True, "grad": checks.shard("column", name, g, rank, 2)}
             for name, g in expected["grads"]["column"].items()}
    for entry in grads.values():
        entry["shape"] = list(entry["grad"].shape)
    return {"layers": {"column": {"is_module": True, "elements": 15,
                                  "parameters": ["bias", "weight"]}},
            "grads": {"column": grads},
            "output": expected["output"].tensor_split(2, dim=1)[rank],
            "input_grad": expected["input_grad"],
            "dense": {name: p.detach().clone() for name, p in
                      checks.dense_state(*checks.dense_layers(sizes, True, seed)).items()}}


COLUMN_CASE = ("column", (4, 6, 2), True, 0, 2)
DAMAGE = [((), None), ((), []), (("layers",), "x"), (("layers", "column", "is_module"), "yes"),
          (("layers", "column", "elements"), 10**9), (("grads", "column", "weight"), None),
          (("grads", "column", "bias", "grad"), "x" * 1_000_000),
          (("grads", "column", "weight", "shape"), [6, 4]), (("output",), torch.zeros(3, 3)),
          (("output",), torch.zeros(3, 3, dtype=torch.complex64)),
          (("input_grad",), None), (("dense",), "yes"),
          (("dense", "first.weight"), torch.zeros(6, 4, dtype=torch.float64))]


def test_honest_reports_pass_the_judge():
    checks.judge_layers([honest_report(0), honest_report(1)], 2, *COLUMN_CASE)


@pytest.mark.parametrize("path, value", DAMAGE, ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(path, value):
    with pytest.raises(CheckFailed) as failed:
        checks.judge_layers([honest_report(0), altered(honest_report(1), path, value)], 2,
                            *COLUMN_CASE)
    message = str(failed.value).split("\n", 1)[1]
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
