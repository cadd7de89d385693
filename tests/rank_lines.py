"""Reading a check's message rank by rank, as ``ddpcourse.grading.checks.by_rank`` writes it:
``rank 1: why`` for one rank, ``ranks 0 and 1: why`` for ranks that failed the same way."""

from __future__ import annotations

import re

_HEAD = re.compile(r"^ranks? ((?:\d+, )*\d+(?: and \d+)?): ", re.MULTILINE)


def ranks_named(text: str) -> list[int]:
    """Every rank a line of ``text`` starts with, sorted."""
    return sorted(int(rank) for head in _HEAD.finditer(text)
                  for rank in re.findall(r"\d+", head[1]))


def message_of(text: str, rank: int) -> str:
    """What ``text`` says of ``rank``: its line and the lines after it, up to the next rank's."""
    heads = list(_HEAD.finditer(text))
    for head, after in zip(heads, heads[1:] + [None]):
        if rank in map(int, re.findall(r"\d+", head[1])):
            return text[head.end():after.start() if after else len(text)].rstrip("\n")
    raise AssertionError(f"rank {rank} is not named in: {text[:500]}")


def names_ranks_first(text: str) -> bool:
    """Whether ``text`` starts by naming the ranks it is about."""
    return _HEAD.match(text) is not None
