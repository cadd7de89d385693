"""Chapter 08, fault tolerance: visible checks for ``train`` (the exercise
``survive_a_killed_worker``), the cases the hidden checks reuse, and the job torchrun runs.

The contract is the docstring of ``train`` in solutions/08_checkpoints/survive_a_killed_worker.nb.py
(students: exercises/08_checkpoints/survive_a_killed_worker.ipynb). The grader owns everything
around the student's loop: the model (it has dropout, so every rank's random-number state
matters), the optimizer, each rank's batch of each step (``batch_at(step)``), and ``on_step``,
which the loop calls after every step and through which the grader injects the fault.

* ``KILLED`` (one grader rank, which launches the real thing): ``python -m torch.distributed.run
  --standalone --nproc_per_node N --max_restarts 1 -m`` this module. Every worker joins the group
  the way a restartable script must (:func:`ddpcourse.dist_env.process_group` with
  ``restart_safe=True``), builds the model, optimizer and random state afresh, and calls the
  student's ``train``. In attempt 0 (``TORCHELASTIC_RESTART_COUNT``) the chosen rank is SIGKILLed
  (or raises) inside ``on_step`` at the chosen step; torchrun's agent stops the other workers and
  starts the whole group again, whose ``train`` must pick up from the last checkpoint. Each worker
  appends what happened to an event log; rank 0 saves the final weights.
* ``STOPPED`` (N ranks, no torchrun; quicker feedback): ``on_step`` raises on every rank at a
  chosen step, and the rank calls ``train`` again on a fresh model, optimizer and random state,
  as a restarted process would start; possibly several times.

The judge computes, on its own, the weights of the same training without any interruption (one
process: every rank's gradient from its own batch and dropout stream, averaged the way DDP does,
which for one or two ranks is exact), and asks for them bit for bit, for the steps redone to be
only those after the last checkpoint, and for no step to be skipped or run twice.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcourse.grading.checks import (Case, CheckFailed, CHECK_TIMEOUT_S, cut_text,
                                      judge_each_rank, observed, run_student, safe_text)

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
FEATURES, HIDDEN, ROWS = 6, 16, 8
LAUNCH_TIMEOUT_S = 90.0  # two attempts of N workers, each importing torch, on a busy machine
_MAX_TEXT = 300


class StopTraining(Exception):
    """Raised by the grader's ``on_step`` in a STOPPED case: the loop ends here, as if killed."""


class InjectedFault(RuntimeError):
    """Raised by the grader's ``on_step`` in a KILLED case whose fault is an exception."""


def setting(seed: int = 0, optimizer: str = "adam", total_steps: int = 8, every: int = 2,
            world_size: int = 2, fault: str = "kill", fault_rank: int = 1, fault_step: int = 5,
            stops: tuple[int, ...] = ()) -> dict:
    """One situation: ``total_steps`` optimizer steps, a checkpoint every ``every`` steps, and
    either a fault in a torchrun worker (``fault`` "kill" or "raise" on ``fault_rank`` at
    ``fault_step``) or, for STOPPED, the steps at which every rank stops (``stops``)."""
    return {"seed": seed, "optimizer": optimizer, "total_steps": total_steps, "every": every,
            "world_size": world_size, "fault": fault, "fault_rank": fault_rank,
            "fault_step": fault_step, "stops": list(stops)}


# --- what the grader provides: the same in the workers and in the judge's reference ------------


def make_model(seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Dropout(0.25),
                             nn.Linear(HIDDEN, 1))


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raise ValueError(name)


def dropout_seed(seed: int, rank: int) -> int:
    """Each rank's own dropout stream, seeded once per fresh start of a process."""
    return 7919 * seed + 104_729 * (rank + 1)


