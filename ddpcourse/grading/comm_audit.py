"""Record every communication call a rank makes: which ops, and how many bytes go out and in.

The hand-written all-reduce exercise must use point-to-point calls only and send about
2(N-1)/N of the tensor per rank. Intercepting ``torch.distributed.all_reduce`` by name would miss
``from torch.distributed import all_reduce``, ``dist.all_gather_into_tensor`` and the functional
collectives. Every one of them, and every send and recv, reaches the backend as a ``c10d`` or
``_c10d_functional`` operator of the dispatcher, which a ``TorchDispatchMode`` sees (PyTorch's
documented hook for interposing on operators; tests/test_grading.py checks that each collective is
still caught in the installed torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

POINT_TO_POINT = {"send", "recv_", "recv_any_source_"}


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@dataclass
class CommRecord:
    ops: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    # (op, bytes of its tensor arguments) for every collective, in call order
    collective_calls: list[tuple[str, int]] = field(default_factory=list)
    # With CommAudit(squares=True): for each "allreduce_" call, in call order, the sum of squares
    # of what the rank handed over (its tensors before the reduction), in float64
    all_reduce_squares: list[float] = field(default_factory=list)

    @property
    def collectives(self) -> list[str]:
        return [op for op in self.ops if op not in POINT_TO_POINT]

    def calls_of(self, op: str) -> list[int]:
        """Bytes of each call of one collective (e.g. ``"allreduce_"``), in call order."""
        return [nbytes for name, nbytes in self.collective_calls if name == op]


def _sum_of_squares(value) -> float:
    if isinstance(value, torch.Tensor):
        return value.detach().double().pow(2).sum().item()
    if isinstance(value, (list, tuple)):
        return sum(_sum_of_squares(v) for v in value)
    return 0.0


class CommAudit(TorchDispatchMode):
    """``with CommAudit() as audit: ...`` then read ``audit.record``. ``squares=True`` also
    records what each all-reduce was handed (its sum of squares), so that a judge can tell a
    gradient synchronisation from an all-reduce of the same size that carries something else."""

    def __init__(self, squares: bool = False):
        super().__init__()
        self.record = CommRecord()
        self.squares = squares

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, op = str(func).split(".")[:2]  # e.g. "c10d.allreduce_.default"
        if namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            if op not in ("wait_tensor", "_wrap_tensor_autograd"):
                self.record.ops.append(op)
                if op not in POINT_TO_POINT:
                    self.record.collective_calls.append((op, _tensor_bytes(args[0])))
                if op == "allreduce_" and self.squares:
                    self.record.all_reduce_squares.append(_sum_of_squares(args[0]))
            if op == "send":
                self.record.bytes_sent += _tensor_bytes(args[0])
            elif op in ("recv_", "recv_any_source_"):
                self.record.bytes_received += _tensor_bytes(args[0])
        return func(*args, **(kwargs or {}))
