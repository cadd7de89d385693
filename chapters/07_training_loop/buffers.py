"""Buffers under DDP: rank 0's copy wins, at construction and in the forwards that sync them;
BatchNorm statistics; SyncBatchNorm.

    torchrun --standalone --nproc_per_node 2 chapters/07_training_loop/buffers.py

DDP all-reduces *gradients*; it never averages *buffers* (tensors registered with
``register_buffer``: BatchNorm's ``running_mean``/``running_var``/``num_batches_tracked``, EMA
statistics, counters). With the default settings it *broadcasts* them from rank 0, twice over:

* once in the constructor, with the parameters (``DistributedDataParallel.__init__`` calls
  ``_sync_module_states`` in torch/distributed/utils.py);
* at the start of a forward (``_pre_forward`` -> ``_sync_buffers`` ->
  ``_sync_module_buffers`` -> ``_default_broadcast_coalesced``, authoritative rank 0), both in
  torch/nn/parallel/distributed.py, but only when ``will_sync_module_buffers()`` holds: the
  model had buffers at construction, ``forward_sync_buffers`` is on, and
  ``require_forward_param_sync`` is set. That flag is set by the constructor and by
  ``_post_forward`` after a forward with gradients enabled outside ``no_sync()``, and cleared
  by ``_post_forward`` after any other forward. So a forward broadcasts when the *previous*
  forward through the wrapper ran with gradients enabled outside ``no_sync()`` (in ``train()``
  or ``eval()`` mode alike): the first ``no_grad`` forward of
  an evaluation broadcasts, the next ones do not, nor does the first training forward after
  them; under ``no_sync`` accumulation only the first micro-batch of each window does.

Those functions in torch 2.13's source (the lesson names them without links):

* ``_sync_module_states``: https://github.com/pytorch/pytorch/blob/v2.13.0/torch/distributed/utils.py#L289-L315
* the constructor's sync, guarded by ``init_sync``:
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1062-L1073
* ``_pre_forward``: https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1744-L1782
* ``_sync_buffers``: https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L2405-L2450
* ``will_sync_module_buffers``: https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L2382-L2387
* ``_post_forward`` setting and clearing ``require_forward_param_sync``:
  https://github.com/pytorch/pytorch/blob/v2.13.0/torch/nn/parallel/distributed.py#L1828-L1841

What each function here shows (each runs in every rank of a process group, e.g. via
``run_ranks``, and returns plain data; the ``check_*`` functions return what contradicts the
lesson):

* :func:`buffer_at_forward`: a rank's own buffer value is replaced by rank 0's when the next
  forward starts. ``broadcast_buffers=False`` (deprecated in torch 2.13) skips that *and* the
  constructor's broadcast of buffers; its replacement ``forward_sync_buffers=False`` skips only
  the forward's (``DistributedDataParallel.__init__``: ``init_sync_buffers``).
* :func:`broadcasts_per_forward`: that rule, counted: the ``gloo:broadcast`` events
  (torch.profiler) of each forward through training, evaluation and accumulation. A sync of a
  BatchNorm's buffers is two broadcasts: ``dist._broadcast_coalesced`` flattens the buffers into
  one broadcast per dtype, here the float32 statistics and the int64 ``num_batches_tracked``
  (measured: any number of float32 buffers, one broadcast; float32 and int64, two).
* :func:`reassignment`: what DDP holds on to. Buffers are looked up again by name at every sync
  (``_assign_modules_buffers``, called in ``_sync_buffers``), so ``module.buf = new_tensor`` is
  synced like ``buf.copy_()``; a tensor attribute that is not a registered buffer is never
  synced; a buffer registered after wrapping a model that had none is never synced
  (``will_sync_module_buffers`` needs one at construction); a *parameter* replaced after
  wrapping is not in the reducer, so its gradient is never all-reduced.
* :func:`running_stats`: BatchNorm running statistics under DDP are rank 0's alone (default), or
  each rank's own (``forward_sync_buffers=False``); averaging those gives the global running
  *mean* exactly but not the global running *variance*.
* :func:`syncbatchnorm_on_cpu`: where SyncBatchNorm fails on CPU, with the exact errors.
* :func:`batchnorm_over_ranks`: BatchNorm normalises with the rank's own batch; SyncBatchNorm
  (GPU only, NCCL, one GPU per rank) with the global batch, equal to one process's BatchNorm on
  the whole batch.

Rank 0 prints the results and exits with code 1 if any check fails. The SyncBatchNorm GPU part
prints a "skipped" line unless every rank has its own GPU. The other demos run on the CPU, on
GPU machines too (in a gloo group beside the NCCL one, :func:`cpu_group`): what they show does
not depend on the device.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from ddpcourse.dist_env import cpu_group, process_group
from ddpcourse.report import report_checks

SYNC_MODES = {
    "default": {},
    "broadcast_buffers=False": {"broadcast_buffers": False},
    "forward_sync_buffers=False": {"forward_sync_buffers": False},
}
TOLERANCE = 1e-5


class Shifted(nn.Module):
    """``weight * x + offset``, where ``offset`` is a buffer; remembers the offset its last
    forward used (``seen``)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.register_buffer("offset", torch.zeros(1))
        self.seen: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.offset.item()
        return self.weight * x + self.offset


