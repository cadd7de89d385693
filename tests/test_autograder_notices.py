"""autograder.notices: what the grading machine's paths look like on a student's feedback page."""

from __future__ import annotations

import sys
import sysconfig
import tempfile
from pathlib import Path

import chromium_page

from autograder.notices import hide_machine_paths, make_readable, write_notice

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = sysconfig.get_paths()["purelib"]
TMP = tempfile.gettempdir()

TRACEBACK = f'''Traceback (most recent call last):
  File "{TMP}/ipykernel_4821/2231904.py", line 7, in average_gradients
  File "{LIBRARIES}/torch/distributed/c10d_logger.py", line 81, in wrapper
  File "{ROOT}/ddpcourse/grading/relay.py", line 120, in all_reduce
  File "{sys.base_prefix}/lib/python3.11/threading.py", line 9, in wait
RuntimeError: see {TMP}/autograde-1a2b/alice/log.txt or {Path.home()}/notes.txt'''


def test_each_machine_path_becomes_what_a_student_can_read():
    text = hide_machine_paths(TRACEBACK, in_html=False)
    assert text.splitlines()[1:] == [
        '  File "<notebook cell>", line 7, in average_gradients',
        '  File "torch/distributed/c10d_logger.py", line 81, in wrapper',
        '  File "ddpcourse/grading/relay.py", line 120, in all_reduce',
        '  File "threading.py", line 9, in wait',
        "RuntimeError: see <tmp>/autograde-1a2b/alice/log.txt or ~/notes.txt"]


def test_on_a_page_the_labels_are_escaped_and_links_kept():
    link = f'<a href="https://example.org{TMP}/x">https://example.org{TMP}/x</a>'
    text = hide_machine_paths(f"<pre>{TRACEBACK}</pre>{link}")
    assert "&lt;notebook cell&gt;" in text and "&lt;tmp&gt;/autograde-1a2b" in text
    assert "<notebook cell>" not in text and "<tmp>" not in text
    assert text.endswith(link)  # a path inside a URL is not the machine's


def test_make_readable_leaves_no_path_of_the_machine(tmp_path):
    page = tmp_path / "page.html"
    page.write_text(f"<html><head></head><body><pre>{TRACEBACK}</pre></body></html>")
    make_readable(page)
    text = page.read_text()
    for where in (str(ROOT), LIBRARIES, sys.prefix, sys.base_prefix, TMP, str(Path.home())):
        assert where + "/" not in text, where


@chromium_page.needs_chromium
def test_a_notice_with_long_lines_fits_a_1280_pixel_window_in_chromium(tmp_path):
    """A timed-out or crashed worker's notice quotes its log: a line with no space in it (a long
    tensor, a path) wraps instead of widening the page."""
    page = tmp_path / "notice.html"
    write_notice(page, "heidi", "05_allreduce", "timed out",
                 TRACEBACK + "\ngot " + "0.125," * 120 + "\n" + "x" * 400)
    laid_out = chromium_page.layout(page, tmp_path / "measured.html", width=1280)
    assert laid_out["page"] <= 1280 and not laid_out["wider"], laid_out
