"""Chapter 10 (performance): ``buckets_and_hooks.py``, DDP's buckets and comm hooks counted.

The script is launched once, as its docstring says (torchrun picks a free port; a deadline), and
checks its own claims (``claims``); here its printed counts are read back and compared with what
torch's source says they must be, and ``claims`` is shown to catch each kind of wrong count.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
from chapter_launch import launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "chapters" / "10_performance" / "buckets_and_hooks.py"
sys.path.insert(0, str(SCRIPT.parent))

import buckets_and_hooks as bh  # noqa: E402

GRAD = bh.LAYERS * bh.WIDTH * (bh.WIDTH + 1) * 4  # six 256x256 layers with biases, fp32
LAYER = bh.WIDTH * (bh.WIDTH + 1) * 4


@pytest.fixture(scope="module")
def printed() -> str:
    done = launch([SCRIPT], torchrun_ranks=2)
    assert "terminate called" not in done.stderr
    return done.stdout


def test_buckets_step_by_step_as_torch_builds_them(printed):
    assert "claims of the docstring: passed" in printed
    assert f"gradient: {GRAD} bytes" in printed
    default, explicit = printed.split("bucket_cap_mb left out:")[1].split("bucket_cap_mb=25:")
    assert f"step 0: [{GRAD}]" in default  # one bucket before the rebuild
    # rebuilt at 1 MiB: four layers (1052672 bytes) reach dist._DEFAULT_FIRST_BUCKET_BYTES
    assert f"step 1: [{4 * LAYER}, {2 * LAYER}]  (2 all-reduce calls, {GRAD} bytes)" in default
    assert f"step 1: [{GRAD}]  (1 all-reduce calls" in explicit
    assert printed.count("[rank") == 0 or "[rank1]" not in printed  # rank 0 prints


def test_the_sweep_and_the_hooks_bytes(printed):
    sweep = dict(re.findall(r"^\s+([\d.]+) MiB:\s+(\d+) buckets", printed, re.M))
    assert sweep == {"0.05": "6", "0.25": "6", "1.0": "2", "4.0": "1", "25.0": "1"}
    hooks = {name: [int(v) for v in values.split(", ")] for name, values in re.findall(
        r"^  (\S.*?)\s+\[([\d, ]+)\]", printed, re.M)}
    assert hooks["allreduce_hook"] == [GRAD] * 4
    assert hooks["fp16_compress_hook"] == hooks["own bf16 hook"] == [GRAD // 2] * 4
    # PowerSGD rank 1 from step 2 (start_powerSGD_iter=2): at least P and Q of each 256x256
    # weight (256 floats each) and the six biases uncompressed, and under 2% of the gradient
    powersgd = hooks["PowerSGD rank 1"]
    assert powersgd[:2] == [GRAD] * 2 and powersgd[2] == powersgd[3]
    assert bh.LAYERS * 3 * bh.WIDTH * 4 <= powersgd[2] < GRAD / 50
    assert "bf16_compress_hook: TypeError" in printed  # a CPU build of torch refuses it


def counts() -> tuple[dict, dict, dict, dict]:
    """Counts as the script finds them with torch 2.13 (the printed tables above)."""
    default = {"gradient_bytes": GRAD, "bucket_bytes": [[GRAD], [4 * LAYER, 2 * LAYER]] * 1
               + [[4 * LAYER, 2 * LAYER]]}
    explicit = {"gradient_bytes": GRAD, "bucket_bytes": [[GRAD]] * 3}
    sweep = {cap: {"bucket_bytes": [[GRAD]] * 2 + [[LAYER] * n], "calls": [1, n, n]}
             for cap, n in {0.05: 6, 0.25: 6, 1.0: 2, 4.0: 1, 25.0: 1}.items()}
    sweep[1.0]["bucket_bytes"][2] = [4 * LAYER, 2 * LAYER]
    sweep[4.0]["bucket_bytes"][2] = sweep[25.0]["bucket_bytes"][2] = [GRAD]
    hooks = {"allreduce_hook": {"sent_bytes": [GRAD] * 4},
             "fp16_compress_hook": {"sent_bytes": [GRAD // 2] * 4},
             "own bf16 hook": {"sent_bytes": [GRAD // 2] * 4},
             "PowerSGD rank 1": {"sent_bytes": [GRAD, GRAD, 18456, 18456]}}
    return default, explicit, sweep, hooks


def test_the_claims_hold_for_these_counts_and_catch_wrong_ones():
    assert bh.claims(*counts()) == []
    wrong = []
    for change in ("one bucket at step 1", "small first bucket kept", "split tensor",
                   "more calls", "fp16 full size", "powersgd"):
        default, explicit, sweep, hooks = copy.deepcopy(counts())
        if change == "one bucket at step 1":
            default["bucket_bytes"][1] = [GRAD]
        elif change == "small first bucket kept":
            explicit["bucket_bytes"][1] = [4 * LAYER, 2 * LAYER]
        elif change == "split tensor":
            sweep[0.05]["bucket_bytes"][2] = [LAYER // 2] * 12
        elif change == "more calls":
            sweep[25.0]["calls"][2] = 9
        elif change == "fp16 full size":
            hooks["fp16_compress_hook"]["sent_bytes"][-1] = GRAD
        else:
            hooks["PowerSGD rank 1"]["sent_bytes"][-1] = GRAD // 4
        wrong.append(bh.claims(default, explicit, sweep, hooks))
    assert all(len(found) == 1 for found in wrong), wrong