def _silently(make):
    """Call ``make()``; return its result and the warnings it raised (as text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = make()
    return result, [f"{w.category.__name__}: {str(w.message).split('. ')[0]}" for w in caught]


def buffer_at_forward(rank: int, world_size: int, mode: str = "default") -> dict:
    """Each rank gives the buffer its own value, before wrapping and again before a forward.

    Returns the offset after ``DDP(...)``, the weight after ``DDP(...)``, the offset the forward
    used, the offset after it, and the constructor's warnings.
    """
    module = Shifted()
    with torch.no_grad():
        module.offset.fill_(rank + 1.0)
        module.weight.fill_(rank + 1.0)
    model, caught = _silently(lambda: DDP(module, process_group=cpu_group(), **SYNC_MODES[mode]))
    result = {"offset after DDP()": module.offset.item(),
              "weight after DDP()": module.weight.item()}
    with torch.no_grad():
        module.offset.fill_(10.0 * (rank + 1))
    model(torch.ones(1)).sum().backward()
    result.update({"own offset set": 10.0 * (rank + 1), "offset the forward used": module.seen,
                   "offset after forward": module.offset.item(), "warnings": caught})
    return result


def check_buffer_at_forward(mode: str, per_rank: list[dict]) -> list[str]:
    """What the lesson says about ``mode``, against every rank's :func:`buffer_at_forward`."""
    problems = []
    init_sync = mode != "broadcast_buffers=False"
    forward_sync = mode == "default"
    for rank, r in enumerate(per_rank):
        where = f"{mode}, rank {rank}"
        expected_init = 1.0 if init_sync else rank + 1.0
        if r["offset after DDP()"] != expected_init:
            problems.append(f"{where}: offset after DDP() {r['offset after DDP()']}, "
                            f"expected {expected_init}")
        if r["weight after DDP()"] != 1.0:
            problems.append(f"{where}: parameters not broadcast at construction")
        expected_seen = 10.0 if forward_sync else 10.0 * (rank + 1)
        if {r["offset the forward used"], r["offset after forward"]} != {expected_seen}:
            problems.append(f"{where}: forward used {r['offset the forward used']}, "
                            f"expected {expected_seen}")
        deprecated = any("`broadcast_buffers` is deprecated" in w for w in r["warnings"])
        if deprecated != mode.startswith("broadcast_buffers"):
            problems.append(f"{where}: warnings {r['warnings']}")
    return problems


