"""Chapter 11, device meshes by hand: visible checks for ``build_2d_groups``, and the case the
hidden checks reuse.

The contract is the docstring of ``build_2d_groups`` in
solutions/11_beyond_ddp/build_2d_groups.nb.py (students:
exercises/11_beyond_ddp/build_2d_groups.ipynb).

Each case is a :class:`~ddpcourse.grading.checks.Case`. Every rank calls the student's function,
then reports, for each group it got back, its members (``dist.get_process_group_ranks``) and
what a real ``all_reduce`` of ``2**rank`` over it gave: the bits set are the ranks the
all-reduce reached. The all-reduces run only when the ranks' reports agree with each other (every
member of a group names the same members), so that a wrong answer fails instead of hanging; last,
an all-reduce over the default group shows it still works. The call runs under a profile hook
(:mod:`ddpcourse.grading.forbidden`) that watches ``torch/distributed/device_mesh.py``:
``init_device_mesh`` builds this very grid in the lesson, so a call that runs that file's code
fails, however it was reached; how the groups are made with ``dist.new_group`` (every rank for
every group, or the members only with ``use_local_synchronization=True``) is the student's
choice, and only what comes back is judged. The judge compares the members with
the grid the contract describes: for the visible cases written out here (:data:`VISIBLE_GRIDS`);
the hidden checks judge their own cases with the grader's reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import device_mesh

from ddpcourse.grading.checks import (Case, CheckFailed, by_rank, cut_text, observed, run_student,
                                      type_name)
from ddpcourse.grading.forbidden import call_watching

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
ROLES = ("dp", "tp")
# init_device_mesh and DeviceMesh: the lesson's way to build the grid, not to run during the call
# (imported above, so the module's own code has run before any call is watched)
MESH_FILE = device_mesh.__file__
MAX_REPORTED_CALLS = 10

# (world_size, tp_size) -> this rank's groups, by rank: the visible cases' answers, written out
# (tests/test_grading_build_2d_groups.py holds them to the hidden reference).
VISIBLE_GRIDS = {
    (4, 2): {"dp": [[0, 2], [1, 3], [0, 2], [1, 3]], "tp": [[0, 1], [0, 1], [2, 3], [2, 3]]},
    (3, 1): {"dp": [[0, 1, 2]] * 3, "tp": [[0], [1], [2]]},
    (3, 3): {"dp": [[0], [1], [2]], "tp": [[0, 1, 2]] * 3},
}


def members_of(group: Any) -> list[int] | str:
    if not isinstance(group, dist.ProcessGroup):
        return f"a {type_name(group)}, not a ProcessGroup"
    try:
        return [int(r) for r in dist.get_process_group_ranks(group)]
    except Exception as exc:  # noqa: BLE001 - what was raised is the finding
        return cut_text(f"a group whose ranks cannot be read ({type(exc).__name__}: {exc})", 300)


def consistent(everyone: list) -> bool:
    """Every rank reported a list of members for each role, holding itself, and every member of
    a group reported the same list for it: all-reducing over these groups cannot wait forever."""
    for rank, mine in enumerate(everyone):
        for role in ROLES:
            members = mine[role]
            if not isinstance(members, list) or rank not in members:
                return False
            if not all(isinstance(m, int) and 0 <= m < len(everyone)
                       and everyone[m][role] == members for m in members):
                return False
    return True


def default_group_sum(world_size: int) -> int | str:
    probe = torch.tensor([dist.get_rank() + 1], dtype=torch.int64)
    try:
        dist.all_reduce(probe)
    except Exception as exc:  # noqa: BLE001 - what was raised is the finding
        return cut_text(f"{type(exc).__name__}: {exc}", 300)
    return int(probe.item())


def observe_groups(rank, world_size, build_2d_groups, tp_size):
    """What the call returned (or raised); each group's members and the ranks a real all-reduce
    over it reached; an all-reduce over the default group afterwards."""
    watched = call_watching(build_2d_groups, (world_size, tp_size), {}, MESH_FILE, quiet=False)
    report: dict[str, Any] = {
        "mesh_calls": [cut_text(name, 200)
                       for name in watched.forbidden_calls[:MAX_REPORTED_CALLS]],
        "hook_removed": bool(watched.hook_removed)}
    result, exc = watched.result, watched.exception
    if exc is not None:
        report.update(raised=type(exc).__name__, value_error=isinstance(exc, ValueError),
                      error=cut_text(f"{type(exc).__name__}: {exc}", 300))
        result = None
    if "raised" not in report:
        if isinstance(result, tuple) and len(result) == 2:
            groups = dict(zip(ROLES, result))
            report["members"] = {role: members_of(group) for role, group in groups.items()}
        else:
            groups = {}
            report["returned"] = f"a {type_name(result)}, not a tuple (dp_group, tp_group)"
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, report.get("members"))
    if all(isinstance(m, dict) for m in everyone) and consistent(everyone):
        reached = {}
        for role in ROLES:
            bits = torch.tensor([1 << rank], dtype=torch.int64)
            dist.all_reduce(bits, group=groups[role])
            reached[role] = [r for r in range(world_size) if int(bits.item()) >> r & 1]
        report["reached"] = reached
    report["default_group_sum"] = default_group_sum(world_size)
    return report


def judge_against(observations: list, world_size: int, tp_size: int,
                  grid: dict[str, list[list[int]]] | None) -> None:
    """Every rank's report against ``grid`` (role -> each rank's members), or, with ``grid``
    None (tp_size does not divide world_size), against the ValueError every rank must raise."""
    what = f"build_2d_groups({world_size}, {tp_size})"
    expected_sum = world_size * (world_size + 1) // 2
    wrong = []
    for rank, report in enumerate(observations):
        try:
            if not isinstance(report, dict):
                raise CheckFailed(f"the rank's report is a {type_name(report)}")
            mesh_calls = observed(report, "mesh_calls", list)
            if mesh_calls:
                names = [cut_text(name, 200) for name in mesh_calls[:MAX_REPORTED_CALLS]]
                raise CheckFailed(
                    f"{what} ran code of torch/distributed/device_mesh.py ({names}): "
                    "init_device_mesh and DeviceMesh build this grid for you (the lesson's way); "
                    "build the groups yourself with dist.new_group")
            if observed(report, "hook_removed", bool):
                raise CheckFailed(f"{what} changed the profile hook (sys.setprofile) that watches "
                                  "for init_device_mesh: leave it alone")
            if grid is None:
                if "raised" not in report:
                    raise CheckFailed(f"{what} returned; {tp_size} does not divide {world_size}, "
                                      "so it must raise ValueError")
                if observed(report, "value_error", bool) is not True:
                    raise CheckFailed(f"{what} raised {observed(report, 'error', str)}; it must "
                                      "raise ValueError")
            elif "raised" in report:
                raise CheckFailed(f"{what} raised {observed(report, 'error', str)}")
            elif "returned" in report:
                raise CheckFailed(f"{what} returned {observed(report, 'returned', str)}")
            else:
                members = observed(report, "members", dict)
                for role in ROLES:
                    got, want = members.get(role), grid[role][rank]
                    if got != want:
                        raise CheckFailed(
                            f"{what}: its {role} group holds "
                            f"{cut_text(got, 200)}, expected "
                            f"ranks {want} ({_layout(world_size, tp_size)})")
                reached = observed(report, "reached", dict)
                for role in ROLES:
                    if reached.get(role) != grid[role][rank]:
                        raise CheckFailed(f"{what}: an all_reduce over its {role} group reached "
                                          f"ranks {cut_text(reached.get(role), 200)}, expected "
                                          f"{grid[role][rank]}")
            total = report.get("default_group_sum")
            if total != expected_sum:
                raise CheckFailed(f"after {what}, an all_reduce over the default group gave "
                                  f"{cut_text(total, 300)} instead of {expected_sum}")
        except CheckFailed as failed:
            wrong.append((rank, str(failed)))
    if wrong:
        raise CheckFailed(by_rank(wrong))


def _layout(world_size: int, tp_size: int) -> str:
    return (f"{world_size // tp_size} tensor-parallel groups of {tp_size} contiguous ranks; "
            f"{tp_size} data-parallel groups of the ranks at the same position in each")


def written_out_grid(world_size: int, tp_size: int) -> dict[str, list[list[int]]]:
    try:
        return VISIBLE_GRIDS[(world_size, tp_size)]
    except KeyError:
        raise LookupError(f"grader bug: no written-out grid for world_size={world_size}, "
                          f"tp_size={tp_size}") from None


def judge_groups(observations, world_size, tp_size):
    judge_against(observations, world_size, tp_size, written_out_grid(world_size, tp_size))


def judge_refusal(observations, world_size, tp_size):
    judge_against(observations, world_size, tp_size, None)


GROUPS = Case(observe_groups, judge_groups)
REFUSAL = Case(observe_groups, judge_refusal)


def _run(case: Case, world_size: int, fn: Callable, tp_size: int) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(case, world_size, fn, tp_size)


def check_two_by_two(build_2d_groups) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(GROUPS, 4, build_2d_groups, 2)


def check_one_dimension(build_2d_groups) -> None:
    """tp_size 1 (data parallel only) and tp_size = world_size (tensor parallel only)."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(GROUPS, 3, build_2d_groups, 1)
    _run(GROUPS, 3, build_2d_groups, 3)


def check_not_a_divisor(build_2d_groups) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    _run(REFUSAL, 3, build_2d_groups, 2)
