"""Every chapter script runs, as its docstring says to launch it, under torchrun with 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from chapter_launch import launch_once
from course_layout import chapter_scripts

ROOT = Path(__file__).resolve().parent.parent
# A script whose docstring says "Launch test: custom" needs more than one command (two "nodes",
# a failing worker); its chapter's own test file launches it.
CUSTOM = "Launch test: custom"
SCRIPTS = [p for p in chapter_scripts() if CUSTOM not in p.read_text()]


def launch_command(script: Path) -> str:
    doc = script.read_text().split('"""')[1]
    return next(line.strip() for line in doc.splitlines() if line.startswith("    torchrun "))


def run_as_documented(script: Path, timeout: float = 240):
    """One launch per script and run: the tests that read the same launch share it, here and in
    the chapters' test files (``chapter_launch.launch_once``)."""
    return launch_once(launch_command(script), timeout)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_runs_under_torchrun_as_documented(script):
    done = run_as_documented(script)
    assert not done.timed_out, f"{launch_command(script)}: still running after 240 s\n{done.stdout}"
    assert done.returncode == 0, f"{launch_command(script)}\n{done.stdout}\n{done.stderr}"
    assert "terminate called" not in done.stderr


def test_the_headline_demo_shows_ddp_equals_a_single_process():
    done = run_as_documented(ROOT / "chapters/01_why_ddp/ddp_equals_single_process.py")
    assert done.returncode == 0, done.stderr
    assert "RESULT: DDP == single process on the global batch" in done.stdout
    assert "replicas identical across ranks: True" in done.stdout
    # printed on rank 0 only
    assert done.stdout.count("RESULT:") == 1
