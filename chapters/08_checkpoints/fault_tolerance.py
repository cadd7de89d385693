"""A worker dies, torchrun restarts the whole group, train.py resumes: the same final weights.

    python chapters/08_checkpoints/fault_tolerance.py

Launch test: custom (a driver run with plain ``python``: it launches torchrun itself, four times;
tests/test_chapter_08_fault_tolerance.py runs its functions).

It launches ``python -m torch.distributed.run --standalone --nproc_per_node 2 --max_restarts 1
chapters/08_checkpoints/train.py`` (2 epochs of 8 optimizer steps, a checkpoint every 4 steps,
``--resume``, an event log, the final weights saved by rank 0):

1. uninterrupted: the reference weights;
2. rank 1 SIGKILLs itself once 14 steps are done (``--kill-at-step 14``; attempt 0 only);
3. rank 1 raises instead (``--raise-at-step 14``);
4. the SIGKILL again with ``--max_restarts 0``.

From the ranks' event log (pid, attempt, checkpoints, resume) and the final weights it shows:
torchrun's agent restarted *every* rank (attempt 1 has new pids for both ranks, not only the one
that died; ``LocalElasticAgent`` stops and restarts the whole worker group), the new attempt
resumed from the last checkpoint attempt 0 completed (step 12, in the middle of epoch 2), so
the steps done after it were done twice (14 - 12 = 2), the final weights are bit-identical to
the uninterrupted run's, and with ``--max_restarts 0`` the job fails: no attempt 1, no final
weights, a non-zero exit.

Every launch has a deadline. torchrun (torch 2.13) starts each worker in a session of its own
(``start_new_session=True`` in ``SubprocessHandler._popen``,
torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py), so killing
torchrun's process group would leave the workers running: at the deadline ``run_bounded``
(ddpcourse/launcher/processes.py) freezes torchrun (SIGSTOP, so it starts nothing new), kills
every process below it, then torchrun.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ddpcourse.launcher import run_bounded
from ddpcourse.report import report_checks

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TRAIN = HERE / "train.py"
TRAINING = ["--epochs", "2", "--train-samples", "256", "--eval-samples", "61",
            "--batch-size", "16", "--checkpoint-every", "4", "--no-progress"]
FAULT_STEP = 14
FAULT_RANK = 1
LAUNCH_TIMEOUT_S = 180.0  # two attempts, each starting 2 workers that import torch, on 2 cores


@dataclass
class Launch:
    """What one torchrun launch left behind."""
    name: str
    command: list[str]
    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    events: list[dict] = field(default_factory=list)
    final_weights: dict | None = None


def run_torchrun(command: list[str], timeout: float) -> tuple[int, bool, str, str]:
    """Run ``command`` with a deadline; at the deadline nothing it started survives
    (``run_bounded`` kills the agent and every worker below it)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    finished = run_bounded(command, timeout, cwd=ROOT, env=env)
    return finished.returncode, finished.timed_out, finished.stdout, finished.stderr


def launch(name: str, root: str | Path, max_restarts: int = 1, fault: str = "",
           timeout: float = LAUNCH_TIMEOUT_S) -> Launch:
    """One torchrun launch of train.py in a fresh folder under ``root``. ``fault``: "" (none),
    "kill" or "raise", by rank FAULT_RANK once FAULT_STEP steps are done, in attempt 0."""
    folder = Path(root) / name
    folder.mkdir(parents=True)
    events, final = folder / "events.jsonl", folder / "final.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", "--max_restarts", str(max_restarts), str(TRAIN),
               *TRAINING, "--checkpoint-dir", str(folder / "checkpoints"), "--resume",
               "--event-file", str(events), "--save-final", str(final),
               "--fault-rank", str(FAULT_RANK)]
    if fault:
        command += [f"--{fault}-at-step", str(FAULT_STEP)]
    returncode, timed_out, out, err = run_torchrun(command, timeout)
    return Launch(name, command, returncode, timed_out, out, err,
                  [json.loads(line) for line in events.read_text().splitlines()]
                  if events.exists() else [],
                  torch.load(final) if final.exists() else None)


def story(run: Launch) -> dict:
    """What the event log says: each attempt's pids by rank, the fault, the checkpoints attempt 0
    completed, where each later attempt resumed, who finished."""
    attempts = sorted({e["attempt"] for e in run.events})
    pids = {a: {e["rank"]: e["pid"] for e in run.events
                if e["attempt"] == a and e["event"] == "started"} for a in attempts}
    faults = [e for e in run.events if e["event"] == "fault"]
    saved = [e["step"] for e in run.events if e["attempt"] == 0 and e["event"] == "checkpoint"]
    resumed = {e["attempt"]: e["step"] for e in run.events if e["event"] == "resumed"}
    fault_step = faults[0]["step"] if faults else None
    last_checkpoint = max(saved) if saved else 0
    return {"attempts": attempts, "pids": pids, "faults": faults,
            "checkpoints in attempt 0": saved, "resumed at": resumed,
            "steps redone": (None if fault_step is None or not resumed  # nobody came back
                             else fault_step - last_checkpoint),
            "finished": sorted((e["attempt"], e["rank"]) for e in run.events
                               if e["event"] == "finished")}


