"""Self-check for students: ``pytest exercises/05_allreduce`` runs each exercise notebook and
reports every visible test cell as its own test (hidden tests show as skipped until grading).

One notebook runs in this process: starting pytest-xdist's worker processes (the repository's
``-n auto``) would cost more than they save (measured: benchmarks/results/self_check.json)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpcourse.grading.notebook_runner import run_test_cells


def pytest_xdist_auto_num_workers(config):
    """No worker processes for one notebook; two for several (each runs its own kernel)."""
    if "PYTEST_XDIST_AUTO_NUM_WORKERS" in os.environ:
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return 0 if len(_notebooks(config.args, config.invocation_params.dir)) <= 1 else 2


def _notebooks(args: list[str], cwd: Path) -> set[Path]:
    found = set()
    for arg in args:
        path = Path(cwd, arg.split("::")[0])
        candidates = path.rglob("*.ipynb") if path.is_dir() else [path]
        found |= {p.resolve() for p in candidates
                  if p.suffix == ".ipynb" and ".ipynb_checkpoints" not in p.parts}
    return found


def pytest_collect_file(parent, file_path):
    if file_path.suffix == ".ipynb" and ".ipynb_checkpoints" not in file_path.parts:
        return ExerciseNotebook.from_parent(parent, path=file_path)
    return None


class ExerciseNotebook(pytest.File):
    def collect(self):
        import nbformat

        nb = nbformat.read(self.path, as_version=4)
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and meta.get("grade"):
                yield TestCell.from_parent(self, name=meta["grade_id"])

    def results(self):
        if not hasattr(self, "_results"):
            self._results = {r.grade_id: r for r in run_test_cells(self.path)}
        return self._results


class TestCellFailed(Exception):
    pass


class TestCell(pytest.Item):
    def runtest(self):
        result = self.parent.results().get(self.name)
        if result is None:
            raise TestCellFailed("this test cell is missing from the notebook; restore it")
        if result.passed is None:
            pytest.skip(result.message)
        if not result.passed:
            raise TestCellFailed(result.message)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, TestCellFailed):
            return f"{self.name} failed:\n{excinfo.value}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name}::{self.name}"