class WithPlainTensor(Shifted):
    """A ``Shifted`` that also keeps ``scale``, a tensor attribute that is *not* a buffer."""

    def __init__(self):
        super().__init__()
        self.scale = torch.ones(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def reassignment(rank: int, world_size: int) -> dict:
    """After wrapping, each rank changes a tensor to its own value ``rank + 1`` in one of four
    ways, then runs one forward; returns the value each way ends with. Last, a parameter replaced
    after wrapping: its gradient, and what the next forward raises."""
    own = torch.full((1,), rank + 1.0)
    ways = {
        "buffer changed in place (offset.copy_)": lambda m: m.offset.copy_(own),
        "buffer reassigned (m.offset = tensor)": lambda m: setattr(m, "offset", own.clone()),
        "plain attribute reassigned (m.scale = tensor)": lambda m: setattr(m, "scale", own.clone()),
    }
    result: dict = {}
    for way, change in ways.items():
        module = WithPlainTensor()
        model = DDP(module, process_group=cpu_group())
        with torch.no_grad():
            change(module)
        model(torch.ones(1)).sum().backward()
        value = module.scale if "plain" in way else module.offset
        result[way] = value.item()

    bare = nn.Linear(1, 1)  # no buffer at construction: DDP decides it never syncs buffers
    model = DDP(bare, process_group=cpu_group())
    bare.register_buffer("late", own.clone())
    model(torch.ones(1, 1)).sum().backward()
    result["buffer registered after DDP() (model had none)"] = bare.late.item()

    replaced = nn.Linear(1, 1)
    model = DDP(replaced, process_group=cpu_group())
    replaced.weight = nn.Parameter(torch.ones(1, 1))  # the reducer still holds the old weight
    model(own.reshape(1, 1)).sum().backward()
    result["gradient of a parameter replaced after DDP()"] = replaced.weight.grad.item()
    try:
        model(own.reshape(1, 1))
        result["next forward raises"] = None
    except RuntimeError as error:
        result["next forward raises"] = str(error).split(". ")[0]
    return result


def check_reassignment(per_rank: list[dict]) -> list[str]:
    problems = []
    world_size = len(per_rank)
    synced = ("buffer changed in place (offset.copy_)", "buffer reassigned (m.offset = tensor)")
    never = ("plain attribute reassigned (m.scale = tensor)",
             "buffer registered after DDP() (model had none)",
             "gradient of a parameter replaced after DDP()")
    for rank, r in enumerate(per_rank):
        for way in synced:
            if r[way] != 1.0:
                problems.append(f"rank {rank}: {way} ended as {r[way]}, not rank 0's 1.0")
        for way in never:
            if r[way] != rank + 1.0:
                problems.append(f"rank {rank}: {way} ended as {r[way]}, not its own {rank + 1.0}")
        if world_size > 1 and not str(r["next forward raises"]).startswith(
                "Expected to have finished reduction in the prior iteration"):
            problems.append(f"rank {rank}: next forward raised {r['next forward raises']!r}")
    return problems


# --- which forwards broadcast: counted --------------------------------------------------------

# The forwards of :func:`broadcasts_per_forward`, in order: (label, mode, gradients enabled,
# under no_sync, backward after it), and whether the rule of ``will_sync_module_buffers`` says
# it broadcasts (the previous forward ran with gradients enabled and outside ``no_sync``).
ACCUMULATION = 4
FORWARD_SEQUENCE = (
    [("training step", "train", True, False, True, True),
     ("eval(), no_grad: 1st forward", "eval", False, False, False, True),
     ("eval(), no_grad: 2nd forward", "eval", False, False, False, False),
     ("eval(), no_grad: 3rd forward", "eval", False, False, False, False),
     ("train(): 1st training step after evaluation", "train", True, False, True, False),
     ("training step", "train", True, False, True, True)]
    + [(f"window {w}, micro-batch {m + 1}" + (" (no_sync)" if m < ACCUMULATION - 1 else ""),
        "train", True, m < ACCUMULATION - 1, True, m == 0)
       for w in (1, 2) for m in range(ACCUMULATION)]
    + [("eval(), gradients enabled", "eval", True, False, False, True)])


def broadcasts_per_forward(rank: int, world_size: int, warmup: int = 2) -> list[tuple[str, int]]:
    """Count the broadcasts (``gloo:broadcast`` events of torch.profiler) in each forward of a
    DDP Linear + BatchNorm1d, through :data:`FORWARD_SEQUENCE`, after ``warmup`` training steps
    (the second of which also broadcasts the rebuilt buckets' order, once per run)."""
    from unused_parameters import captured_stderr  # the profiler prints its start/stop lines

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), process_group=cpu_group())
    counts = []
    with captured_stderr():
        for step in range(warmup):
            model(batch(rank, step)).square().mean().backward()
        for step, (label, mode, grad, no_sync, backward, _) in enumerate(FORWARD_SEQUENCE):
            model.train(mode == "train")
            window = model.no_sync() if no_sync else contextlib.nullcontext()
            with window, torch.set_grad_enabled(grad):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    loss = model(batch(rank, warmup + step)).square().mean()
                if backward:
                    loss.backward()
            counts.append((label, sum(e.name == "gloo:broadcast" for e in prof.events())))
    return counts


