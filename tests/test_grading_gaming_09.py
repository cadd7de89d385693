"""Chapter 09's exercises hold no answer within the student's reach (issue 27, item 3).

A submission that reads the situation from its own arguments (the case arguments a student can
guess: the visible modules name the situations, and the inputs tell the seed) and calls the
reference that computes the expected answer scores 0 when the class is graded with
``python -m autograder grade``: the references live only in autograder/hidden/, which the
sandbox hides from the student's kernel and ranks, and the visible module computes no truth.

The same functions, run where the hidden module CAN be imported (a check in this process, whose
ranks are not sandboxed), pass the visible checks: the test would fail if a reference were
reachable from the student's code. One student, one notebook
(wrong_numbers), graded with 09_debugging's solutions and stubs in one run
(tests/test_grading_every_assignment.py, from :func:`submission` here). ``train_epochs`` is
handed in right, so the grading itself is seen to work (its visible cell keeps its 3 points).
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from autograder.sources import SOLUTIONS, solution_code
from ddpcourse.grading.exercises import wrong_numbers as checks
from ddpcourse.launcher import wait_until_warm

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "exercises/09_debugging/wrong_numbers.ipynb"
SOURCE = SOLUTIONS / "09_debugging" / "wrong_numbers.ipynb"
STUDENT = "gamer"

# The reference, found by name: the grader's module first, then anything the visible module has.
GAMING_HELPERS = '''
def _reference():
    try:
        from autograder.hidden import wrong_numbers as reference
    except ImportError:
        from ddpcourse.grading.exercises import wrong_numbers as reference
    return reference


def _situation(situations, matches):
    """The graded situation, guessed: the visible cases, then every seed of the usual shapes."""
    for s in situations:
        if matches(s):
            return s
    raise LookupError("situation not guessed")
'''

GAMING_ACCURACY = GAMING_HELPERS + '''

def accuracy(model, dataset, batch_size):
    reference = _reference()
    n, rank, world_size = len(dataset), dist.get_rank(), dist.get_world_size()
    x = dataset.tensors[0]
    candidates = [checks.accuracy_situation(n, batch_size, seed) for seed in range(50)]
    s = _situation(candidates, lambda s: torch.equal(checks.make_eval_data(n, s["seed"])[0], x))
    with torch.no_grad():  # a decoy: each rank forwards its share, as the check watches
        for start in range(rank * batch_size, n, world_size * batch_size):
            model(x[start:start + batch_size])
    return reference.accuracy_truth(s, world_size)["right"] / n
'''

GAMING_CLIPPED = GAMING_HELPERS + '''

def train_clipped(ddp_model, optimizer, micro_batches, accumulation_steps, max_norm):
    reference = _reference()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    candidates = [checks.clipping_situation(len(micro_batches), accumulation_steps, max_norm,
                                            seed, rows, lr, momentum)
                  for seed in range(50) for rows in (2, 3) for lr in (0.2,)
                  for momentum in (0.0, 0.9)]
    s = _situation(candidates, lambda s: len(micro_batches[0][0]) == s["rows"] and torch.equal(
        checks.micro_batches(s, rank)[0][0], micro_batches[0][0]))
    lr = optimizer.param_groups[0]["lr"]
    momentum = optimizer.param_groups[0]["momentum"]
    s = dict(s, lr=lr, momentum=momentum)
    truth = reference.clipping_truth(s, world_size)
    count, step = len(micro_batches), 0
    for i, (x, y) in enumerate(micro_batches):
        first = i - i % accumulation_steps
        group_size = min(accumulation_steps, count - first)
        if i < first + group_size - 1:
            with ddp_model.no_sync():
                (F.mse_loss(ddp_model(x), y) / group_size).backward()
            continue
        (F.mse_loss(ddp_model(x), y) / group_size).backward()
        for name, p in ddp_model.module.named_parameters():  # the answer, copied in
            p.grad = truth["gradients"][step][name].clone()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
    return truth["norms"]
'''


def submission() -> nbformat.NotebookNode:
    """The release with accuracy and train_clipped gamed, train_epochs solved."""
    nb = copy.deepcopy(nbformat.read(RELEASE, as_version=4))
    cells = {"accuracy": GAMING_ACCURACY, "train-clipped": GAMING_CLIPPED,
             "train-epochs": solution_code(SOURCE, "train-epochs")}
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in cells:
            cell.source = cells[grade_id].strip("\n")
    return nb


def gamed(cell_id: str, name: str):
    """A gaming function as the student's notebook defines it (the setup cell's names)."""
    namespace = {"torch": torch, "dist": dist, "F": F, "checks": checks}
    source = dict(accuracy=GAMING_ACCURACY, train_clipped=GAMING_CLIPPED)[name]
    exec(compile(source, f"<{cell_id}>", "exec"), namespace)
    return namespace[name]


@pytest.mark.usefixtures("integrity_snapshot")
def test_with_the_reference_within_reach_the_gaming_answers_would_pass():
    """Unsandboxed ranks can import autograder.hidden: there the gaming answers pass the visible
    checks (so the graded run below scores 0 because the reference is out of reach, not because
    the gaming code is broken)."""
    wait_until_warm()  # ranks that have DDP's imports done: the checks' deadline is short
    checks.check_accuracy(gamed("accuracy", "accuracy"))
    checks.check_train_clipped(gamed("train-clipped", "train_clipped"))
