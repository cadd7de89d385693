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
  appends what happened to an event log, with every write it made in the checkpoint directory
  (the audit hook of resumable_checkpoint), judged as in STOPPED; rank 0 saves the final weights.
  With the fault "kill_in_save", rank 0 is SIGKILLed inside its first open for writing of the
  checkpoint of ``fault_step`` (a temporary file), after holding it a moment: a rank that went on
  meanwhile did not wait for the checkpoint, and the restart must resume from the checkpoint
  before. (``torch.save`` onto a path opens it in C++, which the audit hook does not see: such a
  writer is caught by its writes, with no ``os.replace`` at a checkpoint step.)
* ``STOPPED`` (N ranks, no torchrun; quicker feedback): ``on_step`` raises on every rank at a
  chosen step, and the rank calls ``train`` again on a fresh model, optimizer and random state,
  as a restarted process would start; possibly several times.

The judge compares the final weights with those of the same training without any interruption
(one process: every rank's gradient from its own batch and dropout stream, averaged the way DDP
does, which for one or two ranks is exact), and asks for the steps redone to be only those after
the last checkpoint, and for no step to be skipped or run twice.

That uninterrupted run yields the answer of any situation, so this module (the ranks and the
torchrun workers import it) does not hold it: the hidden checks (autograder/hidden/
survive_a_killed_worker.py) compute it on the grader's side and ask for it bit for bit; the
visible situations have its digests written out (:data:`VISIBLE_WEIGHTS`, see
:mod:`ddpcourse.grading.written_out`), held to it by tests/test_grading_survive_a_killed_worker.py,
and judged within ``ATOL + RTOL * |w|``: a written-out value comes from another machine, whose
float32 kernels may round the last bit differently, while every mistake the checks look for (a
random state, an optimizer state or a step not restored) moves the weights far more.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpcourse.grading.checks import (Case, CheckFailed, CHECK_TIMEOUT_S, cut_text,
                                      judge_each_rank, observed, run_student, safe_text)
from ddpcourse.grading.written_out import expect_digest
from ddpcourse.launcher import call_scratch_dir

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel
FEATURES, HIDDEN, ROWS = 6, 16, 8
LAUNCH_TIMEOUT_S = 90.0  # two attempts of N workers, each importing torch, on a busy machine
_MAX_TEXT = 300
MAX_LOGGED_WRITES = 50  # of one worker between two steps
WAIT_FOR_PEERS_S = 1.0  # a kill_in_save holds the write this long for a peer that goes on
ATOL, RTOL = 1e-6, 1e-5  # on the written-out weights of the visible situations (see above)


class StopTraining(Exception):
    """Raised by the grader's ``on_step`` in a STOPPED case: the loop ends here, as if killed."""


class InjectedFault(RuntimeError):
    """Raised by the grader's ``on_step`` in a KILLED case whose fault is an exception."""


