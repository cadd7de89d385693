"""A feedback page as a student's browser lays it out: Debian's Chromium, headless, in a window of a
given width. The grading tests use it to check that nothing runs off the page's right edge.

The page is copied with a script that measures the laid-out page once it has loaded (the
document's width, and every element whose content is wider than its box: a ``<pre>`` that
scrolls sideways hides the end of its lines just as a page that runs off the window does), and
Chromium's ``--dump-dom`` prints the measurement. A screenshot of the first screenful is saved
beside the copy for a person to look at.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser")
MEASURE = """<script>
window.addEventListener("load", () => {
  const wider = [...document.querySelectorAll("body *")].filter(element => {
    const box = element.getBoundingClientRect();
    const scrolls = getComputedStyle(element).overflowX !== "visible"
      && element.scrollWidth > element.clientWidth + 1;
    return scrolls || box.right > window.innerWidth + 1;
  });
  document.body.dataset.layout = JSON.stringify({
    window: window.innerWidth,
    page: document.documentElement.scrollWidth,
    wider: wider.map(element => element.tagName.toLowerCase() + ": "
                     + element.textContent.trim().slice(0, 80)),
  });
});
</script>"""


def browser() -> str | None:
    """The Chromium on this machine, or None."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


needs_chromium = pytest.mark.skipif(
    browser() is None, reason="needs Debian's chromium (apt-get install chromium): the feedback "
                              "pages are laid out in a real browser")


def _chromium(*args: str) -> str:
    command = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--virtual-time-budget=5000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def layout(page: Path, copy_to: Path, width: int = 1280, height: int = 900) -> dict:
    """``page`` laid out in a window ``width`` pixels wide: {"window": its width, "page": the
    document's width, "wider": the elements wider than their box or the window}. Also writes
    ``copy_to`` (the measured copy) and ``copy_to`` with ``.png``: the first screenful."""
    text = page.read_text()
    at = text.rfind("</body>")
    copy_to.write_text(text[:at] + MEASURE + text[at:])
    dom = _chromium(f"--window-size={width},{height}", "--dump-dom", copy_to.as_uri())
    found = re.search(r'data-layout="([^"]*)"', dom)
    assert found, f"Chromium did not run the measuring script on {copy_to}"
    _chromium(f"--window-size={width},{height}", f"--screenshot={copy_to.with_suffix('.png')}",
              copy_to.as_uri())
    return json.loads(html.unescape(found[1]))
