"""A submission that reads the situation and calls the grader's reference scores 0 (issue 27).

The pattern: guess the case's arguments from what the function is handed (the seed, by building
the grader's own inputs for a few seeds until one matches), then import the reference the judge
uses, from the hidden checks or from the visible checks module, and hand back its result instead
of doing the work. Before the references moved to autograder/hidden (the visible checks held
them), this scored in every exercise of chapters 05-08; now the hidden module is out of reach (the
sandbox hides it: ImportError) and the visible one holds no reference, and for chapter 05 every
rank's input depends on a salt only that rank knows, so the grader's own input generators are no
way around communication either.

One student per chapter, one notebook each (the assignment's other notebooks are missing and
score 0 as well), graded end to end with ``python -m autograder grade`` as a class is: in the
same run as the assignment's solutions and stubs (tests/test_grading_every_assignment.py, which
takes its submissions from :data:`CHAPTERS` and :func:`submission` here). Frame
inspection, the other way to read the situation, is flagged by the tamper scan (its own tests:
tests/test_grading_tamper_scan.py and the fake class)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import nbformat
import pytest

from autograder import gradesheet
from autograder.sources import exercises

ROOT = Path(__file__).resolve().parent.parent
STUDENT = "gamer"

# Found by name in the hidden checks, then in the visible ones (plain imports: importlib is one
# of the tools the tamper scan flags, and this submission must be graded, not flagged).
FIND = """
def _reference(*names):
    modules = []
    try:
        from autograder.hidden import SLUG as hidden
        modules.append(hidden)
    except ImportError:  # out of reach: the sandbox hides the hidden checks
        pass
    from ddpcourse.grading.exercises import SLUG as visible
    modules.append(visible)
    for module in modules:
        for name in names:
            if hasattr(module, name):
                return getattr(module, name)
    raise LookupError(f"no reference of SLUG within reach: {names}")
