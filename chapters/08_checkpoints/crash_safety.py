"""Crash safety: a writer killed mid-save destroys a plain checkpoint, not an atomic one.

    torchrun --standalone --nproc_per_node 2 chapters/08_checkpoints/crash_safety.py

A directory holds a complete checkpoint of step 1. A writer process starts saving step 2 and is
killed with SIGKILL, which no ``try``/``finally`` can intercept (a kill by the OOM killer, the
scheduler's ``scancel``, a node failure). The kill is not timed: the writer stops itself at a
chosen point and tells the parent through a pipe, and the parent kills it there, so every run
kills it at the same byte. The points:

* ``"while pickling"``: inside the pickling of the state (an object whose ``__reduce__`` blocks).
  ``torch.save(obj, path)`` has opened, and so truncated, ``path`` before it pickles anything
  (``_open_zipfile_writer`` before ``_save`` in torch/serialization.py), so a plain save killed
  here leaves an empty file: the previous checkpoint is gone before a byte of the new one exists;
* ``"half written"``: after half of the file's bytes (:class:`checkpoint_files.PausingWriter`).
  A plain save leaves a truncated archive that ``torch.load`` rejects (a zip archive's
  directory is at its end). The error depends on where the cut falls: ``OSError: [Errno 22]
  Invalid argument`` for this file cut at half its 18,025 bytes, ``RuntimeError: ... failed
  finding central directory`` for a cut in the first few KiB (who_writes.py shows one);
* ``"before the pointer moves"`` (atomic only): the new checkpoint file is complete, the
  ``latest`` pointer still names the previous one.

With :class:`checkpoint_files.CheckpointDir` (temporary file, fsync, ``os.replace``, then the
pointer), every kill leaves ``latest`` naming a complete checkpoint that loads, and the killed
writer's temporary file, which the next save removes. :func:`keep_last` shows the pruning: only
the newest ``keep`` checkpoints stay, and never the one ``latest`` names, even when an older step
is saved last.

Rank 0 runs the demos (they are about one writer; the other ranks wait for its verdict) and
prints what it found; every rank exits 1 if a claim fails.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling module, also when this
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # file is imported by its path
import checkpoint_files  # noqa: E402
from checkpoint_files import CheckpointDir, PausingWriter, is_complete, saved_size  # noqa: E402

from ddpcourse.dist_env import process_group  # noqa: E402
from ddpcourse.launcher.processes import set_parent_death_signal  # noqa: E402
from ddpcourse.report import report_checks_of_every_rank  # noqa: E402

KILL_POINTS = ("while pickling", "half written", "before the pointer moves")
WRITER_TIMEOUT_S = 60.0  # a writer that never reaches its kill point is killed after this
PLAIN_NAME = "checkpoint.pt"


def checkpoint_state(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"step": step, "model": {"weight": torch.randn(64, 64, generator=generator)}}


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text.split('. ')[0]}"


def load_outcome(path: Path) -> int | str:
    """The step that ``path`` holds, or the error loading it raises."""
    try:
        return torch.load(path, weights_only=True)["step"]
    except Exception as error:  # noqa: BLE001 - the error is the result
        return first_line(error)


# --- a writer that stops where it is told and waits to be killed ------------------------------

class StopHere:
    """Calling it tells the parent "I am at the kill point" and waits (bounded) to be killed."""

    def __init__(self, write_fd: int):
        self.write_fd = write_fd

    def __call__(self) -> None:
        os.write(self.write_fd, b"!")
        select.select([], [], [], WRITER_TIMEOUT_S)
        os._exit(3)  # not killed in time: the parent has a problem; never go on writing


class BlockWhilePickled:
    """An entry of the state whose pickling stops the writer (``__reduce__`` runs in
    ``pickler.dump`` inside torch.save's ``_save``)."""

    def __init__(self, stop: StopHere):
        self.stop = stop

    def __reduce__(self):
        self.stop()
        raise AssertionError("unreachable: the writer is killed while it waits")


def write_until_killed(method: str, kill_point: str, directory: Path, stop: StopHere) -> None:
    """In the writer process: save step 2 (``method`` ``"plain"`` or ``"atomic"``), stopping at
    ``kill_point``. The writer is a forked copy that dies here, so patching ``torch.save`` or
    ``checkpoint_files`` affects nothing else."""
    state = checkpoint_state(step=2)
    if kill_point == "while pickling":
        state["stop"] = BlockWhilePickled(stop)
    elif kill_point == "half written":
        original_save = torch.save
        half = saved_size(state) // 2
        torch.save = lambda obj, f, **kw: original_save(obj, PausingWriter(f, half, stop), **kw)
    elif kill_point == "before the pointer moves":
        replace = checkpoint_files.replace_atomically

        def stop_at_the_pointer(path, write: Callable) -> None:
            if Path(path).name == checkpoint_files.POINTER_NAME:
                stop()
            replace(path, write)

        checkpoint_files.replace_atomically = stop_at_the_pointer
    if method == "plain" and kill_point == "half written":
        with open(directory / PLAIN_NAME, "wb") as file:  # as torch.save(state, path) opens it
            torch.save(state, file)  # the PausingWriter needs a file object
    elif method == "plain":
        torch.save(state, directory / PLAIN_NAME)
    else:
        CheckpointDir(directory, keep=2).save(state, step=2)


def kill_writer_at(method: str, kill_point: str, directory: Path) -> dict:
    """Fork a writer, wait until it reports that it is at ``kill_point``, SIGKILL it, reap it.
    Returns how it ended."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 4
        try:
            os.close(read_fd)
            set_parent_death_signal(signal.SIGKILL)
            write_until_killed(method, kill_point, directory, StopHere(write_fd))
            code = 5  # it finished: it was never stopped
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        ready, _, _ = select.select([read_fd], [], [], WRITER_TIMEOUT_S)
        reached = bool(ready) and os.read(read_fd, 1) == b"!"
    finally:
        os.close(read_fd)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    return {"reached the kill point": reached,
            "killed by": signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
            else f"exit {os.WEXITSTATUS(status)}"}


# --- the demos --------------------------------------------------------------------------------

def plain_save_killed(kill_point: str, parent: str | None = None) -> dict:
    """``torch.save`` straight to the path over a checkpoint of step 1, killed at ``kill_point``.
    Returns what is left: the file's size, whether it is a complete archive, what loading gives."""
    directory = Path(tempfile.mkdtemp(prefix="crash_plain_", dir=parent))
    try:
        path = directory / PLAIN_NAME
        torch.save(checkpoint_state(step=1), path)
        size_before = path.stat().st_size
        ended = kill_writer_at("plain", kill_point, directory)
        return {**ended, "bytes before": size_before,
                "bytes of step 2 complete": saved_size(checkpoint_state(step=2)),
                "bytes after": path.stat().st_size,
                "complete archive": is_complete(path), "load gives": load_outcome(path),
                "files": sorted(p.name for p in directory.iterdir())}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def atomic_save_killed(kill_point: str, parent: str | None = None) -> dict:
    """:class:`CheckpointDir` with step 1 saved, a save of step 2 killed at ``kill_point``, then
    a save of step 3. Returns what ``latest`` named and loaded after the kill, the files left,
    and the files after the next save."""
    directory = Path(tempfile.mkdtemp(prefix="crash_atomic_", dir=parent))
    try:
        checkpoints = CheckpointDir(directory, keep=2)
        checkpoints.save(checkpoint_state(step=1), step=1)
        ended = kill_writer_at("atomic", kill_point, directory)
        latest = checkpoints.latest()
        loaded = checkpoints.load_latest(map_location="cpu")
        after_kill = {
            "latest names": latest.name if latest else None,
            "latest is complete": bool(latest) and is_complete(latest),
            "load_latest step": loaded["step"] if loaded else None,
            "checkpoints": [p.name for p in checkpoints.checkpoints()],
            "leftover temporary files": len(checkpoints.leftovers()),
        }
        checkpoints.save(checkpoint_state(step=3), step=3)
        after_next = {"latest names": checkpoints.latest().name,
                      "checkpoints": [p.name for p in checkpoints.checkpoints()],
                      "leftover temporary files": len(checkpoints.leftovers())}
        return {**ended, "after the kill": after_kill, "after the next save": after_next}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def keep_last(keep: int = 2, steps: tuple = (1, 2, 3, 4, 5), parent: str | None = None) -> dict:
    """Save ``steps`` with ``keep``; then save an older step (as a rollback would) with keep=1.
    Returns the files after each phase and what ``latest`` names."""
    directory = Path(tempfile.mkdtemp(prefix="crash_keep_", dir=parent))
    try:
        checkpoints = CheckpointDir(directory, keep=keep)
        for step in steps:
            checkpoints.save(checkpoint_state(step), step)
        kept = [p.name for p in checkpoints.checkpoints()]
        latest = checkpoints.latest().name
        rollback = CheckpointDir(directory, keep=1)
        older = min(steps) - 1 if min(steps) > 0 else 0
        rollback.save(checkpoint_state(older), older)
        return {"kept": kept, "latest": latest,
                "after saving an older step with keep=1": [p.name for p in
                                                           rollback.checkpoints()],
                "latest after that": rollback.latest().name,
                "loads": rollback.load_latest(map_location="cpu")["step"]}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_all(parent: str | None = None) -> dict:
    """Every demo, keyed by name (what :func:`problems` reads)."""
    results: dict[str, Any] = {}
    for point in KILL_POINTS[:2]:
        results[f"plain, killed {point}"] = plain_save_killed(point, parent)
    for point in KILL_POINTS:
        results[f"atomic, killed {point}"] = atomic_save_killed(point, parent)
    results["keep last 2"] = keep_last(parent=parent)
    return results


def problems(results: dict) -> list[str]:
    """What in the results contradicts the docstring (empty: all shown)."""
    found = []

    def expect(condition: bool, claim: str) -> None:
        if not condition:
            found.append(claim)

    for name, r in results.items():
        if name.startswith(("plain", "atomic")):
            expect(r["reached the kill point"] and r["killed by"] == "SIGKILL",
                   f"{name}: the writer should be killed by SIGKILL at its kill point, got {r}")
    pickling = results["plain, killed while pickling"]
    expect(pickling["bytes after"] == 0 and pickling["bytes before"] > 0
           and str(pickling["load gives"]).startswith("EOFError"),
           f"a plain save killed while pickling should leave an empty file, got {pickling}")
    half = results["plain, killed half written"]
    expect(half["bytes after"] == half["bytes of step 2 complete"] // 2
           and not half["complete archive"]
           and str(half["load gives"]).startswith(("RuntimeError", "OSError")),
           f"a plain save killed half way should leave a truncated archive, got {half}")
    for r in (pickling, half):
        expect(r["files"] == [PLAIN_NAME], "a plain save leaves no other copy of step 1")
    for point in KILL_POINTS:
        r = results[f"atomic, killed {point}"]
        after = r["after the kill"]
        expect(after["latest names"] == "step_00000001.pt" and after["latest is complete"]
               and after["load_latest step"] == 1,
               f"atomic, killed {point}: latest should still name step 1, complete, got {after}")
        expected_files = (["step_00000001.pt", "step_00000002.pt"]
                          if point == "before the pointer moves" else ["step_00000001.pt"])
        expect(after["checkpoints"] == expected_files,
               f"atomic, killed {point}: checkpoints should be {expected_files}, got "
               f"{after['checkpoints']}")
        expect(after["leftover temporary files"] == (0 if point == "before the pointer moves"
                                                     else 1),
               f"atomic, killed {point}: the killed writer's temporary file should be left")
        nxt = r["after the next save"]
        expect(nxt["latest names"] == "step_00000003.pt" and nxt["leftover temporary files"] == 0
               and len(nxt["checkpoints"]) == 2,
               f"atomic, killed {point}: the next save should clean up and keep 2, got {nxt}")
    keep = results["keep last 2"]
    expect(keep["kept"] == ["step_00000004.pt", "step_00000005.pt"]
           and keep["latest"] == "step_00000005.pt", f"keep=2 should keep steps 4, 5: {keep}")
    expect(keep["latest after that"] == "step_00000000.pt" and keep["loads"] == 0
           and "step_00000000.pt" in keep["after saving an older step with keep=1"],
           f"pruning should never delete the checkpoint latest names: {keep}")
    return found


def main() -> int:
    with process_group(timeout_s=120) as ctx:
        found: list[str] = []
        if ctx.is_main:
            results = run_all()
            for name, r in results.items():
                print(f"{name}: {r}")
            found = problems(results)
        return report_checks_of_every_rank(found)  # the other ranks waited here


if __name__ == "__main__":
    sys.exit(main())
