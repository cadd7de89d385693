"""The claims page: the source article's technical claims, each with its verdict and experiment.

``chapters/claims.yaml`` holds the data; :func:`render` makes ``chapters/CLAIMS.md`` from it, and
:func:`problems` lists what is wrong with it: a row without an experiment or a source reference, a
named test, script, lesson cell, check or torch source file that does not exist. The experiments a
row names are of two kinds:

* ``tests``: pytest node ids that already assert the row's correct statement. The suite runs them
  once for its chapter, so the page is kept true at no extra cost; here we only check they exist,
  by reading the test files' syntax tree (collecting them with pytest would cost seconds per file).
* ``check``: a short experiment of :mod:`ddpcourse.claims.experiments`, for claims no chapter
  asserts; ``tests/test_claims.py`` runs each of them.

``python -m ddpcourse.claims`` re-checks the page on a student's machine (see ``__main__``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "chapters" / "claims.yaml"
PAGE = ROOT / "chapters" / "CLAIMS.md"

VERDICTS = ("true", "false", "partly", "outdated", "unverifiable here")
NEEDS = ("GPU", "several GPUs", "several nodes")
PENDING = ("chapter 10", "chapter 11")
FIELDS = {"id", "section", "claim", "verdict", "correct", "evidence", "experiment", "pending"}
EXPERIMENT_FIELDS = {"tests", "check", "script", "cell", "needs"}


@dataclass(frozen=True)
class Claim:
    id: str
    section: str
    claim: str
    verdict: str
    correct: str
    evidence: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    check: str | None = None
    script: str | None = None
    cell: str | None = None
    needs: str | None = None
    pending: str | None = None
    unknown_fields: tuple[str, ...] = field(default=(), compare=False)

    @property
    def has_experiment(self) -> bool:
        return bool(self.tests or self.check or self.script or self.cell)

    @property
    def source_references(self) -> tuple[str, ...]:
        return tuple(e for e in self.evidence if e.startswith("torch/") or "://" in e)


@dataclass(frozen=True)
class Claims:
    torch: str
    sections: dict[str, str]
    claims: tuple[Claim, ...]


def _load_yaml(text: str):
    try:
        import yaml
    except ImportError as error:  # pragma: no cover - pyyaml comes with the [dev] extra
        raise SystemExit("the claims page needs PyYAML: pip install -e \".[dev]\"") from error
    return yaml.safe_load(text)


def parse(data: dict) -> Claims:
    """The claims of a loaded YAML document (a mapping with ``torch``, ``sections``, ``claims``)."""
    rows = []
    for row in data["claims"]:
        experiment = row.get("experiment") or {}
        unknown = sorted((set(row) - FIELDS) | {f"experiment.{k}" for k in set(experiment)
                                                 - EXPERIMENT_FIELDS})
        rows.append(Claim(
            id=str(row.get("id")), section=str(row.get("section")), claim=str(row.get("claim")),
            verdict=str(row.get("verdict")), correct=str(row.get("correct", "")).strip(),
            evidence=tuple(row.get("evidence") or ()), tests=tuple(experiment.get("tests") or ()),
            check=experiment.get("check"), script=experiment.get("script"),
            cell=experiment.get("cell"), needs=experiment.get("needs"),
            pending=row.get("pending"), unknown_fields=tuple(unknown)))
    return Claims(torch=str(data["torch"]), sections={str(k): str(v) for k, v in
                                                       data["sections"].items()},
                  claims=tuple(rows))


def load(path: Path = DATA) -> Claims:
    return parse(_load_yaml(path.read_text()))


# --- what must exist ------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def test_functions(path: Path) -> frozenset[str]:
    """The names of the test functions (and test methods) defined in a test file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if is_function and node.name.startswith("test"):
            names.add(node.name)
    return frozenset(names)


def node_id_problem(node_id: str, root: Path = ROOT) -> str | None:
    """Why ``node_id`` names no test of the repository (None if it does)."""
    file, sep, rest = node_id.partition("::")
    path = root / file
    if not sep or not file.startswith("tests/") or not path.is_file():
        return f"no test file {file!r}"
    function, _, parameter = rest.partition("[")
    if function not in test_functions(path):
        return f"{file} defines no test {function!r}"
    named_path = re.match(r"(chapters/\S+?)\]?$", parameter)
    if named_path and not (root / named_path.group(1)).is_file():
        return f"{node_id}: no file {named_path.group(1)}"
    return None


def _torch_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return Path(spec.origin).parent


