"""Chapter 09's GPU-only failures, run where GPUs are. (The chapter's other scripts run under
torchrun in test_chapter_scripts.py and inside the lesson, whose cells assert their claims.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "chapters" / "09_debugging"))

import gpu_failures  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 1, reason="the GPU-only failures need at least one CUDA GPU, found 0")
def test_gpu_only_failures_fail_as_described():
    outcomes = gpu_failures.run_all(GPUS)
    ran = {case: outcome for case, outcome in outcomes.items() if "skipped" not in outcome}
    assert ran, outcomes
    wrong = {case: outcome["tail"] for case, outcome in ran.items() if not outcome["ok"]}
    assert not wrong, wrong


def test_without_enough_gpus_each_case_says_why_it_skips():
    outcomes = gpu_failures.run_all(0)
    assert {case: outcome["skipped"] for case, outcome in outcomes.items()} == {
        case: f"needs {needs} GPU(s), this machine has 0"
        for case, (needs, _, _) in gpu_failures.CASES.items()}
