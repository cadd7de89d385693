"""Bytes per rank and bytes sent per step: DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (FSDP2), measured.

    torchrun --standalone --nproc_per_node 4 chapters/11_beyond_ddp/memory_and_traffic.py

Every rank builds the same MLP (``--depth`` x Linear(width, width) + ReLU), trains it one Adam
step under four schemes on the same data, and counts, tensor by tensor, what it holds
afterwards, and, call by call, what the schemes hand to the collectives:

* ``ddp``: DistributedDataParallel + Adam. Gradient buckets counted by a comm hook.
* ``zero1``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (Adam state sharded;
  each rank updates the parameters it owns and broadcasts them).
* ``zero2``: FSDP2 ``fully_shard(..., reshard_after_forward=False)`` (parameters gathered once
  per step and kept until backward ends; gradients and Adam state sharded).
* ``zero3``: FSDP2 ``fully_shard`` (parameters gathered for forward, freed, gathered again for
  backward).

Rank 0 prints the table beside :func:`ddpcourse.memory_calculator.estimate`'s prediction and
checks that the weights of every scheme equal one process's Adam step on the global batch.
Exit code 1 if a check fails.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddpcourse.memory_calculator import estimate, tensor_bytes  # noqa: E402

SCHEMES = ("ddp", "zero1", "zero2", "zero3")
ZERO_STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def make_mlp(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def global_batch(world_size: int, batch: int, width: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world_size * batch, width, generator=g)
    y = torch.randn(world_size * batch, width, generator=g)
    return x, y


def optimizer_state_bytes(state) -> int:
    """Bytes of exp_avg and exp_avg_sq (the ``step`` counters, 4 B per tensor, left out)."""
    return sum(tensor_bytes([v]) for s in state.values() for k, v in s.items() if k != "step")


class Traffic:
    """Count the payload bytes handed to the Python collectives (patched while inside)."""

    NAMES = ("broadcast", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
             "reduce_scatter_tensor", "all_reduce")

    def __init__(self):
        self.calls: dict[str, list[int]] = {}
        self._originals = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, original in self._originals.items():
            setattr(dist, name, self._counting(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def _counting(self, name, original):
        # the buffer that holds the whole (unsharded) payload: the output of an all-gather,
        # the input of a reduce-scatter, the tensor of a broadcast / all-reduce
        index, keys = {"all_gather_single": (0, ("output",)),
                       "all_gather_into_tensor": (0, ("output_tensor",)),
                       "reduce_scatter_single": (1, ("input",)),
                       "reduce_scatter_tensor": (1, ("input",))}.get(name, (0, ("tensor",)))

        def call(*args, **kwargs):
            t = next((kwargs[k] for k in keys if k in kwargs), None)
            t = args[index] if t is None else t
            self.calls.setdefault(name, []).append(t.numel() * t.element_size())
            return original(*args, **kwargs)
        return call

    def total(self, *names: str) -> int:
        return sum(sum(self.calls.get(n, [])) for n in names)


def _bucket_recorder(sizes: list, bucket):
    sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def measure(rank: int, world_size: int, scheme: str, width: int = 64, depth: int = 3,
            batch: int = 4) -> dict:
    """One Adam step of ``scheme`` on this rank's share of the global batch: bytes held after the
    step, payload bytes handed to collectives, and the full weights after the step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.nn.functional import all_gather  # noqa: F401  (imported before use)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_mlp(width, depth)
    full_param_bytes = tensor_bytes(model.parameters())
    x, y = global_batch(world_size, batch, width)
    x, y = x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]
    buckets: list[int] = []
    traffic = Traffic()
    if scheme in ("ddp", "zero1"):
        wrapped = DDP(model)
        wrapped.register_comm_hook(buckets, _bucket_recorder)
        optimizer = (torch.optim.Adam(model.parameters(), lr=1e-2) if scheme == "ddp" else
                     ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=scheme == "zero3")
        fully_shard(model, mesh=mesh, reshard_after_forward=scheme == "zero3")
        wrapped = model
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with traffic:
        nn.functional.mse_loss(wrapped(x), y).backward()
        optimizer.step()
    params = list(model.parameters())
    state = optimizer.optim.state if scheme == "zero1" else optimizer.state
    if scheme in ("zero2", "zero3"):
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
    else:
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    owned = (optimizer._param_to_rank if scheme == "zero1" else {})
    return {
        "rank": rank, "scheme": scheme, "full_param_bytes": full_param_bytes,
        "params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
        "optimizer": optimizer_state_bytes(state),
        "buckets": sum(buckets) if scheme in ("ddp", "zero1") else 0,
        "allreduce_payload": sum(buckets),
        "broadcast_payload": traffic.total("broadcast"),
        "all_gather_payload": traffic.total("all_gather_single", "all_gather_into_tensor"),
        "reduce_scatter_payload": traffic.total("reduce_scatter_single",
                                                "reduce_scatter_tensor"),
        "owned_param_bytes": sum(p.numel() * p.element_size()
                                 for p, r in owned.items() if r == rank),
        "weights": full,
    }


