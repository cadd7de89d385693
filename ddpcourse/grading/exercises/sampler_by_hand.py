"""Chapter 06, data loading: visible checks for ``shard_indices``.

The contract is the docstring of ``shard_indices`` in
solutions/06_data_loading/sampler_by_hand.nb.py (students:
exercises/06_data_loading/sampler_by_hand.ipynb). Written by hand: the call runs under a profile
hook (:mod:`ddpcourse.grading.forbidden`) watching ``torch/utils/data/distributed.py``, so no
function of that file may run during it.

Each check is a :class:`~ddpcourse.grading.checks.Case`. In every rank of a real group, the rank
calls the student's function with its own rank for each situation and reports, as plain data, what
came back (the index list, or what else it was, or the exception's type and message) and what the
hook saw. The judge compares first what the ranks hold together (same lengths, every index
covered: invariants of the reports), then each rank's list index by index with the expected list.
The first situation that fails is the one reported, on every rank where it failed.

This module holds no answer (the ranks import it): the expected lists of the visible situations
are written out (:data:`VISIBLE_SHARDS`, held to torch's sampler by
tests/test_grading_sampler_by_hand.py); the hidden checks (autograder/hidden/sampler_by_hand.py)
judge their own situations with torch's own sampler, on the grader's side.
"""

from __future__ import annotations

from torch.utils.data.distributed import DistributedSampler

from ddpcourse.grading.checks import (Case, CheckFailed, cut_text, judge_each_rank, observed,
                                      reported_calls, run_student, safe_text, type_name)

from ddpcourse.grading.forbidden import call_watching

TRUSTED_VERDICTS = True  # every check runs Cases: graded outside the student's kernel

# The file the hook watches: exactly what the profiler reports as a frame's co_filename.
SAMPLER_FILE = DistributedSampler.__init__.__code__.co_filename
MAX_REPORTED_CALLS = 20  # forbidden calls a rank reports (their names, each cut to 200 characters)
MAX_TEXT = 500  # characters of any text a rank reports