def torch_reference_problem(reference: str, torch_dir: Path | None = None) -> str | None:
    """Why ``torch/PATH::NAME`` names nothing in the installed torch (None if it does): the file
    must exist, and the last part of NAME be defined there (``def``/``class``) or, in a header,
    appear in it."""
    path, sep, name = reference.partition("::")
    torch_dir = torch_dir or _torch_dir()
    file = torch_dir.parent / path
    if not file.is_file():
        return f"no file {path} in the installed torch"
    if not sep:
        return None
    last = name.split(".")[-1]
    text = file.read_text(errors="replace")
    if file.suffix == ".py":
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(last)}\b", text, re.M):
            return f"{path} defines no {last!r}"
    elif last not in text:
        return f"{path} does not mention {last!r}"
    return None


def cell_problem(cell: str, root: Path = ROOT) -> str | None:
    """``LESSON.nb.py#words``: the lesson exists and a markdown heading of it holds the words."""
    file, sep, words = cell.partition("#")
    path = root / file
    if not sep or not path.is_file():
        return f"no lesson {file!r}"
    headings = [line for line in path.read_text().splitlines() if re.match(r"# #+ ", line)]
    if not any(words in heading for heading in headings):
        return f"{file} has no heading with {words!r}"
    return None


def problems(claims: Claims, root: Path = ROOT, checks: dict | None = None,
             torch_dir: Path | None = None) -> list[str]:
    """Everything wrong with the data, one line each; [] when the page can be trusted. (In a copy
    of the course without ``tests/``, the students' copy, test node ids are not checked.)"""
    if checks is None:
        from ddpcourse.claims.experiments import CHECKS as checks
    found, seen = [], set()
    for c in claims.claims:
        where = f"claim {c.id!r}"
        if c.id in seen:
            found.append(f"{where}: the id is used twice")
        seen.add(c.id)
        if c.unknown_fields:
            found.append(f"{where}: unknown fields {list(c.unknown_fields)}")
        if c.section not in claims.sections:
            found.append(f"{where}: no section {c.section!r} in the article's list")
        if c.verdict not in VERDICTS:
            found.append(f"{where}: verdict {c.verdict!r} is not one of {VERDICTS}")
        if not c.claim.strip() or not c.correct:
            found.append(f"{where}: needs both the claim and the correct statement")
        if not c.has_experiment and not c.source_references:
            found.append(f"{where}: neither an experiment nor a source reference")
        for e in c.evidence:
            if e.startswith("torch/"):
                if (why := torch_reference_problem(e, torch_dir)):
                    found.append(f"{where}: {why}")
            elif not e.startswith("https://"):
                found.append(f"{where}: evidence {e!r} is neither torch/PATH::NAME nor a URL")
        for node_id in c.tests if (root / "tests").is_dir() else ():  # the student copy has none
            if (why := node_id_problem(node_id, root)):
                found.append(f"{where}: {why}")
        if c.check is not None and c.check not in checks:
            found.append(f"{where}: no experiment {c.check!r} in ddpcourse/claims/experiments.py")
        if c.script is not None and not (root / c.script).is_file():
            found.append(f"{where}: no script {c.script}")
        if c.cell is not None and (why := cell_problem(c.cell, root)):
            found.append(f"{where}: {why}")
        if c.needs is not None and c.needs not in NEEDS:
            found.append(f"{where}: needs {c.needs!r} is not one of {NEEDS}")
        if c.pending is not None and c.pending not in PENDING:
            found.append(f"{where}: pending {c.pending!r} is not one of {PENDING}")
    return found


def node_ids(claims: Claims) -> list[str]:
    """Every test node id the page names, once, in page order."""
    return list(dict.fromkeys(t for c in claims.claims for t in c.tests))


# --- the page -------------------------------------------------------------------------------------

TORCH_BLOB = "https://github.com/pytorch/pytorch/blob/v{version}/{path}"


def _evidence_md(entry: str, version: str) -> str:
    if entry.startswith("torch/"):
        path, _, name = entry.partition("::")
        label = f"`{path}`" + (f" `{name}`" if name else "")
        if path.endswith(".py"):
            return f"[{label}]({TORCH_BLOB.format(version=version, path=path)})"
        return label + " (installed header)"
    return f"<{entry}>"


