"""Resuming whole jobs from their checkpoints on a local Ray cluster: no group trained twice or lost, streaming runs
and tool episodes included, a damaged shard skipped for an older checkpoint."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from cluster.cli import main as cli_main  # noqa: E402
from cluster.job import validate_job  # noqa: E402
from cluster.telemetry.run_files import is_evaluation_row  # noqa: E402
from tests.integration.whole_jobs import (  # noqa: E402  # noqa: E402
    assert_each_group_ends_once,
    assert_the_last_checkpoint_exports_the_saved_model,
    job_config,
    tool_job,
)


def test_resume_from_a_checkpoint_continues_without_gap_or_duplicate(local_ray, tmp_path, capsys, caplog):
    """A run checkpoints at steps 2 and 4; with step 4's checkpoint damaged (a crash while it was
    being replaced), `--resume` falls back to step 2: the ledger and metrics are cut back there,
    in-flight groups are issued again, and every step's groups are trained exactly once. Step 2's
    evaluation was still running at its checkpoint (its row came after the cut): the resume answers it
    again on the restored weights, so each evaluation has one row, and each step's rollout samples one set."""
    job = job_config(
        tmp_path,
        max_lag=1,
        steps=4,
        logging={"run_name": "resumed", "samples": {"every_steps": 1}},
        checkpoint={"every_steps": 2},
        eval={"every_steps": 2, "num_problems": 4},
    )
    run_dir = tmp_path / "runs" / "resumed"
    from cluster.run.driver import train

    train(validate_job(job))
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step-000002", "step-000004"]
    assert_the_last_checkpoint_exports_the_saved_model(run_dir, capsys)
    (run_dir / "checkpoints" / "step-000004" / "driver.json").write_text('{"version": 4, "trunc')

    assert json.loads((run_dir / "checkpoints" / "step-000002" / "driver.json").read_text())["evaluating"] == [2]

    with caplog.at_level("INFO", logger="stableasync"):
        assert cli_main(["train", "--resume", str(run_dir)]) == 0
    assert "evaluating step 2 again: its evaluation was in flight at the checkpoint" in caplog.text
    assert_each_group_ends_once(run_dir, steps=4)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["train/step"], m["eval/policy_version"]) for m in metrics if is_evaluation_row(m)] == [(2, 2), (4, 4)]
    cut = json.loads((run_dir / "checkpoints" / "step-000002" / "driver.json").read_text())["ledger_lines"]
    assert (run_dir / f"ledger.after-{cut}.jsonl").exists()
    samples = [json.loads(line)["step"] for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4  # steps 3 and 4 cut back and logged again
    assert (run_dir / "samples.after-8.jsonl").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert json.loads((run_dir / "checkpoints" / "step-000004" / "driver.json").read_text())["version"] == 4


@pytest.mark.slow  # about 70 s: a 4-step run and its resume
def test_a_streaming_run_resumes_from_a_checkpoint_with_every_group_once(local_ray, tmp_path):
    """A streaming run's checkpoint at step 2 holds its buffered groups with their version spans and the groups
    in flight; resumed from it (step 4's damaged), every step's groups are trained once and each trained step
    logs its tokens' lags again."""
    job = job_config(
        tmp_path,
        max_lag=2,
        steps=4,
        logging={"run_name": "streaming-resumed"},
        checkpoint={"every_steps": 2},
        generator={"streaming": True, "requests_in_flight": 2, "prompts_per_request": 1},
    )
    run_dir = tmp_path / "runs" / "streaming-resumed"
    from cluster.run.driver import train

    train(validate_job(job))
    (run_dir / "checkpoints" / "step-000004" / "driver.json").write_text('{"version": 4, "trunc')
    state = json.loads((run_dir / "checkpoints" / "step-000002" / "driver.json").read_text())
    assert all(c["version_spans"] for group in state["ready"] for c in group["completions"])
    assert cli_main(["train", "--resume", str(run_dir)]) == 0
    assert_each_group_ends_once(run_dir, steps=4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["train/step"] > 0 and "async/token_lag" in r]
    assert [r["train/step"] for r in steps] == [1, 2, 3, 4]
    assert all(len(r["async/token_lag"]) <= 3 and sum(r["async/token_lag"]) > 0 for r in steps)  # lags 0 to 2


@pytest.mark.slow  # 60 s: a 2-step run and its resume
def test_a_checkpoint_whose_rank_1_shard_is_damaged_resumes_both_ranks_from_the_older_one(local_ray, tmp_path, caplog):
    """Only rank 1's ZeRO optimizer shard of the newest checkpoint is damaged (cut short on disk). Rank 1 fails
    to load it while rank 0 loads its own: `--resume` must not go on from two different steps, nor wait on a
    rank, but load the older checkpoint on both ranks, train step 2 again, and write a whole step 2. The log
    names the rank that failed."""
    job = job_config(
        tmp_path, max_lag=1, steps=2, logging={"run_name": "damaged-shard"}, checkpoint={"every_steps": 1, "keep": 3}
    )
    run_dir = tmp_path / "runs" / "damaged-shard"
    from cluster.run.driver import train

    train(validate_job(job))
    (shard,) = (run_dir / "checkpoints" / "step-000002").rglob("zero_pp_rank_1_*optim_states.pt")
    whole = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:1000])

    with caplog.at_level("INFO", logger="stableasync"):
        assert cli_main(["train", "--resume", str(run_dir)]) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("step-000002 did not load" in m and "trying an older checkpoint" in m for m in messages), messages
    failed = [m for m in messages if "failed in load_checkpoint" in m]
    assert failed == ["learner rank(s) [1] failed in load_checkpoint; the error of rank 1 follows"], messages
    assert any("from step-000001 (policy version 1)" in m for m in messages), messages
    assert_each_group_ends_once(run_dir, steps=2)
    assert shard.stat().st_size == whole, "the resumed run wrote step 2's checkpoint again, whole"


@pytest.mark.slow  # about 80 s: a tool run and its resume
def test_a_tool_run_resumes_its_episodes_whole(local_ray, tmp_path):
    """Episodes in flight at the checkpoint are issued again whole on resume: every group still ends once."""
    from cluster.run.driver import train

    train(validate_job(tool_job(tmp_path, "tools-resumed")))
    run_dir = tmp_path / "runs" / "tools-resumed"
    (run_dir / "checkpoints" / "step-000004" / "driver.json").write_text('{"version": 4, "trunc')
    assert cli_main(["train", "--resume", str(run_dir)]) == 0
    rows = assert_each_group_ends_once(run_dir, steps=4)
    assert any(r["event"] == "reissued" for r in rows) or all(
        r["trained_step"] < 2 for r in rows if r["event"] == "trained" and r["reissues"]
    )
