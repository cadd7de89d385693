"""A small fake class for the autograder's tests: one submission per way a student can go wrong.

Each submission starts from the committed student release of 05_allreduce and fills in (or
breaks) cells, exactly as a student editing the notebook would. The students hand in
``allreduce_by_hand``, ``bucketed_ddp`` or both (:func:`handed_in`); most hand in only the first,
which must not stop nbgrader from grading it (every notebook of the assignment not handed in
scores 0). ``EXPECTED`` says what each must score, and with which status; what the assignment is
worth, notebook by notebook, is read from its source notebooks as the grader reads it
(:data:`LAYOUT`, :data:`MAX_POINTS`), so that a notebook added to the assignment changes no test.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat

from autograder import gradesheet
from autograder.sources import grade_id, solution_code
from fake_class.hostile import hostile_class

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENT = "05_allreduce"
# The assignment's notebooks by slug, each with its graded cells and points, and its maximum:
# autograder/gradesheet.py, which the grader's CSV and feedback use.
LAYOUT = {notebook.slug: notebook for notebook in gradesheet.layout(ASSIGNMENT)}
MAX_POINTS = gradesheet.max_points(ASSIGNMENT)
RELEASE = ROOT / "exercises/05_allreduce/allreduce_by_hand.ipynb"
SOLUTIONS = ROOT / "solutions/05_allreduce/allreduce_by_hand.ipynb"
PART2_RELEASE = ROOT / "exercises/05_allreduce/bucketed_ddp.ipynb"
PART2_SOLUTIONS = ROOT / "solutions/05_allreduce/bucketed_ddp.ipynb"


AVERAGE = solution_code(SOLUTIONS, "average-gradients")
RING = solution_code(SOLUTIONS, "ring-allreduce")
AVERAGE_SUMS = '''
def average_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)   # forgot to divide by the world size
'''
# Never returns, inside every rank. It sleeps rather than spins: the grader's deadline stops both
# alike (a spinning rank is killed at its deadline in tests/test_launcher.py), and a spin would burn
# two cores for every deadline of the Try-it cell and the checks, ~80 s of the suite's CPU.
AVERAGE_LOOPS = '''
def average_gradients(model):
    import time
    while True:
        time.sleep(1)
'''
AVERAGE_FLOODS = AVERAGE + '''
    for _ in range(10_000):
        print("debugging " * 10)      # ~1 MB from every rank, every call
'''


RING_DEADLOCKS = '''
def ring_allreduce(tensor):
    world_size, rank = dist.get_world_size(), dist.get_rank()
    incoming = torch.empty_like(tensor)
    dist.recv(incoming, (rank - 1) % world_size)   # every rank waits first: nobody sends
    dist.send(tensor, (rank + 1) % world_size)
'''
RING_EXITS = '''
import os
def ring_allreduce(tensor):
    os._exit(3)
'''


def build(cells: dict[str, str], extra_after: dict[str, str] = None, replace_tests: dict = None,
          delete: list[str] = (), release: Path = RELEASE) -> nbformat.NotebookNode:
    """The release with solution cells ``cells`` filled in, code ``extra_after[grade_id]`` in a new
    cell after that cell, test cells' source replaced or deleted (tampering)."""
    nb = copy.deepcopy(nbformat.read(release, as_version=4))
    out = []
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in delete:
            continue
        if grade_id in cells:
            cell.source = cells[grade_id].strip("\n")
        if replace_tests and grade_id in replace_tests:
            cell.source = replace_tests[grade_id]
        out.append(cell)
        if extra_after and grade_id in extra_after:
            out.append(nbformat.v4.new_code_cell(extra_after[grade_id].strip("\n")))
    nb.cells = out
    return nb


CORRECT = {"average-gradients": AVERAGE, "ring-allreduce": RING}