def batch_at(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for optimizer step ``step`` (1, 2, ...): a function of the step only."""
    generator = torch.Generator().manual_seed(1_000_003 * seed + 1009 * step + rank)
    inputs = torch.randn(ROWS, FEATURES, generator=generator)
    return inputs, torch.sin(inputs.sum(dim=1, keepdim=True))


def fresh_start(s: dict, rank: int) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    """What a freshly started worker has: the initial model, a new optimizer, a new RNG state."""
    torch.set_num_threads(1)
    ddp_model = DistributedDataParallel(make_model(s["seed"]))
    optimizer = make_optimizer(s["optimizer"], ddp_model)
    torch.manual_seed(dropout_seed(s["seed"], rank))
    return ddp_model, optimizer


def uninterrupted_weights(s: dict) -> dict[str, torch.Tensor]:
    """The reference, in one process: every step, every rank's gradient on its own batch with its
    own dropout stream, averaged as DDP does (divided by the world size, then summed; exact for
    one or two ranks); then the optimizer's step."""
    world_size = s["world_size"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            model = make_model(s["seed"])
            optimizer = make_optimizer(s["optimizer"], model)
            streams = []
            for rank in range(world_size):
                torch.manual_seed(dropout_seed(s["seed"], rank))
                streams.append(torch.get_rng_state())
            params = list(model.parameters())
            for step in range(1, s["total_steps"] + 1):
                per_rank = []
                for rank in range(world_size):
                    torch.set_rng_state(streams[rank])
                    inputs, targets = batch_at(s["seed"], rank, step)
                    loss = F.mse_loss(model(inputs), targets)
                    per_rank.append(torch.autograd.grad(loss, params))
                    streams[rank] = torch.get_rng_state()
                for index, param in enumerate(params):
                    total = per_rank[0][index] / world_size
                    for grads in per_rank[1:]:
                        total = total + grads[index] / world_size
                    param.grad = total
                optimizer.step()
                optimizer.zero_grad()
            return {name: t.detach().clone() for name, t in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _raised(exc: BaseException | None) -> dict | None:
    if exc is None:
        return None
    return {"type": type(exc).__name__, "message": safe_text(lambda: exc, _MAX_TEXT)}


def _step_value(step: Any) -> Any:
    return step if type(step) is int else safe_text(lambda: repr(step), 60)


# --- KILLED: the torchrun job (this module, run by every worker) --------------------------------


def _log(work: str, **event) -> None:
    line = json.dumps({"attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       "rank": int(os.environ["RANK"]), "pid": os.getpid(), **event})
    with open(os.path.join(work, "events.jsonl"), "a") as log:  # short appends stay whole
        log.write(line + "\n")


def worker_main(work: str) -> int:
    """One torchrun worker: join, start afresh, train with the student's loop, fault on cue."""
    import cloudpickle

    from ddpcourse.dist_env import process_group

    with open(os.path.join(work, "setting.json")) as f:
        s = json.load(f)
    with open(os.path.join(work, "train.pickle"), "rb") as f:
        train = cloudpickle.load(f)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with process_group(timeout_s=30, backend="gloo", restart_safe=True) as ctx:
        _log(work, event="started")
        ddp_model, optimizer = fresh_start(s, ctx.rank)

        def on_step(step):
            _log(work, event="step", step=_step_value(step))
            if attempt == 0 and ctx.rank == s["fault_rank"] and step == s["fault_step"]:
                _log(work, event=s["fault"], step=_step_value(step))
                if s["fault"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"rank {ctx.rank} fails on purpose after step {step}")

        try:
            train(ddp_model, optimizer, lambda step: batch_at(s["seed"], ctx.rank, step),
                  s["total_steps"], os.path.join(work, "checkpoints"), s["every"], on_step)
        except InjectedFault:
            raise
        except Exception as exc:
            _log(work, event="train raised", error=_raised(exc))
            raise
        _log(work, event="returned")
        if ctx.rank == 0:
            torch.save(model_state(ddp_model.module), os.path.join(work, "final.pt"))
        dist.barrier()
    return 0


def _launch_env() -> dict[str, str]:
    """This process's environment without the variables of the rank it runs in."""
    inherited = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {key: value for key, value in os.environ.items()
           if key not in inherited and not key.startswith(("TORCHELASTIC_", "PET_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _read_events(work: str) -> list:
    path = os.path.join(work, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()[:2000] if line.strip()]


def observe_killed(rank, world_size, train, s):
    from ddpcourse.launcher import pickle_by_value, run_bounded

    work = tempfile.mkdtemp(prefix="killed-worker-")
    os.mkdir(os.path.join(work, "checkpoints"))
    with open(os.path.join(work, "setting.json"), "w") as f:
        json.dump(s, f)
    with open(os.path.join(work, "train.pickle"), "wb") as f:
        f.write(pickle_by_value(train))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(s["world_size"]), "--max_restarts", "1",
               "-m", __name__, work]
    finished = run_bounded(command, LAUNCH_TIMEOUT_S, env=_launch_env())
    final_path = os.path.join(work, "final.pt")
    final = (torch.load(final_path, map_location="cpu", weights_only=True)
             if os.path.exists(final_path) else None)
    return {"returncode": finished.returncode, "timed_out": finished.timed_out,
            "stderr": (finished.stderr or "")[-4000:], "events": _read_events(work),
            "final": final}


# --- STOPPED: interruptions in the ranks, restarts by calling train again ----------------------


def _shared_directory(rank: int) -> str:
    made = [tempfile.mkdtemp(prefix="stopped-training-") if rank == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return made[0]


def observe_stopped(rank, world_size, train, s):
    """Every write of ``train`` in the checkpoint directory is audited (the audit hook of
    resumable_checkpoint); ``on_step`` records how many there were so far."""
    from ddpcourse.grading.exercises.resumable_checkpoint import _start_audit, _stop_audit

    directory = _shared_directory(rank)
    steps, raised, marks = [], None, []
    ddp_model = None
    audit = _start_audit(directory)
    for part, stop in enumerate([*s["stops"], None]):
        ddp_model, optimizer = fresh_start(s, rank)

        def on_step(step, part=part, stop=stop):
            steps.append([part, _step_value(step)])
            marks.append(len(audit["writes"]))
            if stop is not None and step == stop:
                raise StopTraining(f"the grader stops every rank after step {step}")

        try:
            train(ddp_model, optimizer, lambda step: batch_at(s["seed"], rank, step),
                  s["total_steps"], directory, s["every"], on_step)
            if stop is not None:
                raise RuntimeError(f"train returned before step {stop}, where the grader "
                                   "was to stop it")
        except StopTraining:
            continue
        except Exception as exc:  # noqa: BLE001 - reported, judged outside
            raised = _raised(exc)
            break
    _stop_audit()
    return {"raised": raised, "steps": steps, "writes": audit["writes"], "marks": marks,
            "final": model_state(ddp_model.module) if raised is None else None}


# --- the judges -------------------------------------------------------------------------------


def last_checkpoint(step: int, every: int) -> int:
    """The last step with a checkpoint once ``step`` steps are done (0: none yet)."""
    return step // every * every


def _judge_steps(ran: list, first: int, last: int, what: str) -> None:
    """``ran`` must be exactly first, first + 1, ..., last."""
    expected = list(range(first, last + 1))
    if ran == expected:
        return
    if not ran:
        raise CheckFailed(f"{what}: on_step was never called; expected steps {first}-{last} "
                          "(call on_step(step) after every optimizer step)")
    if ran[0] == 1 and first > 1:
        raise CheckFailed(f"{what}: started again from step 1, redoing {first - 1} step(s) that "
                          f"the checkpoint of step {first - 1} already holds: load the latest "
                          "checkpoint and continue after its step")
    if ran[0] != first:
        raise CheckFailed(f"{what}: its first step was {cut_text(ran[0], 60)}, expected {first} "
                          f"(the step after the last checkpoint, {first - 1})")
    raise CheckFailed(f"{what}: the steps run were {cut_text(ran, 200)}, expected {first}-{last}, "
                      "each once, in order")


def _judge_weights(final: Any, s: dict, what: str) -> None:
    expected = uninterrupted_weights(s)
    if not isinstance(final, dict) or set(final) != set(expected):
        raise CheckFailed(f"{what}: the final model's state has keys "
                          f"{cut_text(sorted(map(str, final)) if isinstance(final, dict) else final, 200)}"
                          f", expected {sorted(expected)}")
    for name, tensor in expected.items():
        value = final[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or \
                value.dtype != tensor.dtype:
            raise CheckFailed(f"{what}: the final {name!r} is not a tensor like the model's")
        if not torch.equal(value, tensor):
            diff = (value.double() - tensor.double()).abs().max().item()
            raise CheckFailed(
                f"{what}: the final weights differ from an uninterrupted run ({name!r}: largest "
                f"difference {diff:.3g}). A restart must continue exactly where the checkpoint "
                "left off: the model's weights, the optimizer's state (Adam's moments, "
                "momentum), the step, and every rank's random-number state (the model has "
                "dropout: torch.get_rng_state() differs per rank, so save each rank's)")


def judge_killed(observations, world_size, s):
    what = (f"{s['world_size']} workers under torchrun --max_restarts 1, rank {s['fault_rank']} "
            f"{'SIGKILLed' if s['fault'] == 'kill' else 'raising'} after step {s['fault_step']} "
            f"({s['total_steps']} steps, a checkpoint every {s['every']}, {s['optimizer']})")
    [observation] = observations
    events = observed(observation, "events", list)
    stderr = observed(observation, "stderr", str)
    tail = cut_text("\n".join(stderr.strip().splitlines()[-12:]), 1500)
    if observed(observation, "timed_out", bool):
        raise CheckFailed(f"{what}: the job was still running after {LAUNCH_TIMEOUT_S:g} s and "
                          f"was stopped (a rank waiting for another?). Its last output:\n{tail}")
    faults = [e for e in events if isinstance(e, dict) and e.get("event") == s["fault"]
              and e.get("attempt") == 0]
    errors = [e for e in events if isinstance(e, dict) and e.get("event") == "train raised"]
    if errors and not faults:
        first = errors[0]
        raised = observed(first, "error", dict)
        raise CheckFailed(f"{what}: in the first attempt, before the fault, rank "
                          f"{cut_text(first.get('rank'), 10)}'s train raised "
                          f"{cut_text(observed(raised, 'type', str), 80)}: "
                          f"{cut_text(observed(raised, 'message', str), _MAX_TEXT)}")
    if not faults:
        raise CheckFailed(f"{what}: the fault was never injected: rank {s['fault_rank']} never "
                          f"called on_step({s['fault_step']}) in the first attempt. Its output:"
                          f"\n{tail}")
    returncode = observed(observation, "returncode", int)
    later = [e for e in errors if e.get("attempt") != 0]
    if returncode != 0 and later:
        raised = observed(later[0], "error", dict)
        raise CheckFailed(f"{what}: after the restart, rank {cut_text(later[0].get('rank'), 10)}"
                          f"'s train raised {cut_text(observed(raised, 'type', str), 80)}: "
                          f"{cut_text(observed(raised, 'message', str), _MAX_TEXT)}")
    if returncode != 0:
        raise CheckFailed(f"{what}: torchrun exited with code {returncode}: the restarted "
                          f"workers did not finish. Their last output:\n{tail}")
    restarted = {e.get("rank") for e in events if isinstance(e, dict)
                 and e.get("attempt") == 1 and e.get("event") == "started"}
    if restarted != set(range(s["world_size"])):
        raise CheckFailed(f"{what}: expected every worker to be started again by torchrun (its "
                          f"agent restarts the whole group); the second attempt had ranks "
                          f"{sorted(map(str, restarted))}. Output:\n{tail}")
    resume = last_checkpoint(s["fault_step"], s["every"])
    for rank in range(s["world_size"]):
        ran = [e.get("step") for e in events if isinstance(e, dict) and e.get("attempt") == 1
               and e.get("rank") == rank and e.get("event") == "step"]
        _judge_steps(ran, resume + 1, s["total_steps"], f"{what}: rank {rank} after the restart")
    _judge_weights(observation.get("final"), s, what)


def _judge_checkpoint_writes(rank: int, observation: Any, s: dict, what: str) -> None:
    """Only rank 0 writes in the directory, and it puts every checkpoint in place atomically:
    at each checkpoint step one ``os.replace`` from a file in the same directory, and no file it
    writes directly is one that a replace puts in place (a plain torch.save onto the checkpoint
    truncates it first)."""
    writes = observed(observation, "writes", list)
    marks = observed(observation, "marks", list)
    steps = observed(observation, "steps", list)
    if not all(isinstance(w, list) and len(w) == 3 and all(isinstance(x, str) for x in w)
               for w in writes) or not all(type(m) is int for m in marks) or \
            len(marks) != len(steps):
        raise CheckFailed("the rank's report has malformed 'writes' or 'marks'")
    if rank != 0:
        if writes:
            shown = "; ".join(f"{w[0]} {w[1]}" for w in writes[:3])
            raise CheckFailed(f"{what}: this rank wrote in the checkpoint directory "
                              f"({cut_text(shown, 200)}): only rank 0 writes the checkpoint, "
                              "and every rank waits for it (dist.barrier())")
        return
    targets = {w[1] for w in writes if w[0] == "replace"}
    direct = sorted({w[1] for w in writes if w[0] != "replace"} & targets)
    if direct:
        raise CheckFailed(f"{what}: rank 0 wrote {cut_text(direct[0], 80)} directly, the file it "
                          "also puts in place with os.replace: write a temporary file, then "
                          "os.replace it onto the checkpoint")
    before = 0
    for entry, mark in zip(steps, marks):
        step = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if type(step) is int and step % s["every"] == 0:
            moved = [w for w in writes[before:mark] if w[0] == "replace"]
            if not moved:
                raise CheckFailed(
                    f"{what}: at the checkpoint of step {step}, rank 0 moved no file into place "
                    "with os.replace: a torch.save straight onto the checkpoint's path is not "
                    "atomic (a crash midway leaves it truncated). Write a temporary file in the "
                    "same directory, then os.replace(temporary, path)")
            if any(os.sep in w[2] or w[2].startswith("..") for w in moved):
                raise CheckFailed(f"{what}: at step {step}, rank 0 moved a file from outside "
                                  "the checkpoint directory: os.replace is atomic only within "
                                  "one file system; write the temporary file next to it")
        before = mark


def judge_stopped(observations, world_size, s):
    what = (f"{world_size} rank(s) stopped after step(s) {', '.join(map(str, s['stops']))} and "
            f"started again each time on a fresh model and optimizer ({s['total_steps']} steps, "
            f"a checkpoint every {s['every']}, {s['optimizer']})")

    def judge_rank(rank, observation):
        raised = observed(observation, "raised", (dict, type(None)))
        if raised is not None:
            raise CheckFailed(f"{what}: train raised {cut_text(observed(raised, 'type', str), 80)}"
                              f": {cut_text(observed(raised, 'message', str), _MAX_TEXT)}")
        steps = observed(observation, "steps", list)
        starts = [0, *s["stops"]]
        ends = [*s["stops"], s["total_steps"]]
        for part, (start, end) in enumerate(zip(starts, ends)):
            ran = [entry[1] for entry in steps if isinstance(entry, list) and len(entry) == 2
                   and entry[0] == part]
            run = "the first run" if part == 0 else f"run {part + 1} (after the stop at {start})"
            _judge_steps(ran, last_checkpoint(start, s["every"]) + 1, end, f"{what}: {run}")
        _judge_checkpoint_writes(rank, observation, s, what)
        _judge_weights(observation.get("final"), s, what)

    judge_each_rank(observations, judge_rank)


KILLED = Case(observe_killed, judge_killed)
STOPPED = Case(observe_stopped, judge_stopped)


def run_killed(train: Callable, s: dict, **kwargs) -> None:
    """A KILLED case: one grader rank, which runs the torchrun job and waits for it."""
    run_student(KILLED, 1, train, s, timeout=LAUNCH_TIMEOUT_S + CHECK_TIMEOUT_S + 15, **kwargs)


def check_resumes_after_a_stop(train) -> None:
    run_student(STOPPED, 2, train, setting(seed=1, total_steps=7, every=2, stops=(5,)))


def check_survives_a_killed_worker(train) -> None:
    run_killed(train, setting(seed=2, total_steps=8, every=3, fault="kill", fault_rank=1,
                              fault_step=5))


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
