"""The metric sink: JSONL always, W&B when it works; the metric table, the W&B workspace file, the alerts."""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import zlib
from pathlib import Path

import pytest
import yaml


def test_a_failing_wandb_never_stops_training(tmp_path, monkeypatch, caplog):
    """W&B that cannot start or log: one warning, and every metric still lands in metrics.jsonl."""
    import json

    import wandb

    from cluster.telemetry.metrics import MetricSink

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


def test_an_evaluation_row_holds_its_metrics_only_and_readers_can_tell_it_from_a_step_row(tmp_path, capsys):
    """`log_evaluation` writes the evaluated step's own row: no progress line, no stability rules, and only
    eval/* keys, so `is_evaluation_row` tells it apart (a run from before has eval/* keys in step rows)."""
    from cluster.job import AlertsSection
    from cluster.telemetry.metrics import MetricSink
    from cluster.telemetry.run_files import is_evaluation_row

    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=True, alerts=AlertsSection())
    sink.log(1, {"stability/ess_ratio": 0.9})
    capsys.readouterr()
    sink.log_evaluation(1, {"eval/solved": 0.5, "eval/policy_version": 1})
    assert capsys.readouterr().err == "", "an evaluation prints no progress line"
    with pytest.raises(ValueError, match=r"eval/\* metrics only.*stability/ess_ratio"):
        sink.log_evaluation(1, {"eval/solved": 0.5, "stability/ess_ratio": 0.9})
    sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["train/step"], is_evaluation_row(row)) for row in rows] == [(1, False), (1, True)]
    assert rows[1]["eval/solved"] == 0.5 and set(rows[1]) == {
        "train/step",
        "time/wall_s",
        "eval/solved",
        "eval/policy_version",
    }
    assert not is_evaluation_row({"train/step": 4, "time/step_s": 2.0, "eval/solved": 0.5})  # an older step row
    assert not is_evaluation_row({"train/step": 4, "time/wall_s": 9.0})


def test_step_rows_are_the_learner_steps_alone_in_logged_order(tmp_path):
    """What the report, the calibration and the benchmarks count as steps: not the SFT warm-up's rows, not an
    evaluation's own row (written after later steps, with the evaluated step's number), but an older run's
    step row that carries eval/* keys."""
    from cluster.telemetry.metrics import MetricSink
    from cluster.telemetry.run_files import read_jsonl_rows, step_rows

    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=False)
    sink.log(-1, {"sft/loss": 2.0})
    sink.log(1, {"time/learner_step_s": 0.3})
    sink.log(2, {"time/learner_step_s": 0.4})
    sink.log_evaluation(1, {"eval/solved": 0.5})
    sink.log(3, {"time/learner_step_s": 0.5, "eval/solved": 0.75})  # how runs logged evaluations before
    sink.close()
    rows = read_jsonl_rows(tmp_path / "metrics.jsonl")
    assert len(rows) == 5
    assert [(row["train/step"], row["time/learner_step_s"]) for row in step_rows(rows)] == [
        (1, 0.3),
        (2, 0.4),
        (3, 0.5),
    ]


# ---- the metric table, the W&B workspace file ---------------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
WORKSPACE = ROOT / "deploy" / "wandb" / "workspace.yaml"
SOURCE_FOLDERS = ("algorithms", "learner", "actors", "cluster", "tasks")
PANEL_FIELDS = {"kind", "title", "y", "log_y", "range_y"}  # what cluster/telemetry/workspace.py reads
FOLDER_PREFIXES = {"runs"}  # "runs/sweep" and the like are default folders, not metric keys
# "group/name", not "n/a"; a capital marks a template (eval/pass_at_K)
METRIC_LITERAL = re.compile(r"""["']([a-z][a-z0-9_]+/[a-z][A-Za-z0-9_]*)["']""")


def _metric_keys_in_source() -> dict[str, str]:
    """Every "group/name" string literal in the project's code (not the table itself), with a file it is in.
    Readers of metrics.jsonl count too: a key they expect must be one the code writes."""
    found = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "cluster" / "metrics.py":
                continue
            for key in METRIC_LITERAL.findall(path.read_text()):
                if key.split("/")[0] not in FOLDER_PREFIXES:
                    found.setdefault(key, str(path.relative_to(ROOT)))
    return found


