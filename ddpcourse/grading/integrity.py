"""Notice when notebook code has replaced what the tests rely on.

nbgrader restores locked and test cells from its database, but cannot stop a student's own cell
from running ``dist.all_reduce = fake`` or ``ddpcourse.launcher.run_ranks = lambda *a: [...]``
before the tests run. :func:`snapshot` is taken by the locked setup cell, before any student
code; every test cell calls :func:`assert_untampered` first, which fails the cell if a protected
function, module or check was replaced. A second, out-of-kernel line of defence is the
autograder's static scan of the submission (``autograder/tamper_scan.py``).
"""

from __future__ import annotations

import builtins
import importlib
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.testing

import ddpcourse.launcher
from ddpcourse.grading.exercises import GRADER_PACKAGES

PROTECTED_MODULES = [
    "torch",
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.testing",
    "ddpcourse.launcher",
    "ddpcourse.grading.integrity",
    "ddpcourse.grading.checks",
    "ddpcourse.grading.comm_audit",
]
COMMUNICATION = [
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce", "broadcast", "reduce",
    "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "all_to_all", "all_to_all_single", "barrier", "get_rank", "get_world_size",
]


def _protected_objects() -> dict[str, object]:
    objects: dict[str, object] = {}
    for name in COMMUNICATION:
        if hasattr(c10d, name):
            objects[f"torch.distributed.{name}"] = getattr(dist, name)
            objects[f"torch.distributed.distributed_c10d.{name}"] = getattr(c10d, name)
    for name in ["equal", "allclose", "isclose", "tensor", "zeros", "ones"]:
        objects[f"torch.{name}"] = getattr(torch, name)
    objects["torch.testing.assert_close"] = torch.testing.assert_close
    objects["ddpcourse.launcher.run_ranks"] = ddpcourse.launcher.run_ranks
    objects["builtins.__import__"] = builtins.__import__
    objects["builtins.isinstance"] = builtins.isinstance
    objects["importlib.import_module"] = importlib.import_module
    for module_name in PROTECTED_MODULES:
        objects[f"sys.modules[{module_name!r}]"] = sys.modules.get(module_name)
    for module_name in list(sys.modules):
        if module_name.startswith(GRADER_PACKAGES):
            module = sys.modules[module_name]
            for attr, value in vars(module).items():
                if isinstance(value, types.FunctionType) and not attr.startswith("__"):
                    objects[f"{module_name}.{attr}"] = value
    return objects


_SNAPSHOT: dict[str, object] | None = None


def snapshot() -> None:
    """Record the protected objects (the setup cell calls this before any student code runs)."""
    global _SNAPSHOT
    if _SNAPSHOT is None:
        _SNAPSHOT = _protected_objects()


class TamperingError(AssertionError):
    """Notebook code replaced something the tests depend on."""


def replaced_objects() -> list[str]:
    if _SNAPSHOT is None:
        return ["the setup cell did not run before the tests"]
    now = _protected_objects()
    return sorted(name for name, obj in _SNAPSHOT.items() if now.get(name) is not obj)


def assert_untampered() -> None:
    """Fail (TamperingError) if anything protected was replaced since :func:`snapshot`."""
    changed = replaced_objects()
    if changed:
        raise TamperingError(
            "the notebook replaced what the tests rely on: " + ", ".join(changed)
            + ". Restore the originals (restart the kernel) and do not reassign library "
            "functions in your cells."
        )