def check_broadcasts_per_forward(per_rank: list[list[tuple[str, int]]]) -> list[str]:
    """Every rank counts the same broadcasts, and a forward broadcasts (the same number of
    times as a training step) exactly when the previous forward ran with gradients enabled and
    outside ``no_sync``."""
    problems = []
    per_sync = per_rank[0][0][1]
    if per_sync != 2:  # one coalesced broadcast per dtype: float32 statistics, int64 counter
        problems.append(f"a training step after training broadcast {per_sync} times, not 2")
    for rank, counts in enumerate(per_rank):
        if counts != per_rank[0]:
            problems.append(f"rank {rank} counted {counts}, rank 0 {per_rank[0]}")
        for (label, count), expected in zip(counts, FORWARD_SEQUENCE):
            want = per_sync if expected[-1] else 0
            if count != want:
                problems.append(f"rank {rank}, {label}: {count} broadcasts, expected {want}")
    return problems


def batch(rank: int, step: int, size: int = 8, channels: int = 3) -> torch.Tensor:
    """Rank ``rank``'s batch at ``step``: every rank draws from a different distribution (mean
    ``3 * rank``, spread ``1 + rank``), as with unshuffled or per-domain shards. Any rank can
    make any rank's batch."""
    generator = torch.Generator().manual_seed(1009 * step + rank)
    return torch.randn(size, channels, generator=generator) * (1 + rank) + 3.0 * rank


def _stats(norm: nn.BatchNorm1d) -> dict[str, list[float]]:
    return {"running_mean": norm.running_mean.tolist(), "running_var": norm.running_var.tolist()}


def _reference(batches) -> dict[str, list[float]]:
    """One process's BatchNorm fed ``batches`` in training mode."""
    norm = nn.BatchNorm1d(batches[0].shape[1])
    for b in batches:
        norm(b)
    return _stats(norm)


def running_stats(rank: int, world_size: int, mode: str = "default", steps: int = 10) -> dict:
    """Train a DDP BatchNorm for ``steps`` steps on per-rank batches (:func:`batch`); return this
    rank's running statistics, and three single-process references: BatchNorm fed rank 0's
    batches only, this rank's batches only, and the whole global batch at every step."""
    norm = nn.BatchNorm1d(3)
    model = DDP(norm, process_group=cpu_group(), **SYNC_MODES[mode])
    for step in range(steps):
        model(batch(rank, step)).square().mean().backward()
    return {
        "this rank": _stats(norm),
        "rank 0's batches only": _reference([batch(0, s) for s in range(steps)]),
        "own batches only": _reference([batch(rank, s) for s in range(steps)]),
        "global batch": _reference([torch.cat([batch(r, s) for r in range(world_size)])
                                    for s in range(steps)]),
    }