def _experiment_md(c: Claim) -> str:
    parts = [f"`{t}`" for t in c.tests]
    if c.check:
        parts.append(f"`ddpcourse/claims/experiments.py::{c.check}`")
    if c.script:
        parts.append(f"[`{c.script}`]({Path(c.script).relative_to('chapters').as_posix()})")
    if c.cell:
        file, _, words = c.cell.partition("#")
        parts.append(f"[{Path(file).name}]({Path(file).relative_to('chapters').as_posix()}), "
                     f"section \"{words}\"")
    if c.needs:
        parts.append(f"needs {c.needs}")
    if c.pending:
        parts.append(f"**{c.pending}, pending**")
    return "<br>".join(parts) if parts else "source reference only"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(claims: Claims) -> str:
    """The Markdown page (``chapters/CLAIMS.md``), generated from the data."""
    counts = {v: sum(c.verdict == v for c in claims.claims) for v in VERDICTS}
    pending = sorted({c.pending for c in claims.claims if c.pending})
    lines = [
        "# The source article's claims, checked",
        "",
        "<!-- Generated from chapters/claims.yaml by `python -m ddpcourse.claims --write`; "
        "do not edit by hand. -->",
        "",
        "Every technical claim of the source article (`source_article_zh.txt`, a popular Chinese "
        "write-up on PyTorch DDP), section by section: what it says, whether it holds, what is "
        f"true for **torch {claims.torch}** (the version the course pins and this page was checked "
        "against), the evidence in PyTorch's source or docs (NCCL's docs for NCCL variables), and "
        "the experiment in this repository that shows it.",
        "",
        f"{len(claims.claims)} claims: "
        + ", ".join(f"{n} {v}" for v, n in counts.items() if n) + "."
        + (f" Rows marked *pending* get their experiment in {' and '.join(pending)}." if pending
           else ""),
        "",
        "**Re-check it yourself**, from the repository root:",
        "",
        "```bash",
        "python -m ddpcourse.claims             # every experiment below, then a verdict table",
        "python -m ddpcourse.claims --no-tests  # only the page's own short experiments (seconds)",
        "```",
        "",
        "It runs the page's short experiments (`ddpcourse/claims/experiments.py`) and, with "
        "pytest, the chapter tests each row names; rows that need a GPU run where one is present "
        "and are skipped, with the reason, where not. The course's test suite keeps the page true: "
        "`tests/test_claims.py` fails when this page is out of date with its data, when a row has "
        "neither an experiment nor a source reference, when a named test, script, lesson section "
        "or torch source file does not exist, or when one of the page's experiments no longer "
        "holds; the chapter tests named here run in the suite anyway.",
        "",
        "Verdicts: **true**; **false**; **partly** (right in part, or right for the wrong reason); "
        "**outdated** (was right, is not in this torch); **unverifiable here** (a figure from the "
        "article's own hardware, or outside PyTorch).",
        "",
    ]
    for number, title in claims.sections.items():
        rows = [c for c in claims.claims if c.section == number]
        if not rows:
            continue
        lines += [f"## §{number} {title}", "",
                  "| Claim | Verdict | Correct for torch " + claims.torch
                  + " | Evidence | Experiment |",
                  "|---|---|---|---|---|"]
        for c in rows:
            evidence = "<br>".join(_evidence_md(e, claims.torch) for e in c.evidence)
            lines.append(f"| <a id=\"{c.id}\"></a>{_cell(c.claim)} | **{c.verdict}** | "
                         f"{_cell(c.correct)} | {evidence or '—'} | {_experiment_md(c)} |")
        lines.append("")
    return "\n".join(lines + _by_chapter(claims))


CHAPTER = re.compile(r"(?:chapters/|tests/test_chapter_)(\d\d)_")


def chapters_of(c: Claim) -> list[str]:
    """The chapters (``"07"``) whose tests, scripts or lesson sections a row names."""
    named = [*c.tests, c.script or "", c.cell or ""]
    return sorted({m.group(1) for text in named for m in CHAPTER.finditer(text)})


def _by_chapter(claims: Claims) -> list[str]:
    """One short section per chapter, whose heading "Chapter NN" gives the anchor ``chapter-NN``
    (GitHub's and the course site's heading anchors) each lesson links to: the rows whose
    experiment that chapter holds, by section."""
    lines = ["## By chapter", "",
             "The rows whose experiment each chapter holds (a lesson links to its own list).", ""]
    folders = {p.name[:2]: p.name for p in sorted((ROOT / "chapters").iterdir())
               if p.is_dir() and p.name[:2].isdigit()}
    for number, folder in folders.items():
        rows = [c for c in claims.claims if number in chapters_of(c)]
        lines += [f"### Chapter {number}", "", f"Lesson: [{folder}]({folder}/{folder}.ipynb). "
                  + (f"{len(rows)} claims:" if rows else "No claim of the article is tested here."),
                  ""]
        lines += [f"* §{c.section} {_cell(c.claim)} (**{c.verdict}**)" for c in rows]
        lines += [""] if rows else []
    return lines
