"""Import a chapter's script by its path, under a name of its own.

Chapters 07 and 08 both have a ``train.py``: a plain ``import train`` gets whichever chapter
folder comes first on ``sys.path``. Scripts and tests that need another chapter's file import it
as, say, ``ch07_train`` with :func:`import_by_path`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_by_path(name: str, path: Path, by_value: bool = False) -> ModuleType:
    """The file ``path`` imported as module ``name``, once per process. ``by_value``: the
    module's functions travel to ranks by value (cloudpickle), since the ranks cannot import it
    by that name."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: dataclasses look their module up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    if by_value:
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[name])
    return sys.modules[name]
