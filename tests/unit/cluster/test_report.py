"""`stableasync report`: the summary rules on hand-made runs, tolerant reading, the files it writes, the CLI."""

from __future__ import annotations

import base64
import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.cli import main
from cluster.experiments.report import ReportError, load_run, summarise, summarise_cells, unique_labels, write_report
from tests.fixtures import BENCH_ASYNC, learner_rows, metric_rows

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SFT_STEPS = 2
FIRST_RL_WALL_S = 5.0


def _json_value(value: Any) -> Any:
    """How the metric sink writes a value: non-finite floats as "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _write_run(
    run_dir: Path,
    rewards: list[float],
    *,
    stabilizer: str = "tis_seq",
    max_lag: int = 2,
    alerts: dict[str, Any] | None = None,
    step_s: float = 2.0,
    seed: int | None = None,
    job_name: str = "sweep",
    **series: list[Any],
) -> Path:
    """A run directory as the driver leaves it: job.yaml, metrics.jsonl (SFT rows first), summary.json.
    `series` maps a metric key with "__" for "/" (e.g. stability__ess_ratio) to one value per RL step;
    None leaves the key out of that row."""
    run_dir.mkdir(parents=True)
    job = {
        "name": job_name,  # a sweep's cells share their job's name
        "algorithm": {"stabilizer": {"name": stabilizer}},
        "async": {"max_lag": max_lag},
        "learner": {"steps": len(rewards)},
        "logging": {"alerts": alerts or {}},
    }
    if seed is not None:
        job["seed"] = seed
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job))
    rows = [
        {"train/step": -SFT_STEPS + i, "time/wall_s": 1.0 + i, "sft/loss": 2.0, "sft/grad_norm": "nan"}
        for i in range(SFT_STEPS)
    ]
    for i, reward in enumerate(rewards):
        row = {"train/step": i + 1, "time/wall_s": FIRST_RL_WALL_S + step_s * i, "rollout/reward_mean": reward}
        for name, values in series.items():
            if values[i] is not None:
                row[name.replace("__", "/")] = values[i]
        rows.append({key: _json_value(value) for key, value in row.items()})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "summary.json").write_text(json.dumps({"steps": len(rewards), "rewards": rewards}))
    (run_dir / "ledger.jsonl").write_text("")
    return run_dir


def _wall_s(step: int, step_s: float = 2.0) -> float:
    return FIRST_RL_WALL_S + step_s * (step - 1)


def _first_window_reaching(rewards: list[float], target: float, window: int = 10) -> int | None:
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window : end]) / window >= target:
            return end  # steps are 1-based: the window ending at rewards[end - 1] is step `end`
    return None


# ---- the numbers ------------------------------------------------------------------------------------


def test_time_to_target_uses_full_ten_step_windows_and_final_reward_the_last_tenth(tmp_path):
    rewards = [0.9] + [0.02 * step for step in range(2, 41)]  # a lucky first step, then a ramp
    target = 0.5
    run = load_run(_write_run(tmp_path / "run", rewards))
    summary = summarise(run, target_reward=target)
    expected_step = _first_window_reaching(rewards, target)
    assert expected_step is not None and expected_step > 1
    assert summary.target_step == expected_step
    assert summary.target_wall_s == pytest.approx(_wall_s(expected_step))
    assert summary.final_reward == pytest.approx(statistics.fmean(rewards[-len(rewards) // 10 :]))
    assert summary.best_reward_ma == pytest.approx(max(statistics.fmean(rewards[e - 10 : e]) for e in range(10, 41)))
    assert summary.steps_done == len(rewards)
    unreachable = summarise(run, target_reward=max(rewards) + 0.1)
    assert unreachable.target_step is None and unreachable.target_wall_s is None
    assert summarise(run).target_step is None  # no target given


def test_a_short_run_averages_all_its_steps(tmp_path):
    rewards = [0.2, 0.4, 0.9]
    summary = summarise(load_run(_write_run(tmp_path / "run", rewards)), target_reward=statistics.fmean(rewards))
    assert summary.target_step == len(rewards)  # one window, the whole run, at its last step
    assert summary.final_reward == pytest.approx(rewards[-1])  # 10% of 3 steps: at least one


def test_ess_below_threshold_for_n_steps_in_a_row_collapses(tmp_path):
    threshold, needed = 0.1, 3
    ess: list[Any] = [0.8, 0.05, 0.04, 0.7, 0.9, 0.05, math.nan, None, 0.02, 0.6, 0.8, 0.9]
    rewards = [0.5] * len(ess)
    run = load_run(
        _write_run(
            tmp_path / "run",
            rewards,
            alerts={"ess_ratio_below": threshold, "ess_collapse_steps": needed},
            stability__ess_ratio=ess,
        )
    )
    # expected: walk the logged values; NaN counts as low, a step without the key changes nothing
    streak, expected_step = 0, None
    for step, value in enumerate(ess, start=1):
        if value is None:
            continue
        streak = streak + 1 if (math.isnan(value) or value < threshold) else 0
        if streak == needed:
            expected_step = step
            break
    summary = summarise(run)
    assert (summary.collapsed, summary.collapse_step) == (True, expected_step)
    assert "ESS" in summary.collapse_reason
    assert summary.ess_ratio_min == pytest.approx(min(v for v in ess if v is not None and not math.isnan(v)))
    longer = summarise(run, collapse_steps=needed + 1)  # the CLI's --ess-collapse-steps overrides the job
    assert not longer.collapsed and longer.collapse_reason == ""
    stricter = summarise(run, collapse_below=0.75)  # 0.7 at step 4 now makes a streak 2..4
    assert stricter.collapsed and stricter.collapse_step < expected_step


def test_ess_thresholds_come_from_the_jobs_alerts(tmp_path):
    ess = [0.3] * 5
    default = summarise(load_run(_write_run(tmp_path / "a", [0.5] * 5, stability__ess_ratio=ess)))
    assert (default.ess_collapse_below, default.ess_collapse_steps, default.collapsed) == (0.1, 3, False)
    strict = summarise(
        load_run(_write_run(tmp_path / "b", [0.5] * 5, alerts={"ess_ratio_below": 0.5}, stability__ess_ratio=ess))
    )
    assert strict.collapsed and strict.collapse_step == 3
    off = summarise(
        load_run(
            _write_run(tmp_path / "c", [0.5] * 5, alerts={"ess_ratio_below": None}, stability__ess_ratio=[0.0] * 5)
        )
    )
    assert off.ess_collapse_below is None and not off.collapsed


def test_a_nan_grad_norm_collapses_and_reads_nan(tmp_path):
    grad_norms = [0.5, 0.7, 3.0, math.nan, 0.6, math.inf]
    run = load_run(_write_run(tmp_path / "run", [0.5] * len(grad_norms), optim__grad_norm=grad_norms))
    summary = summarise(run)
    assert math.isnan(summary.grad_norm_max)
    first_bad = next(step for step, v in enumerate(grad_norms, start=1) if not math.isfinite(v))
    assert summary.collapse_step == first_bad and "grad norm nan" in summary.collapse_reason
    inf_only = summarise(load_run(_write_run(tmp_path / "inf", [0.5] * 3, optim__grad_norm=[1.0, math.inf, 2.0])))
    assert inf_only.grad_norm_max == math.inf and inf_only.collapse_step == 2


def test_a_reward_that_falls_below_half_its_best_collapses(tmp_path):
    rise = [0.1 * min(step, 8) for step in range(1, 31)]  # up to 0.8 and holding
    fallen = rise + [0.1] * 20
    summary = summarise(load_run(_write_run(tmp_path / "fallen", fallen)))
    final = statistics.fmean(fallen[-len(fallen) // 10 :])
    best = max(statistics.fmean(fallen[e - 10 : e]) for e in range(10, len(fallen) + 1))
    assert final < 0.5 * best
    assert summary.collapsed and "reward" in summary.collapse_reason
    assert summary.collapse_step > len(rise)  # after the peak, where the moving average fell below half
    dipped = rise + [0.6] * 20
    assert not summarise(load_run(_write_run(tmp_path / "dipped", dipped))).collapsed


def test_a_healthy_run_does_not_collapse(tmp_path):
    n = 20
    rewards = [0.3 + 0.02 * i for i in range(n)]
    ess = [0.9 - 0.01 * i for i in range(n)]
    grad_norms = [1.0 + 0.1 * (i % 3) for i in range(n)]
    kl = [0.001 * (i + 1) for i in range(n)]
    lags = [[3, 4, 1] if i % 2 else [6, 2] for i in range(n)]
    run = load_run(
        _write_run(
            tmp_path / "run",
            rewards,
            stability__ess_ratio=ess,
            optim__grad_norm=grad_norms,
            stability__kl_k3=kl,
            async__lag=lags,
            async__lag_mean=[0.5] * n,
        )
    )
    summary = summarise(run, target_reward=0.4)
    assert not summary.collapsed and summary.collapse_step is None and summary.collapse_reason == ""
    assert summary.ess_ratio_min == pytest.approx(min(ess))
    assert summary.grad_norm_max == pytest.approx(max(grad_norms))
    assert summary.kl_k3_max == pytest.approx(max(kl))
    samples_by_lag = [sum(h[k] for h in lags if k < len(h)) for k in range(3)]
    assert summary.lag_mean == pytest.approx(sum(k * c for k, c in enumerate(samples_by_lag)) / sum(samples_by_lag))
    assert summary.wall_s == pytest.approx(_wall_s(n))
    assert (summary.stabilizer, summary.max_lag, summary.label) == ("tis_seq", 2, "tis_seq lag 2")


def test_evaluation_rows_count_as_evaluations_not_steps(tmp_path):
    """Evaluations run beside training: each is its own row at the step it evaluated, written when it ends,
    after later steps' rows. The report counts steps and times rewards from step rows only."""
    rewards = [0.1 * step for step in range(1, 7)]
    run_dir = _write_run(tmp_path / "run", rewards)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    late = [
        {"train/step": step, "time/wall_s": _wall_s(step + 1) + 0.5, "eval/solved": solved, "eval/policy_version": step}
        for step, solved in ((2, 0.5), (4, 0.625))
    ]
    rows = [*rows[: SFT_STEPS + 3], late[0], *rows[SFT_STEPS + 3 : SFT_STEPS + 5], late[1], *rows[SFT_STEPS + 5 :]]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = summarise(load_run(run_dir), target_reward=0.3)
    assert summary.steps_done == len(rewards)
    assert summary.eval_solved == 0.625
    assert summary.target_step == 6 and summary.target_wall_s == pytest.approx(_wall_s(6))  # one full window: 6 steps
    assert summary.final_reward == pytest.approx(rewards[-1])