def max_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def average_over_ranks(per_rank: list[dict], name: str) -> list[float]:
    """The mean over ranks of one running statistic (what an all-reduce and a division give)."""
    columns = zip(*(r["this rank"][name] for r in per_rank))
    return [sum(column) / len(per_rank) for column in columns]


def check_running_stats(mode: str, per_rank: list[dict]) -> list[str]:
    """default: rank 0 holds exactly the statistics of rank 0's batches, and the others differ
    from it after a forward; forward_sync_buffers=False: each rank holds its own, their average
    is the global running mean but not the global running variance."""
    problems = []
    first = per_rank[0]
    distinct = len(per_rank) > 1
    if mode == "default":
        got = max_difference(first["this rank"]["running_mean"],
                             first["rank 0's batches only"]["running_mean"])
        if got > TOLERANCE:
            problems.append(f"default: rank 0's running mean is {got} from rank 0's batches alone")
        for rank, r in enumerate(per_rank[1:], start=1):
            if max_difference(r["this rank"]["running_mean"],
                              first["this rank"]["running_mean"]) < 0.1:
                problems.append(f"default: rank {rank} equals rank 0 after a forward")
        if distinct and max_difference(first["this rank"]["running_mean"],
                                       first["global batch"]["running_mean"]) < 0.1:
            problems.append("default: rank 0's running mean equals the global one")
    else:
        for rank, r in enumerate(per_rank):
            for name in ("running_mean", "running_var"):
                if max_difference(r["this rank"][name], r["own batches only"][name]) > TOLERANCE:
                    problems.append(f"{mode}: rank {rank}'s {name} is not its own batches'")
        mean_gap = max_difference(average_over_ranks(per_rank, "running_mean"),
                                  first["global batch"]["running_mean"])
        var_gap = max_difference(average_over_ranks(per_rank, "running_var"),
                                 first["global batch"]["running_var"])
        if mean_gap > TOLERANCE:
            problems.append(f"{mode}: averaged running mean is {mean_gap} from the global one")
        if distinct and var_gap < 0.1:
            problems.append(f"{mode}: averaged running var equals the global one ({var_gap})")
    return problems


TORCH_DIR = Path(torch.__file__).parent


def _where(error: BaseException) -> dict:
    """The error, and the torch functions it passed through (``path/in/torch.py:function``)."""
    frames = [(Path(f.filename), f.name) for f in traceback.extract_tb(error.__traceback__)]
    return {"error": f"{type(error).__name__}: {error}",
            "raised in": [f"{path.relative_to(TORCH_DIR).as_posix()}:{name}"
                          for path, name in frames if path.is_relative_to(TORCH_DIR)]}


def describe_error(raised: dict) -> str:
    """``error`` in the innermost torch function that decided to raise it."""
    deciding = [f for f in raised["raised in"] if not f.endswith(":_log_and_throw")]
    return f"{raised['error']}\n      raised in {deciding[-1]}"


