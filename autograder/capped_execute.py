"""nbgrader's ``Execute`` preprocessor, with caps on the output it stores, enforced where that
output arrives: in the grading process, not in the student's kernel.

The locked setup cell caps ``sys.stdout`` and ``sys.stderr`` inside the kernel
(ddpcourse/grading/notebook_guard.py), but the student controls that kernel: ``os.write(1, ...)``
from a cell or from a subprocess bypasses it, and ipykernel forwards whatever reaches its file
descriptors as stream messages. So this preprocessor sizes every message nbclient receives
(stream text, display data of any mime type, execute results, errors, display updates, widget
messages) per cell and per notebook, stores nothing past the caps (an output that does not fit
keeps what fits of its text, or of its plain-text form), and ends a cut cell with one notice
saying how much was dropped. nbgrader's autograde uses it in place of ``Execute``
(``Autograde.autograde_preprocessors`` in autograder/nbgrader_config.py).

The caps count what the output takes in the saved notebook (JSON-escaped UTF-8, plus the
indentation nbformat gives each line of text), so they bound the autograded notebook and its
feedback; the notice counts the dropped text's own bytes, which is what the student wrote.

A cap must never change a grade. nbgrader scores a test cell 0 when it shows an error or stderr
output, and partial credit from an execute result (``nbgrader.utils.determine_grade``), so in
grade cells the first output of each of those kinds is always kept, cut down to
``grading_output_bytes`` when it does not fit.

It also remembers where a notebook's execution stopped for good (``STOPS``): nbgrader drops a
submission whose kernel died or could not be interrupted, and the grader then tells the student
which cell did it from this record, instead of executing the notebook a second time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat.v4 import new_output
from nbgrader.preprocessors import Execute
from nbgrader.utils import is_grade
from traitlets import Integer

from ddpcourse.kernels import without_output_widget_mirror

# The kernel-side cap of the locked setup cell (ddpcourse/grading/notebook_guard.py), which this
# module does not import: that would bring torch into the grading process.
MAX_CELL_OUTPUT_BYTES = 200_000
MAX_NOTEBOOK_OUTPUT_BYTES = 2_000_000
GRADING_OUTPUT_BYTES = 2_000
_LINE_OVERHEAD = 8  # per line of text in a saved notebook: quotes, comma, newline, indentation


def output_size(value) -> int:
    """Bytes ``value`` (anything JSON) takes in a saved notebook, slightly overestimated."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return len(text.encode("utf-8", "surrogatepass")) + _LINE_OVERHEAD * text.count("\\n")


def text_bytes(value) -> int:
    """Bytes of text in ``value`` (anything JSON): what a student would call its size."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _payload_bytes(content: dict) -> int:
    """:func:`text_bytes` of a message's content, less its stream name and transient data."""
    return text_bytes({k: v for k, v in content.items() if k not in ("name", "transient")})