def setting(seed: int = 0, optimizer: str = "adam", total_steps: int = 8, every: int = 2,
            world_size: int = 2, fault: str = "kill", fault_rank: int = 1, fault_step: int = 5,
            stops: tuple[int, ...] = ()) -> dict:
    """One situation: ``total_steps`` optimizer steps, a checkpoint every ``every`` steps, and
    either a fault in a torchrun worker (``fault`` "kill" or "raise" on ``fault_rank`` after
    ``fault_step``, or "kill_in_save": ``fault_rank`` SIGKILLed while it writes the checkpoint of
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


def situation_key(s: dict) -> tuple:
    """How :data:`VISIBLE_WEIGHTS` names a situation: what the uninterrupted run depends on."""
    return (s["seed"], s["optimizer"], s["total_steps"], s["world_size"])


# The uninterrupted run's final weights for every situation the visible checks run: each
# tensor's digest (ddpcourse.grading.written_out), keyed by :func:`situation_key`. Held to the
# hidden checks' reference by tests/test_grading_survive_a_killed_worker.py.
VISIBLE_WEIGHTS: dict[tuple, dict[str, tuple[float, ...]]] = {
    (1, 'adam', 7, 2): {
        '0.weight': (0.631552249193, 0.0631443392485, 1.67299333774, -0.700595449656),
        '0.bias': (1.22598460317, 0.897795915604, -0.26391209662, -1.3334222883),
        '3.weight': (-0.0487809702754, -1.27199652046, -0.951193042099, -0.170484818518),
        '3.bias': (0.1005192101, 0.1005192101, -0.1005192101, -0.1005192101),
    },
    (2, 'adam', 8, 2): {
        '0.weight': (0.406969500706, 1.55560270138, 0.022183669731, -0.371965447441),
        '0.bias': (-0.819066770375, 0.628249458969, 0.512588493526, 0.668224148452),
        '3.weight': (0.392605796456, 0.347627267241, 0.986791774631, 0.969265833497),
        '3.bias': (-0.18975803256, -0.18975803256, 0.18975803256, 0.18975803256),
    },
}


def written_out_weights(s: dict) -> dict:
    key = situation_key(s)
    if key not in VISIBLE_WEIGHTS:
        raise LookupError(f"grader bug: no written-out weights for {key}: add them to "
                          "VISIBLE_WEIGHTS, or judge the situation with the hidden checks")
    return VISIBLE_WEIGHTS[key]


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
    from ddpcourse.grading.exercises.resumable_checkpoint import _start_audit

    with open(os.path.join(work, "setting.json")) as f:
        s = json.load(f)
    with open(os.path.join(work, "train.pickle"), "rb") as f:
        train = cloudpickle.load(f)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    checkpoints = os.path.join(work, "checkpoints")
    with process_group(timeout_s=30, backend="gloo", restart_safe=True) as ctx:
        _log(work, event="started")
        ddp_model, optimizer = fresh_start(s, ctx.rank)
        audit = _start_audit(checkpoints)  # every write in the checkpoint directory
        last_step, logged = [0], [0]

        def log_writes():
            new = audit["writes"][logged[0]:]
            if new:
                _log(work, event="writes", writes=new[:MAX_LOGGED_WRITES])
                logged[0] = len(audit["writes"])

        if attempt == 0 and ctx.rank == s["fault_rank"] and s["fault"] == "kill_in_save":
            audit["on_write"] = lambda name: _kill_while_saving(work, s, last_step[0],
                                                                log_writes)

        def on_step(step):
            log_writes()
            _log(work, event="step", step=_step_value(step))
            last_step[0] = step if type(step) is int else last_step[0]
            if s["fault"] == "kill_in_save":
                return
            if attempt == 0 and ctx.rank == s["fault_rank"] and step == s["fault_step"]:
                _log(work, event=s["fault"], step=_step_value(step))
                if s["fault"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"rank {ctx.rank} fails on purpose after step {step}")

        try:
            train(ddp_model, optimizer, lambda step: batch_at(s["seed"], ctx.rank, step),
                  s["total_steps"], checkpoints, s["every"], on_step)
        except InjectedFault:
            raise
        except Exception as exc:
            _log(work, event="train raised", error=_raised(exc))
            if attempt == 0 and not _fault_injected(work, s):
                return 0  # the verdict is already this error (judge_killed): no restart to wait for
            raise
        log_writes()
        _log(work, event="returned")
        if ctx.rank == 0:
            torch.save(model_state(ddp_model.module), os.path.join(work, "final.pt"))
        dist.barrier()
    return 0


def _kill_while_saving(work: str, s: dict, last_step: int, log_writes: Callable) -> None:
    """Called by the audit hook when this worker opens a file for writing in the checkpoint
    directory: during the checkpoint of ``fault_step`` (the last step reported is the one before
    it), SIGKILL this worker, midway through the write. First it holds the write for up to
    :data:`WAIT_FOR_PEERS_S`, so that a rank that does not wait for the checkpoint (no barrier)
    reports ``fault_step`` meanwhile, every time rather than by luck."""
    if last_step != s["fault_step"] - 1:
        return
    deadline = time.monotonic() + WAIT_FOR_PEERS_S
    while time.monotonic() < deadline and not _went_on(work, s):
        time.sleep(0.02)
    log_writes()
    _log(work, event="kill_in_save", step=s["fault_step"])
    os.kill(os.getpid(), signal.SIGKILL)


def _fault_injected(work: str, s: dict) -> bool:
    """Some rank logged the first attempt's fault (it logs it before it raises or is killed)."""
    return any(e.get("attempt") == 0 and e.get("event") == s["fault"]
               for e in _read_events(work) if isinstance(e, dict))


