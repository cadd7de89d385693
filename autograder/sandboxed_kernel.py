"""A Jupyter kernel manager that starts the student's kernel inside the submission's sandbox.

nbgrader executes a submission through nbclient, which starts its kernel with a
``jupyter_client`` kernel manager; configuring this class as the executor's
``kernel_manager_class`` puts the sandbox's command line (autograder/sandbox.py) in front of the
kernel's own. Two consequences of the sandbox are handled here:

* the kernel lives in its own PID namespace and session, so a SIGINT sent to the launched process
  never reaches it: interrupts go as Jupyter ``interrupt_request`` messages instead (ipykernel
  then interrupts itself), which nbgrader's cell timeout relies on;
* the kernel reads its connection file, and an IPC-transport kernel makes its sockets, in a folder
  the sandbox can write (the worker binds it in): by default jupyter_client would write the
  connection file to ``/tmp``, which is private to the sandbox.

The kernel itself is started as the course starts every headless kernel
(:class:`ddpcourse.kernels.RankServerKernelManager`): its rank server forked before it runs.
"""

from __future__ import annotations

import os
import uuid

from traitlets import List, Unicode

from ddpcourse.kernels import RankServerKernelManager


class SandboxedKernelManager(RankServerKernelManager):
    sandbox_prefix = List(Unicode(), help="The sandbox's command line, up to the wrapped "
                          "command (empty: no sandbox).").tag(config=True)

    connection_dir = Unicode("", help="Where to write the connection file (a folder the sandbox "
                             "can read).").tag(config=True)

    def write_connection_file(self, **kwargs):
        if self.connection_dir and not self.connection_file:
            self.connection_file = os.path.join(self.connection_dir, f"kernel-{uuid.uuid4()}.json")
        super().write_connection_file(**kwargs)

    def format_kernel_cmd(self, extra_arguments=None):
        return [*self.sandbox_prefix, *super().format_kernel_cmd(extra_arguments)]

    @property
    def kernel_spec(self):
        spec = super().kernel_spec
        if spec is not None and self.sandbox_prefix:
            spec.interrupt_mode = "message"
        return spec
