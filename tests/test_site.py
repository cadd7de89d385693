"""The course site, built and read in a real browser (Debian's Chromium, driven by Playwright).

The site shows each lesson with the outputs of the run's one execution of it: the copies
``tests/test_notebooks.py`` keeps in ``build/executed/``. When this run also executes the
lessons, the site is built after those tests have finished: ``tests/suite_plan.py`` starts this
file after every other one, and with several test processes it waits here until the notebook
tests of this run are recorded as finished (``tests/suite_profile.py``'s records, written as
each test ends). A lesson this run does not execute and that has no current copy is executed by
the build, once (``pytest tests/test_site.py`` alone).

Every page is served from a local server and must work offline: a request that leaves this
machine fails the test, as does any console or page error, an image that did not load, a lesson
page with fewer figures than its notebook drew, and a link to a page or anchor that does not
exist. Screenshots of the home page, of chapter 05 (its top and its first figure) and of the
calculator go to ``build/site_screenshots/``.
"""

from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import chromium_page
import nbformat
import pytest
import suite_plan
import suite_profile
from course_layout import LESSONS, ROOT

from website import build as site

# Executing the lessons no copy exists for (a run of this file alone) takes minutes.
pytestmark = [pytest.mark.skipif(chromium_page.browser() is None,
                                 reason="needs Debian's chromium (apt-get install chromium): "
                                        "the site is read in a real browser"),
              pytest.mark.timeout(1800)]

NOTEBOOK_TEST = "tests/test_notebooks.py::test_lesson_notebook_executes_and_draws_its_figures"
WAIT_FOR_NOTEBOOK_TESTS_S = 1200  # in a full run they ended long before; a partial run may wait
SCREENSHOTS = ROOT / "build" / "site_screenshots"
FLAGS = ["--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--disable-gpu", "--disable-quic"]
IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")
STARTED = time.time()


def lesson_rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def lessons_executed_in_this_run(session: pytest.Session) -> dict[str, str]:
    """{lesson: node id} of the notebook tests this run selected."""
    found = {}
    for item in session.items:
        if item.nodeid.startswith(NOTEBOOK_TEST + "["):
            found[item.nodeid[len(NOTEBOOK_TEST) + 1:-1]] = item.nodeid
    return found


def finished_tests() -> set[str]:
    """Node ids of the tests of this run that have ended, in any test process."""
    done = set()
    for records in suite_profile.PROFILE_DIR.glob("*.jsonl"):
        for line in records.read_text().splitlines():
            try:
                done.add(json.loads(line)["nodeid"])
            except (ValueError, KeyError):
                pass  # a line being written
    return done


def wait_for_notebook_tests(session: pytest.Session, in_run: dict[str, str],
                            first_site_test: pytest.Item) -> None:
    """Return once every notebook test of this run has ended (passed or not)."""
    if not in_run:
        return
    if not hasattr(session.config, "workerinput"):  # one process: the order decides
        later = session.items[session.items.index(first_site_test):]
        pending = [item.nodeid for item in later if item.nodeid in in_run.values()]
        assert not pending, (
            f"{len(pending)} notebook tests run after the site test in this process "
            "(tests/suite_plan.py's READ_THE_RUN starts tests/test_site.py last)")
        return
    give_up = time.monotonic() + WAIT_FOR_NOTEBOOK_TESTS_S
    while True:
        if suite_profile.enabled():
            pending = set(in_run.values()) - finished_tests()
        else:  # no records: a copy written since this process started
            pending = {nodeid for lesson, nodeid in in_run.items()
                       if not (site.executed_copy(ROOT / lesson).exists()
                               and site.executed_copy(ROOT / lesson).stat().st_mtime >= STARTED)}
        if not pending:
            return
        assert time.monotonic() < give_up, (
            f"the notebook tests of this run had not ended after {WAIT_FOR_NOTEBOOK_TESTS_S} s: "
            f"{sorted(pending)}")
        time.sleep(2)


@pytest.fixture(scope="module")
def built(request):
    """The site, built from this run's executed lessons."""
    in_run = lessons_executed_in_this_run(request.session)
    mine = next(item for item in request.session.items if item.nodeid.startswith(
        "tests/test_site.py::"))
    waited = time.monotonic()
    wait_for_notebook_tests(request.session, in_run, mine)
    waited = time.monotonic() - waited
    result = site.build(not_to_execute=frozenset(in_run))
    print(f"waited {waited:.1f} s for the notebook tests; built the site in {result.seconds:.1f} s"
          f" (executed here: {result.executed or 'none'})")
    return result


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(built):
    """The built site on a local HTTP server (a free port on the loopback)."""
    handler = functools.partial(_QuietHandler, directory=str(built.out))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="ddpcourse-chromium-") as profile, \
            sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=chromium_page.browser(), headless=True, args=FLAGS,
            viewport={"width": 1280, "height": 900})
        yield context
        context.close()