def _went_on(work: str, s: dict) -> bool:
    """Some other rank reported ``fault_step`` in the first attempt."""
    return any(e.get("attempt") == 0 and e.get("event") == "step" and e.get("rank") !=
               s["fault_rank"] and e.get("step") == s["fault_step"] for e in _read_events(work)
               if isinstance(e, dict))


def _launch_env() -> dict[str, str]:
    """This process's environment without the variables of the rank it runs in."""
    inherited = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {key: value for key, value in os.environ.items()
           if key not in inherited and not key.startswith(("TORCHELASTIC_", "PET_"))}
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = call_scratch_dir()  # torchrun's own log folder goes with the call's files
    return env


def _read_events(work: str) -> list:
    path = os.path.join(work, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()[:2000] if line.strip()]


def observe_killed(rank, world_size, train, s):
    from ddpcourse.launcher import pickle_by_value, run_bounded

    work = tempfile.mkdtemp(prefix="killed-worker-", dir=call_scratch_dir())
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
    made = [tempfile.mkdtemp(prefix="stopped-training-", dir=call_scratch_dir()) if rank == 0
            else None]
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


WEIGHTS_HINT = (". A restart must continue exactly where the checkpoint left off: the model's "
                "weights, the optimizer's state (Adam's moments, momentum), the step, and every "
                "rank's random-number state (the model has dropout: torch.get_rng_state() "
                "differs per rank, so save each rank's)")


def _judge_weights(final: Any, s: dict, what: str, expected_weights=written_out_weights) -> None:
    """``expected_weights(s)``: the uninterrupted run's final state, as tensors (asked bit for
    bit) or their written-out digests (asked within ATOL + RTOL * |w|)."""
    expected = expected_weights(s)
    if not isinstance(final, dict) or set(final) != set(expected):
        raise CheckFailed(f"{what}: the final model's state has keys "
                          f"{cut_text(sorted(map(str, final)) if isinstance(final, dict) else final, 200)}"
                          f", expected {sorted(expected)}")
    like = make_model(s["seed"]).state_dict()
    for name, tensor in expected.items():
        value = final[name]
        if not isinstance(value, torch.Tensor) or value.shape != like[name].shape or \
                value.dtype != like[name].dtype or value.layout != torch.strided:
            raise CheckFailed(f"{what}: the final {name!r} is not a tensor like the model's")
        if not isinstance(tensor, torch.Tensor):
            expect_digest(value, tensor, f"{what}: the final weights differ from an "
                          f"uninterrupted run ({name!r})", RTOL, ATOL, WEIGHTS_HINT)
        elif not torch.equal(value, tensor):
            diff = (value.double() - tensor.double()).abs().max().item()
            raise CheckFailed(
                f"{what}: the final weights differ from an uninterrupted run ({name!r}: largest "
                f"difference {diff:.3g})" + WEIGHTS_HINT)


