"""The small language of a graded cell, read the same way by the grader and by the authoring tests.

A graded (test) cell of a source notebook (``solutions/NN_topic/SLUG.ipynb``) tells the trusted
grader which checks to run on which of the notebook's functions; the grader never executes it
(autograder/trusted.py). So it may only say what this grammar can read::

    cell     := comment* import* "integrity.assert_untampered()" call* ending
    ending   := "print('passed')"                          (a visible test cell)
              | "### BEGIN HIDDEN TESTS"                   (a hidden-test cell)
                "from autograder.hidden import SLUG as hidden" hcall+ "print('passed')"
                "### END HIDDEN TESTS"
    call     := "checks.check_NAME(" argument ("," argument)* ")"
    hcall    := "hidden.check_NAME(" argument ("," argument)* ")"
    argument := FUNCTION | "together(" FUNCTION ("," FUNCTION)+ ")"
    import   := "from ddpcourse.grading import integrity"
              | "from ddpcourse.grading.exercises import SLUG as checks"

``FUNCTION`` is a name the student's notebook defines; ``together(a, b)`` hands a check several
of them as one argument (:func:`ddpcourse.grading.checks.together`). No keyword arguments, no
other expressions: anything else is a :class:`CellGrammarError` naming the cell and the
statement, raised when the grader prepares a submission and by ``tests/test_exercise_authoring.py``
when an author writes the cell, so a cell the grader could not read fails the exercise's own
tests first.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ddpcourse.grading.exercises import CHECKS_PACKAGE, HIDDEN_PACKAGE

BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
INTEGRITY = "integrity.assert_untampered()"
PASSED = "print('passed')"
TOGETHER = "together"


class CellGrammarError(ValueError):
    """A graded cell the grader cannot read; the message names the cell and what is wrong."""


@dataclass(frozen=True)
class CheckCall:
    module: str  # ddpcourse.grading.exercises.SLUG or autograder.hidden.SLUG
    check: str
    # one entry per argument: the notebook function's name, or several names joined by together()
    arguments: tuple[tuple[str, ...], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Every notebook function the call is given, in order."""
        return tuple(name for argument in self.arguments for name in argument)


def split_hidden(source: str) -> tuple[str, str | None]:
    """(the cell's code before its hidden block, the block's code or None without one)."""
    if BEGIN_HIDDEN not in source:
        return source, None
    before, rest = source.split(BEGIN_HIDDEN, 1)
    if END_HIDDEN not in rest:
        raise CellGrammarError(f"{BEGIN_HIDDEN} without {END_HIDDEN}")
    hidden, after = rest.split(END_HIDDEN, 1)
    if after.strip():
        raise CellGrammarError(f"nothing may follow {END_HIDDEN}")
    return before, hidden


def parse_graded_cell(source: str, slug: str, where: str = "") -> tuple[CheckCall, ...]:
    """The check calls of one graded cell of exercise ``slug``, or CellGrammarError."""
    prefix = f"{where}: " if where else ""
    try:
        return _parse(source, slug)
    except CellGrammarError as wrong:
        raise CellGrammarError(f"{prefix}{wrong}") from None
    except SyntaxError as wrong:
        raise CellGrammarError(f"{prefix}not Python: {wrong}") from None


def _parse(source: str, slug: str) -> tuple[CheckCall, ...]:
    visible, hidden = split_hidden(source)
    checks_import = f"from {CHECKS_PACKAGE} import {slug} as checks"
    allowed_imports = {"from ddpcourse.grading import integrity", checks_import}
    body = ast.parse(visible).body
    while body and isinstance(body[0], (ast.Import, ast.ImportFrom)):
        statement = ast.unparse(body.pop(0))
        if statement not in allowed_imports:
            raise CellGrammarError(f"`{statement}`: a test cell imports only "
                                   f"{' or '.join(sorted(allowed_imports))}")
    if not body or ast.unparse(body[0]) != INTEGRITY:
        raise CellGrammarError(f"the first thing a test cell runs is {INTEGRITY}")
    body = body[1:]
    if hidden is None:
        if not body or ast.unparse(body[-1]) != PASSED:
            raise CellGrammarError(f"a visible test cell ends with {PASSED}")
        calls = [_call(node, "checks", f"{CHECKS_PACKAGE}.{slug}") for node in body[:-1]]
    else:
        calls = [_call(node, "checks", f"{CHECKS_PACKAGE}.{slug}") for node in body]
        block = ast.parse(hidden).body
        hidden_import = f"from {HIDDEN_PACKAGE} import {slug} as hidden"
        if not block or ast.unparse(block[0]) != hidden_import:
            raise CellGrammarError(f"a hidden block starts with `{hidden_import}`")
        if ast.unparse(block[-1]) != PASSED:
            raise CellGrammarError(f"a hidden block ends with {PASSED}")
        calls += [_call(node, "hidden", f"{HIDDEN_PACKAGE}.{slug}") for node in block[1:-1]]
    if not calls:
        raise CellGrammarError("a test cell calls at least one check")
    return tuple(calls)


def _call(node: ast.stmt, alias: str, module: str) -> CheckCall:
    text = ast.unparse(node)
    call = node.value if isinstance(node, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) and call.func.value.id == alias
            and call.func.attr.startswith("check_")):
        raise CellGrammarError(f"`{text}`: only calls of {alias}.check_...(...) may stand here")
    if call.keywords or not call.args:
        raise CellGrammarError(f"`{text}`: a check is given the notebook's functions, by "
                               f"position, as names or {TOGETHER}(name, name, ...)")
    return CheckCall(module, call.func.attr, tuple(_argument(arg, text) for arg in call.args))


def _argument(node: ast.expr, text: str) -> tuple[str, ...]:
    if isinstance(node, ast.Name):
        return (node.id,)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == TOGETHER and not node.keywords and len(node.args) >= 2
            and all(isinstance(arg, ast.Name) for arg in node.args)):
        return tuple(arg.id for arg in node.args)
    raise CellGrammarError(f"`{text}`: `{ast.unparse(node)}` is neither a function's name nor "
                           f"{TOGETHER}(name, name, ...)")
