"""The reference loop a newcomer reads first still learns the demo task: the documented command, as is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_reference_loop_learns_the_demo_task():
    result = subprocess.run(
        [sys.executable, "-m", "cluster.reference_loop", "deploy/jobs/demo.yaml", "--steps", "60"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=590,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = re.findall(r"^step (\d+): reward ([\d.]+), ESS ratio ([\d.]+)", result.stdout, flags=re.M)
    assert [int(step) for step, _, _ in steps] == list(range(1, 61))
    assert all(float(ess) > 0.99 for _, _, ess in steps), "on-policy: every importance weight is about 1"
    first, last = map(float, re.search(r"first 10 steps ([\d.]+), last 10 steps ([\d.]+)", result.stdout).groups())
    assert last >= first + 0.05, result.stdout[-2000:]
