"""Parameters that get no gradient: the error, how to find them, the fixes in order, their costs.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/unused_parameters.py

DDP waits, in every backward, for a gradient of every parameter it was given. A parameter the loss
does not depend on never gets one, so the bucket that holds it is never all-reduced, and DDP
notices only at the *next* forward ("Expected to have finished reduction in the prior
iteration..."), raised from ``DistributedDataParallel._pre_forward`` at the line that calls the
model, not where the parameter went unused. Each claim is a function that returns plain data (the
lesson calls them through ``run_ranks``); :func:`problems` lists what contradicts the lesson and
the script exits non-zero if anything does. Shown on 2 ranks with gloo:

* the error, the step and the line it is raised at; that the first step's gradients were silently
  not averaged; ``TORCH_DISTRIBUTED_DEBUG=INFO`` naming the parameters, and how to switch it on
  in a process that has already imported torch (``dist.set_debug_level``);
* the fixes in the order to try them: remove or freeze the parameter (before wrapping), use every
  output in the loss, ``static_graph=True``, and only then ``find_unused_parameters=True``;
* what ``find_unused_parameters=True`` costs, counted: the autograd nodes its search visits every
  iteration, one more all-reduce per iteration, and buckets that are never rebuilt;
* when its "did not find any unused parameters" warning appears (once, at the first iteration
  with none unused, even when a later iteration needs the flag);
* the source article's two workarounds (a reentrant ``checkpoint`` around the unused part, a dummy
  ``all_reduce`` at the end of ``forward``) leave the error as it was, and a reentrant
  ``checkpoint`` with ``find_unused_parameters=True`` fails with "Expected to mark a variable
  ready only once" (fixed by ``use_reentrant=False`` or ``static_graph=True``).

DDP's errors here are raised on every rank alike; every DDP runs on a gloo group with a short
timeout all the same (``short_timeout_group(..., "gloo")``), so a rank that fails alone cannot
leave another waiting.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from ddpcourse.dist_env import process_group, short_timeout_group
from ddpcourse.report import report_checks

GROUP_TIMEOUT_S = 10.0  # no demo here waits for a peer; this only bounds a surprise
PRIOR_REDUCTION = "Expected to have finished reduction in the prior iteration"
MARKED_TWICE = "Expected to mark a variable ready only once"
NO_UNUSED_WARNING = "did not find any unused parameters in the forward pass"



# What the aux head (a second output layer) does in forward, one choice per experiment.
AUX_MODES = (
    "unused",          # defined in __init__, never called: the bug
    "removed",         # fix 1a: not defined at all
    "frozen",          # fix 1b: requires_grad_(False) before wrapping
    "returned",        # forward returns (main, aux); the loss decides whether aux is used
    "no_grad",         # called under torch.no_grad() (the article says this is excluded: no)
    "checkpoint",      # the article's workaround 1: reentrant checkpoint around it
    "dummy all_reduce",  # the article's workaround 2: a collective at the end of forward
    "every other step",  # control flow: used on even steps only
)


class Net(nn.Module):
    """body -> block -> head, plus an aux head whose use is the experiment (see AUX_MODES).
    ``block`` can run under activation checkpointing (``"reentrant"`` / ``"non-reentrant"``)."""

    def __init__(self, aux: str = "unused", block: str = "plain"):
        super().__init__()
        self.aux_mode, self.block_mode = aux, block
        self.body = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        if aux != "removed":
            self.aux = nn.Linear(16, 1)
        if aux == "frozen":
            self.aux.requires_grad_(False)
        self.calls = 0
        self.sync_group = None  # the group of the dummy all_reduce (None: the default group)

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.body(x))
        if self.block_mode == "plain":
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.block_mode == "reentrant")
        main = self.head(h)
        self.calls += 1
        mode = self.aux_mode
        if mode == "returned":
            return main, self.aux(h)
        if mode == "no_grad":
            with torch.no_grad():
                self.aux(h)
        elif mode == "checkpoint":
            checkpoint(self.aux, h, use_reentrant=True)
        elif mode == "dummy all_reduce":
            dist.all_reduce(torch.zeros(1), group=self.sync_group)
        elif mode == "every other step" and self.calls % 2 == 1:
            main = main + self.aux(h)
        return main


def loss_of(output, loss_uses: str) -> torch.Tensor:
    if isinstance(output, tuple):
        main, aux = output
        return main.pow(2).mean() + (aux.pow(2).mean() if loss_uses == "every output" else 0)
    return output.pow(2).mean()


@contextlib.contextmanager
def debug_level(how: str):
    """Switch DDP's debug level to INFO for the block, one of four ways:
    ``"off"``; ``"environ only"`` (set ``TORCH_DISTRIBUTED_DEBUG`` in a process that has already
    imported torch: read at import, so no effect); ``"environ + set_debug_level_from_env"``;
    ``"set_debug_level"`` (``dist.set_debug_level(dist.DebugLevel.INFO)``). Restored afterwards."""
    saved_level, saved_env = dist.get_debug_level(), os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    if how in ("environ only", "environ + set_debug_level_from_env"):
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
    if how == "environ + set_debug_level_from_env":
        dist.set_debug_level_from_env()
    elif how == "set_debug_level":
        dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        yield
    finally:
        dist.set_debug_level(saved_level)
        if saved_env is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = saved_env


@contextlib.contextmanager
def captured_stderr():
    """What this process writes to file descriptor 2 during the block, C++ included (DDP's
    warnings come from C++ and never reach Python's ``warnings``). Yields a list that holds the
    text once the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    text: list[str] = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))