SUBMISSIONS = {
    # and opens a process group of her own in the notebook (a fixed port): harmless
    "alice": build(CORRECT, extra_after={"setup": (
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:29512', rank=0, "
        "world_size=1)")}),
    "bob": build({"average-gradients": AVERAGE_SUMS, "ring-allreduce": RING}),
    "carol": build({"average-gradients": AVERAGE, "ring-allreduce": RING_DEADLOCKS}),
    "dave": build({"average-gradients": AVERAGE_LOOPS, "ring-allreduce": RING}),
    "erin": build({"average-gradients": AVERAGE + "\nimport os\nos._exit(1)  # at top level",
                   "ring-allreduce": RING_EXITS}),
    "heidi": build(CORRECT, extra_after={"ring-allreduce": (
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")}),
    "ivan": build(CORRECT, extra_after={"ring-allreduce": (
        "from datetime import timedelta\n"
        "store = dist.TCPStore('127.0.0.1', 0, 2, True, timedelta(seconds=90))  # waits for a peer")}),
    # patches what the tests use, edits one test cell and deletes another
    "mallory": build(
        {"average-gradients": (
            "import ddpcourse.launcher\n"
            "ddpcourse.launcher.run_ranks = lambda fn, n, *a, **k: [None] * n\n"
            "dist.all_reduce = lambda *a, **k: None\n"
            "integrity.assert_untampered = lambda: None\n"
            "for name in dir(checks):\n"
            "    if name.startswith('check_'):\n"
            "        setattr(checks, name, lambda fn: None)\n"
            "def average_gradients(model):\n    pass")},
        replace_tests={"test-average-gradients-two-ranks": 'print("passed")'},
        delete=["test-ring-allreduce-world-sizes"]),
}

BROADCAST = solution_code(PART2_SOLUTIONS, "broadcast-parameters")
BUCKETED = solution_code(PART2_SOLUTIONS, "bucketed-ddp")
BUCKETED_AFTER_BACKWARD = BUCKETED.replace(
    "if self._missing[index] == 0:\n            self._launch(index)",
    "pass  # every bucket is all-reduced in finish_gradient_synchronization: no overlap")
assert BUCKETED_AFTER_BACKWARD != BUCKETED

# student -> the second notebook, for those who hand it in
PART2 = {
    "alice": build({"broadcast-parameters": BROADCAST, "bucketed-ddp": BUCKETED},
                   release=PART2_RELEASE),
    # oscar hands in only part 2, and his buckets wait for the end of backward
    "oscar": build({"broadcast-parameters": BROADCAST, "bucketed-ddp": BUCKETED_AFTER_BACKWARD},
                   release=PART2_RELEASE),
}

# student -> (score, status); the most a student can score is MAX_POINTS
EXPECTED = {
    "alice": (26, "graded"),
    "bob": (9, "graded"),
    "carol": (4, "graded"),
    "dave": (9, "graded"),
    "erin": (4, "graded"),
    "heidi": (0, "dropped by nbgrader"),
    "ivan": (0, "dropped by nbgrader"),
    "mallory": (0, "flagged for tampering"),
    "oscar": (11, "graded"),  # 13 of part 2 but the 2 points of the overlap test
}


HOSTILE, HOSTILE_EXPECTED = hostile_class(build, CORRECT, RING, AVERAGE_FLOODS)
SUBMISSIONS.update(HOSTILE)
EXPECTED.update(HOSTILE_EXPECTED)


def solved_release(exercise) -> nbformat.NotebookNode:
    """The student release of ``exercise`` (an :class:`autograder.sources.Exercise`) with every
    solution cell as its source notebook has it: what a student who solved it all hands in."""
    source = nbformat.read(exercise.source, as_version=4)
    answers = {grade_id(cell) for cell in source.cells
               if cell.metadata.get("nbgrader", {}).get("solution")}
    notebook = nbformat.read(exercise.release, as_version=4)
    for cell in notebook.cells:
        if grade_id(cell) in answers:
            cell.source = solution_code(exercise.source, grade_id(cell))
    assert answers and answers <= {grade_id(cell) for cell in notebook.cells}, exercise.slug
    return notebook


def handed_in(student: str) -> dict[str, nbformat.NotebookNode]:
    """The notebooks ``student`` hands in, by slug (every other notebook of the assignment is
    missing from their submission)."""
    notebooks = {}
    if student in SUBMISSIONS:
        notebooks["allreduce_by_hand"] = SUBMISSIONS[student]
    if student in PART2:
        notebooks["bucketed_ddp"] = PART2[student]
    assert notebooks and set(notebooks) <= set(LAYOUT), (student, sorted(LAYOUT))
    return notebooks


def write_class(root: Path, students=None) -> Path:
    """Write ``root/submitted/{student}/05_allreduce/{notebook}.ipynb``; return ``root``."""
    for student in students or EXPECTED:
        folder = root / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True, exist_ok=True)
        for slug, notebook in handed_in(student).items():
            nbformat.write(notebook, folder / f"{slug}.ipynb")
    return root


def gradebook_submissions(out: Path, assignment: str = ASSIGNMENT) -> dict[str, tuple]:
    """What the course gradebook ``out/gradebook.db`` (nbgrader's database) holds for each
    student: (score after the late penalty, as nbgrader export's ``score``, flagged, {grade id:
    score}); a student without a submission is absent."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{out / 'gradebook.db'}") as gradebook:
        return {submission.student.id: (
                    submission.score - (submission.late_submission_penalty or 0.0),
                    any(nb.flagged for nb in submission.notebooks),
                    {grade.name: grade.score for nb in submission.notebooks for grade in nb.grades})
                for submission in gradebook.find_assignment(assignment).submissions}
