"""A Jupyter kernel whose warm rank server is forked before the kernel starts its threads.

    python -m ddpcourse.launcher.kernel_with_server -f CONNECTION_FILE   (ipykernel's arguments)

A kernel runs threads of its own, so its rank server cannot be forked from it once it runs
(:func:`ddpcourse.launcher._server_client.can_fork_a_server`): it would be started afresh and
import torch a second time, about a second of CPU per notebook. Here torch is imported and the
warm server forked while this process has one thread only; then ipykernel runs in this same
process, and its notebook's ``run_ranks`` calls use that server. The course starts its headless
kernels so (:class:`ddpcourse.kernels.RankServerKernelManager`: the lessons' and exercises' runs,
the grader's).
"""

from __future__ import annotations

import sys

import torch  # noqa: F401 - before the fork: the server must have it, and the notebook will

from ddpcourse.launcher import fork_server_now

if __name__ == "__main__":
    fork_server_now(dynamo=True)
    if sys.path and sys.path[0] == "":  # as ipykernel_launcher: not the kernel's cwd on the path
        del sys.path[0]
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()