def test_known_metrics_are_the_keys_the_code_logs():
    """KNOWN_METRICS is what the workspace file is checked against, so it must follow the code both ways."""
    from cluster.telemetry.metrics import KNOWN_METRICS, SAMPLES_TABLE, STEP_KEY, WALL_KEY

    found = _metric_keys_in_source()
    unknown = {key: where for key, where in found.items() if key not in KNOWN_METRICS}
    assert not unknown, f"logged but missing from cluster.telemetry.metrics.KNOWN_METRICS: {unknown}"
    stale = set(KNOWN_METRICS) - set(found) - {STEP_KEY, WALL_KEY, SAMPLES_TABLE}  # written by the sink itself
    assert not stale, f"in KNOWN_METRICS but logged nowhere (renamed?): {sorted(stale)}"


def _workspace_problems(spec: dict) -> list[str]:
    from cluster.telemetry.metrics import HISTOGRAM_METRICS, KNOWN_METRICS, STEP_KEY

    problems = [] if spec.get("x_axis") == STEP_KEY else [f"x_axis is {spec.get('x_axis')!r}, not {STEP_KEY}"]
    for section in spec["sections"]:
        for panel in section["panels"]:
            where = f"{section['name']} / {panel.get('title')}"
            problems += [f"{where}: unknown field {field!r}" for field in set(panel) - PANEL_FIELDS]
            if panel.get("kind") not in ("line", "histogram"):
                problems.append(f"{where}: kind {panel.get('kind')!r}")
            if not panel.get("y"):
                problems.append(f"{where}: no metric")
            for key in panel.get("y", []):
                if key not in KNOWN_METRICS:
                    problems.append(f"{where}: {key} is not a metric the project logs")
                elif (key in HISTOGRAM_METRICS) != (panel.get("kind") == "histogram"):
                    kind = "histogram" if key in HISTOGRAM_METRICS else "line"
                    problems.append(f"{where}: {key} needs a {kind} panel")
    return problems


def _plotted(spec: dict) -> set[str]:
    return {key for section in spec["sections"] for panel in section["panels"] for key in panel["y"]}


def test_the_workspace_plots_only_metrics_the_project_logs():
    spec = yaml.safe_load(WORKSPACE.read_text())
    assert _workspace_problems(spec) == []
    assert _plotted(spec) >= {
        "stability/ess_ratio",
        "stability/lr_scale",
        "optim/grad_norm",
        "stability/kl_k3",
        "rollout/reward_mean",
        "async/lag",
        "perf/gen_tokens_per_s",
        "perf/learner_tokens_per_s",
        "perf/weight_sync_s",
    }


def test_a_renamed_metric_in_the_workspace_is_caught():
    spec = yaml.safe_load(WORKSPACE.read_text())
    spec["sections"][0]["panels"][0]["y"] = ["stability/ess"]
    spec["sections"][-1]["panels"].append({"kind": "line", "title": "lag as a line", "y": ["async/lag"]})
    problems = _workspace_problems(spec)
    assert len(problems) == 2
    assert "stability/ess is not a metric" in problems[0] and "async/lag needs a histogram panel" in problems[1]


# ---- the offline W&B run file ---------------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf records of a W&B run file. wandb 0.31 ships no Python reader (the old
    `wandb.sdk.internal.datastore` is gone; wandb-core writes the file), so this reads its format:
    a 7-byte header (':W&B', magic 0xBEE1, version 0), then LevelDB log records in 32 KiB blocks, each
    `crc32 (type byte + data), length, type` (1 full, 2 first, 3 middle, 4 last) followed by the data."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a W&B run file"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt record at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _nested(items, out: dict | None = None) -> dict:
    """History or summary items (a key path and a JSON value each) merged into one nested dict: a
    summary update may carry only the parts that changed (`last` without an unchanged `max`)."""
    out = {} if out is None else out
    for item in items:
        *parents, last = list(item.nested_key) or [item.key]
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        value = json.loads(item.value_json)
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last].update(value)
        else:
            node[last] = value
    return out


