"""Students out to game the grader: every attack class of the grading-integrity issue, each with
at least two variants, spread over four students (each student costs a grading run, so most try
several attacks at once; each attack's own assertions in tests/test_autograder.py say which).

Each hands in ``allreduce_by_hand`` only. Whatever they try, they must score exactly what their
honest code earns (``EXPECTED`` in ``fake_class``), leave the repository and the other students
untouched, read nothing grader-only, and keep their feedback small.
"""

from __future__ import annotations

SHADOW_RUN_RANKS = ("def run_ranks(fn, world_size, *args, **kwargs):\n"
                    "    return [None] * world_size   # shadows the launcher in this notebook only\n")

# 1. Rebind the checks from inside the graded function (in the ranks), through aliases the
#    static scan cannot follow: the comparison, torch's own comparisons, the report's helpers.
REBIND_IN_RANKS = '''
def average_gradients(model):
    from ddpcourse.grading import checks as grading
    alias = grading
    alias.expect_close = lambda *args, **kwargs: None
    import torch as t
    patched = vars(t)
    patched["allclose"] = lambda *args, **kwargs: True
    patched["equal"] = lambda *args, **kwargs: True
    from ddpcourse.grading.exercises import allreduce_by_hand as case
    vars(case)["type_name"] = lambda value: "None"
'''

# 2. Take over the kernel: wrap every later cell in try/except, and report no exception.
TAKE_OVER_KERNEL = '''
ip = get_ipython()
def swallow(lines):
    return ["try:\\n"] + ["    " + line for line in lines] + ["\\nexcept BaseException:\\n    pass\\n"]
ip.input_transformers_post.append(swallow)
ip.set_custom_exc((BaseException,), lambda *args, **kwargs: None)
'''

# 3. Collectives the in-rank audit cannot see, with point-to-point traffic of a ring's size: a
#    process group of its own from torch's C++ objects (rendezvous through an allowed send; it
#    cannot connect sandboxed ranks), then dist.all_reduce called from a thread.
RING_BEHIND_THE_AUDIT = '''
def ring_allreduce(tensor):
    import threading
    from datetime import timedelta
    rank, world_size = dist.get_rank(), dist.get_world_size()
    port = torch.zeros(1, dtype=torch.int64)
    try:
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=1),
                                  wait_for_workers=False)
            port[0] = store.port
            for peer in range(1, world_size):
                dist.send(port, peer)
        else:
            dist.recv(port, 0)
            store = dist.TCPStore("127.0.0.1", int(port), world_size, False, timedelta(seconds=1))
        dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=1)).allreduce([tensor]).wait()
        return
    except Exception:
        pass
    worker = threading.Thread(target=dist.all_reduce, args=(tensor,))
    worker.start()
    worker.join()
    for chunk in list(tensor.view(-1).tensor_split(world_size))[1:] * 2:  # 2(N-1) chunks
        request = dist.isend(torch.zeros_like(chunk), (rank + 1) % world_size)
        dist.recv(torch.empty_like(chunk), (rank - 1) % world_size)
        request.wait()
'''

# 4. Write what the grader or other students read: from a kernel cell and from inside the ranks.
WRITE_GRADER_FILES = '''
import os, pathlib
import ddpcourse.grading.checks as target
attempts = {}
here = pathlib.Path.cwd()  # OUT/work/STUDENT/autograded/STUDENT/05_allreduce
for path in [pathlib.Path(target.__file__), pathlib.Path(target.__file__).parents[2] / "autograder" / "grade.py",
             here.parents[2] / "gradebook.db", here.parents[4] / "grades.csv",
             here.parents[3] / "alice" / "submitted" / "alice" / "05_allreduce" / "allreduce_by_hand.ipynb"]:
    try:
        with open(path, "a") as f:
            f.write("\\n# tampered\\n")
        attempts[str(path)] = "WROTE"
    except OSError as exc:
        attempts[str(path)] = type(exc).__name__
print(attempts)
'''
AVERAGE_WRITES_FROM_RANK = '''
def average_gradients(model):
    import pathlib
    import ddpcourse.grading.exercises.allreduce_by_hand as case
    for path in (pathlib.Path(case.__file__), pathlib.Path(case.__file__).with_name("tampered.py")):
        try:
            with open(path, "a") as f:
                f.write("\\nimport os  # tampered\\n")
        except OSError:
            pass
    world_size = dist.get_world_size()
    for parameter in model.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad)
            parameter.grad /= world_size
'''

# 5. Output below sys.stdout: file descriptors 1 and 2 of the kernel, and a child process's.
FLOOD_FILE_DESCRIPTORS = '''
import os, subprocess
os.write(1, b"y" * 50_000_000)
os.write(2, b"z" * 20_000_000)
subprocess.run(["sh", "-c", "head -c 30000000 /dev/zero | tr '\\\\0' w"])
'''

# 6. Read the hidden checks, the solutions and the repository's history, and print them.
READ_HIDDEN = '''
import pathlib, subprocess
import ddpcourse
repo = pathlib.Path(ddpcourse.__file__).resolve().parents[1]
for path in [repo / "autograder" / "hidden" / "allreduce_by_hand.py",
             repo / "solutions" / "05_allreduce" / "allreduce_by_hand.nb.py",
             repo / "solutions" / "05_allreduce" / "allreduce_by_hand.ipynb"]:
    try:
        print(path.read_text())
    except OSError as exc:
        print("cannot read", path.name, type(exc).__name__)
print(subprocess.run(["git", "-C", str(repo), "show", "HEAD:autograder/hidden/allreduce_by_hand.py"],
                     capture_output=True, text=True).stdout)
try:
    import autograder.hidden.allreduce_by_hand as hidden_checks
    print(open(hidden_checks.__file__).read())
except Exception as exc:
    print("cannot import the hidden checks:", type(exc).__name__)
'''


def hostile_class(build, correct: dict, ring: str, average_floods: str) -> tuple[dict, dict]:
    """(submissions, expected scores with status) of the hostile students."""
    average = correct["average-gradients"]
    submissions = {
        # takes over the kernel, rebinds the checks in the ranks through aliases the static scan
        # cannot follow (the verdicts ignore them anyway), and shadows run_ranks in the notebook,
        # which must not be flagged: harmless
        "kenji": build({"average-gradients": SHADOW_RUN_RANKS + REBIND_IN_RANKS,
                        "ring-allreduce": ring}, extra_after={"setup": TAKE_OVER_KERNEL}),
        # writes (from a cell and from the ranks) and reads (hidden checks, solutions, history)
        # what only the grader may
        "wanda": build({"average-gradients": AVERAGE_WRITES_FROM_RANK, "ring-allreduce": ring},
                       extra_after={"setup": WRITE_GRADER_FILES, "ring-allreduce": READ_HIDDEN}),
        # ~1 MB from every rank at every call, 100 MB of print, and 100 MB below sys.stdout
        "fiona": build({"average-gradients": average_floods + '\nprint("x" * 100_000_000)',
                        "ring-allreduce": ring}, extra_after={"setup": FLOOD_FILE_DESCRIPTORS}),
        "threader": build({"average-gradients": average, "ring-allreduce": RING_BEHIND_THE_AUDIT}),
    }
    expected = {"kenji": (9, "graded"), "wanda": (13, "graded"), "fiona": (13, "graded"),
                "threader": (4, "graded")}
    return submissions, expected