def grads_equal_across_ranks(model: nn.Module, group) -> bool:
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return all(torch.equal(gathered[0], g) for g in gathered[1:])


def error_kind(message: str) -> str:
    for kind in (PRIOR_REDUCTION, MARKED_TWICE):
        if kind in message:
            return kind
    return message.splitlines()[0]


def train(rank: int, world_size: int, aux: str = "unused", block: str = "plain",
          loss_uses: str = "main", steps: int = 3, debug: str = "off", anomaly: bool = False,
          freeze_after_wrapping: bool = False, **ddp_kwargs) -> dict:
    """Train ``steps`` steps of ``Net(aux, block)`` under DDP (``ddp_kwargs``), different data on
    each rank. Returns: ``ok``; the error's kind, the step and the line of this function it was
    raised at, and the torch functions it went through; the parameter names and indices the
    message gives; whether the gradients were equal on every rank after each finished step; and
    which parameters ended with no gradient at all."""
    group = short_timeout_group(GROUP_TIMEOUT_S, "gloo")
    torch.manual_seed(0)
    model = Net(aux, block)
    model.sync_group = group
    with debug_level(debug):
        ddp = DDP(model, process_group=group, **ddp_kwargs)
    if freeze_after_wrapping:
        model.aux.requires_grad_(False)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    result = {"ok": True, "error": None, "step": None, "line": None, "torch frames": None,
              "named": None, "indices": None, "synced": [], "no grad": None}
    step = 0
    try:
        with torch.autograd.set_detect_anomaly(anomaly):
            for step in range(steps):
                optimizer.zero_grad()
                x = torch.randn(4, 8, generator=generator)
                loss = loss_of(ddp(x), loss_uses)  # the line the error points at
                loss.backward()
                result["synced"].append(grads_equal_across_ranks(model, group))
                optimizer.step()
    except RuntimeError as error:
        message = str(error)
        frames = traceback.extract_tb(error.__traceback__)
        mine = [f for f in frames if f.name == "train" and f.filename == __file__][-1]
        named = re.search(r"Parameters which did not receive grad for rank \d+: (.*)", message)
        indices = re.search(r"Parameter indices which did not receive grad for rank \d+: (.*)",
                            message)
        twice = re.search(r"with name (\S+) has been marked as ready twice", message)
        if twice:
            named = twice
        result.update(ok=False, error=error_kind(message), step=step, line=mine.line,
                      named=sorted(named.group(1).strip().split(", ")) if named else None,
                      indices=[int(i) for i in indices.group(1).split()] if indices else None)
        result["torch frames"] = [f.name for f in frames if "torch" in f.filename][-2:]
    result["no grad"] = [n for n, p in model.named_parameters() if p.grad is None]
    return result


