"""Hidden checks for chapter 03: more hostlist forms, any Mapping, bad node ids, 2 x 2 launch.
Every check runs the visible module's Cases (the environments are passed as data; "frozen" asks
the rank for a read-only Mapping), so it runs only in the trusted grader. Each case states its
hostlist's first host; :func:`first_host` is the grader's reference parser, which the tests hold
the cases to (tests/test_grading_torchrun_from_slurm.py), kept here because it is the exercise's
answer."""

from __future__ import annotations

import re

from ddpcourse.grading.checks import run_student
from ddpcourse.grading.exercises.torchrun_from_slurm import ARGVS, ERRORS, launch_nodes, slurm_env


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist such as ``node-[003-004],login1`` (one bracket group
    per item at most)."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    item = nodelist[:end]
    match = re.fullmatch(r"([^\[\]]*)\[([^\]]*)\](.*)", item)
    if not match:
        return item
    prefix, ranges, suffix = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


CASES = [  # (env, script, port, what, the first host of its SLURM_JOB_NODELIST[, "frozen"])
    (slurm_env(3, 2, "node-[003-004],login1", 2), "train.py", 29500,
     "zero-padded range, then a plain host", "node-003"),
    (slurm_env(3, 0, "a[3,1-2]"), "train.py", 29500, "the first number listed, not the smallest",
     "a3"),
    (slurm_env(2, 1, "gpu[01-02]-ib", 4), "train.py", 40000, "a suffix after the brackets",
     "gpu01-ib"),
    (slurm_env(3, 1, "login1,node-[003-004]"), "train.py", 29500,
     "a plain host first, brackets later", "login1"),
    (slurm_env(2, 0, "c[9-10]"), "train.py", 29500, "no padding in 9-10", "c9"),
    (slurm_env(2, 1, "x[0010-0011]"), "train.py", 29500, "four-digit padding", "x0010"),
    (slurm_env(2, 1, "gpu[07-08]", 2), "/scratch/job/train.py", 65000, "a read-only Mapping",
     "gpu07", "frozen"),
    (dict(slurm_env(2, 1, "gpu[07-08]", 4), SLURM_PROCID="5", SLURM_LOCALID="0"), "train.py",
     29500, "SLURM_PROCID is not the node id", "gpu07"),
]
MISSING = [
    (slurm_env(2, 2, "gpu[07-08]"), ("SLURM_NODEID",), "SLURM_NODEID equal to SLURM_NNODES"),
    (slurm_env(2, -1, "gpu[07-08]"), ("SLURM_NODEID",), "a negative SLURM_NODEID"),
    ({"SLURM_NODEID": "0"}, ("SLURM_NNODES", "SLURM_JOB_NODELIST"), "only SLURM_NODEID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu07"},
     ("SLURM_NNODES", "SLURM_NODEID"), "task variables but no node variables"),
]


def check_torchrun_argv(fn) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    run_student(ARGVS, 1, fn, CASES, init_process_group=False, hide_internals=True)
    run_student(ERRORS, 1, fn, MISSING, init_process_group=False, hide_internals=True)
    launch_nodes(fn, 2, "127.0.0.[1-2]", "127.0.0.1", gpus=2, hide_internals=True)  # 2 x 2
