# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown] nbgrader={"grade": false, "grade_id": "intro", "locked": true, "schema_version": 3, "solution": false, "task": false}
# # Exercise 09: read the logs
#
# When a distributed job dies, what you get first is a log: several ranks writing into one
# stream, a traceback or two, and torchrun's summary at the end. Reading it well answers three
# questions before you open any code: **which rank failed first, on which line, in which
# collective**. The rank whose traceback you see first is often not the one that failed first.
#
# Below are six real logs, captured by running small failing jobs: five on this course's CPU
# setup (torch 2.13, gloo, 2 ranks under `torchrun`), one on a GPU machine (an NVIDIA H200,
# torch 2.11, NCCL 2.28.9). Each log opens with a header saying the machine, the date, the torch
# version and the exact command that produced it; the scripts are beside the logs, in
# `chapters/09_debugging/captured_logs/` (`failing_job.py` for the CPU logs; `make_logs.py`
# captures them again). For each log, fill in the small dict that `answer_...()` returns: the
# facts the log tells, read from the log (the script may help you understand, but every answer
# is in the log).
#
# **How it is tested.** The tests call your `answer_...` functions in a fresh process and compare
# each field with the facts the grader parses from the same committed logs (the visible checks
# keep only a fingerprint of each fact they ask: their code holds no answer). A wrong field is
# named, with a hint on where in the log to look.
#
# **Self-check** from the repository root: `pytest exercises/09_debugging/read_the_logs.ipynb`.
# Each visible test checks the first fields of one answer (the rank, the line, the collective);
# the hidden tests, run when the notebook is graded, check the other fields (exit codes,
# exception types, shapes, the sequence number, the timeout, NCCL's error name). Keep the
# functions' names as given.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Setup - locked. Run it first, and keep it the FIRST code cell: the tests rely on it.
from ddpcourse.grading import integrity, setup_notebook
from ddpcourse.grading.exercises import read_the_logs as checks

setup_notebook("read_the_logs")


# %% [markdown] nbgrader={"grade": false, "grade_id": "task-child-failed", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 1. A rank raises: `raise.log`
#
# What you need from the lesson:
#
# * Once the default process group exists, every line of a rank's uncaught exception starts with
#   `[rankN]:` (`init_process_group` installs that excepthook). Two ranks' tracebacks may follow
#   each other, or interleave.
# * A rank that only saw its peer disappear fails too, with its own traceback ("Connection closed
#   by peer" on gloo). That is a consequence, not the cause.
# * torchrun ends with a `ChildFailedError` summary: one entry per failed rank with its `exitcode`
#   (1: an uncaught Python exception; a negative number -N: killed by signal N, e.g. -15 SIGTERM,
#   which torchrun's agent sends to the ranks still running once one has failed). Without
#   `@record` its `traceback :` line only points to the docs.

# %% nbgrader={"grade": false, "grade_id": "given-child-failed", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the log, as captured (line numbers added on the left).
checks.show_log("raise")

# %% nbgrader={"grade": false, "grade_id": "child-failed", "locked": false, "schema_version": 3, "solution": true, "task": false}
def answer_child_failed() -> dict:
    """Facts from raise.log, as a dict with the keys:

    * "failing_rank" (int): the rank whose own error ended the job;
    * "line" (int): the line of failing_job.py where that rank's exception was raised (the
      innermost frame of failing_job.py in its traceback);
    * "exception" (str): the type of that exception, e.g. "KeyError";
    * "other_exitcode" (int): the exit code torchrun reports for the other rank.
    """
    ### BEGIN SOLUTION
    return {"failing_rank": 1, "line": 37, "exception": "ValueError", "other_exitcode": -15}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-child-failed", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): answer_child_failed's "failing_rank" and "line" are what raise.log says.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import read_the_logs as checks
integrity.assert_untampered()
checks.check_child_failed(answer_child_failed)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-with-record", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 2. The same failure with `@record`: `raise_record.log`
#
# The same job, with its entry point decorated by `@record`
# (`torch.distributed.elastic.multiprocessing.errors.record`). It writes the uncaught exception,
# with its traceback and a timestamp, to an error file that torchrun gives each worker
# (`error_file:` is no longer `<N/A>`), and torchrun's summary then shows each rank's traceback
# and picks the root cause by the time the exceptions were recorded. Answer from **the summary
# alone** (after `ChildFailedError`), as you would when only the end of a long log survives.

# %% nbgrader={"grade": false, "grade_id": "given-with-record", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the log, as captured (line numbers added on the left).
checks.show_log("raise_record")