class Visit:
    """One page loaded in the browser, with every problem seen while loading it."""

    def __init__(self, context, url: str, origin: str) -> None:
        self.problems: list[str] = []
        self.page = context.new_page()
        page = self.page
        page.on("console", lambda m: m.type == "error" and self.problems.append(
            f"console error: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: self.problems.append(
            f"request failed: {r.url} ({r.failure})"))
        page.on("response", lambda r: r.status >= 400 and self.problems.append(
            f"HTTP {r.status}: {r.url}"))

        def offline_only(route):
            if route.request.url.startswith((origin, "data:", "blob:")):
                route.continue_()
            else:
                self.problems.append(f"request off this machine: {route.request.url}")
                route.abort()

        page.route("**/*", offline_only)
        page.goto(url, wait_until="load")
        # every image, also those below the fold that the browser would load lazily
        self.broken_images = page.evaluate("""async () => {
            const images = [...document.images];
            images.forEach(image => { image.loading = "eager"; });
            await Promise.all(images.map(image => image.decode().catch(() => null)));
            return images.filter(image => image.naturalWidth === 0).map(image => image.src);
        }""")

    def close(self):
        self.page.close()


def drawn_figures(lesson: Path) -> int:
    """Images in the executed lesson's outputs: what its page must show."""
    nb = nbformat.read(site.executed_copy(lesson), as_version=4)
    return sum(1 for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
               if any(kind in output.get("data", {}) for kind in IMAGE_TYPES))


def page_url(server: str, rel: str) -> str:
    return f"{server}/{Path(rel).with_suffix('.html').as_posix()}"


def test_the_site_test_starts_after_every_other_test_file():
    from types import SimpleNamespace

    items = [SimpleNamespace(nodeid=n) for n in
             ["tests/test_site.py::a", "tests/test_notebooks.py::b", "tests/test_new.py::c"]]
    assert suite_plan.longest_files_first(items)[-1].nodeid == "tests/test_site.py::a"


def test_every_lesson_of_the_build_has_its_outputs(built):
    """A lesson whose notebook test failed in this run has no executed copy, and its page no
    outputs: that is a failure here too, not a page to publish."""
    assert not built.without_outputs, (
        f"lessons built without outputs (their notebook failed or was not run): "
        f"{built.without_outputs}")


def test_home_and_every_chapter_load_cleanly_with_their_figures(built, server, browser):
    problems = []
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    home = Visit(browser, f"{server}/index.html", server)
    problems += [f"index.html: {p}" for p in home.problems + [
        f"image did not load: {src}" for src in home.broken_images]]
    titles = home.page.locator("nav.bd-links a").all_inner_texts()
    home.page.screenshot(path=str(SCREENSHOTS / "home.png"))
    home.close()
    for lesson in LESSONS:
        rel = lesson_rel(lesson)
        visit = Visit(browser, page_url(server, rel), server)
        problems += [f"{rel}: {p}" for p in visit.problems]
        problems += [f"{rel}: image did not load: {src}" for src in visit.broken_images]
        if rel not in built.without_outputs:
            shown = visit.page.locator(".cell_output img").count()
            drawn = drawn_figures(lesson)
            if shown < drawn:
                problems.append(f"{rel}: the page shows {shown} figures, its notebook drew {drawn}")
        if lesson.parent.name.startswith("05_"):
            visit.page.screenshot(path=str(SCREENSHOTS / "chapter_05.png"))
            visit.page.locator(".cell_output img").first.scroll_into_view_if_needed()
            visit.page.screenshot(path=str(SCREENSHOTS / "chapter_05_figure.png"))
        visit.close()
    assert not problems, "\n".join(problems)
    # the navigation lists the chapters in course order
    chapters = [t for t in titles if re.match(r"\s*\d\d\b", t)]
    assert chapters == sorted(chapters, key=lambda t: int(t.split()[0])), titles
    assert (SCREENSHOTS / "home.png").stat().st_size > 10_000


