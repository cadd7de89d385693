"""torch.compile with DDP: the DDP optimizer cuts the graph at bucket boundaries; both orders work.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/compile_with_ddp.py

The problem. DDP overlaps communication with the backward: a gradient bucket is all-reduced as soon
as its last gradient is ready, while the backward carries on with earlier layers. A compiled model
trained through AOTAutograd (the ``aot_eager`` and ``inductor`` backends) runs its whole backward
as *one* autograd node, so every gradient becomes ready at the end, and every all-reduce starts
after the last backward kernel: no overlap. TorchDynamo's DDP optimizer
(``DDPOptimizer`` in torch/_dynamo/backends/distributed.py, on by default:
``torch._dynamo.config.optimize_ddp = True``) therefore splits the forward graph where it expects
DDP's buckets to end (it walks the graph backwards adding up parameter bytes, first bucket 1 MiB,
then ``bucket_cap_mb``) and compiles each piece on its own, so each piece's backward is a node of
its own and DDP's hooks fire between them. It recognises DDP because ``DistributedDataParallel``
records itself as active while it runs the wrapped module (``_inside_ddp_forward``;
torch/_dynamo/convert_frame.py reads ``DistributedDataParallel._get_active_ddp_module()``).

What the script measures on every rank (a small net: four 512x512 tanh layers, 1 MiB of weights
each, and a head; ``bucket_cap_mb=1``; 3 SGD steps on per-rank data) and checks:

* **Subgraphs** (a counting backend: ``torch.compile(backend=callable)`` is the documented way to
  write a backend; each call receives one ``torch.fx.GraphModule``): with the DDP optimizer the
  backend receives several graphs (1, 1, 1 and 2 Linear layers), exactly as
  :func:`predicted_subgraphs` computes from the parameter sizes; without it, one graph of 5.
* **Overlap** (:func:`train_steps`' ``timeline``: a hook before each compiled backward node and a
  comm hook at each all-reduce launch, in the last step): with the DDP optimizer all-reduces are
  launched between compiled backward pieces; without it, all of them after the single one.
* **Both orders** (``model.compile()`` then ``DDP(model)``, the order of the docs page "Where to
  apply torch.compile?", and ``torch.compile(DDP(model))``, the order of the DDP notes' section
  on the DDPOptimizer) give the same subgraphs, and the same gradients and weights as
  eager DDP after 3 steps (bitwise equal here; the check allows float32 rounding, see TOLERANCE).

The backend is ``aot_eager``: AOTAutograd's forward and backward graphs, run without generating
code, which is what the DDP optimizer is about and needs no C++ compiler. ``--backend inductor``
runs the same checks with generated kernels (it compiles C++ on the CPU: slow on a laptop).

Where the lesson's section reads torch 2.13's source:

* "Note [DDPOptimizer]", what the DDP optimizer does and why:
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/_dynamo/backends/distributed.py#L389-L448
* ``optimize_ddp`` and its values: https://github.com/pytorch/pytorch/blob/v2.13.0/torch/_dynamo/config.py#L404-L428
* ``_inside_ddp_forward``, DDP recording itself as the active module:
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1692-L1715
* dynamo asking for the active DDP module when it compiles a frame:
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/_dynamo/convert_frame.py#L2600-L2624
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcourse.dist_env import group_device, process_group
from ddpcourse.report import report_checks

WIDTH = 512  # a 512 x 512 float32 weight is exactly 1 MiB, the DDP optimizer's first bucket cap
DEPTH = 4
CLASSES = 4
BATCH = 8
STEPS = 3
FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (1 MiB)
ORDERS = ("eager", "compile, then DDP", "DDP, then compile")
# float32 rounding allowance: eager and compiled runs may add partial sums in a different order.
# Measured here: 0 (bitwise equal). 1e-6 on weights of size ~0.05 and gradients of ~1e-3 after
# 3 steps is a few hundred float32 ulps, far below what one wrong step changes (lr * grad ~ 1e-4).
TOLERANCE = 1e-6


class BlockNet(nn.Module):
    """``DEPTH`` tanh layers of ``WIDTH`` x ``WIDTH`` and a small head.

    A class of our own on purpose: in torch 2.13 ``nn.Sequential(...).compile()`` captures no
    graph (the frames of torch/nn are on dynamo's skip list; :func:`graphs_captured`)."""

    def __init__(self, width: int = WIDTH, depth: int = DEPTH, classes: int = CLASSES):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def make_net(seed: int = 0) -> BlockNet:
    torch.manual_seed(seed)
    return BlockNet()


def layer_bytes(net: nn.Module) -> list[int]:
    """Parameter bytes of each Linear layer, in forward order."""
    return [sum(p.numel() * p.element_size() for p in m.parameters())
            for m in net.modules() if isinstance(m, nn.Linear)]


def predicted_subgraphs(sizes: list[int], bucket_cap_mb: float) -> list[int]:
    """Linear layers per subgraph, in forward order, by the rule of ``DDPOptimizer.compile_fn``:
    walk the layers from the last one, adding their parameter bytes to the current bucket, and
    start a new bucket once it holds ``FIRST_BUCKET_BYTES`` (the first one) or ``bucket_cap_mb``
    MiB. (The real pass walks graph nodes and may extend a bucket to reach an output; for a chain
    of layers like BlockNet this is the same.)"""
    cap = int(bucket_cap_mb * 1024 * 1024)
    layers, filled = [0], [0]
    for size in reversed(sizes):
        if filled[-1] >= (FIRST_BUCKET_BYTES if len(filled) == 1 else cap):
            layers.append(0)
            filled.append(0)
        layers[-1] += 1
        filled[-1] += size
    return layers[::-1]


class RecordingBackend:
    """A ``torch.compile`` backend that records how many Linear layers each graph it is handed
    holds, then compiles it with ``inner`` (``"eager"``: run the FX graph as it is; ``"aot_eager"``
    or ``"inductor"``: the registered backend of that name). The DDP optimizer calls the backend
    once per piece, so ``linears_per_graph`` lists the pieces in forward order."""

    def __init__(self, inner: str = "aot_eager"):
        self.inner = inner
        self.linears_per_graph: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.linears_per_graph.append(sum(
            1 for node in gm.graph.nodes if node.op == "call_function" and node.target is F.linear))
        if self.inner == "eager":
            return gm.forward
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)




