"""Checkpoint files that a crash cannot corrupt: atomic writes, a "latest" pointer, keep the last K.

    python chapters/08_checkpoints/checkpoint_files.py    # checks itself in a temporary folder

Launch test: custom (an importable module, not a torchrun script: crash_safety.py, train.py and
tests/test_chapter_08_saving.py import it; run directly, it only checks itself).

Only one process writes a checkpoint directory (rank 0; see who_writes.py). What it writes:

* :func:`save_atomically` — ``torch.save`` into a temporary file *in the same directory*, flush,
  ``os.fsync``, then ``os.replace`` onto the final name, then fsync the directory. ``os.replace``
  is a rename, atomic on POSIX within one file system: a reader (or the next run after a crash)
  sees the old complete file or the new complete file, never a mix. A temporary file elsewhere
  (``/tmp``) may be on another file system, where ``os.replace`` raises ``OSError`` ``EXDEV``
  ("Invalid cross-device link"); only ``shutil.move`` falls back to a copy, which is not
  atomic. Without
  the fsyncs the rename can reach the disk before the data does, and a power cut leaves a
  complete-looking name over empty blocks; the directory fsync makes the rename itself durable.
* :class:`CheckpointDir` — ``step_XXXXXXXX.pt`` files, each written atomically, then a ``latest``
  pointer file (also replaced atomically) that names the newest, then all but the newest ``keep``
  checkpoints deleted, never the one ``latest`` names. So at any moment ``latest`` names a
  complete file, and a crash at any point loses at most the save in progress.

A writer killed by SIGKILL cannot clean up; its half-written temporary file stays behind (named
``.NAME.XXXX.tmp``, so it never looks like a checkpoint). :meth:`CheckpointDir.save` deletes such
leftovers of earlier writers, which is safe because a directory has one writer.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

POINTER_NAME = "latest"
CHECKPOINT_PREFIX = "step_"
CHECKPOINT_SUFFIX = ".pt"
TEMPORARY_SUFFIX = ".tmp"


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make the renames and deletions in ``directory`` durable (POSIX; a no-op elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(file)`` on a temporary file in ``path``'s directory; once it has returned and
    the bytes are on disk, rename the file onto ``path``. If ``write`` raises, the temporary file
    is removed and ``path`` is untouched."""
    path = Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                     suffix=TEMPORARY_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(path.parent)


