"""Length-prefixed messages between the trusted grader and a sandboxed process, pickle-free.

A frame is a JSON header and a byte body. The trusted side never unpickles what a sandbox sends:
headers are JSON, and bodies that hold tensors are written with ``torch.save`` and read back with
``torch.load(weights_only=True)``, which rebuilds only tensors and plain containers. Both sizes
are checked before anything is allocated, so a hostile sender cannot make the reader hold more
than the caps. torch is imported only to read or write tensors: a host that only passes bodies on
(the one-rank hosts of autograder/relayed.py) never pays for it.
"""

from __future__ import annotations

import io
import json
import os
import struct
from typing import Any

_PREFIX = struct.Struct("!II")  # header bytes, body bytes
MAX_HEADER_BYTES = 1 << 20


class FrameError(RuntimeError):
    """The peer closed the channel, or sent something malformed or too large."""


def write_frame(fd: int, header: dict, body: bytes = b"") -> None:
    encoded = json.dumps(header).encode()
    _write_all(fd, _PREFIX.pack(len(encoded), len(body)) + encoded + body)


def read_frame(fd: int, max_body_bytes: int) -> tuple[dict, bytes]:
    header_size, body_size = _PREFIX.unpack(_read_exactly(fd, _PREFIX.size))
    if header_size > MAX_HEADER_BYTES or body_size > max_body_bytes:
        raise FrameError(f"a message of {header_size} + {body_size} bytes is over the limit "
                         f"({MAX_HEADER_BYTES} + {max_body_bytes})")
    try:
        header = json.loads(_read_exactly(fd, header_size))
    except ValueError as exc:
        raise FrameError(f"a malformed header: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("a header that is not a JSON object")
    return header, _read_exactly(fd, body_size)


def tensors_to_bytes(data: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


def tensors_from_bytes(body: bytes) -> Any:
    """Rebuild data written by :func:`tensors_to_bytes`: tensors, numbers, strings, None, lists,
    tuples and dicts only; anything else is refused (FrameError)."""
    import torch

    try:
        return torch.load(io.BytesIO(body), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the loader refuses is malformed
        raise FrameError(f"data that is not plain tensors and containers: "
                         f"{type(exc).__name__}: {str(exc)[:300]}") from None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise FrameError("the channel closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