def syncbatchnorm_on_cpu(rank: int, world_size: int) -> dict:
    """Convert a CPU model's BatchNorm to SyncBatchNorm, then wrap it in DDP, then (without DDP)
    run it in training and in eval mode. Returns what each call raised and where."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    result: dict = {"converted to": type(model[1]).__name__}
    calls = {"DDP(model)": lambda: DDP(model, process_group=cpu_group()),
             "model(x), training mode": lambda: model.train()(torch.randn(5, 4)),
             "model(x), eval mode": lambda: model.eval()(torch.randn(5, 4))}
    for call, run in calls.items():
        try:
            run()
            result[call] = None
        except ValueError as error:
            result[call] = _where(error)
    return result


CPU_ERRORS = {  # call -> (message, innermost torch function that decided to raise it)
    "DDP(model)": ("ValueError: SyncBatchNorm layers only work with GPU modules",
                   "nn/parallel/distributed.py:_passing_sync_batchnorm_handle"),
    "model(x), training mode": ("ValueError: SyncBatchNorm expected input tensor to be on GPU",
                                "nn/modules/batchnorm.py:forward"),
}


def check_syncbatchnorm_on_cpu(per_rank: list[dict]) -> list[str]:
    problems = []
    for rank, r in enumerate(per_rank):
        for call, (message, function) in CPU_ERRORS.items():
            raised = r[call]
            if not raised or not raised["error"].startswith(message) \
                    or describe_error(raised).split("raised in ")[-1] != function:
                problems.append(f"rank {rank}: {call} gave {raised}")
        if r["model(x), eval mode"] is not None:
            problems.append(f"rank {rank}: eval-mode forward raised {r['model(x), eval mode']}")
    return problems


def global_batch(world_size: int, per_rank: int = 4, channels: int = 3) -> torch.Tensor:
    """The global batch: rank r's slice is rows ``r * per_rank`` to ``(r + 1) * per_rank``."""
    return torch.cat([batch(r, 0, per_rank, channels) for r in range(world_size)])


def batchnorm_over_ranks(rank: int, world_size: int, sync: bool, per_rank: int = 4) -> dict:
    """One training forward of a DDP BatchNorm over this rank's slice of :func:`global_batch`,
    with ``sync`` a SyncBatchNorm (needs NCCL and one GPU per rank; the device is the rank's
    current GPU under NCCL, else the CPU).

    Returns the largest differences from one process's ``nn.BatchNorm1d``, run here, on the
    whole batch (its output rows of this rank, its running statistics) and on this rank's slice
    alone."""
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    whole = global_batch(world_size, per_rank)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    whole_norm, own_norm = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    expected_whole = whole_norm(whole)[mine].detach()
    expected_own = own_norm(whole[mine]).detach()

    model = nn.BatchNorm1d(3).to(device)                           # 1. on its device
    if sync:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)     # 2. convert
    ddp = DDP(model, device_ids=[device.index] if on_gpu else None)  # 3. wrap
    out = ddp(whole[mine].to(device))
    out.square().mean().backward()
    out, stats = out.detach().cpu(), _stats(model)

    def gaps(norm, expected):
        reference = _stats(norm)
        return {"output": (out - expected).abs().max().item(),
                "running_mean": max_difference(stats["running_mean"], reference["running_mean"]),
                "running_var": max_difference(stats["running_var"], reference["running_var"])}

    return {"vs whole batch": gaps(whole_norm, expected_whole),
            "vs own slice": gaps(own_norm, expected_own)}


def check_batchnorm_over_ranks(sync: bool, per_rank: list[dict]) -> list[str]:
    """SyncBatchNorm equals BatchNorm on the whole batch; BatchNorm equals it on the own slice
    (and, on more than one rank, not on the whole batch)."""
    problems = []
    equal_to = "vs whole batch" if sync else "vs own slice"
    for rank, r in enumerate(per_rank):
        if max(r[equal_to].values()) > 1e-4:
            problems.append(f"sync={sync}, rank {rank}: {equal_to} differs: {r[equal_to]}")
        if not sync and len(per_rank) > 1 and r["vs whole batch"]["output"] < 0.1:
            problems.append(f"rank {rank}: BatchNorm matched the whole batch without sync")
    return problems


def gpus_per_rank_available() -> bool:
    return dist.get_backend() == "nccl"


def run_all(rank: int, world_size: int) -> dict:
    """Every demo of this module, in one rank (the script's main runs this)."""
    results: dict = {f"forward {mode}": buffer_at_forward(rank, world_size, mode)
                     for mode in SYNC_MODES}
    results["broadcasts per forward"] = broadcasts_per_forward(rank, world_size)
    results["reassignment"] = reassignment(rank, world_size)
    for mode in ("default", "forward_sync_buffers=False"):
        results[f"running stats {mode}"] = running_stats(rank, world_size, mode)
    results["SyncBatchNorm on CPU"] = syncbatchnorm_on_cpu(rank, world_size)
    results["BatchNorm over ranks"] = batchnorm_over_ranks(rank, world_size, sync=False)
    if gpus_per_rank_available():
        results["SyncBatchNorm over ranks"] = batchnorm_over_ranks(rank, world_size, sync=True)
    return results