def wrap(net: nn.Module, bucket_cap_mb: float) -> DDP:
    device = group_device()
    return DDP(net, device_ids=[device.index] if device.type == "cuda" else None,
               bucket_cap_mb=bucket_cap_mb)


def build(order: str, bucket_cap_mb: float, backend: str):
    """The model to call, its DDP wrapper, the plain net, and the recording backend (or None)."""
    net = make_net().to(group_device())
    if order == "eager":
        ddp = wrap(net, bucket_cap_mb)
        return ddp, ddp, net, None
    recorder = RecordingBackend(backend)
    if order == "compile, then DDP":  # the docs page "Where to apply torch.compile?"
        net.compile(backend=recorder)
        ddp = wrap(net, bucket_cap_mb)
        return ddp, ddp, net, recorder
    if order == "DDP, then compile":
        ddp = wrap(net, bucket_cap_mb)
        return torch.compile(ddp, backend=recorder), ddp, net, recorder
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    return x.to(group_device()), y.to(group_device())


def compiled_backward_nodes(loss: torch.Tensor) -> list:
    """The autograd nodes behind ``loss`` that run a compiled backward graph (AOTAutograd wraps
    each compiled piece in an autograd.Function, whose node is named CompiledFunctionBackward)."""
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            found.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def train_steps(rank: int, world_size: int, order: str = "compile, then DDP",
                bucket_cap_mb: float = 1, optimize_ddp: bool = True, backend: str = "aot_eager",
                steps: int = STEPS) -> dict:
    """``steps`` SGD steps of the DDP-wrapped net, built in ``order``, with the DDP optimizer on
    or off. Returns the Linear layers of each compiled graph, DDP's buckets in the last step
    (their layers, as a comm hook sees them), the last backward's timeline (``"backward"`` before
    each compiled backward node runs, ``"all-reduce"`` when DDP launches a bucket), and the final
    gradients and weights (flat, on the CPU)."""
    torch._dynamo.reset()  # compiled code of an earlier call must not be reused
    events: list[str] = []
    buckets: list[list[str]] = []
    with torch._dynamo.config.patch(optimize_ddp=optimize_ddp):
        model, ddp, net, recorder = build(order, bucket_cap_mb, backend)
        layer_of = {p.data_ptr(): name.rsplit(".", 1)[0] for name, p in net.named_parameters()}

        def logging_hook(state, bucket):  # no annotation: a string under __future__ annotations
            events.append("all-reduce")
            buckets.append(sorted({layer_of[p.data_ptr()] for p in bucket.parameters()}))
            future = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future()
            return future.then(lambda fut: fut.value()[0])

        ddp.register_comm_hook(None, logging_hook)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(steps):
            x, y = batch(rank, step)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            events.clear()
            buckets.clear()
            for node in compiled_backward_nodes(loss):
                node.register_prehook(lambda grad_outputs: events.append("backward"))
            loss.backward()
            optimizer.step()
    return {
        "subgraphs": recorder.linears_per_graph if recorder else None,
        "buckets": buckets,
        "timeline": list(events),
        "gradients": torch.cat([p.grad.reshape(-1) for p in net.parameters()]).cpu(),
        "weights": torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu(),
    }


def all_reduces_during_backward(timeline: list[str]) -> int:
    """All-reduces launched before the last compiled backward piece starts: work that can overlap
    with the rest of the backward."""
    if "backward" not in timeline:
        return 0
    last = len(timeline) - 1 - timeline[::-1].index("backward")
    return timeline[:last].count("all-reduce")