def judge_killed(observations, world_size, s, expected_weights=written_out_weights):
    fault = {"kill": "SIGKILLed after", "raise": "raising after",
             "kill_in_save": "SIGKILLed while writing the checkpoint of"}[s["fault"]]
    what = (f"{s['world_size']} workers under torchrun --max_restarts 1, rank {s['fault_rank']} "
            f"{fault} step {s['fault_step']} "
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
    if s["fault"] == "kill_in_save" and not faults:
        # torch.save onto a path opens it in C++, unseen by the audit hook: its writes say more
        for rank in range(s["world_size"]):
            _judge_checkpoint_writes(rank, writes_of(events, 0, rank), s, f"{what}: attempt 1")
        raise CheckFailed(f"{what}: rank {s['fault_rank']} opened no file for writing in the "
                          f"checkpoint directory at step {s['fault_step']}, a checkpoint step "
                          "of the first attempt: only rank 0 writes the checkpoint, every "
                          f"`checkpoint_every` steps. Its output:\n{tail}")
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
    in_save = s["fault"] == "kill_in_save"
    if in_save:
        went_on = sorted({e.get("rank") for e in events if isinstance(e, dict)
                          and e.get("attempt") == 0 and e.get("event") == "step"
                          and e.get("step") == s["fault_step"]}, key=str)
        if went_on:
            raise CheckFailed(
                f"{what}: rank(s) {cut_text(went_on, 40)} went on past step {s['fault_step']} "
                f"while rank {s['fault_rank']} was still writing its checkpoint: every rank "
                "must wait until the checkpoint is written (dist.barrier() after rank 0's "
                "save), or a failure during the write loses a step the others count as saved")
    for rank in range(s["world_size"]):  # the first attempt's writes, before its outcome
        _judge_checkpoint_writes(rank, writes_of(events, 0, rank), s, f"{what}: attempt 1")
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
    # the checkpoint being written when the worker died does not count
    resume = last_checkpoint(s["fault_step"] - (1 if s["fault"] == "kill_in_save" else 0),
                             s["every"])
    for rank in range(s["world_size"]):
        _judge_checkpoint_writes(rank, writes_of(events, 1, rank), s, f"{what}: attempt 2")
    for rank in range(s["world_size"]):
        ran = [e.get("step") for e in events if isinstance(e, dict) and e.get("attempt") == 1
               and e.get("rank") == rank and e.get("event") == "step"]
        _judge_steps(ran, resume + 1, s["total_steps"], f"{what}: rank {rank} after the restart")
    _judge_weights(observation.get("final"), s, what, expected_weights)


def writes_of(events: list, attempt: int, rank: int) -> dict:
    """What a torchrun worker reported of its writes, in the form of a STOPPED observation:
    ``writes`` in order, and at each step it reported, how many came before (``marks``)."""
    writes, marks, steps = [], [], []
    for e in events:
        if not isinstance(e, dict) or e.get("attempt") != attempt or e.get("rank") != rank:
            continue
        if e.get("event") == "writes" and isinstance(e.get("writes"), list):
            writes += e["writes"]
        elif e.get("event") == "step":
            marks.append(len(writes))
            steps.append([attempt, e.get("step")])
    return {"writes": writes, "marks": marks, "steps": steps}


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


def judge_stopped(observations, world_size, s, expected_weights=written_out_weights):
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
        _judge_weights(observation.get("final"), s, what, expected_weights)

    judge_each_rank(observations, judge_rank)


KILLED = Case(observe_killed, judge_killed)
STOPPED = Case(observe_stopped, judge_stopped)


def run_killed(train: Callable, s: dict, case: Case = KILLED, **kwargs) -> None:
    """A KILLED case: one grader rank, which runs the torchrun job and waits for it."""
    run_student(case, 1, train, s, timeout=LAUNCH_TIMEOUT_S + CHECK_TIMEOUT_S + 15, **kwargs)


def check_resumes_after_a_stop(train) -> None:
    run_student(STOPPED, 2, train, setting(seed=1, total_steps=7, every=2, stops=(5,)))


def check_survives_a_killed_worker(train) -> None:
    run_killed(train, setting(seed=2, total_steps=8, every=3, fault="kill", fault_rank=1,
                              fault_step=5))


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
