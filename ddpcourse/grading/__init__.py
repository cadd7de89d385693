"""What graded exercises share: the notebook's locked setup, tamper checks, and rank-side audits.

* :func:`setup_notebook` - called by every exercise's locked first cell.
* :mod:`ddpcourse.grading.integrity` - notices when notebook code replaced what the tests rely on.
* :mod:`ddpcourse.grading.comm_audit` - counts what a rank sends and which collectives it calls.
* :mod:`ddpcourse.grading.checks` - run a student's function in clean ranks and compare;
  ``agree`` ends a failed case on every rank at once (no peer left waiting in a collective).
* ``ddpcourse.grading.exercises.<slug>`` - each exercise's visible checks, one module per
  exercise: health_check (bus bandwidth, an all-reduce self-test that can fail),
  ddp_same_as_one_process (DDP on shares = one process), memory_per_rank (bytes per rank, DDP vs
  FSDP2, measured), torchrun_from_slurm (torchrun flags from SLURM, launched for real),
  ranks_from_env (ranks from the environment), allreduce_by_hand (average_gradients, ring
  all-reduce), bucketed_ddp (broadcast, BucketedDDP), sampler_by_hand (DistributedSampler's
  indices by hand), train_steps (gradient accumulation with one all-reduce per step),
  global_metrics (exact loss and accuracy of a whole data set), fix_the_loop (a DDP loop's three
  silent bugs: a head outside DDP, a summed loss, a rank's own loss logged),
  resumable_checkpoint (save on rank 0 atomically, load on every rank, resume bit for bit),
  survive_a_killed_worker (a loop that resumes after torchrun restarts a killed worker),
  and chapter 09's labs, broken jobs to fix: ddp_errors (an unused head, a checkpoint through the
  wrapper, reentrant checkpointing), collectives_that_hang (collectives one rank makes alone),
  wrong_numbers (padded evaluation, set_epoch, no_sync), replicas_that_disagree (the rank from
  the wrong variable, a module outside the wrapper, unbroadcast buffers), read_the_logs (real
  captured logs, answered in a small structure).
  Hidden checks are grader-only, in ``autograder.hidden.<slug>``.
* :mod:`ddpcourse.grading.forbidden` - run a student's function under a profile hook that sees
  whether a forbidden shortcut (the library function to be rebuilt) ran.
* :mod:`ddpcourse.grading.notebook_runner` - execute a notebook and report each test cell.
"""

__all__ = ["setup_notebook"]


def __getattr__(name: str):
    # Imported on first use (it imports torch): processes that only pass data on, such as the
    # one-rank hosts of the autograder, import ddpcourse.grading without paying for torch.
    if name == "setup_notebook":
        from ddpcourse.grading.notebook_guard import setup_notebook

        return setup_notebook
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
