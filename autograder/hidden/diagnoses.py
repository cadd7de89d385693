"""Chapter 09's graded diagnoses, judged one way for every lab.

Each lab of ``ddp_errors``, ``collectives_that_hang`` and ``replicas_that_disagree`` asks, after
its Run-it cell, for ``diagnose_<lab>() -> dict``: a few facts of what the given code did (which
rank hung, at which step, which parameter the error named...). The exercise's hidden module holds
what is secret: the expected facts, how each field is compared, where to look when one is wrong,
and the lab's explanation. A :class:`Diagnoses` made of those judges an answer:

* it is called in a rank of its own (no process group), as every submitted function, and only
  what it returned, as plain data, comes back (``read_the_logs.observe_diagnosis``);
* every missing, mistyped or wrong field is named, with where to look; never its value;
* the lab's explanation ends the feedback either way: in the failure's message after a wrong
  diagnosis (the grader keeps a failing cell's message), printed after a right one (the grader
  keeps what a passing cell printed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpcourse.grading.checks import Case, CheckFailed, cut_text, run_student
from ddpcourse.grading.exercises.read_the_logs import DIAGNOSIS_TIMEOUT_S, observe_diagnosis


@dataclass(frozen=True)
class Diagnoses:
    """One exercise's diagnoses: ``facts[lab][field]`` is what the given code does;
    ``normalize(kinds[field], value)`` is a value's comparable form, or None when its type is
    wrong (``expected_types[kind]`` says what it should be); ``hints[(lab, field)]`` where the
    evidence for a field is; ``explanations[lab]``, under ``heading``, the graded feedback."""

    facts: Mapping[str, Mapping[str, Any]]
    kinds: Mapping[str, str]
    normalize: Callable[[str, Any], Any]
    expected_types: Mapping[str, str]
    plain_types: str  # what the dict may hold, for an answer that is not plain data
    explanations: Mapping[str, str]
    heading: str
    hints: Mapping[tuple[str, str], str] = field(default_factory=dict)

    def explanation(self, lab: str) -> str:
        return f"{self.heading}\n\n{self.explanations[lab].rstrip()}\n"

    def wrong_fields(self, lab: str, answer: Any) -> list[str]:
        """Every wrong or missing field of ``answer`` (the observed plain data, untrusted), each
        named with where to look; empty when the diagnosis is right."""
        expected = self.facts[lab]
        if isinstance(answer, dict) and set(answer) == {"not_plain"}:
            return [f"it must return a dict of {self.plain_types}, with the keys "
                    f"{', '.join(expected)}; it returned {cut_text(answer['not_plain'], 100)}"]
        if not isinstance(answer, dict):
            return [f"it must return a dict with the keys {', '.join(expected)}"]
        wrong = []
        for name, value in expected.items():
            kind = self.kinds[name]
            if name not in answer:
                wrong.append(f"{name!r} is missing (the dict has {cut_text(sorted(answer), 200)})")
                continue
            given = self.normalize(kind, answer[name])
            if given is None:
                wrong.append(f"{name!r} should be {self.expected_types[kind]}, not "
                             f"{cut_text(repr(answer[name]), 60)}")
            elif given != self.normalize(kind, value):
                hint = self.hints.get((lab, name))
                wrong.append(f"{name!r} = {cut_text(repr(answer[name]), 60)} is not what the "
                             f"given code does" + (f". Where to look: {hint}" if hint else ""))
        return wrong

    def case(self, lab: str) -> Case:
        """The check's case: observe the returned dict in the rank, judge it here."""
        def judge(observations, world_size):
            [observation] = observations
            answer = observation.get("answer") if isinstance(observation, dict) else None
            wrong = self.wrong_fields(lab, answer)
            if wrong:
                raise CheckFailed(f"diagnose_{lab}():\n" + "\n".join(f"* {line}" for line in wrong)
                                  + f"\n\n{self.explanation(lab)}")

        return Case(observe_diagnosis, judge)

    def check(self, lab: str, diagnose: Callable[[], dict]) -> None:
        """Judge ``diagnose``; print the lab's explanation after a right diagnosis (a wrong one
        has it in the failure's message)."""
        __tracebackhide__ = True  # noqa: F841
        run_student(self.case(lab), 1, diagnose, timeout=DIAGNOSIS_TIMEOUT_S,
                    init_process_group=False, hide_internals=True)
        print(self.explanation(lab))

    def checker(self, lab: str) -> Callable[[Callable[[], dict]], None]:
        """``check_<lab>_diagnosis``, the function the lab's hidden test cell calls."""
        def check_diagnosis(diagnose: Callable[[], dict]) -> None:
            __tracebackhide__ = True  # noqa: F841
            self.check(lab, diagnose)

        check_diagnosis.__name__ = check_diagnosis.__qualname__ = f"check_{lab}_diagnosis"
        check_diagnosis.__doc__ = f"Grade diagnose_{lab}() (1 point, hidden)."
        return check_diagnosis
