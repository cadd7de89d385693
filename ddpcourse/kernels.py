"""Execute notebooks in kernels that listen on Unix sockets, not TCP ports.

A Jupyter kernel normally talks over five TCP ports that the client picks by binding port 0 and
closing it again; the kernel binds them a moment later. With several notebooks (or graders)
running at once - and gloo opening ephemeral ports for every process group - another process can
take a port in between, and the kernel dies with "Address already in use" (seen in CI while
grading a class two at a time). An IPC kernel uses socket files in a private folder instead: no
ports, nothing to collide.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient


def ipc_kernel_manager(socket_dir: str, kernel_name: str = "python3") -> AsyncKernelManager:
    return AsyncKernelManager(kernel_name=kernel_name, transport="ipc",
                              ip=os.path.join(socket_dir, "kernel"))


def execute_notebook(nb, cwd: Path, timeout: int, **client_options):
    """Execute ``nb`` in place in a fresh IPC kernel started in ``cwd``; returns ``nb``."""
    with tempfile.TemporaryDirectory(prefix="ddpcourse-kernel-") as socket_dir:
        client = NotebookClient(nb, km=ipc_kernel_manager(socket_dir), timeout=timeout,
                                resources={"metadata": {"path": str(cwd)}}, **client_options)
        client.execute()
    return nb