# Every visible situation's expected list per rank (torch's sampler's, written out rather than
# computed: the ranks import this module), keyed by the call as a message shows it
# (:func:`situation_key`). Held to torch's own sampler by tests/test_grading_sampler_by_hand.py.
VISIBLE_SHARDS: dict[str, list[int]] = {
    'shard_indices(10, 2, 0, shuffle=False)': [0, 2, 4, 6, 8],
    'shard_indices(10, 2, 1, shuffle=False)': [1, 3, 5, 7, 9],
    'shard_indices(11, 2, 0, shuffle=False)': [0, 2, 4, 6, 8, 10],
    'shard_indices(11, 2, 1, shuffle=False)': [1, 3, 5, 7, 9, 0],
    'shard_indices(10, 3, 0, shuffle=False)': [0, 3, 6, 9],
    'shard_indices(10, 3, 1, shuffle=False)': [1, 4, 7, 0],
    'shard_indices(10, 3, 2, shuffle=False)': [2, 5, 8, 1],
    'shard_indices(11, 3, 0, shuffle=False)': [0, 3, 6, 9],
    'shard_indices(11, 3, 1, shuffle=False)': [1, 4, 7, 10],
    'shard_indices(11, 3, 2, shuffle=False)': [2, 5, 8, 0],
    'shard_indices(10, 2, 0)': [4, 7, 3, 0, 6],
    'shard_indices(10, 2, 1)': [1, 5, 9, 8, 2],
    'shard_indices(11, 2, 0)': [10, 4, 5, 2, 9, 6],
    'shard_indices(11, 2, 1)': [0, 3, 8, 1, 7, 10],
    'shard_indices(10, 2, 0, epoch=1)': [5, 1, 0, 9, 7],
    'shard_indices(10, 2, 1, epoch=1)': [6, 2, 8, 3, 4],
    'shard_indices(11, 2, 0, epoch=1)': [0, 2, 7, 4, 1, 5],
    'shard_indices(11, 2, 1, epoch=1)': [10, 3, 6, 8, 9, 0],
    'shard_indices(11, 2, 0, epoch=1, seed=1)': [3, 10, 1, 5, 7, 9],
    'shard_indices(11, 2, 1, epoch=1, seed=1)': [8, 0, 4, 2, 6, 3],
    'shard_indices(10, 3, 0)': [4, 5, 0, 2],
    'shard_indices(10, 3, 1)': [1, 3, 8, 4],
    'shard_indices(10, 3, 2)': [7, 9, 6, 1],
    'shard_indices(11, 3, 0)': [10, 3, 2, 7],
    'shard_indices(11, 3, 1)': [0, 5, 1, 6],
    'shard_indices(11, 3, 2)': [4, 8, 9, 10],
    'shard_indices(10, 3, 0, epoch=1)': [5, 2, 9, 4],
    'shard_indices(10, 3, 1, epoch=1)': [6, 0, 3, 5],
    'shard_indices(10, 3, 2, epoch=1)': [1, 8, 7, 6],
    'shard_indices(11, 3, 0, epoch=1)': [0, 3, 4, 9],
    'shard_indices(11, 3, 1, epoch=1)': [10, 7, 8, 5],
    'shard_indices(11, 3, 2, epoch=1)': [2, 6, 1, 0],
    'shard_indices(11, 3, 0, epoch=1, seed=1)': [3, 0, 5, 6],
    'shard_indices(11, 3, 1, epoch=1, seed=1)': [8, 1, 2, 9],
    'shard_indices(11, 3, 2, epoch=1, seed=1)': [10, 4, 7, 3],
    'shard_indices(11, 2, 0, drop_last=True)': [10, 4, 5, 2, 9],
    'shard_indices(11, 2, 1, drop_last=True)': [0, 3, 8, 1, 7],
    'shard_indices(11, 2, 0, drop_last=True, shuffle=False)': [0, 2, 4, 6, 8],
    'shard_indices(11, 2, 1, drop_last=True, shuffle=False)': [1, 3, 5, 7, 9],
    'shard_indices(10, 2, 0, drop_last=True, epoch=1)': [5, 1, 0, 9, 7],
    'shard_indices(10, 2, 1, drop_last=True, epoch=1)': [6, 2, 8, 3, 4],
    'shard_indices(11, 3, 0, drop_last=True)': [10, 3, 2],
    'shard_indices(11, 3, 1, drop_last=True)': [0, 5, 1],
    'shard_indices(11, 3, 2, drop_last=True)': [4, 8, 9],
    'shard_indices(11, 3, 0, drop_last=True, shuffle=False)': [0, 3, 6],
    'shard_indices(11, 3, 1, drop_last=True, shuffle=False)': [1, 4, 7],
    'shard_indices(11, 3, 2, drop_last=True, shuffle=False)': [2, 5, 8],
    'shard_indices(10, 3, 0, drop_last=True, epoch=1)': [5, 2, 9],
    'shard_indices(10, 3, 1, drop_last=True, epoch=1)': [6, 0, 3],
    'shard_indices(10, 3, 2, drop_last=True, epoch=1)': [1, 8, 7],
}




def situation_key(dataset_len: int, num_replicas: int, rank: int, kwargs: dict) -> str:
    """How :data:`VISIBLE_SHARDS` names a call: its text, as a message shows it."""
    return _shown((dataset_len, num_replicas, rank), dict(sorted(kwargs.items())))


def written_out_indices(dataset_len: int, num_replicas: int, rank: int, kwargs: dict) -> list[int]:
    """The visible situations' expected lists, from :data:`VISIBLE_SHARDS`."""
    key = situation_key(dataset_len, num_replicas, rank, kwargs)
    if key not in VISIBLE_SHARDS:
        raise LookupError(f"grader bug: no written-out index list for {key}: add it to "
                          "VISIBLE_SHARDS, or judge the situation with the hidden checks")
    return list(VISIBLE_SHARDS[key])


def _shown(args: tuple, kwargs: dict, rank_text: str | None = None) -> str:
    parts = [repr(a) for a in args] + ([rank_text] if rank_text else [])
    parts += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"shard_indices({', '.join(parts)})"


def _is_index_list(value) -> bool:
    return type(value) is list and all(type(v) is int for v in value)


def _cut(text, limit: int = MAX_TEXT) -> str:
    return cut_text(text, limit)


def _safe_text(make) -> str:
    return safe_text(make, MAX_TEXT)


# --- in the rank: what the call gave, as data --------------------------------------------------