def save_atomically(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, except that ``path`` never holds a partial file."""
    replace_atomically(path, lambda file: torch.save(obj, file))


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a whole ``torch.save`` file (torch's zip format). A zip archive ends
    with its central directory, so a file cut short anywhere fails this check without being
    unpickled."""
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


class CheckpointDir:
    """A directory of checkpoints written by one process: ``save``, ``latest``, ``load_latest``."""

    def __init__(self, root: str | os.PathLike, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def pointer(self) -> Path:
        return self.root / POINTER_NAME

    def path_for(self, step: int) -> Path:
        return self.root / f"{CHECKPOINT_PREFIX}{step:08d}{CHECKPOINT_SUFFIX}"

    def checkpoints(self) -> list[Path]:
        """The checkpoint files present, oldest step first."""
        found = []
        for path in self.root.glob(f"{CHECKPOINT_PREFIX}*{CHECKPOINT_SUFFIX}"):
            digits = path.name[len(CHECKPOINT_PREFIX):-len(CHECKPOINT_SUFFIX)]
            if digits.isdigit():
                found.append((int(digits), path))
        return [path for _, path in sorted(found)]

    def leftovers(self) -> list[Path]:
        """Temporary files of writers that died before renaming them."""
        return sorted(self.root.glob(f".*{TEMPORARY_SUFFIX}"))

    def save(self, state: dict, step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step``, point ``latest`` at it, keep the newest
        ``keep`` checkpoints. Returns the checkpoint's path."""
        for leftover in self.leftovers():
            leftover.unlink(missing_ok=True)
        path = self.path_for(step)
        save_atomically(state, path)
        replace_atomically(self.pointer, lambda file: file.write(path.name.encode()))
        self._delete_old(keep_also=path)
        return path

    def _delete_old(self, keep_also: Path) -> None:
        stale = [p for p in self.checkpoints()[:-self.keep] if p != keep_also]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            fsync_directory(self.root)

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names; without a usable pointer, the newest complete
        checkpoint file; None if there is none."""
        try:
            named = self.root / self.pointer.read_text().strip()
        except FileNotFoundError:
            named = None
        if named is not None and named.parent == self.root and named.is_file():
            return named
        complete = [p for p in self.checkpoints() if is_complete(p)]
        return complete[-1] if complete else None

    def load_latest(self, map_location: Any = None, weights_only: bool = True) -> dict | None:
        """``torch.load`` of :meth:`latest` (None if there is no checkpoint yet). ``weights_only``
        (torch's default since 2.6) refuses pickled objects other than tensors, containers and
        plain values; pass False only for files you wrote yourself."""
        path = self.latest()
        if path is None:
            return None
        return torch.load(path, map_location=map_location, weights_only=weights_only)


class PausingWriter:
    """A binary file for ``torch.save(obj, PausingWriter(file, ...))`` that, once ``pause_at``
    bytes have gone to ``file``, flushes them and calls ``pause()`` before writing on. For the
    lessons' demonstrations: it stops a real ``torch.save`` at a chosen byte, every run, so that
    another rank or process can look at (or kill) a save in progress without a timing race.

    ``torch.save`` into a file object (``_open_zipfile_writer_buffer`` in torch/serialization.py)
    writes the same bytes in the same order as into a path: the file is opened (truncated) first,
    then written from the start to the end."""

    def __init__(self, file: BinaryIO, pause_at: int, pause: Callable[[], Any]):
        self.file = file
        self.pause_at = pause_at
        self.pause = pause
        self.written = 0
        self.paused = False

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        size = len(data)
        if not self.paused and self.written + len(data) >= self.pause_at:
            head = self.pause_at - self.written
            self.file.write(data[:head])
            self.file.flush()
            self.written += head
            self.paused = True
            self.pause()
            data = data[head:]
        self.file.write(data)
        self.written += len(data)
        return size

    def flush(self) -> None:
        self.file.flush()


def saved_size(obj: Any) -> int:
    """How many bytes ``torch.save(obj, ...)`` writes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.tell()


def self_check() -> list[str]:
    """Save five steps with keep=2 into a fresh directory; what contradicts the docstring."""
    problems = []
    with tempfile.TemporaryDirectory() as root:
        directory = CheckpointDir(root, keep=2)
        if directory.latest() is not None or directory.load_latest() is not None:
            problems.append("an empty directory should have no latest checkpoint")
        for step in range(1, 6):
            directory.save({"step": step, "weight": torch.full((3,), float(step))}, step)
        names = [p.name for p in directory.checkpoints()]
        if names != ["step_00000004.pt", "step_00000005.pt"]:
            problems.append(f"keep=2 should leave steps 4 and 5, found {names}")
        if directory.pointer.read_text() != "step_00000005.pt":
            problems.append("latest should name step 5")
        loaded = directory.load_latest(map_location="cpu")
        if loaded is None or loaded["step"] != 5 or not torch.equal(loaded["weight"],
                                                                    torch.full((3,), 5.0)):
            problems.append(f"load_latest should return step 5, got {loaded}")
        directory.pointer.unlink()
        (directory.root / "step_00000009.pt").write_bytes(b"PK\x03\x04 cut short")
        if directory.latest() != directory.path_for(5):
            problems.append("without a pointer, latest should skip an incomplete newer file")
        if os.listdir(root) and any(name.endswith(TEMPORARY_SUFFIX) for name in os.listdir(root)):
            problems.append("a completed save should leave no temporary file")
    return problems


if __name__ == "__main__":
    from ddpcourse.report import report_checks  # here only: the module itself needs torch alone

    sys.exit(report_checks(self_check(), label="checkpoint_files self-check"))
