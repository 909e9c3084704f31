"""The reference loop a newcomer reads first still learns the demo task: the documented command, as is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]


def _output(module: str, job: Path | str, steps: int) -> str:
    """The documented command's output."""
    command = [sys.executable, "-m", module, str(job), "--steps", str(steps)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=590)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(600)
def test_the_reference_loop_learns_the_demo_task():
    output = _output("cluster.reference_loop", "deploy/jobs/demo.yaml", 60)
    steps = re.findall(r"^step (\d+): lag 0, reward ([\d.]+), ESS ratio ([\d.]+)", output, flags=re.M)
    assert [int(step) for step, _, _ in steps] == list(range(1, 61))
    assert all(float(ess) > 0.99 for _, _, ess in steps), "on-policy: every importance weight is about 1"
    first, last = map(float, re.search(r"first 10 steps ([\d.]+), last 10 steps ([\d.]+)", output).groups())
    assert last >= first + 0.05, output[-2000:]


@pytest.mark.timeout(600)
def test_the_reference_loop_queues_samples_for_a_fixed_lag(tmp_path):
    """async.fixed_lag 3: steps 1 to 4 train the initial policy's samples, every later step samples 3 versions old."""
    job = yaml.safe_load((ROOT / "deploy/jobs/demo.yaml").read_text())
    job["async"] = {**job.get("async", {}), "max_lag": 3, "fixed_lag": 3}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    output = _output("cluster.reference_loop", tmp_path / "job.yaml", 6)
    lags = re.findall(r"^step \d+: lag (\d+), reward", output, flags=re.M)
    assert [int(lag) for lag in lags] == [0, 1, 2, 3, 3, 3]