"""


def find(slug: str) -> str:
    return FIND.replace("SLUG", slug)


AVERAGE_GRADIENTS = find("allreduce_by_hand") + '''
def average_gradients(model):
    import torch
    import torch.distributed as dist
    build = _reference("model_after_backward")
    grad_model = _reference("GradModel")
    awkward, tied = hasattr(model, "unused"), model.out.weight is model.mid.weight
    dtype = next(model.parameters()).dtype
    name = str(dtype).removeprefix("torch.")
    for seed in range(32):  # the case's seed: the one whose weights these are
        torch.manual_seed(seed)
        if all(torch.equal(a, b) for a, b in zip(grad_model(awkward, tied).to(dtype).parameters(),
                                                 model.parameters())):
            break
    world = dist.get_world_size()
    others = [dict(build(r, name, awkward, tied, seed).named_parameters()) for r in range(world)]
    for key, p in model.named_parameters():
        if p.grad is not None:  # every rank's gradient, rebuilt here: no communication
            p.grad.copy_(sum(o[key].grad for o in others) / world)
'''
RING_ALLREDUCE = find("allreduce_by_hand") + '''
def ring_allreduce(tensor):
    import torch.distributed as dist
    make = _reference("make_rank_tensor")
    rank, world = dist.get_rank(), dist.get_world_size()
    for seed in range(32):
        if make(rank, tuple(tensor.shape), tensor.dtype, seed).equal(tensor):
            tensor.copy_(sum(make(r, tuple(tensor.shape), tensor.dtype, seed)
                             for r in range(world)))
            return
    raise LookupError("no seed makes this rank's tensor")
'''
SHARD_INDICES = find("sampler_by_hand") + '''
def shard_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                  drop_last=False):
    reference = _reference("reference_indices")
    return reference(dataset_len, num_replicas, rank, shuffle=shuffle, seed=seed, epoch=epoch,
                     drop_last=drop_last)
'''
TRAIN_STEPS = find("train_steps") + '''
def train_steps(ddp_model, micro_batches, optimizer, loss_fn, accumulation_steps):
    import torch
    import torch.distributed as dist
    reference = _reference("reference_run")
    make_model, rank_seed, setting = (_reference(name) for name in
                                      ("make_model", "rank_seed", "setting"))
    seed = next(s for s in range(64) if all(  # DDP broadcast rank 0's model: its seed is the case's
        torch.equal(a, b) for a, b in zip(make_model(rank_seed(s, 0)).parameters(),
                                          ddp_model.module.parameters())))
    group = optimizer.param_groups[0]
    s = setting(len(micro_batches), accumulation_steps,
                rows=len(micro_batches[0][0]) if micro_batches else 3, seed=seed,
                loss="cross_entropy" if isinstance(loss_fn, torch.nn.CrossEntropyLoss) else "mse",
                momentum=group["momentum"], lr=group["lr"])
    weights, losses = reference(s, dist.get_world_size())
    with torch.no_grad():
        for name, p in ddp_model.module.named_parameters():
            p.copy_(weights[name])
    grads = sum(p.numel() for p in ddp_model.parameters())
    for _ in losses:  # one gradient-sized all-reduce per optimizer step, for the byte count
        dist.all_reduce(torch.zeros(grads))
    return losses
'''
SURVIVE = find("survive_a_killed_worker") + '''
def train(ddp_model, optimizer, batch_at, total_steps, checkpoint_dir, checkpoint_every, on_step):
    import os
    import tempfile
    import torch
    import torch.distributed as dist
    reference = _reference("uninterrupted_weights")
    make_model, setting = _reference("make_model"), _reference("setting")
    seed = next(s for s in range(64) if all(
        torch.equal(a, b) for a, b in zip(make_model(s).parameters(),
                                          ddp_model.module.parameters())))
    name = "sgd" if isinstance(optimizer, torch.optim.SGD) else "adam"
    weights = reference(setting(seed=seed, optimizer=name, total_steps=total_steps,
                                world_size=dist.get_world_size()))
    marker = os.path.join(checkpoint_dir, "done")
    done = int(open(marker).read()) if os.path.exists(marker) else 0
    for step in range(done + 1, total_steps + 1):
        if step % checkpoint_every == 0:
            if dist.get_rank() == 0:
                handle, temporary = tempfile.mkstemp(dir=checkpoint_dir)
                with os.fdopen(handle, "w") as file:
                    file.write(str(step))
                os.replace(temporary, marker)
            dist.barrier()
        if step == total_steps:
            with torch.no_grad():
                for key, value in ddp_model.module.state_dict().items():
                    value.copy_(weights[key])
        on_step(step)
'''

# Every exercise, found from solutions/ as the grader finds them: a new one is checked too.
EXERCISES = [exercise.slug for exercise in exercises()]
# Per exercise (of chapters 00-08): the functions that computed an answer in its visible checks
# before they moved to autograder/hidden (each yields the expected result of any case).
MOVED = {
    "ddp_same_as_one_process": ["reference_run", "train_single_process"],
    "memory_per_rank": ["measured_bytes", "measure_ddp", "measure_fsdp", "count_held"],
    "torchrun_from_slurm": ["first_host"],
    "bucketed_ddp": ["reference_buckets", "expected_buckets", "one_process"],
    "sampler_by_hand": ["reference_indices"],
    "fix_the_loop": ["expected_for", "replay", "_diagnosis"],
    "global_metrics": ["reference"],
    "train_steps": ["reference_run"],
    "survive_a_killed_worker": ["uninterrupted_weights"],
}
# Per exercise: the functions both modules define on purpose, each with a body of its own. From
# chapter 09 on, a visible judge or check runs the visible cases against values written out in
# the visible module, and the hidden one of the same name runs the hidden cases with the
# reference; the visible ``written_out`` looks the written-out values up, the hidden one
# computes them from the reference.
SAME_NAME = {
    "collectives_that_hang": ["judge_log", "judge_evaluate", "judge_shard", "judge_skip",
                              "judge_gather", "written_out"],
    "ddp_errors": ["judge_unused", "judge_resume", "judge_checkpointed", "written_out"],
    "replicas_that_disagree": ["judge_temperature", "judge_batchnorm", "written_out"],
    "wrong_numbers": ["judge_accuracy", "judge_epochs", "judge_clipped", "check_accuracy",
                      "check_train_epochs", "check_train_clipped", "written_out"],
    "fit_cost_model": ["check_predict_step_time"],
}


def own_functions(module) -> dict:
    return {name: value for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__}


def test_the_lists_name_only_exercises_that_exist():
    """MOVED, SAME_NAME and CHAPTERS name exercises by hand: a name that is not (or no longer)
    an exercise fails here rather than checking nothing."""
    slugs = set(EXERCISES)
    assert sorted(set(MOVED) - slugs) == [] and sorted(set(SAME_NAME) - slugs) == []
    pairs = {(exercise.assignment, exercise.slug) for exercise in exercises()}
    assert sorted({(a, notebook) for a, (notebook, _, _) in CHAPTERS.items()} - pairs) == []


@pytest.mark.parametrize("slug", EXERCISES)
def test_no_visible_checks_module_holds_a_reference(slug):
    """Mechanically: no function the hidden checks define (their references, and judges that use
    them) is also in the visible module, but those of SAME_NAME, each a function of its own in
    both; and none of the functions listed in MOVED is back."""
    visible = importlib.import_module(f"ddpcourse.grading.exercises.{slug}")
    hidden = importlib.import_module(f"autograder.hidden.{slug}")
    own, same = own_functions(hidden), SAME_NAME.get(slug, [])
    assert not [name for name in own if hasattr(visible, name) and name not in same]
    for name in same:  # still defined by both, neither imported from the other
        assert name in own and name in own_functions(visible), (slug, name)
    assert not [name for name in MOVED.get(slug, []) if hasattr(visible, name)]


def points(assignment: str, slug: str) -> float:
    """What notebook ``slug`` of ``assignment`` is worth (0 if it has no such notebook)."""
    return sum(notebook.points for notebook in gradesheet.layout(assignment)
               if notebook.slug == slug)


CHAPTERS = {  # assignment: (notebook, {solution cell: code}, its points)
    assignment: (notebook, cells, points(assignment, notebook))
    for assignment, (notebook, cells) in {
        "05_allreduce": ("allreduce_by_hand", {"average-gradients": AVERAGE_GRADIENTS,
                                               "ring-allreduce": RING_ALLREDUCE}),
        "06_data_loading": ("sampler_by_hand", {"shard-indices": SHARD_INDICES}),
        "07_training_loop": ("train_steps", {"train-steps": TRAIN_STEPS}),
        "08_checkpoints": ("survive_a_killed_worker", {"train": SURVIVE}),
    }.items()}


def submission(assignment: str, notebook: str, cells: dict[str, str]) -> nbformat.NotebookNode:
    """The student release with the solution cells ``cells`` filled in."""
    nb = nbformat.read(ROOT / "exercises" / assignment / f"{notebook}.ipynb", as_version=4)
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in cells:
            cell.source = cells[grade_id].strip("\n")
    assert {c.metadata.get("nbgrader", {}).get("grade_id") for c in nb.cells} >= set(cells)
    return nb