def graphs_captured(how: str) -> int:
    """How many graphs dynamo hands the backend when a model is compiled ``how``: a torch
    container (``nn.Sequential``) or our own class, through ``.compile()`` or ``torch.compile``.
    No process group needed."""
    torch._dynamo.reset()
    recorder = RecordingBackend("eager")
    container = how.startswith("nn.Sequential")
    model = (nn.Sequential(nn.Linear(4, 4), nn.Tanh()) if container
             else BlockNet(width=4, depth=1, classes=2))
    if how.endswith(".compile()"):
        model.compile(backend=recorder)
    else:
        model = torch.compile(model, backend=recorder)
    model(torch.randn(2, 4))
    return len(recorder.linears_per_graph)


def state_dict_keys(how: str) -> list[str]:
    """The state_dict keys of a compiled one-layer model. ``model.compile()`` compiles in place
    and keeps them; ``torch.compile(model)`` returns an ``OptimizedModule`` that holds the model
    as ``_orig_mod``, so its keys (and a checkpoint saved from it) start with ``_orig_mod.``."""
    model = BlockNet(width=4, depth=1, classes=2)
    if how == ".compile()":
        model.compile(backend="eager")
    elif how == "torch.compile":
        model = torch.compile(model, backend="eager")
    return list(model.state_dict())


def measure(rank: int, world_size: int, backend: str = "aot_eager") -> dict:
    """Everything the script checks, in the current process group (every rank calls this)."""
    runs = {
        "eager": train_steps(rank, world_size, "eager", backend=backend),
        "compile, then DDP": train_steps(rank, world_size, "compile, then DDP", backend=backend),
        "DDP, then compile": train_steps(rank, world_size, "DDP, then compile", backend=backend),
        "compile, then DDP; optimize_ddp=False": train_steps(
            rank, world_size, "compile, then DDP", optimize_ddp=False, backend=backend),
    }
    return {"expected subgraphs": predicted_subgraphs(layer_bytes(make_net()), 1), "runs": runs}


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def problems(result: dict) -> list[str]:
    """What in ``measure``'s result contradicts the lesson."""
    found = []
    runs = result["runs"]
    on, reversed_order = runs["compile, then DDP"], runs["DDP, then compile"]
    off = runs["compile, then DDP; optimize_ddp=False"]
    if on["subgraphs"] != result["expected subgraphs"]:
        found.append(f"DDP optimizer on: subgraphs {on['subgraphs']}, expected "
                     f"{result['expected subgraphs']} Linear layers each")
    if reversed_order["subgraphs"] != on["subgraphs"]:
        found.append(f"DDP, then compile: subgraphs {reversed_order['subgraphs']} differ from "
                     f"compile, then DDP: {on['subgraphs']}")
    if off["subgraphs"] != [sum(result["expected subgraphs"])]:
        found.append(f"DDP optimizer off: subgraphs {off['subgraphs']}, expected one graph")
    if all_reduces_during_backward(on["timeline"]) == 0:
        found.append(f"DDP optimizer on: no all-reduce launched during the backward: "
                     f"{on['timeline']}")
    if all_reduces_during_backward(off["timeline"]) != 0 or off["timeline"].count("backward") != 1:
        found.append(f"DDP optimizer off: expected one compiled backward, then all all-reduces: "
                     f"{off['timeline']}")
    for name, run in runs.items():
        if name == "eager":
            continue
        for what in ("gradients", "weights"):
            gap = max_difference(run[what], runs["eager"][what])
            if gap > TOLERANCE:
                found.append(f"{name}: {what} differ from eager DDP by {gap:.2e} > {TOLERANCE}")
    return found


def replicas_differ(results: list[dict]) -> list[str]:
    """Every rank must end with the same weights in every run (DDP's whole point)."""
    return [f"{name}: rank {rank}'s weights differ from rank 0's"
            for rank, result in enumerate(results[1:], start=1)
            for name, run in result["runs"].items()
            if not torch.equal(run["weights"], results[0]["runs"][name]["weights"])]


def report(result: dict) -> list[str]:
    runs = result["runs"]
    lines = [f"{'run':<40} {'Linear layers per compiled graph':<34} all-reduces during backward"]
    for name, run in runs.items():
        graphs = "not compiled" if run["subgraphs"] is None else str(run["subgraphs"])
        overlap = ("(eager: per layer)" if name == "eager"
                   else str(all_reduces_during_backward(run["timeline"])))
        lines.append(f"{name:<40} {graphs:<34} {overlap}")
    lines.append(f"predicted from parameter sizes (bucket_cap_mb=1): "
                 f"{result['expected subgraphs']}")
    for name in ("compile, then DDP", "compile, then DDP; optimize_ddp=False"):
        lines.append(f"last backward, {name}: {' -> '.join(runs[name]['timeline'])}")
    for name, run in runs.items():
        if name != "eager":
            gap = max(max_difference(run[w], runs["eager"][w]) for w in ("gradients", "weights"))
            lines.append(f"{name}: largest gap to eager DDP (gradients, weights) = {gap:.1e}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    args = parser.parse_args(argv)
    with process_group(timeout_s=120) as ctx:
        result = measure(ctx.rank, ctx.world_size, args.backend)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, result)
        if not ctx.is_main:
            return 0
        for line in report(result):
            print(line)
        found = problems(result) + replicas_differ(gathered)
        for line in found:
            print("PROBLEM:", line)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
