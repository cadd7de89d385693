"""Forking a process whose native threads call into Python: how many children never start, as JSON.

    python benchmarks/fork_with_native_threads.py            # about seven minutes on 2 cores
    python benchmarks/fork_with_native_threads.py --forks 2000 --out /tmp/fork.json

A DDP rank is such a process: libraries' C++ threads (gloo's among them) run beside the main
thread, and some enter Python now and then. When such a thread enters Python it creates a
thread state, holding the interpreter's lock on the list of thread states but not the GIL, so a
``fork`` in the main thread can happen while that lock is held. In CPython 3.8 to 3.11 the child
then waits for that lock forever, in ``PyOS_AfterFork_Child`` -> ``_PyEval_ReInitThreads`` ->
``_PyThreadState_DeleteExcept``, before it runs any code of its own (CPython issue gh-112275;
later Pythons re-create the lock before taking it). Chapter 08's ``resume_bit_exact.py`` hit it
through its DataLoader's forked workers, with the same stack.

Here two Python threads keep starting native threads (``pthread_create`` through ctypes) whose
only work is to enter Python and leave, while the main thread starts ``--forks`` children that
exit at once, by each start method; a child still alive after ``--child-timeout`` seconds is
counted as hung (and killed). The result is a count, not a time: on an affected Python ``fork``
hangs now and then; ``forkserver`` forks from a server process that runs no other thread.
Linux only (glibc's ``pthread_create``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "fork_with_native_threads.json"
NATIVE_ENTRY = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@NATIVE_ENTRY
def enter_python(_argument):
    """A native thread's start routine: calling it enters Python from a thread Python never
    started, which creates (and afterwards deletes) a thread state for it."""
    return None


def start_native_threads(stop: threading.Event) -> None:
    """Until ``stop``: start a native thread that enters Python, wait for it, again."""
    libc = ctypes.CDLL(None)
    while not stop.is_set():
        thread = ctypes.c_ulong()
        libc.pthread_create(ctypes.byref(thread), None, enter_python, None)
        libc.pthread_join(thread, None)


def exit_at_once() -> None:
    """The child's whole work."""


def hung_children(method: str, forks: int, child_timeout: float) -> int:
    """Start ``forks`` children by ``method`` while native threads come and go; how many were
    still alive after ``child_timeout`` seconds."""
    context = multiprocessing.get_context(method)
    warm_up = context.Process(target=exit_at_once)  # forkserver: its server starts before the churn
    warm_up.start()
    warm_up.join()
    stop = threading.Event()
    churn = [threading.Thread(target=start_native_threads, args=(stop,)) for _ in range(2)]
    for thread in churn:
        thread.start()
    hung = 0
    try:
        for _ in range(forks):
            child = context.Process(target=exit_at_once)
            child.start()
            child.join(child_timeout)
            if child.is_alive():
                hung += 1
                child.kill()
                child.join()
    finally:
        stop.set()
        for thread in churn:
            thread.join()
    return hung


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forks", type=int, default=20_000, help="children per start method")
    parser.add_argument("--methods", nargs="+", default=["fork", "forkserver"])
    parser.add_argument("--child-timeout", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--note", default="", help="what the reader should know about the run")
    args = parser.parse_args()
    # here, not at the top: every forkserver child imports this file again, and should not have
    # to import torch with it
    sys.path.insert(0, str(ROOT))
    from ddpcourse.timing import command_line, machine_load, reference_header

    record = reference_header(command_line(), machine_load(2.0), args.note)
    record.update(python=platform.python_version(), forks=args.forks,
                  child_timeout_s=args.child_timeout, hung={}, seconds={})
    for method in args.methods:
        start = time.perf_counter()
        record["hung"][method] = hung_children(method, args.forks, args.child_timeout)
        record["seconds"][method] = round(time.perf_counter() - start, 1)
        print(f"{method}: {record['hung'][method]} of {args.forks} children hung "
              f"({record['seconds'][method]} s)", flush=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("written:", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