# --- what find_unused_parameters=True costs ---------------------------------------------------

def nodes_searched(outputs) -> int:
    """How many autograd nodes DDP's search for unused parameters visits for these outputs.

    The same walk as ``Reducer::search_unused_parameters`` (torch/csrc/distributed/c10d/
    reducer.cpp): start at each output's ``grad_fn`` and follow ``next_functions`` until every
    reachable node was seen; a parameter whose gradient accumulator was not seen is unused."""
    queue = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = set(queue)
    while queue:
        node = queue.pop()
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                queue.append(next_node)
    return len(seen)


def mlp(depth: int, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
    return nn.Sequential(*layers)


def search_sizes(depths=(1, 2, 4, 8, 16, 32), batches=(1, 64)) -> list[dict]:
    """Nodes the search visits per iteration for MLPs of several depths and batch sizes
    (single process: the graph of the wrapped module's output is what DDP searches)."""
    rows = []
    for depth in depths:
        model = mlp(depth)
        row = {"depth": depth, "parameters": sum(1 for _ in model.parameters())}
        for batch in batches:
            row[f"nodes, batch {batch}"] = nodes_searched([model(torch.randn(batch, 32))])
        rows.append(row)
    return rows


FIXES = {  # name -> train() keyword arguments; the order is the order to try them in
    "remove the layer": {"aux": "removed"},
    "freeze it before wrapping": {"aux": "frozen"},
    "use every output in the loss": {"aux": "returned", "loss_uses": "every output"},
    "static_graph=True": {"aux": "unused", "static_graph": True},
    "find_unused_parameters=True": {"aux": "unused", "find_unused_parameters": True},
}


def work_per_iteration(rank: int, world_size: int, fix: str, warmup: int = 2,
                       iterations: int = 3) -> dict:
    """Profile ``iterations`` steps after ``warmup`` of ``Net`` fixed by ``FIXES[fix]``: how many
    all-reduces and graph searches per iteration (torch.profiler's CPU events), and whether the
    buckets were rebuilt after the first iteration (``DDP._has_rebuilt_buckets``, a private flag:
    nothing public tells it)."""
    kwargs = dict(FIXES[fix])
    aux, loss_uses = kwargs.pop("aux"), kwargs.pop("loss_uses", "main")
    group = short_timeout_group(GROUP_TIMEOUT_S, "gloo")
    torch.manual_seed(0)
    ddp = DDP(Net(aux), process_group=group, **kwargs)

    def step():
        loss_of(ddp(torch.randn(4, 8)), loss_uses).backward()

    with captured_stderr():  # the profiler's start/stop lines and the flag's warning
        for _ in range(warmup):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(iterations):
                step()
    names = Counter(event.name for event in prof.events())
    return {"all_reduce per iteration": names["c10d::allreduce_"] / iterations,
            "graph searches per iteration":
                names["torch.distributed.ddp.reducer::search_unused_parameters"] / iterations,
            "buckets rebuilt": ddp._has_rebuilt_buckets}


WARNING_CASES = {  # name -> (aux mode, what the loss uses), in the order they run
    "aux never used": ("unused", "main"),
    "aux used on even steps": ("every other step", "main"),
    "every parameter used, a second model": ("returned", "every output"),
}


def unused_warning(rank: int, world_size: int, steps: int = 4) -> dict[str, list[bool]]:
    """With ``find_unused_parameters=True``: in which steps does DDP print its "did not find any
    unused parameters" warning? One new DDP model per case of WARNING_CASES, in that order, in
    this process. The warning is a C++ ``TORCH_WARN_ONCE``: once per process, whatever the
    model, so this must run before anything else in the process used the flag."""
    printed = {}
    for case, (aux, loss_uses) in WARNING_CASES.items():
        group = short_timeout_group(GROUP_TIMEOUT_S, "gloo")
        torch.manual_seed(0)
        ddp = DDP(Net(aux), process_group=group, find_unused_parameters=True)
        printed[case] = []
        for _ in range(steps):
            with captured_stderr() as text:
                loss_of(ddp(torch.randn(4, 8)), loss_uses).backward()
            printed[case].append(NO_UNUSED_WARNING in text[0])
    return printed


# --- everything, and the check -------------------------------------------------------------

EXPERIMENTS = {  # name -> train() keyword arguments
    "unused aux head": {"aux": "unused"},
    "debug: environ only": {"aux": "unused", "debug": "environ only"},
    "debug: environ + set_debug_level_from_env": {"aux": "unused",
                                                  "debug": "environ + set_debug_level_from_env"},
    "debug: set_debug_level": {"aux": "unused", "debug": "set_debug_level"},
    "anomaly detection": {"aux": "unused", "anomaly": True},
    "aux returned, loss uses main only": {"aux": "returned"},
    "aux under torch.no_grad()": {"aux": "no_grad"},
    "frozen after wrapping": {"aux": "unused", "freeze_after_wrapping": True},
    **FIXES,
    "static_graph=True, aux every other step": {"aux": "every other step", "static_graph": True},
    "find_unused_parameters=True, aux every other step": {"aux": "every other step",
                                                          "find_unused_parameters": True},
    "article 1: reentrant checkpoint around aux": {"aux": "checkpoint"},
    "article 2: dummy all_reduce in forward": {"aux": "dummy all_reduce"},
    "reentrant checkpoint + find_unused_parameters=True": {
        "block": "reentrant", "find_unused_parameters": True},
    "non-reentrant checkpoint + find_unused_parameters=True": {
        "block": "non-reentrant", "find_unused_parameters": True},
    "reentrant checkpoint + static_graph=True": {"block": "reentrant", "static_graph": True},
}


def run_experiments(rank: int, world_size: int, names) -> dict:
    """``train`` for each experiment of EXPERIMENTS named in ``names``, in one process."""
    return {name: train(rank, world_size, **EXPERIMENTS[name]) for name in names}


def costs(rank: int, world_size: int, fixes=tuple(FIXES)) -> dict:
    """``work_per_iteration`` for each of ``fixes``, in one process."""
    return {fix: work_per_iteration(rank, world_size, fix) for fix in fixes}


def run_all(rank: int, world_size: int) -> dict:
    """Every experiment in this rank (what :func:`problems` reads)."""
    return {
        "warning": unused_warning(rank, world_size),  # first: it is printed once per process
        "train": run_experiments(rank, world_size, EXPERIMENTS),
        "work": costs(rank, world_size),
        "search sizes": search_sizes(),
    }


def problems(results: dict) -> list[str]:
    """What ``results`` (rank 0's :func:`run_all`) contradicts in the lesson."""
    found = []
    t = results["train"]

    def expect(condition: bool, claim: str) -> None:
        if not condition:
            found.append(claim)

    bug = t["unused aux head"]
    expect(bug["error"] == PRIOR_REDUCTION and bug["step"] == 1,
           "an unused parameter should fail at the second step's forward")
    expect(bug["line"] is not None and "ddp(x)" in bug["line"]
           and bug["torch frames"] == ["forward", "_pre_forward"],
           "the error should be raised at the line that calls the model, in _pre_forward")
    expect(bug["synced"] == [False], "the first step's gradients should not have been averaged")
    expect(bug["named"] is None and bug["indices"] == [6, 7],
           "without debug the message should give only indices (aux is parameters 6 and 7)")
    for how in ("environ + set_debug_level_from_env", "set_debug_level"):
        expect(t[f"debug: {how}"]["named"] == ["aux.bias", "aux.weight"],
               f"debug via {how} should name aux.weight and aux.bias")
    expect(t["debug: environ only"]["named"] is None,
           "TORCH_DISTRIBUTED_DEBUG set after torch was imported should change nothing")
    expect(t["anomaly detection"]["named"] is None,
           "anomaly detection should not name the parameters")
    for name in ("aux returned, loss uses main only", "aux under torch.no_grad()",
                 "frozen after wrapping", "article 1: reentrant checkpoint around aux",
                 "article 2: dummy all_reduce in forward",
                 "static_graph=True, aux every other step"):
        expect(t[name]["error"] == PRIOR_REDUCTION, f"{name}: should fail as the bug does")
    for name in FIXES:
        expect(t[name]["ok"] and all(t[name]["synced"]), f"{name}: should train, synchronised")
    for name in ("static_graph=True", "find_unused_parameters=True"):
        expect(t[name]["no grad"] == ["aux.weight", "aux.bias"],
               f"{name}: a parameter unused on every rank should keep grad None")
    expect(t["find_unused_parameters=True, aux every other step"]["ok"],
           "find_unused_parameters=True should handle control flow")
    twice = t["reentrant checkpoint + find_unused_parameters=True"]
    expect(twice["error"] == MARKED_TWICE and twice["step"] == 0,
           "reentrant checkpoint + find_unused_parameters should fail in the first backward")
    expect(twice["named"] == ["block.bias"],
           "the message should name the parameter marked ready twice, debug level or not")
    for name in ("non-reentrant checkpoint + find_unused_parameters=True",
                 "reentrant checkpoint + static_graph=True"):
        expect(t[name]["ok"] and all(t[name]["synced"]), f"{name}: should train")
    work = results["work"]
    for fix, w in work.items():
        searching = fix == "find_unused_parameters=True"
        expect(w["graph searches per iteration"] == (1 if searching else 0),
               f"{fix}: graph searches per iteration")
        expect(w["all_reduce per iteration"] == (2 if searching else 1),
               f"{fix}: all-reduces per iteration")
        expect(w["buckets rebuilt"] == (not searching), f"{fix}: bucket rebuild")
    warning = results["warning"]
    expect(warning == {"aux never used": [False] * 4,
                       "aux used on even steps": [True, False, False, False],
                       "every parameter used, a second model": [False] * 4},
           "the warning should appear once per process, at the first step with no unused "
           "parameter, even where the flag is needed")
    sizes = results["search sizes"]
    expect(all(r["nodes, batch 1"] == r["nodes, batch 64"] for r in sizes),
           "the search should visit as many nodes whatever the batch size")
    expect(sizes[-1]["nodes, batch 1"] > 16 * sizes[0]["nodes, batch 1"],
           "the search should grow with the depth of the graph")
    return found


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        results = run_all(ctx.rank, ctx.world_size)
        if not ctx.is_main:
            return 0
        for name, r in results["train"].items():
            if r["ok"]:
                print(f"{name}: trains; gradients equal on every rank: {r['synced']}; "
                      f"no gradient: {r['no grad']}")
            else:
                named = f"; named: {r['named']}" if r["named"] else ""
                print(f"{name}: {r['error']!r} at step {r['step']}, line {r['line']!r} "
                      f"({' -> '.join(r['torch frames'])}){named}")
        for fix, w in results["work"].items():
            print(f"{fix}: {w}")
        print("'did not find any unused parameters' printed at steps:", results["warning"])
        print("nodes the search visits per iteration:", results["search sizes"])
        found = problems(results)
        return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