def test_the_documented_report_command_on_recorded_runs_counts_their_steps_not_their_evaluations(tmp_path, capsys):
    """docs/report.md's command with every flag, on two real runs whose evaluations have their own rows."""
    runs = [BENCH_ASYNC / "lag0", BENCH_ASYNC / "lag1"]
    out = tmp_path / "cmp"
    assert (
        main(
            [
                "report",
                *map(str, runs),
                "--out",
                str(out),
                "--target-reward",
                "0.6",
                "--ess-collapse-below",
                "0.2",
                "--ess-collapse-steps",
                "5",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    with (out / "table.csv").open() as table:
        summaries = list(csv.DictReader(table))
    for run, summary in zip(runs, summaries):
        rows, steps = metric_rows(run), learner_rows(run)
        evaluations = [row for row in rows if "eval/solved" in row]
        assert len(steps) == yaml.safe_load((run / "job.yaml").read_text())["learner"]["steps"]
        assert len(steps) < sum(row["train/step"] > 0 for row in rows)  # evaluation rows are there
        assert int(summary["steps_done"]) == len(steps)
        assert float(summary["eval_solved"]) == evaluations[-1]["eval/solved"]
        assert float(summary["wall_s"]) == pytest.approx(rows[-1]["time/wall_s"])
        assert (summary["ess_collapse_below"], summary["ess_collapse_steps"]) == ("0.2", "5")
        assert f"| {summary['label']} |" in printed
    assert [summary["max_lag"] for summary in summaries] == ["0", "1"]
    assert (out / "report.html").stat().st_size > 0 and len(list(out.glob("*.png"))) == 8


# ---- reading ----------------------------------------------------------------------------------------


def test_the_last_evaluation_is_reported_and_a_run_without_one_shows_none(tmp_path):
    evaluated = _write_run(tmp_path / "evaluated", [0.1] * 6, eval__solved=[None, 0.25, None, 0.75, None, float("nan")])
    summary = summarise(load_run(evaluated))
    assert summary.eval_solved == 0.75  # the last finite one, not the NaN after it
    assert summary.eval_solved_lowest == 0.25  # the dip the run recovered from
    plain = _write_run(tmp_path / "plain", [0.1] * 6)
    assert summarise(load_run(plain)).eval_solved is None and summarise(load_run(plain)).eval_solved_lowest is None
    assert main(["report", str(evaluated), str(plain), "--out", str(tmp_path / "report")]) == 0
    header, _, first, second = (tmp_path / "report" / "table.md").read_text().splitlines()[:4]
    column = [cell.strip() for cell in header.split("|")].index("last eval solved")
    assert first.split("|")[column].strip() == "0.750" and second.split("|")[column].strip() == "—"
    assert (
        first.split("|")[column + 1].strip() == "0.250"
        and header.split("|")[column + 1].strip() == "lowest eval solved"
    )


def test_a_held_out_share_below_half_its_best_is_flagged_apart_from_collapse(tmp_path):
    """Under a fixed lag the training reward is an older policy's, so a run whose held-out accuracy fell
    from 50% to 5% logged a steady reward and no collapse; the held-out flag shows the fall."""
    rewards = [0.4] * 8
    fell = _write_run(tmp_path / "fell", rewards, eval__solved=[None, 0.5, None, 0.625, None, 0.5, None, 0.25 - 1e-9])
    summary = summarise(load_run(fell))
    assert (summary.eval_solved_best, summary.held_out_fell, summary.collapsed) == (0.625, True, False)
    half = _write_run(
        tmp_path / "half", rewards, max_lag=0, eval__solved=[None, 0.5, None, 0.625, None, 0.5, None, 0.3125]
    )
    assert summarise(load_run(half)).held_out_fell is False  # exactly half is not below half
    zeros = _write_run(tmp_path / "zeros", rewards, eval__solved=[None, 0.0, None, 0.0, None, 0.0, None, 0.0])
    assert summarise(load_run(zeros)).held_out_fell is False  # never solved anything: nothing fell
    plain = _write_run(tmp_path / "plain", rewards, max_lag=4)  # a cell of its own: no table over seeds
    assert summarise(load_run(plain)).held_out_fell is None
    out = tmp_path / "report"
    assert main(["report", str(fell), str(half), str(plain), "--out", str(out)]) == 0
    header, _, *rows = (out / "table.md").read_text().splitlines()
    column = [cell.strip() for cell in header.split("|")].index("held-out fell")
    assert [row.split("|")[column].strip() for row in rows] == ["yes", "no", "—"]
    page = (out / "report.html").read_text()
    assert page.count('<tr class="collapsed">') == 1  # the fallen run's row is shaded, though not collapsed


def test_cells_count_held_out_falls_over_the_runs_that_evaluated(tmp_path):
    series = {0: [None, 0.75, None, 0.25], 1: [None, 0.75, None, 0.5], 2: None}
    runs = [
        _write_run(tmp_path / f"m2po-{seed}", [0.5] * 4, stabilizer="m2po", max_lag=16, seed=seed)
        if evals is None
        else _write_run(
            tmp_path / f"m2po-{seed}", [0.5] * 4, stabilizer="m2po", max_lag=16, seed=seed, eval__solved=evals
        )
        for seed, evals in series.items()
    ]
    runs.append(_write_run(tmp_path / "none", [0.5] * 4, stabilizer="none", max_lag=16, seed=0))
    m2po, none = summarise_cells([summarise(load_run(run)) for run in runs])
    assert (m2po.evaluated, m2po.held_out_fell, m2po.collapsed) == (2, 1, 0)
    assert (none.evaluated, none.held_out_fell) == (0, 0)
    out = tmp_path / "out"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    header, _, m2po_row, none_row = (out / "cells.md").read_text().splitlines()[:4]
    column = [cell.strip() for cell in header.split("|")].index("held-out fell")
    assert (m2po_row.split("|")[column].strip(), none_row.split("|")[column].strip()) == ("1/2", "—")


def test_missing_keys_are_tolerated(tmp_path):
    run = load_run(_write_run(tmp_path / "run", [0.1, 0.2, 0.3]))  # reward only: no ESS, grad norm, KL, lag
    summary = summarise(run, target_reward=0.9)
    assert summary.ess_ratio_min is None and summary.grad_norm_max is None and summary.kl_k3_max is None
    assert summary.lag_mean is None and not summary.collapsed
    no_hist = load_run(_write_run(tmp_path / "means", [0.1] * 4, async__lag_mean=[1.0, 2.0, None, 0.0]))
    assert summarise(no_hist).lag_mean == pytest.approx(1.0)  # the mean of the logged means
    bare = tmp_path / "bare"  # a job.yaml without the sections the label needs
    bare.mkdir()
    (bare / "job.yaml").write_text("name: bare\n")
    (bare / "metrics.jsonl").write_text(json.dumps({"train/step": 1}) + "\n")
    minimal = summarise(load_run(bare))
    assert minimal.label == "? lag ?" and minimal.final_reward is None and minimal.steps_done == 1


def test_nan_strings_parse_as_floats_and_sft_rows_are_dropped(tmp_path):
    run = load_run(_write_run(tmp_path / "run", [0.5] * 3, stability__kl_k3=[math.nan, math.inf, -math.inf]))
    assert "nan" in (tmp_path / "run" / "metrics.jsonl").read_text()  # written as the sink writes them
    kl = [row["stability/kl_k3"] for row in run.rows]
    assert math.isnan(kl[0]) and kl[1] == math.inf and kl[2] == -math.inf
    assert [row["train/step"] for row in run.rows] == [1, 2, 3]  # the SFT rows (train/step <= 0) are gone
    assert summarise(run).kl_k3_max is None  # no finite value


def test_wall_time_continues_across_a_resume(tmp_path):
    run_dir = _write_run(tmp_path / "run", [0.5] * 4)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows[-2]["time/wall_s"], rows[-1]["time/wall_s"] = 1.5, 3.0  # the resumed sink's clock starts again
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = rows[-3]["time/wall_s"]
    assert load_run(run_dir).wall_s[-2:] == [before + 1.5, before + 3.0]


def test_a_resolved_job_file_loads(tmp_path):
    from cluster.job import dump_job, validate_job

    job = validate_job(
        {
            "name": "m2",
            "task": {"name": "arithmetic"},
            "algorithm": {"stabilizer": {"name": "m2po"}},
            "async": {"max_lag": 4},
            "logging": {"alerts": {"ess_collapse_steps": 5}},
        }
    )
    run_dir = _write_run(tmp_path / "run", [0.5])
    (run_dir / "job.yaml").write_text(dump_job(job))
    run = load_run(run_dir)
    assert (run.name, run.label, run.ess_collapse_below, run.ess_collapse_steps) == ("m2", "m2po lag 4", 0.1, 5)


@pytest.mark.parametrize(
    "damage,file,also",
    [
        (lambda d: (d / "job.yaml").unlink(), "job.yaml", "not found"),
        (lambda d: (d / "metrics.jsonl").unlink(), "metrics.jsonl", "not found"),
        (lambda d: (d / "job.yaml").write_text("name: x\nasync: {max_lag: 1\n"), "job.yaml", "not YAML"),
        (lambda d: (d / "job.yaml").write_text("- a list\n"), "job.yaml", "mapping"),
        (lambda d: (d / "job.yaml").write_text("async: {max_lag: two}\n"), "job.yaml", "async.max_lag"),
    ],
)
def test_errors_name_the_file(tmp_path, damage, file, also):
    run_dir = _write_run(tmp_path / "run", [0.5] * 3)
    damage(run_dir)
    with pytest.raises(ReportError) as error:
        load_run(run_dir)
    assert str(error.value).startswith(str(run_dir / file)) and also in str(error.value)


@pytest.mark.parametrize("line", ["{not json", "[1, 2]", json.dumps({"time/wall_s": 3.0})])
def test_a_bad_metrics_line_is_named_with_its_number(tmp_path, line):
    run_dir = _write_run(tmp_path / "run", [0.5] * 3)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines.insert(3, line)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError) as error:
        load_run(run_dir)
    assert f"{run_dir / 'metrics.jsonl'}:4:" in str(error.value)


def test_runs_sharing_a_label_get_their_directory_name(tmp_path):
    runs = [load_run(_write_run(tmp_path / name, [0.5])) for name in ("a", "b")]
    runs.append(load_run(_write_run(tmp_path / "c", [0.5], max_lag=0)))
    labels = [run.label for run in unique_labels(runs + runs[:1])]
    assert len(set(labels)) == len(labels)
    assert labels[:3] == ["tis_seq lag 2 (a)", "tis_seq lag 2 (b)", "tis_seq lag 0"]


def test_runs_sharing_a_label_are_told_apart_by_seed_when_the_seeds_differ(tmp_path):
    seeded = [load_run(_write_run(tmp_path / f"s{seed}", [0.5], seed=seed)) for seed in (0, 1)]
    same_seed = [load_run(_write_run(tmp_path / f"t{i}", [0.5], max_lag=0, seed=3)) for i in (0, 1)]
    labels = [run.label for run in unique_labels(seeded + same_seed)]
    assert labels == ["tis_seq lag 2 seed 0", "tis_seq lag 2 seed 1", "tis_seq lag 0 (t0)", "tis_seq lag 0 (t1)"]
    assert [run.seed for run in seeded] == [0, 1]


def test_cells_aggregate_each_stabilizer_and_lag_over_its_seeds(tmp_path):
    n = 20
    ramp = [0.05 * i for i in range(n)]  # moving average reaches 0.4 at step 13
    runs = [
        _write_run(
            tmp_path / "a",
            ramp,
            seed=0,
            stability__ess_ratio=[0.05] * n,  # ESS collapse, reward holds
            optim__grad_norm=[2.0] * n,
        ),
        _write_run(
            tmp_path / "b", [r + 0.1 for r in ramp], seed=1, stability__ess_ratio=[0.2] * n, optim__grad_norm=[5.0] * n
        ),
        _write_run(
            tmp_path / "c",
            [0.8] * 10 + [0.1] * 10,
            seed=2,  # falls below half its best: collapsed
            stability__ess_ratio=[math.nan] * n,
            optim__grad_norm=[1.0] * n,
        ),
        _write_run(tmp_path / "d", [0.3] * n, stabilizer="none", max_lag=0, seed=0),
    ]
    summaries = [summarise(load_run(run), target_reward=0.4) for run in runs]
    cells = summarise_cells(summaries)
    assert [(c.stabilizer, c.max_lag, c.runs, c.seeds) for c in cells] == [
        ("tis_seq", 2, 3, (0, 1, 2)),
        ("none", 0, 1, (0,)),
    ]
    tis, none = cells
    finals = [s.final_reward for s in summaries[:3]]
    assert (tis.final_reward_mean, tis.final_reward_min, tis.final_reward_max) == pytest.approx(
        (statistics.fmean(finals), min(finals), max(finals))
    )
    assert [s.collapsed for s in summaries[:3]] == [True, False, True]
    assert [s.reward_fell for s in summaries[:3]] == [False, False, True]
    assert (tis.collapsed, tis.reward_fell) == (2, 1)
    steps = sorted(s.target_step for s in summaries[:3])
    assert tis.target_reached == 3 and tis.target_step_median == steps[1]
    assert math.isnan(tis.ess_ratio_min_lowest) and tis.ess_ratio_min_median == pytest.approx(0.05)  # NaN ranks lowest
    assert tis.grad_norm_max == 5.0
    assert (none.runs, none.collapsed, none.target_reached, none.target_step_median) == (1, 0, 0, None)
    assert none.final_reward_mean == pytest.approx(0.3) and none.ess_ratio_min_median is None


def test_cells_average_each_runs_last_and_lowest_evaluation_and_plot_them_by_lag(tmp_path):
    """The fixed-lag grid is read by held-out solved, where the reward is the sampling policy's: per cell the
    mean of the runs' last evaluations and of their lowest ones (a dip the run recovered from)."""
    evals = {0: [None, 0.5, None, 0.25, None, 0.75], 1: [None, 1.0, None, 0.5, None, 0.5]}
    runs = [
        _write_run(
            tmp_path / f"vcpo16-{seed}", [0.5] * 6, stabilizer="vcpo", max_lag=16, seed=seed, eval__solved=series
        )
        for seed, series in evals.items()
    ]
    runs.append(_write_run(tmp_path / "vcpo4", [0.5] * 6, stabilizer="vcpo", max_lag=4, seed=0))  # never evaluated
    summaries = [summarise(load_run(run)) for run in runs]
    assert [(s.eval_solved, s.eval_solved_lowest) for s in summaries] == [(0.75, 0.25), (0.5, 0.5), (None, None)]
    lag4, lag16 = summarise_cells(summaries)
    assert (lag16.eval_solved_mean, lag16.eval_solved_lowest_mean) == pytest.approx((0.625, 0.375))
    assert (lag4.max_lag, lag4.eval_solved_mean, lag4.eval_solved_lowest_mean) == (4, None, None)
    out = tmp_path / "out"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    row = next(r for r in csv.DictReader((out / "cells.csv").open()) if r["max_lag"] == "16")
    assert float(row["eval_solved_mean"]) == pytest.approx(0.625)
    assert "| 0.625 | 0.375 |" in (out / "cells.md").read_text()
    data = (out / "eval_by_lag.png").read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_cells_list_each_stabilizers_lags_in_numeric_order(tmp_path):
    order = [("vcpo", 16), ("vcpo", 2), ("none", 8), ("vcpo", 0), ("none", 0)]  # as a shell glob lists them
    summaries = [
        summarise(load_run(_write_run(tmp_path / f"{name}{lag}", [0.5], stabilizer=name, max_lag=lag)))
        for name, lag in order
    ]
    assert [(c.stabilizer, c.max_lag) for c in summarise_cells(summaries)] == [
        ("vcpo", 0),
        ("vcpo", 2),
        ("vcpo", 16),
        ("none", 0),
        ("none", 8),
    ]


def test_the_report_adds_a_table_over_seeds_only_when_a_cell_repeats(tmp_path, capsys):
    n = 12
    seeded = [
        _write_run(tmp_path / f"vcpo{seed}", [0.1 * seed + 0.02 * i for i in range(n)], stabilizer="vcpo", seed=seed)
        for seed in range(3)
    ]
    other = _write_run(tmp_path / "none", [0.2] * n, stabilizer="none", seed=0)
    out = tmp_path / "out"
    assert main(["report", *map(str, [*seeded, other]), "--out", str(out), "--target-reward", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "over seeds" in printed and "| vcpo | 2 | 0,1,2 | 0/3 | 0.320 | 0.220–0.420 |" in printed
    assert "| vcpo lag 2 seed 1 |" in printed
    header = next(line for line in printed.splitlines() if line.startswith("| run |"))
    assert header.count("|") - 1 == 10, header  # the terminal's columns (21 before); table.md has every one
    cells = (out / "cells.md").read_text().splitlines()
    assert len(cells) == 2 + 2 and cells[2].startswith("| vcpo | 2 | 0,1,2 |")
    rows = list(csv.DictReader((out / "cells.csv").open()))
    assert [(row["stabilizer"], row["runs"], row["seeds"]) for row in rows] == [
        ("vcpo", "3", "0;1;2"),
        ("none", "1", "0"),
    ]
    assert "Over seeds" in (out / "report.html").read_text()
    assert (out / "reward_by_cell.png").read_bytes()[:8] == PNG_SIGNATURE

    single = tmp_path / "single"
    assert main(["report", str(seeded[0]), str(other), "--out", str(single)]) == 0
    assert "over seeds" not in capsys.readouterr().out
    assert "Over seeds" not in (single / "report.html").read_text() and (single / "cells.md").is_file()


def test_runs_of_different_jobs_never_share_a_cell(tmp_path, capsys):
    """Two users' jobs with one stabilizer, lag and seed were one cell (seeds "0,0") whose mean was plotted."""
    mine = _write_run(tmp_path / "mine", [0.1] * 12, seed=0, job_name="mine")
    theirs = _write_run(tmp_path / "theirs", [0.9] * 12, seed=0, job_name="theirs")
    again = _write_run(tmp_path / "mine-again", [0.3] * 12, seed=1, job_name="mine")
    out = tmp_path / "out"
    assert main(["report", *map(str, [mine, theirs, again]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| mine | tis_seq | 2 | 0,1 | 0/2 | 0.200 |" in printed and "0,0" not in printed
    rows = list(csv.DictReader((out / "cells.csv").open()))
    assert [(row["job"], row["runs"], row["seeds"]) for row in rows] == [("mine", "2", "0;1"), ("theirs", "1", "0")]
    assert "| run | job |" in (out / "table.md").read_text()


def test_the_evaluation_plot_starts_at_the_policy_before_rl_and_the_tables_do_not(tmp_path):
    """eval_solved.png left out step 0 (the warmed-up policy before any RL step); the tables' rules still count
    RL steps only."""
    from cluster.experiments.report_reading import metric_series

    run = _write_run(tmp_path / "run", [0.5, 0.6])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluations = [{"train/step": 0, "time/wall_s": 3.0, "eval/solved": 0.25}]
    evaluations.append({"train/step": 2, "time/wall_s": 9.0, "eval/solved": 0.75})
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [*rows, *evaluations]))
    data = load_run(run)
    assert [(step, value) for step, _, value in metric_series(data, "eval/solved", from_start=True)] == [
        (0, 0.25),
        (2, 0.75),
    ]
    assert [step for step, _, _ in metric_series(data, "eval/solved")] == [2]
    assert summarise(data).eval_solved_lowest == 0.75


# ---- the files --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory) -> list[Path]:
    """A healthy run, one with a NaN grad norm and one with only rewards (no ESS, grad norm, KL or lag)."""
    root = tmp_path_factory.mktemp("runs")
    n = 15
    healthy = _write_run(
        root / "healthy",
        [0.05 * i for i in range(n)],
        stabilizer="vcpo",
        max_lag=1,
        stability__ess_ratio=[0.9] * n,
        optim__grad_norm=[1.0 + i for i in range(n)],
        stability__kl_k3=[0.01] * n,
        async__lag=[[4, 4]] * n,
    )
    broken = _write_run(
        root / "broken",
        [0.3] * n,
        stabilizer="none",
        max_lag=4,
        stability__ess_ratio=[0.5] * 5 + [math.nan] * (n - 5),
        optim__grad_norm=[1.0] * 5 + [math.nan] * (n - 5),
        async__lag=[[1, 2, 3, 2, 0]] * n,
    )
    sparse = _write_run(root / "sparse", [0.2] * n, stabilizer="m2po", max_lag=2)
    return [healthy, broken, sparse]


@pytest.fixture(scope="module")
def report(three_runs, tmp_path_factory) -> tuple[Path, list]:
    out = tmp_path_factory.mktemp("report")
    return out, write_report(three_runs, out, target_reward=0.4)


def test_write_report_returns_a_summary_per_run_in_order(three_runs, report):
    _, summaries = report
    assert [s.run_dir for s in summaries] == three_runs
    assert [s.collapsed for s in summaries] == [False, True, False]


def test_pngs_are_written_and_valid(report):
    out, _ = report
    pngs = sorted(out.glob("*.png"))
    assert {p.stem for p in pngs} == {
        "reward",
        "ess_ratio",
        "grad_norm",
        "kl_k3",
        "eval_solved",
        "lag_hist",
        "reward_by_cell",
        "eval_by_lag",
    }
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000, png


def test_html_is_self_contained(three_runs, report):
    out, _ = report
    page = (out / "report.html").read_text()
    pngs = sorted(out.glob("*.png"))
    assert page.count("data:image/png;base64,") == len(pngs)
    for png in pngs:
        assert f"data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}" in page
    assert 'src="http' not in page and "<script" not in page and "<link" not in page
    for run_dir in three_runs:
        assert str(run_dir.resolve()) in page


def test_tables_have_a_row_per_run(report):
    out, summaries = report
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 2 + len(summaries)
    for line, summary in zip(table[2:], summaries):
        assert line.startswith(f"| {summary.label} |")
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [row["label"] for row in rows] == [s.label for s in summaries]
    assert rows[1]["grad_norm_max"] == "nan" and rows[2]["grad_norm_max"] == ""  # NaN, and not logged
    assert float(rows[0]["final_reward"]) == pytest.approx(summaries[0].final_reward)
    assert rows[0]["target_step"] == str(summaries[0].target_step)


# ---- the command ------------------------------------------------------------------------------------


def test_cli_exits_2_naming_the_file_of_a_bad_run(tmp_path, capsys, three_runs):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "job.yaml").write_text("name: bad\n")
    assert main(["report", str(three_runs[0]), str(bad), "--out", str(tmp_path / "out")]) == 2
    assert str(bad / "metrics.jsonl") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # every run is read before anything is written
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err


def test_cli_writes_the_report(tmp_path, capsys, three_runs):
    out = tmp_path / "out"
    assert (
        main(
            [
                "report",
                *map(str, three_runs[:2]),
                "--out",
                str(out),
                "--target-reward",
                "0.4",
                "--ess-collapse-below",
                "0.95",
                "--ess-collapse-steps",
                "2",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| vcpo lag 1 |" in printed and "| none lag 4 |" in printed and "report.html" in printed
    assert (out / "report.html").stat().st_size > 0 and len(list(out.glob("*.png"))) == 8
    healthy = next(csv.DictReader((out / "table.csv").open()))  # ESS 0.9 every step: low for the flags' rule
    assert (healthy["collapsed"], healthy["collapse_step"], healthy["ess_collapse_below"]) == ("True", "2", "0.95")


def test_importing_the_report_loads_no_torch_ray_or_matplotlib():
    import subprocess
    import sys

    code = "import sys, cluster.experiments.report; print(' '.join(sorted(sys.modules)))"
    root = Path(__file__).resolve().parents[3]
    loaded = {
        name.split(".")[0]
        for name in subprocess.run(
            [sys.executable, "-c", code], cwd=root, check=True, capture_output=True, text=True
        ).stdout.split()
    }
    assert not loaded & {"torch", "ray", "matplotlib", "vllm", "deepspeed"}
