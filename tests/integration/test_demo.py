"""The README's first command does what the README says: the demo job as shipped, run once, reaches the outcome
the README states (docs/results.md#the-demo-across-seeds has the runs behind the figures); and the dataset template,
`deploy/jobs/dataset.yaml`, learns its own sample data as docs/tasks.md says.

About 3 minutes and 1 minute on the 2-core development machine, the longest tests of the default suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")
ROOT = Path(__file__).resolve().parents[2]

# The README's floor for the demo: issue 44's bar, which seed 0 (the one run here) clears in docs/results.md (60 of
# 64 at the last evaluation, last-10 mean reward 0.91), since runs are not bit-reproducible; seed 1 ended at 47
# and 59 in two runs. RL must also have
# done the work: the sampled reward rose from 0.38-0.42 over the first 10 steps. The collapses it guards against
# ended at 0 of 64 and 0.00 (the policy blown up to uniform), or 39 of 64 and 0.65.
MIN_SOLVED_AT_LAST_EVAL = 50  # of 64
MIN_LAST_10_REWARD = 0.75
MIN_REWARD_GAIN = 0.25  # last 10 steps over the first 10


@dataclass(frozen=True)
class ShippedRun:
    """A shipped job's run through the CLI, as a user starts it: what it printed and what its run directory holds."""

    console: str
    summary: dict
    evaluated_steps: list[int]
    solved: list[int]  # problems solved at each evaluation
    first_10: float  # mean sampled reward over the first 10 RL steps
    last_10: float


def _train_shipped(job_file: str, tmp_path: Path, timeout_s: int) -> ShippedRun:
    from cluster.telemetry.run_files import is_evaluation_row, read_jsonl_rows

    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "train", job_file, "--set", f"logging.run_dir={tmp_path / 'runs'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    evaluations = [row for row in read_jsonl_rows(run_dir / "metrics.jsonl") if is_evaluation_row(row)]
    rewards = summary["rewards"]
    return ShippedRun(
        result.stdout + result.stderr,
        summary,
        [row["train/step"] for row in evaluations],
        [round(row["eval/solved"] * row["eval/problems"]) for row in evaluations],
        sum(rewards[:10]) / 10,
        sum(rewards[-10:]) / 10,
    )


@pytest.mark.timeout(900)
def test_the_demo_job_as_shipped_reaches_the_readmes_floor(tmp_path):
    run = _train_shipped("deploy/jobs/demo.yaml", tmp_path, 880)
    assert run.summary["steps"] == 300 and len(run.summary["rewards"]) == 300
    assert run.evaluated_steps == [0, 50, 100, 150, 200, 250, 300]
    solved, first_10, last_10 = run.solved, run.first_10, run.last_10
    outcome = f"solved {solved} of 64 at steps 0..300, mean reward {first_10:.3f} -> {last_10:.3f}"
    assert solved[-1] >= MIN_SOLVED_AT_LAST_EVAL, outcome
    assert last_10 >= MIN_LAST_10_REWARD and last_10 >= first_10 + MIN_REWARD_GAIN, outcome
    # the console: quiet engines (vLLM's start-up was 40 lines), no colour codes in a file, a labelled warm-up
    console = run.console
    assert "Initializing a V1 LLM engine" not in console and "\x1b[" not in console, console[:3000]
    assert "warm-up 1/50 | sft loss " in console and "step 300/300 | reward " in console


# The dataset template's floor (docs/tasks.md has its runs): seeds 0-2 went from 10-15 of 24 at step 0 to 20 of 24,
# and the sampled reward from 0.10 to 0.65-0.71 over the first and last 10 steps. With 10 warm-up steps it used to
# learn nothing (0.01-0.06 sampled, 0 of 4 solved).
TEMPLATE_MIN_SOLVED = 16  # of 24, at the last evaluation
TEMPLATE_MIN_SOLVED_GAIN = 3  # over the step-0 evaluation
TEMPLATE_MIN_REWARD_GAIN = 0.3  # last 10 steps over the first 10


@pytest.mark.timeout(600)
def test_the_dataset_template_as_shipped_learns_its_own_sample_data(tmp_path):
    run = _train_shipped("deploy/jobs/dataset.yaml", tmp_path, 580)
    assert run.evaluated_steps == [0, 50, 100, 150, 200]
    solved, first_10, last_10 = run.solved, run.first_10, run.last_10
    outcome = f"solved {solved} of 24 at steps 0..200, mean reward {first_10:.3f} -> {last_10:.3f}"
    assert solved[-1] >= TEMPLATE_MIN_SOLVED and solved[-1] >= solved[0] + TEMPLATE_MIN_SOLVED_GAIN, outcome
    assert last_10 >= first_10 + TEMPLATE_MIN_REWARD_GAIN, outcome