def test_offline_wandb_run_holds_the_metrics_histograms_groups_and_alerts(tmp_path, monkeypatch):
    """The sink's W&B side, read back from the offline run file with W&B's own record format: every value
    and the lag histogram per step, each metric group plotted against train/step, the summaries, the alert."""
    from cluster.job import AlertsSection
    from cluster.telemetry.metrics import SUMMARIES, MetricSink, metric_groups

    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    steps = {
        1: {
            "stability/ess_ratio": 0.9,
            "optim/grad_norm": 1.5,
            "stability/kl_k3": 0.01,
            "rollout/reward_mean": 0.25,
            "perf/gen_tokens_per_s": 812.0,
            "async/lag": [3, 5],
        },
        2: {
            "stability/ess_ratio": 0.05,
            "optim/grad_norm": 2.5,
            "stability/kl_k3": 0.2,
            "rollout/reward_mean": 0.5,
            "perf/gen_tokens_per_s": 790.0,
            "async/lag": [0, 6, 2],
        },
        3: {
            "stability/ess_ratio": 0.04,
            "optim/grad_norm": 0.5,
            "stability/kl_k3": 0.3,
            "rollout/reward_mean": 0.75,
            "perf/gen_tokens_per_s": 805.0,
            "async/lag": [8],
        },
    }
    sink = MetricSink(
        tmp_path,
        "offline-check",
        {"seed": 0},
        "offline",
        progress_bar=False,
        alerts=AlertsSection(ess_collapse_steps=2),
    )
    assert sink._wandb is not None, "offline W&B started"
    for step, metrics in steps.items():
        sink.log(step, metrics)
    evaluation = {"eval/solved": 0.625, "eval/policy_version": 2}
    sink.log_evaluation(2, evaluation)  # step 2's evaluation, ended after step 3: plotted at step 2
    sink.close()  # returns only once wandb-core has saved every record (read at once below)

    files = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1
    records = list(_wandb_records(files[0]))
    history = [_nested(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [row["train/step"] for row in history] == [1, 2, 3, 2]
    assert {key: history[3][key] for key in evaluation} == evaluation and "stability/ess_ratio" not in history[3]
    for row, metrics in zip(history, steps.values()):
        for key, value in metrics.items():
            if key == "async/lag":
                assert row[key] == {"_type": "histogram", "values": value, "bins": list(range(len(value) + 1))}
            else:
                assert row[key] == value, key

    definitions = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    globs = {d.glob_name: d.step_metric for d in definitions if d.glob_name}
    assert globs == {f"{group}/*": "train/step" for group in metric_groups()}
    assert set(metric_groups()) >= {"rollout", "stability", "optim", "async", "perf", "time", "sft", "opob", "fault"}
    named = {d.name: d for d in definitions if d.name}
    assert "train/step" in named and not named["train/step"].step_metric
    for key, ops in SUMMARIES.items():
        assert named[key].step_metric == "train/step"
        assert {op for op in ("min", "max", "mean", "last") if getattr(named[key].summary, op)} == set(ops.split(","))

    summary: dict = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            _nested(record.summary.update, summary)
    assert summary["stability/ess_ratio"] == {"min": 0.04, "last": 0.04}
    assert summary["optim/grad_norm"] == {"max": 2.5, "last": 0.5}
    assert summary["eval/solved"] == {"max": 0.625, "last": 0.625}

    alerts = [r.alert for r in records if r.WhichOneof("record_type") == "alert"]
    assert [(a.title, a.level) for a in alerts] == [("ESS collapse", "WARN")]
    assert "step 3" in alerts[0].text


# ---- stability alerts ----------------------------------------------------------------------------------


def _alert_steps(key: str, values: list[float], **thresholds) -> list[int]:
    """The steps (1, 2, ...) at which the rules raise an alert for this sequence of one metric."""
    from cluster.job import AlertsSection
    from cluster.telemetry.alerts import StabilityAlerts

    rules = StabilityAlerts(AlertsSection(**thresholds))
    return [step for step, value in enumerate(values, start=1) if rules.check(step, {key: value})]


NAN = math.nan


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.5, 0.05, 0.05, 0.05, 0.05, 0.5, 0.05, 0.05, 0.05], [4, 9]),  # once per collapse, again after recovery
        ([0.05, 0.05, 0.5, 0.05, 0.05, 0.5], []),  # never 3 in a row
        ([NAN, NAN, NAN, NAN], [3]),  # NaN is a collapse
        ([0.05, NAN, 0.09], [3]),
        ([0.1, 0.1, 0.1, 0.1], []),  # at the threshold is not below it
    ],
)
def test_ess_collapse_alerts_once_per_collapse(values, expected):
    assert _alert_steps("stability/ess_ratio", values, ess_ratio_below=0.1, ess_collapse_steps=3) == expected