def prefix_within(text: str, budget: int) -> str:
    """The longest-ish prefix of ``text`` whose :func:`output_size` is at most ``budget``."""
    piece = text[:max(budget, 0)]
    size = output_size(piece)
    while piece and size > budget:
        piece = piece[:min(len(piece) - 1, len(piece) * budget // size)]
        size = output_size(piece)
    return piece


def cut_error(content: dict, budget: int) -> dict:
    """An error's content within about ``budget`` bytes: its name, the start of its message and
    the last lines of its traceback (where the exception is)."""
    ename = prefix_within(str(content.get("ename", "")), 200)
    evalue = prefix_within(str(content.get("evalue", "")), budget // 4)
    room = budget - output_size(ename) - output_size(evalue) - 100
    kept: list[str] = []
    traceback = content.get("traceback") or []
    for line in reversed(traceback):
        size = output_size(line) + 2
        if size > room:
            if room > 50:
                kept.append(prefix_within(line, room) + " ...")
            break
        kept.append(line)
        room -= size
    if len(kept) < len(traceback):
        kept.append(f"... {len(traceback) - len(kept)} lines of traceback cut ...")
    return {"ename": ename, "evalue": evalue, "traceback": kept[::-1]}


def _grading_kind(msg: dict) -> str | None:
    """Which kind of output, if any, ``nbgrader.utils.determine_grade`` scores on."""
    msg_type = msg["msg_type"]
    if msg_type == "error":
        return "error"
    if msg_type == "stream" and msg["content"].get("name") == "stderr":
        return "stderr"
    if msg_type == "execute_result":
        return "result"
    return None


def _cut(msg: dict, budget: int) -> dict | None:
    """``msg`` with its content cut to about ``budget`` bytes, or None if nothing useful fits."""
    content, msg_type = msg["content"], msg["msg_type"]
    if msg_type == "stream":
        text = prefix_within(content.get("text", ""), budget - 40)
        return dict(msg, content=dict(content, text=text)) if text else None
    if budget < 200:
        return None
    if msg_type == "error":
        return dict(msg, content=cut_error(content, budget))
    plain = content.get("data", {}).get("text/plain")
    if isinstance(plain, str):  # display data and results: their plain text alone, cut
        data = {"text/plain": prefix_within(plain, budget - 100)}
        return dict(msg, content=dict(content, data=data, metadata={}))
    return None


@dataclass
class Stop:
    """Where and why a notebook's execution stopped before its end: the code cell that was
    running, and whether it had run past its timeout (the kernel could not be interrupted),
    killed its kernel, or failed otherwise."""

    cell_index: int
    cells: int  # the notebook's cells, as executed
    source: str
    why: str  # "blocked", "died" or "failed"
    error: str  # the exception, as nbclient raised it


# notebook name (its file's stem) -> where its execution stopped, for the notebooks this process
# executed (a grading worker executes one submission)
STOPS: dict[str, Stop] = {}


@dataclass
class _Tally:
    kept: int = 0
    dropped: int = 0
    grading_kinds: set[str] = field(default_factory=set)


class CappedExecute(Execute):
    """nbgrader's Execute, storing at most ``max_cell_output_bytes`` of output per cell and
    ``max_notebook_output_bytes`` per notebook (see the module docstring)."""

    max_cell_output_bytes = Integer(
        MAX_CELL_OUTPUT_BYTES, help="bytes of output kept per cell; the rest is dropped"
    ).tag(config=True)
    max_notebook_output_bytes = Integer(
        MAX_NOTEBOOK_OUTPUT_BYTES, help="bytes of output kept per notebook; the rest is dropped"
    ).tag(config=True)
    grading_output_bytes = Integer(
        GRADING_OUTPUT_BYTES,
        help="size that a grade cell's first error, stderr or execute result is cut to when it "
             "does not fit under the caps: it is kept all the same, because the grade depends "
             "on it",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        without_output_widget_mirror(self)  # as the course's other headless runs

    def reset_execution_trackers(self) -> None:
        super().reset_execution_trackers()
        self._notebook_kept = 0
        self._tallies: dict[int, _Tally] = {}
        self._cell_index = -1

    def preprocess(self, nb, resources=None, km=None):
        name = ((resources or {}).get("metadata") or {}).get("name") or ""
        STOPS.pop(name, None)
        self._stopped = None
        try:
            return super().preprocess(nb, resources, km)
        finally:
            if self._stopped is not None:
                STOPS[name] = self._stopped

    def preprocess_cell(self, cell, resources, cell_index):
        try:
            return super().preprocess_cell(cell, resources, cell_index)
        except Exception as exc:
            # With interrupt_on_timeout, a cell past its timeout is interrupted and execution
            # goes on; nbclient raises CellTimeoutError only when the kernel then still does not
            # answer: it could not be interrupted.
            why = ("blocked" if isinstance(exc, CellTimeoutError) else
                   "died" if isinstance(exc, DeadKernelError) else "failed")
            self._stopped = Stop(cell_index, len(self.nb.cells), cell.source, why,
                                 f"{type(exc).__name__}: {exc}")
            raise

    def _tally(self, cell_index: int) -> _Tally:
        return self._tallies.setdefault(cell_index, _Tally())

    def _room(self, tally: _Tally) -> int:
        return max(0, min(self.max_cell_output_bytes - tally.kept,
                          self.max_notebook_output_bytes - self._notebook_kept))

    def _keep(self, tally: _Tally, size: int) -> None:
        tally.kept += size
        self._notebook_kept += size

    def process_message(self, msg, cell, cell_index):
        self._cell_index = cell_index
        return super().process_message(msg, cell, cell_index)

    def output(self, outs, msg, display_id, cell_index):
        tally = self._tally(cell_index)
        size, room = output_size(msg["content"]), self._room(tally)
        if size > room:
            kind = _grading_kind(msg)
            must_keep = (kind is not None and kind not in tally.grading_kinds
                         and is_grade(self.nb.cells[cell_index]))
            cut = _cut(msg, max(room, self.grading_output_bytes) if must_keep else room)
            tally.dropped += _payload_bytes(msg["content"])
            if cut is None:
                return None
            tally.dropped -= _payload_bytes(cut["content"])
            msg, size = cut, output_size(cut["content"])
        self._keep(tally, size)
        kind = _grading_kind(msg)
        if kind:
            tally.grading_kinds.add(kind)
        return super().output(outs, msg, display_id, cell_index)

    def _update_display_id(self, display_id, msg):
        if display_id in self._display_id_map:
            tally = self._tally(self._cell_index)
            size = output_size(msg["content"])
            if size > self._room(tally):
                tally.dropped += _payload_bytes(msg["content"])
                return
            self._keep(tally, size)
        super()._update_display_id(display_id, msg)

    def handle_comm_msg(self, outs, msg, cell_index):
        tally = self._tally(cell_index)
        buffers = sum(memoryview(b).nbytes for b in msg.get("buffers") or [])
        size = output_size(msg["content"]) + buffers * 4 // 3  # buffers are saved in base64
        if size > self._room(tally):
            tally.dropped += _payload_bytes(msg["content"]) + buffers
            return
        self._keep(tally, size)
        super().handle_comm_msg(outs, msg, cell_index)

    def on_cell_executed(self, **kwargs):
        cell, cell_index = kwargs["cell"], kwargs["cell_index"]
        tally = self._tally(cell_index)
        before = len(cell.outputs)
        super().on_cell_executed(**kwargs)  # adds the reply's error when no error output matched
        added = cell.outputs[before:]
        del cell.outputs[before:]
        for output in added:
            room = self._room(tally)
            if output_size(output) > room:
                whole = text_bytes(output)
                budget = max(room, self.grading_output_bytes) if is_grade(cell) else room
                if budget < 200:
                    tally.dropped += whole
                    continue
                output.update(cut_error(output, budget))
                tally.dropped += whole - text_bytes(output)
            self._keep(tally, output_size(output))
            cell.outputs.append(output)
        if tally.dropped:
            cell.outputs.append(new_output("display_data", data={"text/plain": self.notice(tally)}))

    def notice(self, tally: _Tally) -> str:
        return (f"[output cut: {tally.dropped:,} bytes of this cell's output were dropped; "
                f"grading keeps at most {self.max_cell_output_bytes:,} bytes per cell and "
                f"{self.max_notebook_output_bytes:,} per notebook]")
