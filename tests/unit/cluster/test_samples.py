"""Rollout samples a person reads: the rows built from a step's groups, samples.jsonl and the W&B table."""

from __future__ import annotations

import json

import pytest

from actors.buffer import ScoredGroup
from cluster.telemetry.samples import COLUMNS, rollout_samples
from tests.unit.cluster.test_metrics import _nested, _wandb_records


def _group(group_id: int, version: int, texts: list[str], rewards: list[float]) -> ScoredGroup:
    completions = [
        {
            "completion_ids": list(range(3 + i)),
            "behaviour_logprobs": [-0.5] * (3 + i),
            "text": text,
            "finish_reason": "length" if i else "stop",
            "reward": reward,
            "score_error": "timeout" if i == 2 else None,
        }
        for i, (text, reward) in enumerate(zip(texts, rewards))
    ]
    return ScoredGroup(
        group_id,
        f"p{group_id}",
        [1, 2],
        completions,
        version,
        version,
        0,
        question=f"What is {group_id} + 1?",
        answer=str(group_id + 1),
    )


def test_each_response_gets_its_question_reward_lag_and_log_ratio_in_order():
    groups = [_group(7, 3, ["<answer>8</answer>", "8", "x" * 50], [1.0, 0.0, 0.0]), _group(9, 5, ["ten"], [0.0])]
    rows = rollout_samples(
        step=7, trained_version=6, groups=groups, log_ratios=[0.3, -0.8, 1.5, 0.0, 9.9], max_chars=10
    )
    assert [(r.group_id, r.completion_tokens, r.lag) for r in rows] == [(7, 3, 3), (7, 4, 3), (7, 5, 3), (9, 3, 1)]
    assert rows[0].question == "What is 7 + 1?" and rows[0].answer == "8" and rows[0].reward == 1.0
    assert rows[1].finish_reason == "length" and rows[2].score_error == "timeout"
    assert rows[2].completion == "x" * 10 + " [...]" and rows[0].completion == "<answer>8</answer>"[:10] + " [...]"
    assert rows[3].completion == "ten"
    assert [r.log_ratio for r in rows] == [0.3, -0.8, 1.5, 0.0]  # the extra ratio (another group's row) unused
    assert rows[1].log_ratio_per_token == pytest.approx(-0.2) and all(r.step == 7 for r in rows)


def test_fewer_log_ratios_than_responses_is_an_error():
    with pytest.raises(ValueError, match="3 responses but 2 learner log-ratios"):
        rollout_samples(1, 0, [_group(1, 0, ["a", "b", "c"], [0.0, 0.0, 0.0])], [0.0, 0.0], max_chars=100)


def test_the_sink_appends_samples_jsonl_and_logs_a_wandb_table(tmp_path, monkeypatch):
    from cluster.telemetry.metrics import SAMPLES_TABLE, MetricSink

    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sink = MetricSink(tmp_path, "samples-check", {}, "offline", progress_bar=False)
    first = rollout_samples(2, 1, [_group(1, 0, ["a", "b"], [1.0, 0.0])], [0.1, 0.2], max_chars=100)
    second = rollout_samples(4, 3, [_group(2, 3, ["c"], [0.5])], [-0.3], max_chars=100)
    sink.log_samples(2, first)
    sink.log_samples(4, second)
    assert sink.sample_lines == 3
    sink.close()

    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["completion"], r["reward"], r["log_ratio"]) for r in rows] == [
        (2, "a", 1.0, 0.1),
        (2, "b", 0.0, 0.2),
        (4, "c", 0.5, -0.3),
    ]
    assert list(rows[0]) == COLUMNS
    # a resumed run counts on
    assert MetricSink(tmp_path, "again", {}, "disabled", progress_bar=False).sample_lines == 3

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    history = [_nested(r.history.item) for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "history"]
    tables = [(row["train/step"], row[SAMPLES_TABLE]) for row in history if SAMPLES_TABLE in row]
    assert [(step, table["_type"], table["nrows"], table["ncols"]) for step, table in tables] == [
        (2, "table-file", 2, len(COLUMNS)),
        (4, "table-file", 1, len(COLUMNS)),
    ]
    (saved,) = run_file.parent.glob(f"files/{tables[1][1]['path']}")
    table = json.loads(saved.read_text())
    assert table["columns"] == COLUMNS and table["data"][0][COLUMNS.index("completion")] == "c"