# %% nbgrader={"grade": false, "grade_id": "with-record", "locked": false, "schema_version": 3, "solution": true, "task": false}
def answer_with_record() -> dict:
    """Facts from the ChildFailedError summary of raise_record.log, as a dict with the keys:

    * "root_cause_rank" (int): the rank of the summary's root cause;
    * "line" (int): the line of failing_job.py where that rank's exception was raised, read in
      the summary's traceback;
    * "rank0_exitcode" (int): the exit code the summary reports for rank 0;
    * "rank0_exception" (str): the type of the exception in rank 0's entry, e.g. "KeyError".
    """
    ### BEGIN SOLUTION
    return {"root_cause_rank": 1, "line": 37, "rank0_exitcode": -15,
            "rank0_exception": "RuntimeError"}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-with-record", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): answer_with_record's "root_cause_rank" and "line" are what raise_record.log's summary says.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import read_the_logs as checks
integrity.assert_untampered()
checks.check_with_record(answer_with_record)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-timeout", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 3. A collective times out: `timeout.log`
#
# The loop's collectives run in a group created with a 5-second timeout
# (`dist.new_group(timeout=...)`; start-up keeps the default one). When the ranks of a group do
# not call the same collectives in the same order, each waits in its own collective until the
# timeout, and gloo raises `Timed out waiting ...ms`. Its message names no collective: the
# traceback does (the torch.distributed function, and the line of the script that called it).
# Which rank torchrun then lists as the root cause is a matter of which exit it noticed first.

# %% nbgrader={"grade": false, "grade_id": "given-timeout", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the log, as captured (line numbers added on the left).
checks.show_log("timeout")

# %% nbgrader={"grade": false, "grade_id": "timeout", "locked": false, "schema_version": 3, "solution": true, "task": false}
def answer_timeout() -> dict:
    """Facts from timeout.log, as a dict with the keys:

    * "rank0_collective" (str): the torch.distributed collective rank 0 was waiting in, by its
      function's name, e.g. "broadcast";
    * "rank0_line" (int): the line of failing_job.py that called it (the innermost frame of
      failing_job.py in rank 0's traceback);
    * "rank1_collective" (str) and "rank1_line" (int): the same for rank 1;
    * "timeout_ms" (int): how long the ranks waited, in milliseconds, as gloo says.
    """
    ### BEGIN SOLUTION
    return {"rank0_collective": "all_reduce", "rank0_line": 79,
            "rank1_collective": "all_gather", "rank1_line": 56, "timeout_ms": 5000}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-timeout", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): answer_timeout's collective and line of each rank are what timeout.log says.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import read_the_logs as checks
integrity.assert_untampered()
checks.check_timeout(answer_timeout)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-mismatch", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 4. A fingerprint mismatch: `mismatch_detail.log`
#
# With `TORCH_DISTRIBUTED_DEBUG=DETAIL`, every collective is first checked across the ranks: each
# rank sends a `CollectiveFingerPrint` (the collective's sequence number in its group, its type,
# its tensors' shapes, dtypes and devices), and a difference raises at once, "Detected mismatch
# between collectives on ranks", instead of a hang or a wrong result. (DETAIL is for plain
# collectives here: on CPU with torch 2.13 it crashed while building DDP; see the lesson.)

# %% nbgrader={"grade": false, "grade_id": "given-mismatch", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the log, as captured (line numbers added on the left).
checks.show_log("mismatch_detail")

# %% nbgrader={"grade": false, "grade_id": "mismatch", "locked": false, "schema_version": 3, "solution": true, "task": false}
def answer_mismatch() -> dict:
    """Facts from mismatch_detail.log, as a dict with the keys:

    * "collective" (str): the collective both ranks called, by its torch.distributed function's
      name, e.g. "broadcast";
    * "line" (int): the line of failing_job.py that called it;
    * "shape_rank0" and "shape_rank1" (lists of ints): the tensor shape each rank passed;
    * "sequence_number" (int): the collective's sequence number in its group.
    """
    ### BEGIN SOLUTION
    return {"collective": "all_gather", "line": 56, "shape_rank0": [8, 1],
            "shape_rank1": [5, 1], "sequence_number": 9}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-mismatch", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): answer_mismatch's "collective" and "line" are what mismatch_detail.log says.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import read_the_logs as checks
integrity.assert_untampered()
checks.check_mismatch(answer_mismatch)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-killed", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 5. A rank is killed: `sigkill.log`
#
# A process killed by SIGKILL runs no more Python: no traceback, no `finally`, no error file.
# torchrun reports a process ended by a signal with the exit code -N, N the signal's number
# (Python's `subprocess` convention, which torchrun passes on): -9 is SIGKILL (what the Linux OOM
# killer sends when the host runs out of memory), -15 SIGTERM (what torchrun's agent sends to the
# ranks still running once one has failed), -6 SIGABRT (the process aborted itself, e.g. on an
# uncaught C++ exception).

