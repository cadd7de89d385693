"""Call a student's function while watching which Python code runs: forbidden shortcuts.

Some exercises ask to rebuild something the installed libraries already do (nccl-tests' formulas,
which ``ddpcourse.doctor`` computes; ``DistributedSampler``'s index list). Scanning the source
for names misses ``from x import y as z`` and ``getattr`` tricks; a profile hook
(``sys.setprofile``, and ``threading.setprofile`` for threads the function starts) sees every
Python function call, however it was reached. Code run in a child process is not seen.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Watched:
    result: Any = None
    exception: BaseException | None = None
    # "module.function" of every call into a watched file, in first-seen order
    forbidden_calls: list[str] = field(default_factory=list)
    hook_removed: bool = False  # the function replaced or removed the profile hook


def call_watching(fn: Callable, args: tuple, kwargs: dict, watched_prefix: str,
                  quiet: bool = True) -> Watched:
    """Run ``fn(*args, **kwargs)``, recording calls of functions whose file starts with
    ``watched_prefix`` (a package folder, or one file). Exceptions are returned, not raised;
    with ``quiet`` what it prints is dropped."""
    watched = Watched()

    def spy(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(watched_prefix):
            name = f"{frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"
            if name not in watched.forbidden_calls:
                watched.forbidden_calls.append(name)

    output = contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()
    with output:
        sys.setprofile(spy)
        threading.setprofile(spy)
        try:
            watched.result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the caller judges the exception
            watched.exception = exc
        finally:
            watched.hook_removed = sys.getprofile() is not spy
            sys.setprofile(None)
            threading.setprofile(None)
    return watched