def test_ess_collapse_rule_can_be_turned_off_and_ignores_steps_without_ess():
    assert _alert_steps("stability/ess_ratio", [0.0] * 5, ess_ratio_below=None) == []
    assert _alert_steps("stability/ess_ratio", [0.0, 0.0], ess_collapse_steps=1) == [1]
    from cluster.job import AlertsSection
    from cluster.telemetry.alerts import StabilityAlerts

    rules = StabilityAlerts(AlertsSection(ess_collapse_steps=2))
    assert rules.check(1, {"stability/ess_ratio": 0.01}) == []
    assert rules.check(2, {"optim/loss": 0.3}) == []  # no ESS this step: the streak neither grows nor breaks
    assert [a.title for a in rules.check(3, {"stability/ess_ratio": 0.02})] == ["ESS collapse"]


def test_entropy_collapse_is_off_by_default_and_alerts_once_per_collapse():
    values = [2.0, 0.05, 0.04, NAN, 0.5, 0.01, 0.01, 0.01]
    assert _alert_steps("stability/entropy", values) == []  # null unless the job sets a threshold
    assert _alert_steps("stability/entropy", values, entropy_below=0.1, entropy_collapse_steps=3) == [4, 8]
    assert _alert_steps("stability/entropy", values, entropy_below=0.1, entropy_collapse_steps=2) == [3, 7]
    from cluster.job import AlertsSection
    from cluster.telemetry.alerts import StabilityAlerts

    rules = StabilityAlerts(AlertsSection(entropy_below=0.2, entropy_collapse_steps=1, ess_collapse_steps=1))
    alerts = rules.check(7, {"stability/entropy": 0.03, "stability/ess_ratio": 0.01})
    assert [a.title for a in alerts] == ["ESS collapse", "entropy collapse"]  # independent streaks
    assert alerts[1].text.startswith(
        "step 7: stability/entropy = 0.03, below 0.2 (or NaN) for 1 step(s) in a row "
        "(logging.alerts.entropy_below); the policy has stopped exploring"
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, 6.0, 7.0, 1.0, 6.0], [2, 5]),  # above the absolute limit: once, again after it came back down
        ([1.0, NAN, NAN, 1.0, math.inf], [2, 5]),  # non-finite is a spike
        ([5.0, 5.0, 1.0], []),  # at the limit is not above it
    ],
)
def test_grad_norm_above_an_absolute_limit(values, expected):
    assert _alert_steps("optim/grad_norm", values, grad_norm_above=5.0, grad_norm_spike_factor=None) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        # window 3, factor 10: median of the 3 previous steps
        ([1.0, 1.0, 1.0, 9.0, 20.0, 1.0], [5]),  # 9 < 10 x 1; 20 > 10 x median(1, 1, 9)
        ([1.0, 1.0, 1.0, 20.0, 30.0, 40.0, 1.0, 1.0, 1.0, 500.0], [4, 10]),  # the window adapts; a later spike again
        ([1.0, 100.0, 100.0], []),  # the relative rule waits for a full window
        ([0.0, 0.0, 0.0, 1.0], []),  # zero-gradient steps (all-equal rewards) give no median to compare with
        ([1.0, 1.0, 1.0, NAN, 1.0, NAN], [4, 6]),  # NaN counts while only the relative rule is on
    ],
)
def test_grad_norm_spike_against_the_running_median(values, expected):
    got = _alert_steps("optim/grad_norm", values, grad_norm_spike_factor=10.0, grad_norm_window_steps=3)
    assert got == expected


