"""Out-of-kernel tamper scan: read a submission's code cells and flag grader tampering.

Inside the kernel, ``ddpcourse.grading.integrity`` catches replaced library functions and checks.
A determined student could also replace that check itself; this scan reads the submitted
notebook's source from outside the kernel, where no student code runs, and flags:

* assignments, deletions, ``setattr``/``delattr`` on anything reached from a protected module
  (torch, torch.distributed, ddpcourse, autograder, builtins, sys, importlib), e.g.
  ``dist.all_reduce = ...``, ``checks.check_ring_allreduce_two_ranks = ...``,
  ``sys.modules["ddpcourse.launcher"] = ...``;
* the tools such tampering needs and these exercises never do: ``exec``, ``eval``, ``compile``,
  ``__import__``, ``ctypes``, ``gc``, ``importlib``, ``inspect``, ``sys._getframe``,
  ``__code__``, ``__globals__``, ``__builtins__``, ``__dict__``;
* ``sys.modules`` through any alias of ``sys`` (``import sys as s``, ``os.sys``,
  ``from sys import modules``) and ``sys`` itself used as anything but ``sys.<name>`` (passed to a
  function, ``getattr(sys, ...)``, ``vars(sys)``): the attribute name ``modules`` alone is not
  flagged, since ``nn.Module.modules()`` is a method every PyTorch user calls;
* frame objects, through which a function reads its callers' locals (the grader's situation):
  ``tb_frame``, ``f_back``, ``f_locals``, ``f_globals``, ``gi_frame``, ``cr_frame``,
  ``traceback.walk_stack``/``walk_tb``. This is a second line only: what a grading process's
  frames hold is the situation, never the expected answer (see ``autograder/trusted.py``).

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
                        "__setattr__",
                        # frame objects: the callers' locals
                        "tb_frame", "f_back", "f_locals", "f_globals", "f_builtins", "gi_frame",
                        "cr_frame", "ag_frame", "walk_stack", "walk_tb"}
# Attributes of ``sys`` that reach other modules or frames.
FORBIDDEN_SYS_ATTRIBUTES = {"modules", "_getframe", "_current_frames", "settrace", "setprofile",
                            "meta_path", "path_hooks", "path_importer_cache"}


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


def _is_sys(node: ast.AST, sys_names: set[str]) -> bool:
    """``node`` is ``sys`` by a name bound to it, or ``<anything>.sys`` (``os.sys``)."""
    return (isinstance(node, ast.Name) and node.id in sys_names) or \
        (isinstance(node, ast.Attribute) and node.attr == "sys")


class _Scanner(ast.NodeVisitor):
    def __init__(self, cell: int, protected: set[str], sys_names: set[str] | None = None):
        self.cell = cell
        self.protected = protected
        # names bound to the sys module; shared across a notebook's cells like ``protected``
        self.sys_names = sys_names if sys_names is not None else {"sys"}
        self.findings: list[Finding] = []
        self._sys_attribute_bases: set[int] = set()  # ids of sys nodes used as ``sys.<name>``

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
            if top == "sys":
                self.sys_names.add(alias.asname or top)
            if top in PROTECTED_ROOTS:
                self.protected.add(alias.asname or top)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        top = (node.module or "").split(".")[0]
        if top in FORBIDDEN_MODULES:
            self._flag(node, f"imports from {node.module}")
        for alias in node.names:
            if node.module == "sys" and (alias.name == "*" or alias.name in FORBIDDEN_SYS_ATTRIBUTES):
                self._flag(node, f"imports {alias.name} from sys")
            if alias.name == "sys":
                self.sys_names.add(alias.asname or alias.name)
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
        if _is_sys(node.value, self.sys_names):
            if node.attr in FORBIDDEN_SYS_ATTRIBUTES:
                self._flag(node, f"uses {ast.unparse(node)}")
            else:
                self._sys_attribute_bases.add(id(node.value))
        if node.attr == "sys" and id(node) not in self._sys_attribute_bases:
            self._flag(node, f"uses {ast.unparse(node)} other than as sys.<name>")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "__builtins__":
            self._flag(node, "uses __builtins__")
        if node.id in self.sys_names and isinstance(node.ctx, ast.Load) and \
                id(node) not in self._sys_attribute_bases:
            self._flag(node, f"uses {node.id} other than as {node.id}.<name>")


def scan_notebook(path, locked_ids: set[str]) -> list[Finding]:
    """Findings in the code cells of ``path`` whose grade_id is not in ``locked_ids``."""
    nb = nbformat.read(path, as_version=4)
    protected = set(SETUP_NAMES)
    sys_names = {"sys"}
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
        scanner = _Scanner(index, protected, sys_names)
        scanner.visit(tree)
        findings.extend(scanner.findings)
    return findings


def locked_ids_of(source_notebook) -> set[str]:
    nb = nbformat.read(source_notebook, as_version=4)
    return {c.metadata["nbgrader"]["grade_id"] for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("locked")}