def measure_all(rank: int, world_size: int, width: int = 64, depth: int = 3,
                batch: int = 4) -> list[dict]:
    return [measure(rank, world_size, s, width, depth, batch) for s in SCHEMES]


def fsdp_checkpoint_roundtrip(rank: int, world_size: int, directory: str, width: int = 64,
                              depth: int = 3) -> dict:
    """Save an FSDP2 model and its Adam state with torch.distributed.checkpoint (each rank
    writes its own shards), load them into a model built from another seed, compare exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed):
        model = make_mlp(width, depth, seed=seed)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        x, y = global_batch(world_size, 4, width, seed=seed)
        nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size]).backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = build(0)
    saved_model, saved_optim = get_state_dict(model, optimizer)
    dcp.save({"model": saved_model, "optim": saved_optim}, checkpoint_id=directory)
    expected = {n: p.to_local().clone() for n, p in model.named_parameters()}
    expected_state = [v.to_local().clone() for s in optimizer.state.values()
                      for k, v in sorted(s.items()) if k != "step"]
    other, other_optim = build(7)
    state_model, state_optim = get_state_dict(other, other_optim)
    state = {"model": state_model, "optim": state_optim}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(other, other_optim, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    loaded_state = [v.to_local() for s in other_optim.state.values()
                    for k, v in sorted(s.items()) if k != "step"]
    files = sorted(p.name for p in Path(directory).iterdir())
    return {"params_equal": all(torch.equal(expected[n], p.to_local())
                                for n, p in other.named_parameters()),
            "optimizer_equal": len(loaded_state) == len(expected_state) and all(
                torch.equal(a, b) for a, b in zip(loaded_state, expected_state)),
            "files": files}


def one_process_weights(world_size: int, width: int = 64, depth: int = 3, batch: int = 4):
    """The weights after one Adam step of one process on the global batch."""
    model = make_mlp(width, depth)
    x, y = global_batch(world_size, batch, width)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def wire_bytes(row: dict, world_size: int) -> float:
    """Bytes one rank sends for the counted payloads with ring algorithms: all-reduce
    2(n-1)/n, all-gather and reduce-scatter (n-1)/n of the full buffer each; a broadcast from
    each owner in turn, (n-1)/n of it on average (a pipelined ring broadcast)."""
    f = (world_size - 1) / world_size
    return f * (2 * row["allreduce_payload"] + row["all_gather_payload"]
                + row["reduce_scatter_payload"] + row["broadcast_payload"])


def prediction(scheme: str, world_size: int, width: int, depth: int, batch: int) -> dict:
    parameters = depth * (width * width + width)
    return estimate(parameters=parameters, batch=batch, sequence=1, layers=depth,
                    hidden=width, dp=world_size, zero_stage=ZERO_STAGE[scheme])


def table(rows: list[list[dict]], width: int, depth: int, batch: int) -> list[dict]:
    """One line per (scheme, rank): measured bytes, predicted bytes and relative error."""
    world = len(rows)
    lines = []
    for per_rank in rows:
        for m in per_rank:
            p = prediction(m["scheme"], world, width, depth, batch)
            wire = wire_bytes(m, world)
            lines.append({"scheme": m["scheme"], "rank": m["rank"], "ranks": world,
                          "params": m["params"], "params_pred": p["params"],
                          "grads": m["grads"], "grads_pred": p["grads"],
                          "optimizer": m["optimizer"], "optimizer_pred": p["optimizer"],
                          "buckets": m["buckets"],
                          "wire": wire, "wire_pred": p["wire_dp"]})
    return lines


def format_table(lines: list[dict]) -> str:
    head = (f"{'scheme':<7}{'rank':>5}{'params':>16}{'grads':>16}{'Adam m+v':>18}"
            f"{'buckets':>9}{'sent/step':>20}")
    out = [head, "  (each: measured / predicted bytes)", "-" * len(head)]
    for r in lines:
        out.append(f"{r['scheme']:<7}{r['rank']:>5}"
                   f"{r['params']:>8,}/{r['params_pred']:<7,.0f}"
                   f"{r['grads']:>8,}/{r['grads_pred']:<7,.0f}"
                   f"{r['optimizer']:>9,}/{r['optimizer_pred']:<8,.0f}"
                   f"{r['buckets']:>9,}"
                   f"{r['wire']:>10,.0f}/{r['wire_pred']:<9,.0f}")
    return "\n".join(out)


def write_record(path: str, lines: list[dict], opts) -> None:
    """The measured table with the header every record under benchmarks/results/ carries.
    Bytes are deterministic; the header says where they were counted."""
    import json

    from ddpcourse import timing

    record = timing.reference_header(
        "torchrun --standalone --nproc_per_node {} {}".format(
            dist.get_world_size(), " ".join(["chapters/11_beyond_ddp/memory_and_traffic.py"]
                                            + sys.argv[1:])),
        timing.machine_load(interval=0.5),
        note="bytes counted tensor by tensor and collective by collective; load is irrelevant")
    record.update(width=opts.width, depth=opts.depth, batch=opts.batch,
                  world_size=dist.get_world_size(), rows=lines)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")


def main() -> int:
    import argparse

    from ddpcourse.dist_env import process_group

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", help="also write the table as a JSON record (machine, date, "
                        "torch, command), e.g. benchmarks/results/ch11_memory_traffic_ws4.json")
    opts = parser.parse_args()
    with process_group(timeout_s=120, backend="gloo") as ctx:
        mine = measure_all(ctx.rank, ctx.world_size, opts.width, opts.depth, opts.batch)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        with tempfile.TemporaryDirectory() as scratch:
            where = [scratch if ctx.is_main else None]
            dist.broadcast_object_list(where, src=0)
            saved = fsdp_checkpoint_roundtrip(ctx.rank, ctx.world_size, where[0] + "/dcp",
                                              opts.width, opts.depth)
            checkpoints = [None] * ctx.world_size
            dist.all_gather_object(checkpoints, saved)
            dist.barrier()  # rank 0 removes the folder only after every rank has read it
        if not ctx.is_main:
            return 0
        lines = table(everyone, opts.width, opts.depth, opts.batch)
        print(f"{ctx.world_size} ranks; model {everyone[0][0]['full_param_bytes']:,} B of float32"
              f" parameters; batch {opts.batch} per rank")
        print(format_table(lines))
        reference = one_process_weights(ctx.world_size, opts.width, opts.depth, opts.batch)
        ok = True
        for per_rank in everyone:
            for m in per_rank:
                err = max((m["weights"][n] - w).abs().max().item() for n, w in reference.items())
                if err > 1e-5:
                    ok = False
                    print(f"FAIL rank {m['rank']} {m['scheme']}: weights differ from one "
                          f"process by {err:.2e}")
        if opts.out:
            write_record(opts.out, lines, opts)
        print(f"FSDP2 + DCP: files {checkpoints[0]['files']}")
        for c, r in zip(checkpoints, range(ctx.world_size)):
            print(f"  rank {r}: parameter shards restored exactly {c['params_equal']}, "
                  f"Adam state shards restored exactly {c['optimizer_equal']}")
            ok &= c["params_equal"] and c["optimizer_equal"]
        print("RESULT: every scheme's weights equal one process's step; DCP round-trips" if ok
              else "RESULT: a check FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