def test_groups_without_signal_alert_once_when_most_stay_flat():
    """TRL users watch frac_reward_zero_std; here a lasting high share is an alert that says what to change."""
    values = [0.5, 0.95, 1.0, 0.95, 0.92, 0.95, 0.2, 0.95, NAN, 0.95]
    assert _alert_steps("rollout/zero_std_share", values) == []  # 10 in a row above 0.9 by default
    assert _alert_steps("rollout/zero_std_share", values, zero_std_steps=5) == [6]
    assert _alert_steps("rollout/zero_std_share", values, zero_std_steps=1) == [2, 8, 10]  # NaN breaks a streak
    assert _alert_steps("rollout/zero_std_share", [1.0] * 10) == [10]
    assert _alert_steps("rollout/zero_std_share", values, zero_std_share_above=None) == []
    from cluster.job import AlertsSection
    from cluster.telemetry.alerts import StabilityAlerts

    (alert,) = StabilityAlerts(AlertsSection(zero_std_steps=1)).check(3, {"rollout/zero_std_share": 1.0})
    assert alert.title == "no learning signal" and alert.text.startswith(
        "step 3: rollout/zero_std_share = 1, above 0.9 for 1 step(s) in a row (logging.alerts.zero_std_share_above)"
    )
    assert "generator.samples_per_prompt" in alert.text


def test_grad_norm_rules_off_means_no_alert_even_for_nan():
    assert _alert_steps("optim/grad_norm", [NAN, 1e9], grad_norm_above=None, grad_norm_spike_factor=None) == []


def test_the_sink_raises_stability_alerts_on_rl_steps_only(tmp_path, caplog):
    """The sink consults the rules in `log`: a log line per alert (W&B is off here), none for SFT steps
    (step <= 0) and none without an alert configuration."""
    from cluster.job import AlertsSection
    from cluster.telemetry.metrics import MetricSink

    caplog.set_level(logging.WARNING, logger="stableasync")
    bad = {"stability/ess_ratio": 0.01, "optim/grad_norm": NAN}
    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=False, alerts=AlertsSection(ess_collapse_steps=2))
    for step in (-2, -1, 0):
        sink.log(step, {"sft/loss": 1.0, **bad})
    assert "ALERT" not in caplog.text
    for step in (1, 2, 3):
        sink.log(step, bad)
    sink.log(4, {"stability/ess_ratio": 0.9, "optim/grad_norm": 1.0})
    sink.log(5, {"stability/ess_ratio": 0.9, "optim/grad_norm": NAN})
    sink.close()
    alerts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ALERT")]
    assert len(alerts) == 3
    assert alerts[0].startswith("ALERT gradient-norm spike: step 1: optim/grad_norm = nan, not finite")
    assert alerts[1].startswith("ALERT ESS collapse: step 2: stability/ess_ratio = 0.01")
    assert alerts[2].startswith("ALERT gradient-norm spike: step 5")

    caplog.clear()
    (tmp_path / "quiet").mkdir()
    quiet = MetricSink(tmp_path / "quiet", "run", {}, "disabled", progress_bar=False)
    for step in (1, 2, 3, 4):
        quiet.log(step, bad)
    quiet.close()
    assert "ALERT" not in caplog.text


def test_the_progress_line_labels_the_warm_up_and_shows_what_a_user_steers_by(tmp_path, capsys):
    """The warm-up showed as `step -60/30 | 4s`: negative steps, no label, no loss; a step had no loss, KL,
    entropy or flat-group share, and its time no label."""
    from cluster.telemetry.metrics import MetricSink

    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=True, total_steps=30, warmup_steps=2)
    sink.log(-2, {"sft/loss": 2.5})
    sink.log(-1, {"sft/loss": 1.25})
    row = {"rollout/reward_mean": 0.5, "rollout/zero_std_share": 0.25, "optim/loss": 0.0123, "stability/kl_k3": -1e-9}
    sink.log(1, {**row, "stability/entropy": 1.5, "stability/ess_ratio": 0.9, "optim/grad_norm": math.nan})
    sink.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("warm-up 1/2 | sft loss 2.500 | ") and lines[0].endswith("s elapsed")
    assert lines[1].startswith("warm-up 2/2 | sft loss 1.250 | ")
    assert lines[2].startswith(
        "step 1/30 | reward 0.500 | flat groups 25% | loss 0.0123 | kl 0.0000 | entropy 1.50 | ess 0.90 | "
    ), lines[2]


def test_the_flat_group_share_counts_trained_rows_in_groups_with_one_reward():
    import torch

    from algorithms.diagnostics import zero_std_share

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.1, 0.1, 0.3, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    trained = torch.tensor([True] * 7 + [False])  # the last row an idle one
    assert float(zero_std_share(rewards, groups, trained)) == pytest.approx(4 / 7)  # groups 0 and 2 are flat
    assert float(zero_std_share(rewards, groups, torch.zeros(8, dtype=torch.bool))) == 0.0