# %% nbgrader={"grade": false, "grade_id": "given-killed", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the log, as captured (line numbers added on the left).
checks.show_log("sigkill")

# %% nbgrader={"grade": false, "grade_id": "killed", "locked": false, "schema_version": 3, "solution": true, "task": false}
def answer_killed() -> dict:
    """Facts from sigkill.log, as a dict with the keys:

    * "failing_rank" (int): the rank that failed first;
    * "exitcode" (int): its exit code, as torchrun reports it;
    * "signal" (str): the signal that ended it, by name, e.g. "SIGINT";
    * "rank0_line" (int): the line of failing_job.py where rank 0 was when it failed;
    * "rank0_exitcode" (int): rank 0's exit code, as torchrun reports it.
    """
    ### BEGIN SOLUTION
    return {"failing_rank": 1, "exitcode": -9, "signal": "SIGKILL", "rank0_line": 47,
            "rank0_exitcode": -15}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-killed", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): answer_killed's "failing_rank" and "exitcode" are what sigkill.log says.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import read_the_logs as checks
integrity.assert_untampered()
checks.check_killed(answer_killed)
print("passed")

# %% [markdown] nbgrader={"grade": false, "grade_id": "task-duplicate-gpu", "locked": true, "schema_version": 3, "solution": false, "task": false}
# ## 6. Two ranks on one GPU: `gpu_duplicate_*.log`
#
# Captured on a machine with a single NVIDIA H200, two ranks launched on it (torch 2.11, NCCL
# 2.28.9, `dup_gpu.py`, kept beside the logs as `gpu_duplicate.py` with the same line numbers).
# NCCL refuses a communicator with two ranks on one device. In
# `gpu_duplicate_no_set_device.log` no rank called `torch.cuda.set_device`, so every rank's
# `"cuda"` is GPU 0, and the error comes with the first collective, which creates NCCL's
# communicator. In `gpu_duplicate_set_device.log` both ranks called `torch.cuda.set_device(0)` and
# passed `device_id` to `init_process_group`, which creates the communicator at once: the error
# comes from `init_process_group`, before its excepthook adds `[rankN]:`, so the two ranks'
# tracebacks are interleaved line by line. (NCCL's "CUDA device 60" is the GPU's PCI bus id,
# `00000000:00:06.0` in `nvidia-smi`, not a CUDA device index.)

# %% nbgrader={"grade": false, "grade_id": "given-duplicate-gpu", "locked": true, "schema_version": 3, "solution": false, "task": false}
# Locked: the logs, as captured (line numbers added on the left).
checks.show_log("gpu_duplicate_no_set_device")
print()
checks.show_log("gpu_duplicate_set_device")

# %% nbgrader={"grade": false, "grade_id": "duplicate-gpu", "locked": false, "schema_version": 3, "solution": true, "task": false}
def answer_duplicate_gpu() -> dict:
    """Facts from gpu_duplicate_no_set_device.log (and, for one key, gpu_duplicate_set_device.log),
    as a dict with the keys:

    * "line" (int): the line of dup_gpu.py where the ranks failed, without set_device;
    * "collective" (str): the torch.distributed function they failed in, e.g. "broadcast";
    * "line_with_device_id" (int): the line of dup_gpu.py where the ranks failed in
      gpu_duplicate_set_device.log;
    * "nccl_error" (str): the name of NCCL's error, e.g. "ncclSystemError".
    """
    ### BEGIN SOLUTION
    return {"line": 14, "collective": "all_reduce", "line_with_device_id": 7,
            "nccl_error": "ncclInvalidUsage"}
    ### END SOLUTION


# %% nbgrader={"grade": true, "grade_id": "test-duplicate-gpu", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false}
# Test (2 points): answer_duplicate_gpu's "line" and "collective" are what gpu_duplicate_no_set_device.log says.
from ddpcourse.grading import integrity
from ddpcourse.grading.exercises import read_the_logs as checks
integrity.assert_untampered()
checks.check_duplicate_gpu(answer_duplicate_gpu)
print("passed")

# %% nbgrader={"grade": true, "grade_id": "test-read-the-logs-hidden", "locked": true, "points": 4, "schema_version": 3, "solution": false, "task": false}
# Hidden tests: they run when your notebook is graded.
# (4 points) the other fields of every answer: exception types, exit codes, the signal, the timeout, the shapes, the sequence number, NCCL's error name.
from ddpcourse.grading import integrity
integrity.assert_untampered()
### BEGIN HIDDEN TESTS
from autograder.hidden import read_the_logs as hidden
hidden.check_read_the_logs(answer_child_failed, answer_with_record, answer_timeout, answer_mismatch, answer_killed, answer_duplicate_gpu)
print("passed")
### END HIDDEN TESTS
