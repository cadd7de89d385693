"""Out-of-kernel tamper scan: read a submission's code cells and flag grader tampering.

Inside the kernel, ``ddpcourse.grading.integrity`` catches replaced library functions and checks.
A determined student could also replace that check itself; this scan reads the submitted
notebook's source from outside the kernel, where no student code runs, and flags:

* assignments, deletions, ``setattr``/``delattr`` on anything reached from a protected module
  (torch, torch.distributed, ddpcourse, autograder, builtins, sys, importlib), e.g.
  ``dist.all_reduce = ...``, ``checks.check_ring_allreduce_two_ranks = ...``,
  ``sys.modules["ddpcourse.launcher"] = ...``;
* the tools such tampering needs and these exercises never do: ``exec``, ``eval``, ``compile``,
  ``__import__``, ``ctypes``, ``gc``, ``importlib``, ``sys._getframe``, ``__code__``,
  ``__globals__``, ``__builtins__``, ``__dict__``.

Only cells a student can edit are scanned (nbgrader restores locked and test cells). A flagged
submission scores 0 and is listed for the instructor to review.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import nbformat

PROTECTED_ROOTS = ("torch", "ddpcourse", "autograder", "builtins", "sys", "importlib")


def names_bound_to_protected_modules(code: str) -> set[str]:
    """Names that ``code``'s imports bind to protected modules or their functions."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROTECTED_ROOTS:
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PROTECTED_ROOTS:
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _setup_names() -> set[str]:
    from autograder.sources import exercises, setup_source

    return set().union(*(names_bound_to_protected_modules(
        setup_source(nbformat.read(exercise.source, as_version=4))) for exercise in exercises()))


# Names the locked setup cells bind to protected modules and functions (dist, checks, run_ranks...).
SETUP_NAMES = _setup_names()
FORBIDDEN_CALLS = {"exec", "eval", "compile", "__import__", "setattr", "delattr"}
FORBIDDEN_MODULES = {"ctypes", "gc", "importlib", "builtins", "inspect"}
FORBIDDEN_ATTRIBUTES = {"_getframe", "__code__", "__globals__", "__builtins__", "__dict__",
                        "__setattr__", "modules"}


@dataclass
class Finding:
    cell: int
    line: int
    what: str

    def __str__(self) -> str:
        return f"cell {self.cell}, line {self.line}: {self.what}"


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


class _Scanner(ast.NodeVisitor):
    def __init__(self, cell: int, protected: set[str]):
        self.cell = cell
        self.protected = protected
        self.findings: list[Finding] = []

    def _flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.cell, getattr(node, "lineno", 0), what))

    def _check_target(self, target: ast.AST, verb: str) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._check_target(element, verb)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            root = _root_name(target)
            if root in self.protected:
                self._flag(target, f"{verb} {ast.unparse(target)} (part of a library the tests use)")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.split(".")[0]
            if top in FORBIDDEN_MODULES:
                self._flag(node, f"imports {alias.name}")
            if top in PROTECTED_ROOTS:
                self.protected.add(alias.asname or top)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        top = (node.module or "").split(".")[0]
        if top in FORBIDDEN_MODULES:
            self._flag(node, f"imports from {node.module}")
        if top in PROTECTED_ROOTS:
            for alias in node.names:
                self.protected.add(alias.asname or alias.name)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._check_target(target, "assigns to")
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_target(node.target, "modifies")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._check_target(node.target, "assigns to")
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._check_target(target, "deletes")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            self._flag(node, f"calls {node.func.id}()")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in FORBIDDEN_ATTRIBUTES:
            self._flag(node, f"uses .{node.attr}")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "__builtins__":
            self._flag(node, "uses __builtins__")


def scan_notebook(path, locked_ids: set[str]) -> list[Finding]:
    """Findings in the code cells of ``path`` whose grade_id is not in ``locked_ids``."""
    nb = nbformat.read(path, as_version=4)
    protected = set(SETUP_NAMES)
    findings: list[Finding] = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.metadata.get("nbgrader", {}).get("grade_id") in locked_ids:
            continue
        source = "\n".join(line for line in cell.source.splitlines()
                           if not line.lstrip().startswith(("%", "!")))  # IPython magics
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue  # it fails when run; nothing to tamper with
        scanner = _Scanner(index, protected)
        scanner.visit(tree)
        findings.extend(scanner.findings)
    return findings


def locked_ids_of(source_notebook) -> set[str]:
    nb = nbformat.read(source_notebook, as_version=4)
    return {c.metadata["nbgrader"]["grade_id"] for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("locked")}
