"""ddpcourse.dist_env: set-up for torchrun scripts, and the exit-time abort it prevents."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ddpcourse.dist_env import (MODULES_THAT_BIND_THE_GROUP_AT_IMPORT, free_port,
                                pick_backend, process_group)

DDP_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddpcourse.dist_env import process_group

    with process_group(timeout_s=30) as ctx:
        model = DDP(torch.nn.Linear(4, 4).to(ctx.device))
        model(torch.ones(2, 4, device=ctx.device)).sum().backward()
        ctx.print0("trained on", ctx.world_size, "ranks with", ctx.backend)
    """
)


def test_outside_torchrun_it_says_how_to_launch(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="launch this script with torchrun"):
        with process_group():
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice; GPUs present")
def test_without_gpus_the_backend_is_gloo():
    assert pick_backend(2) == "gloo"


def test_a_ddp_script_exits_cleanly_every_time(tmp_path):
    """Before process_group collected garbage and freed its group for real, about 1 in 3 of these
    runs aborted (exit -6)."""
    script = tmp_path / "ddp_once.py"
    script.write_text(DDP_SCRIPT)
    for attempt in range(3):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             str(script)],
            capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr
        assert done.stdout.count("trained on 2 ranks with gloo") == 1


# In a group of one rank, a DDP model trained and a ZeRO optimizer stepped ("ddp"), or an FSDP2
# model (fully_shard: DTensor parameters) trained one Adam step ("fsdp2"); then the names of the
# process's threads once the group is gone (gloo's are "gloo_tcp_loop" and "pt_gloo_runloop").
THREADS_AFTER_THE_GROUP = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist

    def train_ddp():
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(4, 4))
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()

    def train_fsdp2():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()

    train_a_little = {"ddp": train_ddp, "fsdp2": train_fsdp2}[sys.argv[2]]
    if sys.argv[1] == "process_group":
        from ddpcourse.dist_env import process_group
        with process_group(timeout_s=30):
            train_a_little()
    else:  # what a script does by hand
        dist.init_process_group("gloo")
        train_a_little()
        dist.destroy_process_group()
    import gc; gc.collect()
    print(sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task")))
    """
)


def threads_left_after_the_group(tmp_path, how: str, training: str = "ddp") -> list[str]:
    script = tmp_path / "threads_after.py"
    script.write_text(THREADS_AFTER_THE_GROUP)
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    done = subprocess.run([sys.executable, str(script), how, training], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


needs_proc = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="reads thread names from /proc (Linux)")


@needs_proc
def test_leaving_process_group_ends_gloo_threads_even_after_ddp_and_zero(tmp_path):
    """The group is freed when the block ends, so no gloo thread can still be working when the
    interpreter shuts down. A thread that was (in a CI run, caught in a core dump): a gloo worker
    dropping a finished all_gather whose tensors Python created asked for the GIL while the main
    thread was in Py_FinalizeEx; CPython 3.11 ended it with pthread_exit, whose unwinding reached
    a noexcept C++ frame: std::terminate, exit -6, "terminate called without an active
    exception"."""
    left = threads_left_after_the_group(tmp_path, "process_group")
    assert not [name for name in left if "gloo" in name], left


@needs_proc
def test_by_hand_the_same_script_keeps_its_group_until_exit(tmp_path):
    """The experiment behind process_group's resetting of default arguments: DDP's constructor
    imports torch._dynamo, which imports modules whose default arguments are ``group.WORLD``,
    evaluated at import; they keep the group (and its threads) after ``destroy_process_group``.
    If this fails, a newer torch no longer does so: update ddpcourse/dist_env.py's docstring."""
    left = threads_left_after_the_group(tmp_path, "by_hand")
    assert [name for name in left if "gloo" in name], left


@needs_proc
def test_leaving_process_group_ends_gloo_threads_after_an_fsdp2_step(tmp_path):
    """FSDP2's DTensor parameters fill DTensor's caches (the C++ fast path's among them) with
    entries that hold the device mesh, and the mesh holds the group: process_group empties them
    before destroying it. Seen without that: memory_per_rank.py (chapter 02) aborted at exit
    under torchrun, "terminate called without an active exception"."""
    left = threads_left_after_the_group(tmp_path, "process_group", "fsdp2")
    assert not [name for name in left if "gloo" in name], left


@needs_proc
def test_by_hand_an_fsdp2_step_keeps_its_group_until_exit(tmp_path):
    """The experiment behind process_group's emptying of DTensor's caches: after one FSDP2 step,
    ``destroy_process_group`` and a garbage collection leave gloo's threads running. If this
    fails, a newer torch frees the mesh by itself: update ddpcourse/dist_env.py's docstring."""
    left = threads_left_after_the_group(tmp_path, "by_hand", "fsdp2")
    assert [name for name in left if "gloo" in name], left


def modules_with_world_group_defaults() -> set[str]:
    """Every torch.distributed module with a function whose default argument names
    ``group.WORLD`` (or ``GroupMember.WORLD``), read from the installed source."""
    root = Path(torch.__file__).parent
    found = set()
    for path in (root / "distributed").rglob("*.py"):
        source = path.read_text(encoding="utf-8", errors="replace")
        if ".WORLD" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defaults = node.args.defaults + [d for d in node.args.kw_defaults if d]
                if any(ast.unparse(d).endswith(".WORLD") for d in defaults):
                    module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
                    found.add(module.removesuffix(".__init__"))
    return found


def test_every_module_that_binds_the_group_at_import_is_on_process_groups_list():
    """process_group resets the defaults of the listed modules only. distributed_c10d itself is
    imported with torch.distributed, before any group exists."""
    found = modules_with_world_group_defaults() - {"torch.distributed.distributed_c10d"}
    assert found, "the scan found nothing: has torch's source moved?"
    assert found <= set(MODULES_THAT_BIND_THE_GROUP_AT_IMPORT), (
        f"add {sorted(found - set(MODULES_THAT_BIND_THE_GROUP_AT_IMPORT))} to "
        "ddpcourse.dist_env.MODULES_THAT_BIND_THE_GROUP_AT_IMPORT")
