"""Ctrl-C during a ``run_ranks`` call: never lost, never leaving a process half-registered.

A Ctrl-C reaches Python as SIGINT, whose default handler raises ``KeyboardInterrupt`` in the main
thread wherever it happens to be. Jupyter's stop button and nbgrader's cell timeout send it too.
Two places of a call must not take it there:

* ``import torch``, which the launcher does lazily on a process's first call (so that importing
  ``ddpcourse`` stays light). torch's C extension imports numpy while it initialises and, if that
  import raises, clears the error and carries on (``validate_numpy_for_dlpack_deleter_bug`` in
  ``torch/csrc/utils/tensor_numpy.cpp``): a ``KeyboardInterrupt`` raised there vanishes, the
  import "succeeds", and the call runs to its deadline. Raised anywhere else in the import, it
  does come out, but leaves torch half-registered: importing it again fails, and so would every
  later call. So the Ctrl-C waits for the whole import (``tests/test_launcher_interrupts.py``
  shows all three).
* starting a rank server and stopping the ranks: interrupted halfway, they would leave a process
  nobody tracks.

:func:`interrupts_deferred` holds a SIGINT that arrives inside such a block and delivers it to the
caller's own handler when the block ends. :func:`set_phase_hook` lets a test act at the named
moments of a call (:data:`PHASES`), so each can be interrupted on purpose rather than by luck.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator

PHASES = ("call started", "rank servers starting", "ranks starting")
_phase_hook: Callable[[str], None] | None = None


@contextlib.contextmanager
def interrupts_deferred(signals: tuple[int, ...] = (signal.SIGINT,)) -> Iterator[None]:
    """Run the block with ``signals`` (SIGINT by default) held back; one that came meanwhile is
    delivered to the caller's own handler at its end (a program that turns SIGTERM into an
    exception as well passes both).

    Only the main thread runs Python's signal handlers, and only it may replace one: elsewhere
    (and under a handler installed from C, which Python cannot put back) the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    callers_handlers = {signum: signal.getsignal(signum) for signum in signals}
    if any(handler is None for handler in callers_handlers.values()):
        yield
        return
    held: list[int] = []
    replaced: list[int] = []
    try:
        for signum in signals:
            # signal.signal first runs the handlers of signals already pending: a SIGTERM pending
            # as SIGINT's is replaced raises here, and SIGINT's must still be put back.
            signal.signal(signum, lambda received, _frame: held.append(received))
            replaced.append(signum)
        yield
    finally:
        for signum in replaced:
            signal.signal(signum, callers_handlers[signum])
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)  # the caller's handler: KeyboardInterrupt by default


def set_phase_hook(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Call ``hook(phase)`` as each later call reaches each of :data:`PHASES`; return the
    previous hook. For tests: ``hook`` may raise (or send a SIGINT) to interrupt the call there.

    * ``"call started"``: arguments checked, nothing imported or started yet;
    * ``"rank servers starting"``: this call has just started rank servers (the first call of a
      process, or after a server died); they are still importing torch;
    * ``"ranks starting"``: the ranks have been requested from a ready rank server and may not
      exist yet.
    """
    global _phase_hook
    previous, _phase_hook = _phase_hook, hook
    return previous


def reached(phase: str) -> None:
    if _phase_hook is not None:
        _phase_hook(phase)
