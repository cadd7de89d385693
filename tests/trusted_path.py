"""What the grading tests share to run checks the way the autograder does (autograder/trusted.py).

``host`` (a fixture in conftest.py) is one observation host per test module; :func:`submitted`
turns a function into what the student's kernel leaves behind; :func:`altered` damages a rank's
report, for the tests that prove a judge reads reports as untrusted data.
"""

from __future__ import annotations

import copy
import sys

import cloudpickle

from ddpcourse.launcher import pickle_by_value


def submitted(fn, host, relayed=None):
    """``fn`` as the kernel leaves it: pickled by value. A notebook's functions live in
    ``__main__``; a test module's would be pickled by reference, and the host cannot import
    test modules, so those are sent by value too. ``relayed``: the ranks of communication-
    audited cases (autograder/relayed.py)."""
    from autograder import trusted  # here: ranks rebuilding a test's function must not import it

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is not None and module.__name__.split(".")[-1].startswith("test_"):
        cloudpickle.register_pickle_by_value(module)
    return trusted.SubmittedFunction(fn.__name__, pickle_by_value(fn), host, relayed)


def altered(report, path, value):
    """A deep copy of ``report`` with the field at ``path`` (keys and indexes) set to ``value``;
    an empty path replaces the whole report."""
    if not path:
        return value
    report = copy.deepcopy(report)
    inner = report
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return report
