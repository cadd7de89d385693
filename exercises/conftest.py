"""Self-check for students: ``pytest exercises/05_allreduce`` runs each exercise notebook and
reports every visible test cell as its own test (hidden tests show as skipped until grading)."""

from __future__ import annotations

import pytest

from ddpcourse.grading.notebook_runner import run_test_cells


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
