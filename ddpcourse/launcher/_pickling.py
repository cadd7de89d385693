"""Pickle a rank's job by value, keeping what makes a traceback readable.

cloudpickle sends functions defined in ``__main__`` (a script, a notebook cell) by value, which is
what lets a notebook-defined function run in another process. It also renames their code's file to
``<dynamic-code>``, which would turn every traceback and stack dump from a rank into line numbers
without source. We keep the real file name, and send along the source of notebook cells (IPython
keeps it in ``linecache``, not on disk), so a student sees their own lines in a rank's traceback.
"""

from __future__ import annotations

import io
import linecache
import types
from collections import ChainMap

import cloudpickle

_DYNAMIC = "<dynamic-code>"


def _code_reduce_keeping_filename(code: types.CodeType):
    constructor, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)
    args = tuple(code.co_filename if arg == _DYNAMIC else arg for arg in args)
    return constructor, args


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap(
        {types.CodeType: _code_reduce_keeping_filename}, cloudpickle.Pickler.dispatch_table
    )


def dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


def in_memory_sources() -> dict:
    """linecache entries that exist only in memory (notebook cells), to install in a rank."""
    return {
        name: entry
        for name, entry in list(linecache.cache.items())
        if len(entry) == 4 and entry[1] is None
    }
