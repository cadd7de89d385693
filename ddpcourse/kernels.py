"""Execute notebooks in kernels that listen on Unix sockets, not TCP ports.

A Jupyter kernel normally talks over five TCP ports that the client picks by binding port 0 and
closing it again; the kernel binds them a moment later. With several notebooks (or graders)
running at once - and gloo opening ephemeral ports for every process group - another process can
take a port in between, and the kernel dies with "Address already in use" (seen in CI while
grading a class two at a time). An IPC kernel uses socket files in a private folder instead: no
ports, nothing to collide.

The kernel is ipykernel, started through :mod:`ddpcourse.launcher.kernel_with_server`
(:class:`RankServerKernelManager`): its notebook's rank server is forked before the kernel starts
its threads, rather than started afterwards as a second interpreter that imports torch again.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from traitlets.config import Config

KERNEL_MODULE = "ipykernel_launcher"
KERNEL_WITH_SERVER = "ddpcourse.launcher.kernel_with_server"


def with_rank_server(argv: list[str]) -> list[str]:
    """A kernel's command line with ipykernel's launcher module replaced by
    :mod:`ddpcourse.launcher.kernel_with_server` (the same kernel, with its rank server forked
    before it starts); any other command as it is."""
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == KERNEL_MODULE:
            return [*argv[:i + 1], KERNEL_WITH_SERVER, *argv[i + 2:]]
    return list(argv)


class RankServerKernelManager(AsyncKernelManager):
    """nbclient's kernel manager, starting the kernel with :func:`with_rank_server`: a second of
    CPU less per notebook (the rank server's own import of torch), and two for a lesson, whose
    first ``prestart()`` would otherwise start a fast server too."""

    def format_kernel_cmd(self, extra_arguments=None):
        return with_rank_server(super().format_kernel_cmd(extra_arguments))


def ipc_kernel_config(socket_dir: str) -> Config:
    """Config that makes any jupyter_client KernelManager start its kernel on IPC sockets."""
    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = os.path.join(socket_dir, "kernel")
    config.NotebookClient.kernel_manager_class = RankServerKernelManager
    return config


# A kernel that imported torch spends seconds of its shutdown in the interpreter's last garbage
# collections over torch's many objects (2.4-3.5 s against 0.3-0.5 s without torch, measured on
# 2 busy cores), and the client waits for it after every notebook. Freezing the heap in an atexit
# handler (registered first, so it runs after torch's own handlers) leaves those objects to the
# operating system, as a plain ``python -c "import torch"`` exit does; the kernel's outputs are
# all sent by then.
FAST_EXIT = "__import__('atexit').register(__import__('gc').freeze)"
# As a kernel's command-line argument: each such argument appends one line to ``exec_lines``, so
# it combines with other ``exec_lines`` arguments (nbgrader_config.py passes one).
FAST_EXIT_ARGUMENT = f"--IPKernelApp.exec_lines={FAST_EXIT}"


def without_output_widget_mirror(client: NotebookClient) -> None:
    """Stop ``client`` from mirroring Output widgets. nbclient's mirror (nbclient/output_widget.py)
    answers every output an Output widget captures with a comm_msg on the shell channel while the
    cell still runs, and with ipykernel 7 a cell that did so (lesson 11's ipywidgets.interact)
    sometimes never got its execute_reply: the kernel idle, every thread of it waiting (its stacks,
    from a quiet run), the client waiting for the reply until its timeout. ipykernel 7 answers the
    shell from a thread of its own and has lost shell messages before (ipython/ipykernel#1529,
    #1554). Nothing run headless shows a widget's output: the course site replaces widgets with a
    note, and a grade never reads one."""
    client.widget_registry = {}


def ipc_client(nb, socket_dir: str, cwd: Path, timeout: int, kernel_name: str = "python3",
               config: Config | None = None, **client_options) -> NotebookClient:
    """A NotebookClient that starts (and, owning it, shuts down) an IPC kernel in ``cwd``;
    ``config`` is merged in (e.g. a kernel manager that starts the kernel in a sandbox)."""
    merged = ipc_kernel_config(socket_dir)
    if config is not None:
        merged.merge(config)
    extra = [*client_options.pop("extra_arguments", []), FAST_EXIT_ARGUMENT]
    client = NotebookClient(nb, config=merged, kernel_name=kernel_name, extra_arguments=extra,
                            timeout=timeout, resources={"metadata": {"path": str(cwd)}},
                            **client_options)
    without_output_widget_mirror(client)
    return client


def execute_notebook(nb, cwd: Path, timeout: int, **client_options):
    """Execute ``nb`` in place in a fresh IPC kernel started in ``cwd``; returns ``nb``."""
    with tempfile.TemporaryDirectory(prefix="ddpcourse-kernel-") as socket_dir:
        ipc_client(nb, socket_dir, cwd, timeout, **client_options).execute()
    return nb