def test_a_page_of_every_other_kind_loads_cleanly(built, server, browser):
    """The claims page, the instructor and contributor docs, the exercises' index and one
    exercise, one script's source: pages of one kind share their layout and scripts, and the
    links of every page are checked below."""
    pages = [Path(rel).with_suffix(".html").as_posix()
             for paths in site.DOCS.values() for rel in paths]
    pages += ["exercises/README.html", "genindex.html",
              sorted(p.relative_to(built.out).as_posix()
                     for p in (built.out / "exercises").glob("*/*.html"))[0],
              Path(lesson_rel(site.chapter_scripts(LESSONS[0].parent)[0])).as_posix() + ".html"]
    problems = []
    for rel in pages:
        assert (built.out / rel).is_file(), rel
        visit = Visit(browser, f"{server}/{rel}", server)
        problems += [f"{rel}: {p}" for p in visit.problems + [
            f"image did not load: {src}" for src in visit.broken_images]]
        visit.close()
    assert not problems, "\n".join(problems)


def _anchors(path: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', path.read_text()))


def test_no_internal_link_is_broken(built):
    """Every link between the site's pages reaches a file, and its anchor an element there."""
    anchors: dict[Path, set[str]] = {}
    broken = []
    for page in sorted(built.out.rglob("*.html")):
        for href in re.findall(r'<a\b[^>]*\bhref="([^"]*)"', page.read_text()):
            href = html.unescape(href)
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(built.out)}: {href}"
            if not target.is_file():
                broken.append(f"{where} (no file)")
            elif parts.fragment and target.suffix == ".html":
                if target not in anchors:
                    anchors[target] = _anchors(target)
                if unquote(parts.fragment) not in anchors[target]:
                    broken.append(f"{where} (no anchor)")
    assert not broken, "\n".join(broken)


def test_every_chapter_links_its_scripts_source_and_the_home_page_its_chapters(built):
    home = (built.out / "index.html").read_text()
    for lesson in LESSONS:
        rel = lesson_rel(lesson)
        assert f'href="{Path(rel).with_suffix(".html").as_posix()}"' in home, rel
        page = (built.out / rel).with_suffix(".html").read_text()
        for script in site.chapter_scripts(lesson.parent):
            assert f'href="{script.name}.html"' in page, (rel, script.name)
            source = (built.out / lesson_rel(script)).with_name(script.name + ".html").read_text()
            text = html.unescape(re.sub(r"<[^>]+>", "", source))
            lines = [line.strip() for line in script.read_text().splitlines() if line.strip()]
            assert lines[0] in text and lines[-1] in text, f"{script}: its page lacks its source"


def test_exercise_pages_hold_no_solution_and_no_hidden_test(built):
    pages = sorted((built.out / "exercises").rglob("*.html"))
    assert len(pages) >= 18
    for page in pages:
        text = page.read_text()
        for secret in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS", "autograder.hidden"):
            assert secret not in text, (page, secret)


def test_search_finds_a_lesson(server, browser):
    visit = Visit(browser, f"{server}/search.html?q=all_reduce", server)
    results = visit.page.locator("#search-results li")
    results.first.wait_for(timeout=30_000)
    hits = results.all_inner_texts()
    problems = visit.problems
    visit.close()
    assert not problems, problems
    assert any("AllReduce" in hit or "all_reduce" in hit for hit in hits), hits


def calculator_grid() -> list[dict]:
    """Every ZeRO stage and schedule against DP, TP, PP and micro-batch counts of 1 and more;
    the model's size, precision and optimizer vary along the grid."""
    import itertools

    sizes = [{"log_parameters": "6", "batch": "1", "sequence": "1", "layers": "3",
              "hidden": "64", "bytes_per_value": "4", "optimizer_values_per_parameter": "2",
              "saved_values_per_layer": "1", "tp_allreduces_per_layer": "2"},
             {"log_parameters": "9.85", "batch": "8", "sequence": "2048", "layers": "32",
              "hidden": "4096", "bytes_per_value": "2", "optimizer_values_per_parameter": "1",
              "saved_values_per_layer": "17", "tp_allreduces_per_layer": "4"},
             {"log_parameters": "11.2", "batch": "5", "sequence": "777", "layers": "96",
              "hidden": "12288", "bytes_per_value": "4", "optimizer_values_per_parameter": "0",
              "saved_values_per_layer": "34", "tp_allreduces_per_layer": "2"}]
    grid = []
    for i, (zero, dp, tp, pp, micro, schedule) in enumerate(itertools.product(
            "0123", ("1", "8"), ("1", "4"), ("1", "4"), ("1", "6"), ("1f1b", "gpipe"))):
        grid.append({**sizes[i % len(sizes)], "zero_stage": zero, "dp": dp, "tp": tp, "pp": pp,
                     "microbatches": micro, "schedule": schedule})
    return grid