def observe_call(shard_indices, args: tuple, kwargs: dict) -> dict:
    """Call the student's function under the hook that watches the sampler's file; report what
    came back and what the hook saw. The hook's findings (``forbidden_calls``, ``hook_removed``)
    are facts of the rank's process, reported by the rank: a determined student could forge them
    there. The judge still recomputes every index itself, so a forged report can only hide a
    shortcut that gave the right answer, never score a wrong one."""
    watched = call_watching(shard_indices, args, kwargs, SAMPLER_FILE)
    result, exc = watched.result, watched.exception
    return {
        "forbidden_calls": [_cut(name, 200) for name in watched.forbidden_calls[:MAX_REPORTED_CALLS]],
        "hook_removed": bool(watched.hook_removed),
        "indices": list(result) if exc is None and _is_index_list(result) else None,
        "type": type_name(result),
        "text": _safe_text(lambda: str(result)[:120]),
        "repr": _safe_text(lambda: repr(result)[:200]),
        "raised": None if exc is None else {"raised": type(exc).__name__,
                                            "message": _safe_text(lambda: exc)},
        # isinstance, not the name: a subclass of ValueError is a ValueError (reported, too)
        "value_error": isinstance(exc, ValueError),
    }


def observe_shards(rank, world_size, shard_indices, cases):
    """Every situation ``(dataset_len, kwargs)`` on this rank, with ``num_replicas = world_size``.
    No collective is needed: the judge compares the ranks."""
    return {"calls": [observe_call(shard_indices, (dataset_len, world_size, rank), kwargs)
                      for dataset_len, kwargs in cases]}


def observe_errors(rank, world_size, shard_indices, errors):
    """Each ``(args, what)`` of a call that must raise ValueError; one process, no group."""
    return {"calls": [observe_call(shard_indices, tuple(args), {}) for args, _ in errors]}


# --- in the judge: the reference, and the verdict ----------------------------------------------


def _first_difference(got: list, expected: list) -> str:
    for position, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            return f"first difference at position {position}: expected {e}, got {g}"
    return (f"the first {min(len(got), len(expected))} agree, then the lengths differ: expected "
            f"{len(expected)} indices, got {len(got)}")


def _preview(values: list, n: int = 14) -> str:
    return "[" + ", ".join(map(str, values[:n])) + (", ...]" if len(values) > n else "]")


def _reported_indices(call) -> list[int] | None:
    """The rank's index list, checked here (the rank only says what it saw), or None."""
    indices = observed(call, "indices", (list, type(None)))
    if indices is not None and not _is_index_list(indices):
        raise CheckFailed("the rank's report has 'indices' that are not a list of ints")
    return indices


def _reported_exception(call) -> tuple[str, str] | None:
    raised = observed(call, "raised", (dict, type(None)))
    if raised is None:
        return None
    return _cut(observed(raised, "raised", str), 200), _cut(observed(raised, "message", str))


def _judge_hook(call, what: str) -> None:
    """The shortcut: any code of the sampler's file ran during the call, or the hook was off."""
    forbidden = observed(call, "forbidden_calls", list)
    if forbidden:
        names = [_cut(name, 200) for name in forbidden[:MAX_REPORTED_CALLS]]
        raise CheckFailed(
            f"{what} ran code of torch/utils/data/distributed.py ({names}): DistributedSampler "
            "is what you are to rebuild, so it must not run during the call. torch.Generator and "
            "torch.randperm are allowed")
    if observed(call, "hook_removed", bool):
        raise CheckFailed(f"{what} changed the profiler hook (sys.setprofile) that watches for "
                          "DistributedSampler: leave it alone")


def _judge_result(call, expected: list[int], what: str) -> None:
    raised = _reported_exception(call)
    if raised is not None:
        raise CheckFailed(f"{what}: expected {_preview(expected)}, but it raised "
                          f"{raised[0]}: {raised[1]}")
    got = _reported_indices(call)
    if got is None:
        raise CheckFailed(f"{what}: expected a list of Python ints (torch's .tolist() gives "
                          f"them), got {_cut(observed(call, 'type', str), 100)}: "
                          f"{_cut(observed(call, 'text', str), 120)}")
    if got != expected:
        raise CheckFailed(f"{what}: expected {_preview(expected)}, got {_preview(got)}; "
                          f"{_first_difference(got, expected)}")


