"""Ctrl-C (SIGINT) at each moment of a ``run_ranks`` call raises ``KeyboardInterrupt``, leaves no
process behind, and the next call works. Jupyter's stop button and nbgrader's cell timeout are
SIGINT, so an interrupt the launcher loses is a student's cell that will not stop.

The moments are reached on purpose, not by timing: a hook set with ``set_phase_hook`` sends the
SIGINT as a call reaches a named phase, a thread sends it once the ranks' own files say they run,
and an import hook sends it just as torch's C extension starts importing numpy. That last one is
where a first call used to lose it: the launcher imports torch lazily, and torch clears any error
raised while it imports numpy (``validate_numpy_for_dlpack_deleter_bug`` in
``torch/csrc/utils/tensor_numpy.cpp``), a ``KeyboardInterrupt`` included. The first moments need a
process that has not imported torch nor started a rank server, so all of them run, in order, in
one fresh Python process (and plain ``import torch`` in another, at the same time).
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddpcourse.launcher import interrupts_deferred
from ddpcourse.launcher.processes import run_bounded

pytestmark = pytest.mark.usefixtures("no_orphans")

SIGINT_WHEN_IMPORTING = textwrap.dedent(
    """
    import importlib.abc, os, signal, sys

    class SigintWhenImporting(importlib.abc.MetaPathFinder):
        fired = False

        def __init__(self, module):
            self.module = module

        def find_spec(self, name, path=None, target=None):
            if name == self.module and not self.fired:
                type(self).fired = True
                os.kill(os.getpid(), signal.SIGINT)
            return None

    assert "numpy" not in sys.modules and "torch" not in sys.modules
    """
)

# torch's own behaviour, which the launcher has to work around: SIGINT as `import torch` reaches
# the import of sys.argv[1].
PLAIN_IMPORT = SIGINT_WHEN_IMPORTING + textwrap.dedent(
    """
    sys.meta_path.insert(0, SigintWhenImporting(sys.argv[1]))
    try:
        import torch
        print("lost" if SigintWhenImporting.fired else "never sent")
    except KeyboardInterrupt:
        try:
            import torch.distributed
            print("raised; imported again")
        except Exception as exc:
            print(f"raised; cannot be imported again: {type(exc).__name__}: {exc}")
    """
)

CALLER = SIGINT_WHEN_IMPORTING + textwrap.dedent(
    """
    import json, threading, time
    from pathlib import Path

    from ddpcourse.launcher import rank_server_pids, run_ranks, set_phase_hook
    from ddpcourse.launcher.processes import live_descendants

    folder = Path(sys.argv[1])
    report = {}


    def sleep_long(rank, world_size, folder):
        (Path(folder) / f"running-{rank}").write_text("")
        time.sleep(600)


    def total(rank, world_size):
        import torch, torch.distributed as dist
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()


    def leftovers():
        give_up = time.monotonic() + 3
        while (left := live_descendants() - rank_server_pids()) and time.monotonic() < give_up:
            time.sleep(0.05)
        return sorted(left)


    def sigint_at(phase, seen):
        def hook(reached):
            if reached == phase:
                seen.update(phase=reached, servers=sorted(rank_server_pids()),
                            torch_imported="torch" in sys.modules)
                os.kill(os.getpid(), signal.SIGINT)
        return hook


    def interrupted_call(moment, fn=sleep_long, before=lambda seen: None):
        seen = {}
        ranks_folder = folder / moment.replace(" ", "-")
        ranks_folder.mkdir()
        before(seen)
        try:
            run_ranks(fn, 2, *([str(ranks_folder)] if fn is sleep_long else []), timeout=20)
            outcome = "returned"
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"[:300]
        set_phase_hook(None)
        report[moment] = dict(seen, outcome=outcome, leftovers=leftovers(),
                              ranks_ran=len(list(ranks_folder.glob("running-*"))),
                              servers_after=sorted(rank_server_pids()))


    interrupted_call("before the call",
                     before=lambda seen: set_phase_hook(sigint_at("call started", seen)))


    def arm_numpy_import(seen):
        seen.update(torch_imported="torch" in sys.modules)
        sys.meta_path.insert(0, SigintWhenImporting("numpy"))

    interrupted_call("while torch is imported", fn=total, before=arm_numpy_import)
    report["while torch is imported"]["sigint_sent"] = SigintWhenImporting.fired
    import numpy, torch
    report["while torch is imported"]["numpy_works"] = (
        torch.from_numpy(numpy.ones(2)).sum().item() == 2.0)

    interrupted_call("during rank-server start",
                     before=lambda seen: set_phase_hook(sigint_at("rank servers starting", seen)))
    interrupted_call("during the ranks' start",
                     before=lambda seen: set_phase_hook(sigint_at("ranks starting", seen)))


    def sigint_once_forked_ranks_run(seen):
        # The call is held in the hook, so it has not read which pids its ranks got.
        def hook(reached):
            if reached == "ranks starting":
                ranks_folder = folder / "before-the-call-knows-its-ranks"
                give_up = time.monotonic() + 20
                while len(list(ranks_folder.glob("running-*"))) < 2 and time.monotonic() < give_up:
                    time.sleep(0.02)
                seen.update(phase=reached, running=len(list(ranks_folder.glob("running-*"))))
                os.kill(os.getpid(), signal.SIGINT)
        set_phase_hook(hook)

    interrupted_call("before the call knows its ranks", before=sigint_once_forked_ranks_run)


    def sigint_once_ranks_run(seen):
        def watch():
            ranks_folder = folder / "while-the-ranks-run"
            give_up = time.monotonic() + 20
            while len(list(ranks_folder.glob("running-*"))) < 2 and time.monotonic() < give_up:
                time.sleep(0.02)
            seen.update(running=len(list(ranks_folder.glob("running-*"))))
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=watch, daemon=True).start()

    interrupted_call("while the ranks run", before=sigint_once_ranks_run)

    report["next call"] = run_ranks(total, 2, timeout=60)
    print(json.dumps(report), flush=True)
    os._exit(0)  # the rank servers die with this process; no need to wait for the warm one's import
    """
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Run the fresh processes at once: the caller's report, and what a plain ``import torch``
    did with a SIGINT as it began importing numpy, and torch.nn."""
    folder = tmp_path_factory.mktemp("interrupts")
    commands = {
        "caller": [sys.executable, "-c", CALLER, str(folder)],
        "numpy": [sys.executable, "-c", PLAIN_IMPORT, "numpy"],
        "torch.nn": [sys.executable, "-c", PLAIN_IMPORT, "torch.nn"],
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        runs = {key: pool.submit(run_bounded, cmd, 180) for key, cmd in commands.items()}
        runs = {key: run.result() for key, run in runs.items()}
    for run in runs.values():
        assert run.returncode == 0 and not run.timed_out, run.stderr[-3000:]
    last_lines = {key: run.stdout.strip().splitlines()[-1] for key, run in runs.items()}
    return json.loads(last_lines.pop("caller")), last_lines


def test_torch_itself_loses_a_ctrl_c_that_comes_while_it_imports_numpy(outcomes):
    """Why the launcher holds Ctrl-C back while it imports torch."""
    _, plain = outcomes
    assert plain["numpy"] == "lost"


def test_torch_interrupted_later_in_its_import_cannot_be_imported_again(outcomes):
    """Why it holds Ctrl-C back for the whole import, and does not just import numpy first:
    a ``KeyboardInterrupt`` that does come out of ``import torch`` leaves a process where torch
    can no longer be imported, so its next ``run_ranks`` would fail."""
    _, plain = outcomes
    assert plain["torch.nn"].startswith("raised; cannot be imported again")


def test_before_the_call_nothing_is_started(outcomes):
    moment = outcomes[0]["before the call"]
    assert moment["phase"] == "call started" and not moment["torch_imported"]
    assert moment["outcome"] == "KeyboardInterrupt"
    assert moment["servers_after"] == [] and moment["leftovers"] == [] and moment["ranks_ran"] == 0


def test_while_the_first_call_imports_torch(outcomes):
    moment = outcomes[0]["while torch is imported"]
    assert not moment["torch_imported"] and moment["sigint_sent"]
    assert moment["outcome"] == "KeyboardInterrupt"
    assert moment["numpy_works"], "torch was left without numpy"
    assert moment["servers_after"] == [] and moment["leftovers"] == []


def test_during_rank_server_start(outcomes):
    moment = outcomes[0]["during rank-server start"]
    assert moment["phase"] == "rank servers starting" and moment["servers"]
    assert moment["outcome"] == "KeyboardInterrupt"
    # The servers started are kept (and used by the next calls), nothing else is left.
    assert moment["servers_after"] == moment["servers"] and moment["leftovers"] == []


def test_during_the_ranks_start(outcomes):
    moment = outcomes[0]["during the ranks' start"]
    assert moment["phase"] == "ranks starting"
    assert moment["outcome"] == "KeyboardInterrupt"
    assert moment["leftovers"] == []


def test_once_the_ranks_run_but_before_the_call_has_heard_their_pids(outcomes):
    moment = outcomes[0]["before the call knows its ranks"]
    assert moment["phase"] == "ranks starting" and moment["running"] == 2
    assert moment["outcome"] == "KeyboardInterrupt"
    assert moment["leftovers"] == []


def test_while_the_ranks_run(outcomes):
    moment = outcomes[0]["while the ranks run"]
    assert moment["running"] == 2 and moment["ranks_ran"] == 2
    assert moment["outcome"] == "KeyboardInterrupt"
    assert moment["leftovers"] == []


def test_the_next_call_still_works(outcomes):
    assert outcomes[0]["next call"] == [2.0, 2.0]


def test_a_signal_held_back_by_a_block_is_delivered_as_it_ends():
    with pytest.raises(KeyboardInterrupt), interrupts_deferred():
        signal.raise_signal(signal.SIGINT)
        reached_the_end_of_the_block = True
    assert reached_the_end_of_the_block
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_pending_as_a_block_starts_leaves_every_handler_as_it_was(monkeypatch):
    """``signal.signal`` first runs the handlers of signals already pending (CPython's
    ``signal_signal_impl``). A SIGTERM pending as the block replaces SIGTERM's handler, after
    SIGINT's, raises from there: SIGINT's handler must be put back all the same, or every later
    Ctrl-C of the process would be held back for good."""
    class Terminated(Exception):
        pass

    def on_sigterm(_signum, _frame):
        raise Terminated

    real_signal = signal.signal
    callers_sigterm = real_signal(signal.SIGTERM, on_sigterm)
    try:
        def signal_with_sigterm_pending(signum, handler):
            if signum == signal.SIGTERM and handler is not on_sigterm:
                signal.getsignal(signal.SIGTERM)(signum, None)  # the pending one, handled first
            return real_signal(signum, handler)

        monkeypatch.setattr(signal, "signal", signal_with_sigterm_pending)
        with pytest.raises(Terminated), interrupts_deferred((signal.SIGINT, signal.SIGTERM)):
            pytest.fail("the block ran although starting it raised")
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is on_sigterm
    finally:
        real_signal(signal.SIGTERM, callers_sigterm)