def check(gathered: list[dict]) -> list[str]:
    """Every check, on the per-rank results of :func:`run_all`."""
    def ranks(key):
        return [r[key] for r in gathered]
    problems = []
    for mode in SYNC_MODES:
        problems += check_buffer_at_forward(mode, ranks(f"forward {mode}"))
    problems += check_broadcasts_per_forward(ranks("broadcasts per forward"))
    problems += check_reassignment(ranks("reassignment"))
    for mode in ("default", "forward_sync_buffers=False"):
        problems += check_running_stats(mode, ranks(f"running stats {mode}"))
    problems += check_syncbatchnorm_on_cpu(ranks("SyncBatchNorm on CPU"))
    problems += check_batchnorm_over_ranks(False, ranks("BatchNorm over ranks"))
    if "SyncBatchNorm over ranks" in gathered[0]:
        problems += check_batchnorm_over_ranks(True, ranks("SyncBatchNorm over ranks"))
    return problems


def _print_results(gathered: list[dict]) -> None:
    def ranks(key, field):
        return [r[key][field] for r in gathered]
    print("buffer set to rank + 1 before DDP(), to 10 * (rank + 1) before the first forward")
    for mode in SYNC_MODES:
        key = f"forward {mode}"
        print(f"  {mode:<27} after DDP(): {ranks(key, 'offset after DDP()')}"
              f"  forward used: {ranks(key, 'offset the forward used')}")
    print("broadcasts in each forward of a DDP Linear + BatchNorm1d, after two training steps:")
    for label, count in gathered[0]["broadcasts per forward"]:
        print(f"  {label:<48} {count}")
    print("after wrapping, each rank sets its own value rank + 1; after the next forward:")
    for way, value in gathered[0]["reassignment"].items():
        values = ranks("reassignment", way)
        print(f"  {way:<48} {values if way != 'next forward raises' else value!r}")
    for mode in ("default", "forward_sync_buffers=False"):
        key = f"running stats {mode}"
        per_rank = [round(r[key]["this rank"]["running_mean"][0], 4) for r in gathered]
        references = {name: round(stats["running_mean"][0], 4)
                      for name, stats in gathered[0][key].items()
                      if name in ("rank 0's batches only", "global batch")}
        print(f"running_mean[0] after 10 steps, {mode}: per rank {per_rank}; "
              f"BatchNorm in one process on {references}")
    cpu = gathered[0]["SyncBatchNorm on CPU"]
    for call in ("DDP(model)", "model(x), training mode", "model(x), eval mode"):
        print(f"  SyncBatchNorm on CPU, {call}: "
              f"{describe_error(cpu[call]) if cpu[call] else 'ok'}")
    for name in ("BatchNorm over ranks", "SyncBatchNorm over ranks"):
        if name in gathered[0]:
            gaps = {k: round(max(v.values()), 6) for k, v in gathered[0][name].items()}
            print(f"{name} (largest gap from one process's BatchNorm):", gaps)
    if "SyncBatchNorm over ranks" not in gathered[0]:
        print("SyncBatchNorm over ranks: skipped: needs NCCL and one GPU per rank "
              f"(this run uses {dist.get_backend()})")


def main() -> int:
    with process_group(timeout_s=60) as ctx:
        results = run_all(ctx.rank, ctx.world_size)
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, results)
        if not ctx.is_main:
            return 0
        _print_results(gathered)
        problems = check(gathered)
        return report_checks(problems)


if __name__ == "__main__":
    sys.exit(main())