def _judge_shards(everyone: list, dataset_len, num_replicas, drop_last, what) -> None:
    """What the ranks hold together: equal lengths and, without drop_last, the union."""
    if any(shard is None for shard in everyone):
        return  # a rank's own verdict says what is wrong with it
    lengths = [len(shard) for shard in everyone]
    if len(set(lengths)) > 1:
        raise CheckFailed(f"{what} on every rank: the ranks got different numbers of indices "
                          f"{lengths}; every rank must get the same number (else the "
                          "ranks run different numbers of steps and the extra one waits forever "
                          "in DDP's all-reduce)")
    covered = set().union(*everyone) if everyone else set()
    if not drop_last and covered != set(range(dataset_len)):
        missing = sorted(set(range(dataset_len)) - covered)
        extra = sorted(covered - set(range(dataset_len)))
        raise CheckFailed(f"{what} on every rank: together the ranks must cover every index of "
                          f"range({dataset_len}); missing {missing[:10]}, outside it "
                          f"{extra[:10]}")


def judge_shards(observations, world_size, cases):
    """The visible situations' judge: their lists are written out (:data:`VISIBLE_SHARDS`)."""
    judge_shards_with(written_out_indices, observations, world_size, cases)


def judge_shards_with(expected_indices, observations, world_size, cases):
    """Situation by situation, in order; the first that fails on some rank is reported.
    ``expected_indices(dataset_len, num_replicas, rank, kwargs)`` gives a rank's expected list."""
    reports: list = []

    def read_rank(rank, observation):
        reports.append(reported_calls(observation, len(cases)))

    judge_each_rank(observations, read_rank)
    for number, (dataset_len, kwargs) in enumerate(cases):
        calls = [report[number] for report in reports]
        shown = {rank: _shown((dataset_len, world_size, rank), kwargs)
                 for rank in range(world_size)}
        judge_each_rank(calls, lambda rank, call: _judge_hook(call, shown[rank]))
        everyone: list = []
        judge_each_rank(calls, lambda rank, call: everyone.append(_reported_indices(call)))
        _judge_shards(everyone, dataset_len, world_size, kwargs.get("drop_last", False),
                      _shown((dataset_len, world_size), kwargs, "rank"))  # about all the ranks
        judge_each_rank(calls, lambda rank, call: _judge_result(
            call, expected_indices(dataset_len, world_size, rank, kwargs), shown[rank]))


def judge_errors(observations, world_size, errors):
    for args, _ in errors:  # the sampler itself must refuse them, or the exercise text is wrong
        try:
            DistributedSampler(range(args[0]), num_replicas=args[1], rank=args[2])
        except ValueError:
            pass
        else:
            raise RuntimeError(f"DistributedSampler accepted {args}")

    def judge_rank(rank, observation):
        for call, (args, what) in zip(reported_calls(observation, len(errors)), errors):
            shown = f"{_shown(tuple(args), {})} ({what})"
            _judge_hook(call, _shown(tuple(args), {}))
            raised = _reported_exception(call)
            if raised is None:
                raise CheckFailed(f"{shown}: expected ValueError, as DistributedSampler raises, "
                                  f"got {_cut(observed(call, 'repr', str), 200)}")
            if observed(call, "value_error", bool) is not True:
                raise CheckFailed(f"{shown}: expected ValueError, got {raised[0]}: {raised[1]}")

    judge_each_rank(observations, judge_rank)


SHARDS = Case(observe_shards, judge_shards)
BAD_ARGUMENTS = Case(observe_errors, judge_errors)

NO_SHUFFLE = [(10, {"shuffle": False}), (11, {"shuffle": False})]
SHUFFLED = [(10, {}), (11, {}), (10, {"epoch": 1}), (11, {"epoch": 1}),
            (11, {"seed": 1, "epoch": 1})]
DROP_LAST = [(11, {"drop_last": True}), (11, {"shuffle": False, "drop_last": True}),
             (10, {"epoch": 1, "drop_last": True})]
BAD_RANKS = [((10, 2, 2), "rank == num_replicas"), ((10, 3, -1), "a negative rank"),
             ((10, 0, 0), "num_replicas 0")]  # every kind of bad argument the task names


def check_shard_indices_without_shuffle(shard_indices) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size in (2, 3):
        run_student(SHARDS, world_size, shard_indices, NO_SHUFFLE)


def check_shard_indices_shuffled(shard_indices) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size in (2, 3):
        run_student(SHARDS, world_size, shard_indices, SHUFFLED)


def check_shard_indices_drop_last_and_bad_ranks(shard_indices) -> None:
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of tracebacks
    for world_size in (2, 3):
        run_student(SHARDS, world_size, shard_indices, DROP_LAST)
    run_student(BAD_ARGUMENTS, 1, shard_indices, BAD_RANKS, init_process_group=False)
