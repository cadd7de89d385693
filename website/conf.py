"""Sphinx settings of the course site (``python -m website`` passes this folder as ``-c``)."""

from pathlib import Path

project = "DDP course"
author = "the ddp-course contributors"
copyright = "the ddp-course contributors (MIT)"

extensions = ["myst_nb"]
exclude_patterns = ["_includes"]  # parts of pages, included by index.md

# The lessons are shown with the outputs of the suite's one execution (build/executed/); the
# site never executes a notebook itself, and the exercises are shown as released, empty.
nb_execution_mode = "off"
nb_merge_streams = True
nb_ipywidgets_js = {}  # widgets need a kernel; build.py replaces them with a note (and no CDN)
myst_heading_anchors = 3  # "#a-heading" links between pages, as GitHub renders them
suppress_warnings = ["myst.header"]  # notebooks that start at "##" after the title cell

html_theme = "sphinx_book_theme"
html_title = "DDP course"
html_static_path = [str(Path(__file__).parent / "_static")]
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "home_page_in_toc": True,
}
# light unless the reader switches: the lessons' figures are drawn on white
html_context = {"default_mode": "light"}
html_show_sourcelink = False
html_last_updated_fmt = None
html_css_files = ["calculator.css"]