def same_weights(a: dict | None, b: dict | None) -> bool:
    return (a is not None and b is not None and a.keys() == b.keys()
            and all(torch.equal(a[k], b[k]) for k in a))


def max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def launch_problems(run: Launch) -> list[str]:
    if run.timed_out:
        return [f"{run.name}: still running after the deadline; stopped"]
    return []


def reference_problems(reference: Launch) -> list[str]:
    found = launch_problems(reference)
    told = story(reference)
    if reference.returncode != 0 or reference.final_weights is None:
        found.append(f"uninterrupted: exit {reference.returncode}, final weights "
                     f"{'missing' if reference.final_weights is None else 'saved'}")
    if told["attempts"] != [0] or told["finished"] != [(0, 0), (0, 1)]:
        found.append(f"uninterrupted: expected one attempt finished by both ranks: {told}")
    return found


def recovery_problems(run: Launch, reference: Launch, how: str) -> list[str]:
    """The claims about a run whose worker died and which torchrun restarted once."""
    found = launch_problems(run)
    told = story(run)
    if run.returncode != 0:
        found.append(f"{run.name}: torchrun exited {run.returncode}")
    if told["attempts"] != [0, 1]:
        found.append(f"{run.name}: expected attempts 0 and 1, saw {told['attempts']}")
        return found
    if [(f["rank"], f["step"], f["how"]) for f in told["faults"]] != [(FAULT_RANK, FAULT_STEP,
                                                                      how)]:
        found.append(f"{run.name}: expected one {how} by rank {FAULT_RANK} at step "
                     f"{FAULT_STEP}: {told['faults']}")
    before, after = told["pids"][0], told["pids"][1]
    if sorted(before) != [0, 1] or sorted(after) != [0, 1] or set(before.values()) & set(
            after.values()):
        found.append(f"{run.name}: every rank should have a new process in attempt 1: {before} "
                     f"-> {after}")
    last = max(told["checkpoints in attempt 0"], default=None)
    if told["resumed at"] != {1: last} or last is None:
        found.append(f"{run.name}: attempt 1 should resume at the last checkpoint of attempt 0 "
                     f"({last}): {told['resumed at']}")
    if told["finished"] != [(1, 0), (1, 1)]:
        found.append(f"{run.name}: both ranks of attempt 1 should finish: {told['finished']}")
    if not same_weights(run.final_weights, reference.final_weights):
        gap = (max_difference(run.final_weights, reference.final_weights)
               if run.final_weights is not None else "no file")
        found.append(f"{run.name}: final weights differ from the uninterrupted run's ({gap})")
    return found


def no_restart_problems(run: Launch) -> list[str]:
    found = launch_problems(run)
    told = story(run)
    if run.returncode == 0:
        found.append(f"{run.name}: torchrun should fail without restarts, it exited 0")
    if told["attempts"] != [0] or told["finished"] or run.final_weights is not None:
        found.append(f"{run.name}: expected attempt 0 only, nobody finished and no final "
                     f"weights: {told}, final weights saved: {run.final_weights is not None}")
    return found


def describe(run: Launch, reference: Launch) -> str:
    told = story(run)
    lines = [f"{run.name}: torchrun exit {run.returncode}; attempts {told['attempts']}"]
    for attempt, pids in told["pids"].items():
        lines.append(f"  attempt {attempt}: pids by rank {dict(sorted(pids.items()))}")
    for fault in told["faults"]:
        lines.append(f"  rank {fault['rank']} ({fault['how']}) after step {fault['step']} of "
                     f"attempt {fault['attempt']}")
    if told["faults"] and told["resumed at"]:
        lines.append(f"  checkpoints written in attempt 0: steps {told['checkpoints in attempt 0']}"
                     f"; resumed at {told['resumed at']}; steps redone: {told['steps redone']}")
    elif told["faults"]:
        lines.append(f"  checkpoints written in attempt 0: steps {told['checkpoints in attempt 0']}"
                     "; no attempt resumed (no restart left), so no step was redone")
    if run.final_weights is None:
        lines.append("  no final weights")
    elif run is not reference:
        lines.append("  final weights bit-identical to the uninterrupted run: "
                     f"{same_weights(run.final_weights, reference.final_weights)}")
    return "\n".join(lines)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fault-tolerance-") as root:
        reference = launch("uninterrupted", root)
        killed = launch("SIGKILL, --max_restarts 1", root, fault="kill")
        raised = launch("raise, --max_restarts 1", root, fault="raise")
        alone = launch("SIGKILL, --max_restarts 0", root, max_restarts=0, fault="kill")
    found = (reference_problems(reference) + recovery_problems(killed, reference, "SIGKILL")
             + recovery_problems(raised, reference, "raise") + no_restart_problems(alone))
    for run in (reference, killed, raised, alone):
        print(describe(run, reference))
    for line in found:
        print("PROBLEM:", line)
    return report_checks(found)


if __name__ == "__main__":
    sys.exit(main())
