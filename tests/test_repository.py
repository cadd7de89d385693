"""The repository keeps its promises: layout, one dependency list, CI running the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from course_layout import PYPROJECT, TESTED_TORCH, chapter_of, chapter_scripts
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"torch": "pytorch"}  # pip name -> conda-forge name, where they differ


def test_the_design_cards_layout_exists():
    for folder in ["chapters", "solutions", "exercises", "autograder", "tests", "ddpcourse"]:
        assert (ROOT / folder).is_dir(), folder
    for file in ["environment.yml", "README.md", "pyproject.toml", ".ci/run"]:
        assert (ROOT / file).is_file(), file


def pyproject_requirements() -> dict[str, str]:
    project = PYPROJECT["project"]
    wanted = {}
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"python_version": "3.11"}):
            wanted[CONDA_NAMES.get(req.name, req.name)] = str(req.specifier)
    return wanted


def conda_requirements() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    found = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str) and not re.match(r"^(python|pip)\b", dep):
            name, spec = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", dep).groups()
            found[name] = spec.replace(" ", "")
    return found


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    assert conda_requirements() == pyproject_requirements()


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    quickstart = [b.strip() for b in blocks[:2]]
    assert all("\n" not in c for c in quickstart), "each quickstart command is one line"
    return quickstart


def test_ci_runs_the_readmes_two_quickstart_commands_verbatim():
    demo, tests = readme_commands()
    assert "torchrun" in demo and tests.endswith("pytest")
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert demo in ci_lines and tests in ci_lines
    assert ci_lines.index(tests) == max(i for i, line in enumerate(ci_lines) if line), (
        "the test command is the last thing CI runs, so its exit code is CI's"
    )
    assert "set -euo pipefail" in ci_lines


def test_the_tested_torch_version_is_written_once():
    """pyproject.toml's [tool.ddpcourse] torch; CI reads it from there instead of repeating it."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", TESTED_TORCH)
    for path in [ROOT / ".ci/run", ROOT / "README.md", *ROOT.glob("tests/*.py")]:
        assert f"torch=={TESTED_TORCH}" not in path.read_text(), path


@pytest.mark.parametrize(
    "script", chapter_scripts(),
    ids=lambda p: p.name,
)
def test_every_chapter_script_starts_with_its_launch_command(script):
    doc = script.read_text().split('"""')[1]
    first_command = next(line.strip() for line in doc.splitlines() if line.startswith("    "))
    assert first_command.startswith(("torchrun ", "python ", "bash ", "srun ", "sbatch ")), (
        first_command
    )
    assert str(script.relative_to(ROOT)) in first_command


@pytest.mark.parametrize("nodeid, chapter", [
    ("tests/test_chapter_03_torchrun.py::test_x", "03"),
    ("tests/test_grading_bucketed_ddp.py::test_x", "05"),
    ("tests/test_exercises.py::test_x[sampler_by_hand]", "06"),
    ("tests/test_notebooks.py::test_x[chapters/02_dp_ddp_fsdp/02_dp_ddp_fsdp.ipynb]", "02"),
    ("tests/test_chapter_scripts.py::test_x[chapters/04_process_groups/collectives_tour.py]", "04"),
    ("tests/test_launcher.py::test_x", None),
    ("tests/test_grading.py::test_x", None),
])
def test_each_chapters_tests_carry_its_marker(nodeid, chapter):
    """`pytest -m ch05` (CONTRIBUTING.md) selects by these."""
    assert chapter_of(nodeid) == chapter


@pytest.mark.parametrize("cores, memory_gib, workers", [
    (1, 4, 2), (2, 8, 2), (4, 16, 2),  # small machines: two, as the suite has always used
    (8, 32, 4), (16, 128, 8), (64, 512, 8),  # one per two cores, at most eight
    (16, 7, 2),  # memory decides: three GiB each
])
def test_auto_starts_more_test_processes_on_larger_machines(cores, memory_gib, workers):
    from suite_plan import auto_workers

    assert auto_workers(cores, memory_gib) == workers


@pytest.mark.parametrize("reason, gpu", [
    ("needs >= 2 CUDA GPUs, found 1", True),
    ("needs 2 CUDA GPUs and NCCL; runs only on a GPU machine", True),
    ("SyncBatchNorm needs NCCL, one GPU per rank: 0 GPU(s)", True),
    ("the GPU-only failures need at least one CUDA GPU, found 0", True),
    ("checks the CPU-only path", False),
    ("DataParallel only falls back to the module without GPUs", False),
    ("this machine has the GPUs: the real runs below", False),
    ("checks the CPU fallback; this machine has GPUs", False),
])
def test_a_skip_for_want_of_a_gpu_is_what_the_gpu_marker_follows(reason, gpu):
    """`pytest -m gpu` (README) runs every test whose skip reason says it needs a GPU."""
    from suite_plan import NEEDS_A_GPU

    assert bool(NEEDS_A_GPU.search(reason)) == gpu


def test_the_files_start_longest_first_as_the_committed_profile_has_them(monkeypatch):
    """With --no-loadscope-reorder (pyproject.toml) the workers take files in this order; a file
    the profile has not seen yet starts first (it may be long); a file's own order is kept; a file
    that mostly waits (under half a core busy) is put beside busy ones, never next to another."""
    from types import SimpleNamespace

    import suite_plan
    import suite_profile

    monkeypatch.setattr(suite_profile, "recorded_file_seconds", lambda: {
        "tests/test_a.py": (10.0, 9.0), "tests/test_b.py": (300.0, 280.0),
        "tests/test_c.py": (200.0, 190.0), "tests/test_w1.py": (150.0, 30.0),
        "tests/test_w2.py": (120.0, 20.0)})
    items = [SimpleNamespace(nodeid=n) for n in
             ["tests/test_a.py::x", "tests/test_b.py::y", "tests/test_a.py::z", "tests/test_new.py::w",
              "tests/test_w2.py::v", "tests/test_c.py::u", "tests/test_w1.py::t"]]
    assert [i.nodeid for i in suite_plan.longest_files_first(items)] == [
        "tests/test_new.py::w", "tests/test_w1.py::t", "tests/test_w2.py::v", "tests/test_b.py::y",
        "tests/test_c.py::u", "tests/test_a.py::x", "tests/test_a.py::z"]
    assert "--no-loadscope-reorder" in PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"]
