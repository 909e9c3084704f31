"""The README's first command does what the README says: the demo job as shipped, run once, reaches the outcome
the README states (docs/results.md#the-demo-across-seeds has the runs behind the figures).

About 3 minutes on the 2-core development machine, the longest test of the default suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]

# The README's floor for the demo, below the band its seeds 0-2 reached in docs/results.md (39-60 of 64 at the
# last evaluation, last-10 mean reward 0.65-0.81), since runs are not bit-reproducible. The collapses it guards
# against ended at 0 of 64 and 0.00 (the policy blown up to uniform), or 18 of 64 and 0.35.
MIN_SOLVED_AT_LAST_EVAL = 32  # of 64
MIN_LAST_10_REWARD = 0.55


@pytest.mark.timeout(900)
def test_the_demo_job_as_shipped_reaches_the_readmes_floor(tmp_path):
    from cluster.telemetry.run_files import is_evaluation_row, read_jsonl_rows

    result = subprocess.run([sys.executable, "-m", "cluster.cli", "train", "deploy/jobs/demo.yaml",
                             "--set", f"logging.run_dir={tmp_path / 'runs'}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 300 and len(summary["rewards"]) == 300
    evaluations = [row for row in read_jsonl_rows(run_dir / "metrics.jsonl") if is_evaluation_row(row)]
    assert [row["train/step"] for row in evaluations] == [50, 100, 150, 200, 250, 300]
    solved = [round(row["eval/solved"] * row["eval/problems"]) for row in evaluations]
    last_10 = sum(summary["rewards"][-10:]) / 10
    outcome = f"solved {solved} of 64 at steps 50..300, last-10 mean reward {last_10:.3f}"
    assert solved[-1] >= MIN_SOLVED_AT_LAST_EVAL, outcome
    assert last_10 >= MIN_LAST_10_REWARD, outcome
