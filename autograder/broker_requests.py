"""What a rank may ask the relay broker, checked field by field, and what a collective answers.

The broker (:mod:`autograder.broker`) reads frames and routes; this module decides, without any
I/O, whether a request is well-formed (:class:`Violation` if not: the rank is cut off) and
computes a collective's replies once every rank has called it. Nothing here trusts the rank:
headers are JSON checked key by key, tensors are raw bytes of known dtypes and bounded shapes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from ddpcourse.grading.relay import DTYPES, MAX_DIMS, MAX_TENSORS, REDUCE_OPS, spec_nbytes, tensors_from

ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
INT32 = 2**31


class Violation(Exception):
    """A rank broke the protocol; the message says how, for the log and the other ranks."""


@dataclass
class Request:
    rank: int
    id: int
    op: str
    payload: bytearray
    tensors: list[dict]
    expect: list[dict]
    entry: dict
    deadline: float
    src: int | None = None  # a recv's source; None: any
    held: bool = False
    signature: tuple = ()
    seq: int | None = None

    @property
    def dtype(self) -> str | None:
        specs = self.tensors or self.expect
        return specs[0]["dtype"] if specs else None

def shape_text(item: dict) -> str:
    return f"{item['dtype']}[{', '.join(map(str, item['shape']))}]"

def parse_header(data: bytearray) -> dict:
    try:
        header = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Violation("sent a message header that is not JSON") from None
    if not isinstance(header, dict):
        raise Violation("sent a message header that is not a JSON object")
    return header

def int_field(header: dict, key: str, low: int, high: int, none_ok: bool = False) -> int | None:
    value = header.get(key)
    if value is None and none_ok:
        return None
    if type(value) is not int or not low <= value < high:
        raise Violation(f"sent a bad {key!r}: {str(value)[:40]!r} "
                         f"(expected an integer in [{low}, {high}))")
    return value

def tensor_specs(header: dict, key: str, max_message_bytes: int) -> list[dict]:
    items = header.get(key, [])
    if not isinstance(items, list) or len(items) > MAX_TENSORS:
        raise Violation(f"sent a bad {key!r} list")
    specs = []
    for item in items:
        if not isinstance(item, dict) or item.get("dtype") not in DTYPES:
            raise Violation(f"sent a tensor of an unknown dtype in {key!r}")
        shape = item.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or any(type(d) is not int or not 0 <= d < 2**40 for d in shape)):
            raise Violation(f"sent a bad tensor shape in {key!r}")
        if spec_nbytes(item) > max_message_bytes:
            raise Violation(f"named a tensor larger than {max_message_bytes} bytes")
        specs.append({"dtype": item["dtype"], "shape": list(shape)})
    return specs

def nbytes(specs: list[dict]) -> int:
    return sum(spec_nbytes(s) for s in specs)

def check_send(req: Request, header: dict, world_size: int) -> None:
    dst = int_field(header, "dst", 0, world_size)
    tag = int_field(header, "tag", -INT32, INT32)
    if len(req.tensors) != 1 or req.expect:
        raise Violation("sent a send request without exactly one tensor")
    req.entry.update(peer=dst, tag=tag)

def check_recv(req: Request, header: dict, world_size: int) -> None:
    req.src = src = int_field(header, "src", 0, world_size, none_ok=True)
    tag = int_field(header, "tag", -INT32, INT32)
    if req.tensors or len(req.expect) != 1:
        raise Violation("sent a recv request without exactly one expected tensor")
    req.entry.update(peer=src, tag=tag)

def check_collective(req: Request, header: dict, world_size: int) -> None:
    op, ws = req.op, world_size
    root = int_field(header, "root", 0, ws) if op in ROOTED else None
    reduce_op = header.get("reduce_op") if op in REDUCING else None
    if op in REDUCING and reduce_op not in REDUCE_OPS:
        raise Violation(f"asked for an unknown reduce op {str(reduce_op)[:20]!r}")
    is_root = root == req.rank
    n_up, n_exp = len(req.tensors), len(req.expect)
    counts = {
        "all_reduce": n_up >= 1 and n_exp == 0,
        "broadcast": (n_up, n_exp) == ((1, 0) if is_root else (0, 1)),
        "all_gather": (n_up, n_exp) == (1, 0),
        "reduce_scatter": (n_up, n_exp) == (ws, 0),
        "reduce": (n_up, n_exp) == (1, 0),
        "gather": (n_up, n_exp) == (1, 0),
        "scatter": (n_up, n_exp) == ((ws, 0) if is_root else (0, 1)),
        "all_to_all": (n_up, n_exp) == (ws, ws),
        "barrier": (n_up, n_exp) == (0, 0),
    }[op]
    if not counts:
        raise Violation(f"sent a {op} request with {n_up} tensors and {n_exp} expected")
    specs = req.tensors or req.expect
    if op in ("reduce_scatter", "scatter") and any(s != specs[0] for s in specs):
        raise Violation(f"sent {op} chunks of different shapes")
    shapes = ([tuple(s["shape"]) for s in req.tensors] if op == "all_reduce"
              else [] if op in ("all_to_all", "barrier") else [tuple(specs[0]["shape"])])
    req.signature = (op, root, reduce_op, req.dtype, tuple(shapes))
    req.entry.update(root=root, reduce_op=reduce_op)

def wait_cycle(waits_for: dict[int, int]) -> list[int] | None:
    """Ranks that wait for one another in a circle, in the order they wait (each for the next,
    the last for the first), given ``waits_for`` (rank -> the one peer it is blocked on); None
    if there is no circle. Each rank waits for one peer at most, so following the arrows from
    every rank finds every circle."""
    for start in sorted(waits_for):
        path: list[int] = []
        rank: int | None = start
        while rank is not None and rank not in path:
            path.append(rank)
            rank = waits_for.get(rank)
        if rank is not None:
            return path[path.index(rank):]
    return None


def blocked_call(req: Request) -> str:
    """A blocked point-to-point call in words: "send to rank 1 (tag 0, float32[4])"."""
    spec = (req.tensors or req.expect)[0]
    if req.op == "send":
        return f"send to rank {req.entry['peer']} (tag {req.entry['tag']}, {shape_text(spec)})"
    source = f"rank {req.src}" if req.src is not None else "any rank"
    return f"recv from {source} (tag {req.entry['tag']}, {shape_text(spec)})"


def describe(req: Request) -> str:
    op, root, reduce_op, dtype, shapes = req.signature
    parts = [f"{dtype}[{', '.join(map(str, s))}]" for s in shapes]
    if op == "all_to_all":
        parts.append(str(req.dtype))
    if reduce_op:
        parts.append(f"op={reduce_op}")
    if root is not None:
        parts.append(f"root={root}")
    return f"{op}({', '.join(parts)})"

def collective_replies(reqs: list[Request], world_size: int) -> list[tuple[Request, list, list]]:
    """The reply to every rank of one collective, once all have called it (in rank order):
    (request, specs of the tensors sent back, their payloads). ValueError if they cannot agree."""
    replies = []

    def reply(req: Request, specs: list, parts: list) -> None:
        replies.append((req, specs, parts))

    first = reqs[0]
    op, root, reduce_op = first.op, first.signature[1], first.signature[2]
    ws = world_size
    inputs = [tensors_from(r.payload, r.tensors) for r in reqs]
    if op == "barrier":
        for r in reqs:
            reply(r, [], [])
    elif op == "all_reduce":
        results = [reduce([inputs[r][i] for r in range(ws)], reduce_op)
                   for i in range(len(first.tensors))]
        for r in reqs:
            reply(r, first.tensors, results)
    elif op == "reduce":
        result = reduce([inputs[r][0] for r in range(ws)], reduce_op)
        for r in reqs:
            reply(r, r.tensors if r.rank == root else [],
                        [result] if r.rank == root else [])
    elif op == "reduce_scatter":
        for r in reqs:
            result = reduce([inputs[s][r.rank] for s in range(ws)], reduce_op)
            reply(r, [first.tensors[0]], [result])
    elif op == "broadcast":
        source = reqs[root]
        for r in reqs:
            reply(r, [] if r is source else source.tensors,
                        [] if r is source else [source.payload])
    elif op == "all_gather":
        for r in reqs:
            reply(r, [s.tensors[0] for s in reqs], [s.payload for s in reqs])
    elif op == "gather":
        for r in reqs:
            mine = r.rank == root
            reply(r, [s.tensors[0] for s in reqs] if mine else [],
                        [s.payload for s in reqs] if mine else [])
    elif op == "scatter":
        chunks = inputs[root]
        for r in reqs:
            reply(r, [reqs[root].tensors[r.rank]], [chunks[r.rank]])
    elif op == "all_to_all":
        for r in reqs:
            for s in reqs:
                sent, wanted = s.tensors[r.rank], r.expect[s.rank]
                if math.prod(sent["shape"]) != math.prod(wanted["shape"]):
                    raise ValueError(f"rank {s.rank} sends {shape_text(sent)} to rank "
                                     f"{r.rank}, which expects {shape_text(wanted)}")
        for r in reqs:
            reply(r, r.expect, [inputs[s][r.rank] for s in range(ws)])
    return replies


def reduce(tensors: list[torch.Tensor], reduce_op: str) -> torch.Tensor:
    floating = tensors[0].is_floating_point()
    if reduce_op == "avg" and not floating:
        raise ValueError("AVG needs floating-point tensors")
    if reduce_op in ("band", "bor", "bxor") and floating:
        raise ValueError(f"{reduce_op.upper()} needs integer tensors")
    combine = {"sum": torch.add, "avg": torch.add, "product": torch.mul,
               "min": torch.minimum, "max": torch.maximum, "band": torch.bitwise_and,
               "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[reduce_op]
    result = tensors[0].clone()
    for tensor in tensors[1:]:  # rank order, so the result never depends on arrival order
        result = combine(result, tensor)
    if reduce_op == "avg":
        result = result / len(tensors)
    return result.to(tensors[0].dtype)
