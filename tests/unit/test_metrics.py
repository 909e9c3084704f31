"""The metric sink: JSONL always, W&B when it works."""

from __future__ import annotations


def test_a_failing_wandb_never_stops_training(tmp_path, monkeypatch, caplog):
    """W&B that cannot start or log: one warning, and every metric still lands in metrics.jsonl."""
    import json

    import wandb

    from cluster.metrics import MetricSink

    def unreachable(*args, **kwargs):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(wandb, "init", unreachable)
    sink = MetricSink(tmp_path, "run", {}, "online", progress_bar=False)
    sink.log(1, {"stability/ess_ratio": 0.9})
    sink.log(2, {"stability/ess_ratio": 0.8})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["stability/ess_ratio"] for r in rows] == [0.9, 0.8]
    assert "W&B disabled" in caplog.text and "unreachable" in caplog.text
