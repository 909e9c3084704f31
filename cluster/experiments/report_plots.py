"""The PNGs of `stableasync report` (matplotlib's Agg canvas, imported only when plotting): every metric
against step and wall time, the lag histogram, the reward per cell over seeds, and held-out solved by
stabilizer and lag (the grid in one figure). Apart so that reading
and tabulating runs never needs matplotlib."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster.experiments.report_reading import (
    ESS_KEY,
    EVAL_SOLVED_KEY,
    GRAD_NORM_KEY,
    KL_K3_KEY,
    LAG_HIST_KEY,
    MOVING_AVERAGE_STEPS,
    REWARD_KEY,
    RunData,
    lag_counts,
    metric_series,
    reward_moving_average,
)
from cluster.experiments.report_tables import Cell, RunSummary, by_cell, lag_order

# (file stem, metric key, y-axis label, log y)
CURVES: list[tuple[str, str, str, bool]] = [
    ("reward", REWARD_KEY, "reward (mean of the step's samples)", False),
    ("ess_ratio", ESS_KEY, "ESS ratio (1: on-policy)", False),
    ("grad_norm", GRAD_NORM_KEY, "gradient norm before clipping (log)", True),
    ("kl_k3", KL_K3_KEY, "KL k3 per token (behaviour || learner)", False),
    # the policy of that step itself, where the reward is the sampling policy's (async.fixed_lag K: K steps older)
    ("eval_solved", EVAL_SOLVED_KEY, "evaluation problems solved (eval.*; step 0: before RL)", False),
]
LAG_PLOT = "lag_hist"


def _style(index: int) -> dict[str, Any]:
    """A colour per run (tab10), and a new line style every 10 runs so more than 10 stay distinct."""
    return {"color": f"C{index % 10}", "linestyle": ("-", "--", ":", "-.")[index // 10 % 4]}


# long: one figure per metric; each panel's rules (log scale, shares, NaN notes) sit beside what they change
def plot_runs(
    runs: Sequence[RunData], summaries: Sequence[RunSummary], out_dir: Path, target_reward: float | None = None
) -> list[Path]:
    """Write one PNG per metric (left: against RL step, right: against run wall time) and the lag
    histogram; returns their paths. Every file is written even when no run logged its metric (the panel
    says so), so a report always has the same pages. Uses matplotlib's Agg canvas (no display, no pyplot
    state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    paths = []
    for stem, key, ylabel, log_y in CURVES:
        figure = Figure(figsize=(13, 4.2), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(1, 2, sharey=True)
        any_positive, any_line = False, False
        thresholds = {s.ess_collapse_below for s in summaries}
        ess_threshold = next(iter(thresholds)) if len(thresholds) == 1 else None  # one shared line only
        for index, run in enumerate(runs):
            series = metric_series(run, key, from_start=key == EVAL_SOLVED_KEY)
            if not series:
                continue
            any_line = True
            style = _style(index)
            steps: list[float] = [s for s, _, _ in series]
            walls = [w for _, w, _ in series]
            values = [v for _, _, v in series]
            any_positive = any_positive or any(math.isfinite(v) and v > 0 for v in values)
            for ax, xs in zip(axes, (steps, walls)):
                finite = [(x, v) for x, v in zip(xs, values) if math.isfinite(v)]
                if key == REWARD_KEY and len(finite) > MOVING_AVERAGE_STEPS:
                    # raw rewards faint, the moving average (what the table uses) bold; a run too short for a
                    # full window keeps its raw line bold
                    ax.plot(xs, values, alpha=0.25, linewidth=0.8, color=style["color"])
                    moving = reward_moving_average([v for _, v in finite])
                    ax.plot([x for x, _ in finite][len(finite) - len(moving) :], moving, label=run.label, **style)
                elif len(finite) == 1:  # one point (a run's single evaluation) draws no line: a marker
                    ax.plot(xs, values, "o", label=run.label, color=style["color"])
                else:  # evaluations are sparse: each one a marker on its line
                    marker = {"marker": "o", "markersize": 3} if key == EVAL_SOLVED_KEY else {}
                    ax.plot(xs, values, label=run.label, linewidth=1.2, **marker, **style)
                bad = [x for x, v in zip(xs, values) if not math.isfinite(v)]
                if bad:  # NaN/inf leave gaps in the line: mark them at the top of the panel
                    ax.plot(
                        bad,
                        [0.98] * len(bad),
                        "x",
                        color=style["color"],
                        markersize=6,
                        transform=blended_transform_factory(ax.transData, ax.transAxes),
                    )
        for ax, xlabel in zip(axes, ("RL step (policy version)", "run wall time (s since the run started)")):
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            if not any_line:
                ax.text(0.5, 0.5, f"no run logged {key}", ha="center", va="center", transform=ax.transAxes)
            if key == REWARD_KEY and target_reward is not None:
                ax.axhline(
                    target_reward, color="black", linestyle="--", linewidth=0.8, label=f"target {target_reward:g}"
                )
            if key == ESS_KEY and any_line and ess_threshold is not None:
                ax.axhline(
                    ess_threshold, color="red", linestyle="--", linewidth=0.8, label=f"collapse below {ess_threshold:g}"
                )
        if log_y and any_positive:
            axes[0].set_yscale("log")
        if key == EVAL_SOLVED_KEY:  # a share: 0 to 1 always, so a constant 1.0 reads as solved, not as noise
            axes[0].set_ylim(-0.03, 1.03)
        axes[0].set_ylabel(ylabel)
        if any_line:
            axes[1].legend(fontsize="small", loc="best")
        title = f"{key} against step and wall time"
        if key == REWARD_KEY:
            title += f" (bold: trailing {MOVING_AVERAGE_STEPS}-step moving average)"
        if any_line and any(not math.isfinite(v) for run in runs for _, _, v in metric_series(run, key)):
            title += "; x: NaN/inf"
        figure.suptitle(title)
        path = out_dir / f"{stem}.png"
        figure.savefig(path, dpi=90)
        paths.append(path)

    paths.append(_plot_lag_histogram(runs, out_dir))
    return paths


def _plot_lag_histogram(runs: Sequence[RunData], out_dir: Path) -> Path:
    """The runs' trained samples by lag, side by side, as LAG_PLOT.png (a note on the panel when none logged it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    hists = [(index, run, lag_counts(run)) for index, run in enumerate(runs)]
    hists = [(index, run, counts) for index, run, counts in hists if sum(counts) > 0]
    width = 0.8 / max(1, len(hists))
    for slot, (index, run, counts) in enumerate(hists):
        ax.bar(
            [k - 0.4 + width * (slot + 0.5) for k in range(len(counts))],
            counts,
            width=width,
            color=_style(index)["color"],
            label=f"{run.label} ({sum(counts):.0f} samples)",
        )
    if hists:
        bins = max(len(counts) for _, _, counts in hists)
        ax.set_xticks(range(bins))
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, f"no run logged {LAG_HIST_KEY}", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("lag (policy versions between sampling and training)")
    ax.set_ylabel("trained samples (summed over the run)")
    ax.grid(alpha=0.3, axis="y")
    figure.suptitle(f"{LAG_HIST_KEY}: lag histogram")
    path = out_dir / f"{LAG_PLOT}.png"
    figure.savefig(path, dpi=90)
    return path


def _reward_ma_by_step(run: RunData) -> dict[int, float]:
    finite = [(step, value) for step, _, value in metric_series(run, REWARD_KEY) if math.isfinite(value)]
    moving = reward_moving_average([value for _, value in finite])
    return dict(zip([step for step, _ in finite][len(finite) - len(moving) :], moving))


def _series(cells: Mapping[Cell, Any]) -> dict[tuple[str, str], str]:
    """Each (job, stabilizer) of the cells, in order, with its legend: the stabilizer, and the job too when the
    runs come from more than one."""
    pairs = list(dict.fromkeys((job, stabilizer) for job, stabilizer, _ in cells))
    many_jobs = len({job for job, _ in pairs}) > 1
    return {(job, stabilizer): f"{job}: {stabilizer}" if many_jobs else stabilizer for job, stabilizer in pairs}


def plot_cells(runs: Sequence[RunData], out_dir: Path, target_reward: float | None = None) -> Path:
    """reward_by_cell.png: per (job, stabilizer, max lag), the mean over its runs of the reward moving average
    at each step every run reached, with the runs' min–max as a band: the seed-to-seed spread next to the
    gaps between cells."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = {key: [_reward_ma_by_step(run) for run in same] for key, same in by_cell(runs).items()}
    lags = sorted({lag for _, _, lag in cells}, key=lag_order)
    figure = Figure(figsize=(max(6.4, 4.2 * len(lags)), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, max(1, len(lags)), sharey=True, squeeze=False)[0]
    series = _series(cells)
    any_line = False
    for ax, lag in zip(axes, lags):
        for (job, stabilizer, max_lag), curves in cells.items():
            if max_lag != lag:
                continue
            steps = sorted(set.intersection(*(set(curve) for curve in curves)))
            if not steps:
                continue
            any_line = True
            color = _style(list(series).index((job, stabilizer)))["color"]
            values = [[curve[step] for curve in curves] for step in steps]
            ax.plot(
                steps,
                [statistics.fmean(v) for v in values],
                "o-" if len(steps) == 1 else "-",
                color=color,
                label=f"{series[job, stabilizer]} ({len(curves)} run{'s' if len(curves) > 1 else ''})",
            )
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=color, alpha=0.15)
        if target_reward is not None:
            ax.axhline(target_reward, color="black", linestyle="--", linewidth=0.8, label=f"target {target_reward:g}")
        ax.set_title(f"max lag {'?' if lag is None else lag}")
        ax.set_xlabel("RL step (policy version)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="best")
    axes[0].set_ylabel(f"reward, trailing {MOVING_AVERAGE_STEPS}-step moving average")
    if not any_line:
        axes[0].text(0.5, 0.5, f"no run logged {REWARD_KEY}", ha="center", va="center", transform=axes[0].transAxes)
    figure.suptitle("reward by cell: mean over runs, band min–max")
    path = out_dir / "reward_by_cell.png"
    figure.savefig(path, dpi=90)
    return path


def plot_eval_by_lag(summaries: Sequence[RunSummary], out_dir: Path) -> Path:
    """eval_by_lag.png: the grid in one figure. Per job and stabilizer, evaluation problems solved against max lag
    (with `async.fixed_lag`, the lag every group trained at): left the last evaluation, right the lowest
    one of the run, a dip it recovered from included; dots are runs (seeds), the line their mean. Lags sit
    evenly spaced, labelled with their values, so 0, 4, 16, 64 and 256 all stay readable."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = {key: runs for key, runs in by_cell(summaries).items() if key[2] is not None}
    lags = sorted({lag for _, _, lag in cells}, key=lag_order)
    series = _series(cells)
    figure = Figure(figsize=(12, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 2, sharey=True)
    panels = (("at the last evaluation", "eval_solved"), ("lowest over the run", "eval_solved_lowest"))
    any_point = False
    for ax, (title, attr) in zip(axes, panels):
        for index, ((job, stabilizer), legend) in enumerate(series.items()):
            color = _style(index)["color"]
            nudge = 0.06 * (index - (len(series) - 1) / 2)  # side by side, so equal values stay visible
            xs, means = [], []
            for slot, lag in enumerate(lags):
                runs = cells.get((job, stabilizer, lag), [])
                values = [getattr(run, attr) for run in runs if getattr(run, attr) is not None]
                if not values:
                    continue
                any_point = True
                position = slot + nudge
                ax.plot([position] * len(values), values, "o", color=color, alpha=0.4, markersize=4)
                xs.append(position)
                means.append(statistics.fmean(values))
            if xs:
                ax.plot(xs, means, "-o", color=color, label=legend)
        ax.set_xticks(range(len(lags)), [str(lag) for lag in lags])
        ax.set_xlabel("max lag (with async.fixed_lag: the lag every group trained at)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if not any_point:
            ax.text(0.5, 0.5, f"no run logged {EVAL_SOLVED_KEY}", ha="center", va="center", transform=ax.transAxes)
    axes[0].set_ylabel("evaluation problems solved (eval/solved)")
    axes[0].set_ylim(-0.03, 1.03)
    if any_point:
        axes[1].legend(fontsize="small", loc="best")
    figure.suptitle("evaluation solved by stabilizer and lag: mean over runs (dots: each run)")
    path = out_dir / "eval_by_lag.png"
    figure.savefig(path, dpi=90)
    return path