def test_the_calculator_page_computes_what_memory_calculator_estimates(server, browser):
    """Sliders moved in the page give the numbers of ddpcourse.memory_calculator.estimate, on a
    grid of inputs; the page shows them as format_bytes does."""
    from ddpcourse.memory_calculator import estimate, format_bytes

    visit = Visit(browser, f"{server}/calculator.html", server)
    page = visit.page
    root = page.locator("#calculator")

    def shown() -> tuple[dict, dict, dict]:
        """The inputs as the page read them, its numbers, and the sizes it shows."""
        return page.evaluate("""() => {
            const root = document.getElementById("calculator");
            const texts = Object.fromEntries([...root.querySelectorAll("[data-key]")].map(
                cell => [cell.dataset.key, cell.textContent.trim()]));
            return [JSON.parse(root.dataset.inputs), JSON.parse(root.dataset.result), texts];
        }""")

    def compare(inputs, result, texts) -> list[str]:
        expected = estimate(**inputs)
        wrong = [f"{inputs}: {key} page {result[key]!r}, estimate {value!r}"
                 for key, value in expected.items()
                 if abs(result[key] - value) > 1e-9 * max(1.0, abs(value))]
        wrong += [f"{inputs}: {key} shown {texts[key]!r}, format_bytes {format_bytes(value)!r}"
                  for key, value in expected.items() if texts[key] != format_bytes(value)]
        return wrong

    # a student's moves: a slider stepped with the keyboard, another dragged to a value, a choice
    before, _, _ = shown()
    page.locator("#dp").focus()
    page.keyboard.press("ArrowRight")
    page.locator("#zero_stage").fill("3")
    page.locator("#schedule").select_option("gpipe")
    after, result, texts = shown()
    assert (after["dp"], after["zero_stage"], after["schedule"]) == (before["dp"] + 1, 3, "gpipe")
    problems = compare(after, result, texts)
    # the grid: each case's controls set as the moves above set them (a value, then the input
    # event the page listens to), in one round trip per case
    for case in calculator_grid():
        page.evaluate("""case_ => {
            for (const [id, value] of Object.entries(case_)) {
                const control = document.getElementById(id);
                control.value = value;
                control.dispatchEvent(new Event("input", {bubbles: true}));
            }
        }""", case)
        inputs, result, texts = shown()
        assert inputs["parameters"] == round(10 ** float(case["log_parameters"]))
        assert {k: str(v) for k, v in inputs.items() if k in case} == {
            k: v for k, v in case.items() if k in inputs}
        problems += compare(inputs, result, texts)
    problems += visit.problems
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "calculator.png"), full_page=True)
    visit.close()
    assert not problems, "\n".join(problems[:20])


def test_links_are_pointed_at_pages_and_never_into_the_solutions(tmp_path):
    stage = site.Stage(tmp_path)
    stage.pages.add("autograder/README.md")
    text = ("[twin](07_training_loop/07_training_loop.nb.py) [script](07_training_loop/train.py#L3) "
            "[page](../autograder/README.md#top) [answer](../solutions/05_allreduce/bucketed_ddp.ipynb) "
            "[web](https://pytorch.org/docs) [here](#verdicts)")
    assert stage.rewrite_links(text, "chapters/CLAIMS.md") == (
        "[twin](07_training_loop/07_training_loop.ipynb) [script](07_training_loop/train.py.md#L3) "
        "[page](../autograder/README.md#top) answer "
        "[web](https://pytorch.org/docs) [here](#verdicts)")
    assert (tmp_path / "chapters/07_training_loop/train.py").read_text() == (
        ROOT / "chapters/07_training_loop/train.py").read_text()
    assert "literalinclude" in (tmp_path / "chapters/07_training_loop/train.py.md").read_text()


def test_a_lesson_without_a_current_run_is_shown_without_outputs_under_a_banner(tmp_path,
                                                                                monkeypatch):
    """--no-execute, or a lesson whose executed copy is of an older version of it."""
    monkeypatch.setattr(site, "EXECUTED", tmp_path / "executed")
    lesson = LESSONS[0]
    stale = nbformat.read(lesson, as_version=4)
    stale.cells[-1].source += "\n# edited since"
    site.executed_copy(lesson).parent.mkdir(parents=True)
    nbformat.write(stale, site.executed_copy(lesson))
    assert not site.is_current(site.executed_copy(lesson), lesson)
    built = site.Built(out=tmp_path / "out")
    site.stage_lesson(site.Stage(tmp_path / "stage"), lesson, built, execute=False)
    staged = nbformat.read(tmp_path / "stage" / lesson_rel(lesson), as_version=4)
    assert built.without_outputs == [lesson_rel(lesson)] and not built.executed
    assert "without its outputs" in staged.cells[1].source
    nbformat.write(nbformat.read(lesson, as_version=4), site.executed_copy(lesson))
    assert site.is_current(site.executed_copy(lesson), lesson)
