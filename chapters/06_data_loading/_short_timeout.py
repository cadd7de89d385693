"""A process group with a short demo timeout whose clock starts only once every rank is ready.

The chapter's hang demos turn a wait that never ends into an error after a few seconds. Start-up
is slow and uneven on a loaded machine: creating processes, importing torch, and the first
``DistributedDataParallel(...)`` or optimizer, which imports ``torch._dynamo`` (seconds; see
``DistributedDataParallel.__init__`` in torch/nn/parallel/distributed.py, which reads
``torch._dynamo.utils.get_optimize_ddp_mode()``). A short timeout that counted that time would
fire on start-up skew instead of on the bug being shown. So :func:`short_timeout_group` pays
those costs first, waits for every rank at a barrier of the patient default group, and only then
creates the short-timeout group (and meets once more, so no rank starts using it before all have
it).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


def short_timeout_group(timeout_s: float) -> dist.ProcessGroup:
    """All ranks: a new group over the world whose collectives time out after ``timeout_s``."""
    import torch._dynamo  # noqa: F401  (what DDP's constructor would import inside the short clock)

    dist.barrier()  # default group, patient timeout: absorbs start-up skew
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    dist.barrier()  # every rank has the group before any rank uses it
    return group
