"""The checks of exercise build_2d_groups (chapter 11: the dp and tp groups of a 2-D grid) pass the
solution and catch plausible wrong ones, in the student's kernel and judged by the trusted grader
(autograder/trusted.py). The exercise: solutions/11_beyond_ddp/build_2d_groups.nb.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from autograder.hidden import build_2d_groups as hidden
from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.checks import CheckFailed
from ddpcourse.grading.exercises import build_2d_groups as checks
from rank_lines import ranks_named
from trusted_path import altered, submitted

pytestmark = pytest.mark.usefixtures("integrity_snapshot")

SOURCE = SOLUTIONS / "11_beyond_ddp" / "build_2d_groups.ipynb"
SOLUTION = solution_code(SOURCE, "build-2d-groups")


def build(*replacements: tuple[str, str]):
    """The solution's build_2d_groups, with each (old, new) applied once."""
    source = SOLUTION
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace = {"dist": dist}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["build_2d_groups"]


def test_the_solution_passes_visible_and_hidden_checks():
    solution = build()
    checks.check_two_by_two(solution)
    checks.check_one_dimension(solution)
    checks.check_not_a_divisor(solution)
    hidden.check_build_2d_groups(solution)


def test_every_written_out_grid_is_the_reference_grid():
    for (world_size, tp_size), grid in checks.VISIBLE_GRIDS.items():
        assert grid == hidden.reference_grid(world_size, tp_size), (world_size, tp_size)
    assert hidden.reference_grid(6, 3) == {"tp": [[0, 1, 2]] * 3 + [[3, 4, 5]] * 3,
                                           "dp": [[0, 3], [1, 4], [2, 5]] * 2}
    assert not hasattr(checks, "reference_grid")


def test_the_visible_judge_refuses_a_case_without_a_written_out_grid():
    with pytest.raises(LookupError, match="grader bug: no written-out grid"):
        checks.judge_groups([None] * 4, 4, 4)


SWAPPED = ("    return dp_group, tp_group", "    return tp_group, dp_group")
STRIDED_TP = ("group = dist.new_group(list(range(start, start + tp_size)))",
              "group = dist.new_group(list(range(start // tp_size, world_size, "
              "world_size // tp_size)))")
# without the check, new_group([2, 3]) of 3 ranks raises ValueError itself; a grid cut short does not
PARTIAL_GRID = ("    if tp_size < 1 or world_size % tp_size:\n", "    if tp_size < 1:\n",
                "range(0, world_size, tp_size)", "range(0, world_size - tp_size + 1, tp_size)")
RANK_LISTS = ("    return dp_group, tp_group",
              "    return (dist.get_process_group_ranks(dp_group), "
              "dist.get_process_group_ranks(tp_group))")


@pytest.mark.parametrize("mistake, replacement, check, message", [
    ("dp and tp swapped", SWAPPED, checks.check_two_by_two,
     r"its dp group holds \[0, 1\], expected ranks \[0, 2\]"),
    ("tp groups strided", STRIDED_TP, checks.check_two_by_two,
     r"its tp group holds \[0, 2\], expected ranks \[0, 1\]"),
    ("a grid cut short", PARTIAL_GRID, checks.check_not_a_divisor, "must raise ValueError"),
    ("lists of ranks instead of groups", RANK_LISTS, checks.check_two_by_two,
     "a list, not a ProcessGroup"),
])
def test_the_checks_catch(mistake, replacement, check, message):
    pairs = [replacement[i:i + 2] for i in range(0, len(replacement), 2)]
    with pytest.raises(CheckFailed, match=message) as failed:
        check(build(*pairs))
    assert ranks_named(str(failed.value))


# --- judged by the trusted grader ----------------------------------------------------------------


def test_the_trusted_grader_catches_swapped_groups(host):
    with pytest.raises(CheckFailed, match="its dp group holds"):
        checks.check_two_by_two(submitted(build(SWAPPED), host))


def from_source(source):
    namespace = {"dist": dist}
    exec(compile(source, "<student notebook>", "exec"), namespace)
    return namespace["build_2d_groups"]


# A differently written correct answer: each rank creates only its own two groups, with
# use_local_synchronization=True (members only; every rank in one order: tp, then dp).
MEMBERS_ONLY = '''
def build_2d_groups(world_size, tp_size):
    if not 1 <= tp_size <= world_size or world_size % tp_size != 0:
        raise ValueError(f"tp_size {tp_size} is not a divisor of {world_size}")
    rank = dist.get_rank()
    first = rank // tp_size * tp_size
    tp_group = dist.new_group(list(range(first, first + tp_size)),
                              use_local_synchronization=True)
    dp_group = dist.new_group(list(range(rank % tp_size, world_size, tp_size)),
                              use_local_synchronization=True)
    return dp_group, tp_group
'''
# The lesson's init_device_mesh builds the same grid: it meets every other requirement.
DEVICE_MESH = '''
def build_2d_groups(world_size, tp_size):
    if tp_size < 1 or world_size % tp_size:
        raise ValueError("tp_size must divide world_size")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return mesh.get_group("dp"), mesh.get_group("tp")
'''


def test_members_only_groups_pass_every_check_judged_outside_the_ranks(host):
    answer = submitted(from_source(MEMBERS_ONLY), host)
    checks.check_two_by_two(answer)
    checks.check_one_dimension(answer)
    checks.check_not_a_divisor(answer)
    hidden.check_build_2d_groups(answer)


def test_the_graded_run_catches_init_device_mesh(host):
    with pytest.raises(CheckFailed, match=r"ranks 0, 1, 2 and 3: build_2d_groups\(4, 2\) ran code "
                       r"of torch/distributed/device_mesh.py \(\['torch\.distributed\.device_mesh"
                       r"\.init_device_mesh'") as failed:
        checks.check_two_by_two(submitted(from_source(DEVICE_MESH), host))
    assert ranks_named(str(failed.value))


# --- the judge reads the ranks' reports as untrusted data ---------------------------------------


def honest_report(rank: int) -> dict:
    grid = checks.VISIBLE_GRIDS[(4, 2)]
    mine = {role: grid[role][rank] for role in checks.ROLES}
    return {"members": mine, "reached": dict(mine), "default_group_sum": 10, "mesh_calls": [],
            "hook_removed": False}


DAMAGE = [((), None), ((), []), (("members",), "x"), (("members", "dp"), [0, 3]),
          (("members", "tp"), "x" * 1_000_000), (("reached",), None), (("reached", "tp"), [1]),
          (("default_group_sum",), 11), (("default_group_sum",), "x" * 1_000_000),
          (("raised",), "ValueError"), (("mesh_calls",), None),
          (("mesh_calls",), ["torch.distributed.device_mesh.init_device_mesh"]),
          (("hook_removed",), True)]


def test_honest_reports_pass_the_judge():
    checks.judge_groups([honest_report(r) for r in range(4)], 4, 2)


@pytest.mark.parametrize("path, value", DAMAGE, ids=lambda v: repr(v)[:40])
def test_malformed_reports_fail_the_rank_instead_of_crashing_the_judge(path, value):
    reports = [honest_report(r) for r in range(4)]
    reports[1] = altered(reports[1], path, value)
    with pytest.raises(CheckFailed) as failed:
        checks.judge_groups(reports, 4, 2)
    message = str(failed.value)
    assert message.startswith("rank 1:") and "rank 0:" not in message and len(message) < 5000
