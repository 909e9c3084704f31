"""The numbers and tables of `stableasync report`: each run's summary and collapse verdict, the rows over
seeds, and how they are written (markdown, CSV; the HTML page in report_html.py). Apart from the reading and
the plots so that every rule behind a number sits with the table that shows it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cluster.experiments.report_format import (
    MISSING,
    fixed,
    general,
    markdown,
    plain,
    shown_columns,
    write_dataclass_csv,
    yes_no,
)
from cluster.experiments.report_reading import (
    ESS_KEY,
    EVAL_SOLVED_KEY,
    GRAD_NORM_KEY,
    KL_K3_KEY,
    LAG_MEAN_KEY,
    REWARD_KEY,
    RunData,
    lag_counts,
    metric_series,
    reward_moving_average,
)
from cluster.telemetry.run_files import step_rows

FINAL_FRACTION = 0.1  # the final reward is the mean over this last share of RL steps (at least one)
REWARD_DROP_FRACTION = 0.5  # collapse: final reward below this share of the best moving average
HELD_OUT_DROP_FRACTION = 0.5  # held-out fell: the last eval/solved below this share of the best one


@dataclass(frozen=True)
class RunSummary:
    """The numbers of one run's table row; None where the run logged nothing to compute it from."""

    run_dir: Path
    label: str
    job: str  # job.name
    stabilizer: str
    max_lag: int | None
    seed: int | None
    steps_planned: int | None
    steps_done: int  # RL step rows in metrics.jsonl (evaluation rows not counted)
    wall_s: float | None  # run wall time at the last RL row
    final_reward: float | None
    best_reward_ma: float | None  # best trailing moving average of the reward
    eval_solved: float | None  # the last evaluation's solved share (eval.every_steps); None: never evaluated
    eval_solved_lowest: float | None  # the lowest of them: a dip the run recovered from shows here, not above
    eval_solved_best: float | None  # the highest of them
    held_out_fell: bool | None  # the last below half the best: the outcome under a lag; None: never evaluated
    target_reward: float | None
    target_step: int | None  # first step whose moving average reaches target_reward
    target_wall_s: float | None  # run wall time at target_step
    ess_ratio_min: float | None  # over finite values; NaN if the run logged ESS but never a finite one
    grad_norm_max: float | None  # NaN if any step's grad norm was NaN, inf if any was inf
    kl_k3_max: float | None
    lag_mean: float | None  # over all trained samples (policy versions)
    ess_collapse_below: float | None  # the thresholds this summary was judged with
    ess_collapse_steps: int
    collapsed: bool
    collapse_step: int | None  # earliest step at which a collapse rule fired
    collapse_reason: str  # "" when not collapsed
    reward_fell: bool  # rule (c) fired: the final reward fell below half the best moving average


# ---- the numbers ------------------------------------------------------------------------------------


def _lag_mean(run: RunData) -> float | None:
    counts = lag_counts(run)
    if sum(counts) > 0:
        return sum(k * c for k, c in enumerate(counts)) / sum(counts)
    means = [v for _, _, v in metric_series(run, LAG_MEAN_KEY) if math.isfinite(v)]
    return statistics.fmean(means) if means else None


def _held_out_fell(evaluations: list[float], best: float | None) -> bool | None:
    if best is None:
        return None
    return best > 0 and evaluations[-1] < HELD_OUT_DROP_FRACTION * best


def _grad_norm_max(values: list[float]) -> float | None:
    if not values:
        return None
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values)


# long: 27 lines of docstring state every rule of the row, so a reader can recompute it
def summarise(
    run: RunData,
    target_reward: float | None = None,
    collapse_below: float | None = None,
    collapse_steps: int | None = None,
) -> RunSummary:
    """One run's table row. Every rule, over RL steps only (train/step > 0), in logged order:

    - final reward: mean `rollout/reward_mean` of the last max(1, n // 10) of the n steps with a finite
      reward.
    - moving average: trailing mean over min(10, n) steps, full windows only (`reward_moving_average`).
    - last eval solved: `eval/solved` of the last step that logged a finite one (held-out accuracy when the
      job evaluates; the training reward alone can rise on a policy that games its verifier); lowest eval
      solved: the least of those finite values over RL steps (the step-0 evaluation of the initial policy
      is not an RL row).
    - held-out fell: the last eval solved is below 50% of the best (when the best is > 0). Not a collapse
      rule: runs without evaluations keep one comparable collapse verdict, and under a fixed lag the
      training reward is a policy K steps older than the one evaluated, so only this shows the fall.
    - time to target: the first step whose moving average is >= `target_reward`, and the run wall time
      (`time/wall_s`, seconds since the run's sink started, SFT warm-up included) at that step; None if
      never reached or no target given.
    - min ESS ratio, max KL k3: over finite values. Max grad norm: NaN if any step logged NaN (a skipped
      step), else inf if any logged inf, else the largest.
    - mean lag: over all trained samples, from the summed `async/lag` histogram (else the mean of
      `async/lag_mean`).
    - collapsed, if any of these holds (the earliest step any fires is `collapse_step`):
      (a) ESS: `stability/ess_ratio` < `collapse_below`, or not finite, on `collapse_steps` consecutive
          steps that logged it (steps without the key neither extend nor break the streak; the same rule
          as the ESS-collapse alert); `collapse_below` None means the run's `logging.alerts`
          (job.yaml; 0.1 and 3 steps by default; a null threshold there turns this rule off);
      (b) a non-finite `optim/grad_norm` on any step;
      (c) reward: the best moving average is > 0 and the final reward is < 50% of it.
    Why: one comparable row per run, with the rules stated so a reader can recompute them."""
    below = run.ess_collapse_below if collapse_below is None else collapse_below
    needed = run.ess_collapse_steps if collapse_steps is None else collapse_steps
    rewards = [(s, w, r) for s, w, r in metric_series(run, REWARD_KEY) if math.isfinite(r)]
    reward_values = [r for _, _, r in rewards]
    final_reward = statistics.fmean(reward_values[-max(1, len(reward_values) // 10) :]) if reward_values else None
    evaluations = [v for _, _, v in metric_series(run, EVAL_SOLVED_KEY) if math.isfinite(v)]
    eval_best = max(evaluations) if evaluations else None
    moving = reward_moving_average(reward_values)
    offset = len(rewards) - len(moving)  # moving[i] belongs to rewards[i + offset]
    best_ma = max(moving) if moving else None
    target_step = target_wall_s = None
    if target_reward is not None:
        for i, value in enumerate(moving):
            if value >= target_reward:
                target_step, target_wall_s = rewards[i + offset][0], rewards[i + offset][1]
                target_wall_s = target_wall_s if math.isfinite(target_wall_s) else None
                break

    ess = metric_series(run, ESS_KEY)
    finite_ess = [v for _, _, v in ess if math.isfinite(v)]
    grad_norms = metric_series(run, GRAD_NORM_KEY)
    kl = [v for _, _, v in metric_series(run, KL_K3_KEY) if math.isfinite(v)]

    fired: list[tuple[int, str]] = []  # (step, why)
    if below is not None and needed > 0:
        streak = 0
        for step, _, value in ess:
            streak = streak + 1 if (not math.isfinite(value) or value < below) else 0
            if streak == needed:
                fired.append((step, f"ESS ratio < {below:g} (or NaN) for {needed} steps in a row at step {step}"))
                break
    for step, _, value in grad_norms:
        if not math.isfinite(value):
            fired.append((step, f"grad norm {value} at step {step}"))
            break
    reward_fell = (
        best_ma is not None
        and final_reward is not None
        and best_ma > 0
        and final_reward < REWARD_DROP_FRACTION * best_ma
    )
    if reward_fell and best_ma is not None:  # reward_fell implies best_ma is not None
        peak = moving.index(best_ma)
        drop = next(
            (i for i in range(peak + 1, len(moving)) if moving[i] < REWARD_DROP_FRACTION * best_ma), len(moving) - 1
        )
        step = rewards[drop + offset][0]
        fired.append(
            (
                step,
                f"final reward {final_reward:.3g} < {REWARD_DROP_FRACTION:.0%} of the best "
                f"moving average {best_ma:.3g} (step {rewards[peak + offset][0]})",
            )
        )
    fired.sort(key=lambda item: item[0])
    finite_wall = [w for w in run.wall_s if math.isfinite(w)]
    return RunSummary(
        run_dir=run.path,
        label=run.label,
        job=run.job,
        stabilizer=run.stabilizer,
        max_lag=run.max_lag,
        seed=run.seed,
        steps_planned=run.steps_planned,
        steps_done=len(step_rows(run.rows)),
        wall_s=finite_wall[-1] if finite_wall else None,
        final_reward=final_reward,
        best_reward_ma=best_ma,
        eval_solved=evaluations[-1] if evaluations else None,
        eval_solved_lowest=min(evaluations) if evaluations else None,
        eval_solved_best=eval_best,
        held_out_fell=_held_out_fell(evaluations, eval_best),
        target_reward=target_reward,
        target_step=target_step,
        target_wall_s=target_wall_s,
        ess_ratio_min=(min(finite_ess) if finite_ess else math.nan) if ess else None,
        grad_norm_max=_grad_norm_max([v for _, _, v in grad_norms]),
        kl_k3_max=max(kl) if kl else None,
        lag_mean=_lag_mean(run),
        ess_collapse_below=below,
        ess_collapse_steps=needed,
        collapsed=bool(fired),
        collapse_step=fired[0][0] if fired else None,
        collapse_reason="; ".join(why for _, why in fired),
        reward_fell=reward_fell,
    )


# ---- the table --------------------------------------------------------------------------------------


# (header, RunSummary attribute, how the markdown/HTML table shows a value that is not None)
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("run", "label", plain),
    ("job", "job", plain),
    ("stabilizer", "stabilizer", plain),
    ("max lag", "max_lag", plain),
    ("seed", "seed", plain),
    ("steps", "steps_done", plain),
    ("final reward", "final_reward", fixed(3)),
    ("best reward MA", "best_reward_ma", fixed(3)),
    ("last eval solved", "eval_solved", fixed(3)),
    ("lowest eval solved", "eval_solved_lowest", fixed(3)),
    ("best eval solved", "eval_solved_best", fixed(3)),
    ("held-out fell", "held_out_fell", yes_no),
    ("target step", "target_step", plain),
    ("target wall s", "target_wall_s", fixed(0)),
    ("min ESS ratio", "ess_ratio_min", fixed(3)),
    ("max grad norm", "grad_norm_max", general),
    ("max KL k3", "kl_k3_max", general),
    ("mean lag", "lag_mean", fixed(2)),
    ("wall s", "wall_s", fixed(0)),
    ("collapse", "collapsed", yes_no),
    ("collapse reason", "collapse_reason", plain),
    ("run dir", "run_dir", plain),
]


def row_cells(summary: RunSummary) -> list[str]:
    """A run's row of the run table, each value as its column shows it."""
    return [MISSING if getattr(summary, attr) is None else show(getattr(summary, attr)) for _, attr, show in COLUMNS]


# the terminal's tables: what tells runs apart and how each ended (the report's files have every column)
TERMINAL_COLUMNS = (
    "run", "job", "seed", "steps", "final reward", "last eval solved", "min ESS ratio", "max grad norm",
    "mean lag", "wall s", "collapse",
)  # fmt: skip
TERMINAL_CELL_COLUMNS = (
    "job", "stabilizer", "max lag", "seeds", "collapsed", "final reward mean", "final reward min–max",
    "last eval solved mean", "median min ESS ratio", "mean wall s",
)  # fmt: skip


def markdown_table(summaries: Sequence[RunSummary], only: Sequence[str] | None = None) -> str:
    """One row per run, for the terminal (`only` TERMINAL_COLUMNS) and table.md ("—": the run logged nothing to
    compute it from)."""
    headers = [name for name, _, _ in COLUMNS]
    shown = shown_columns(headers, {summary.job for summary in summaries}, only)
    rows = [row_cells(summary) for summary in summaries]
    return markdown([headers[i] for i in shown], [[row[i] for i in shown] for row in rows])


def write_csv(summaries: Sequence[RunSummary], path: Path) -> None:
    """table.csv: every `RunSummary` field."""
    write_dataclass_csv(RunSummary, summaries, path)


# ---- the cells: one row per (stabilizer, max lag) over its seeds ---------------------------------------


@dataclass(frozen=True)
class CellSummary:
    """The runs of one (job, stabilizer, max_lag) cell, usually one per seed (`stableasync sweep --seeds`).
    Rules: means and ranges over the runs that have the value; "lower median" is the middle run's value
    (the lower of the two middle ones for an even count), NaN ranked lowest, so a run whose ESS was never
    finite pulls the median down instead of vanishing."""

    job: str
    stabilizer: str
    max_lag: int | None
    runs: int
    seeds: tuple[int | None, ...]
    collapsed: int  # runs flagged collapsed, by any rule
    reward_fell: int  # runs flagged by the reward rule (c): the outcome, not only the ESS warning
    evaluated: int  # runs that logged an evaluation
    held_out_fell: int  # of those, runs whose last eval/solved fell below half their best
    final_reward_mean: float | None
    final_reward_min: float | None
    final_reward_max: float | None
    best_reward_ma_mean: float | None
    eval_solved_mean: float | None  # mean over the runs that evaluated of their last eval/solved
    eval_solved_lowest_mean: float | None  # mean over the same runs of their lowest eval/solved
    target_reached: int  # runs whose moving average reached the target
    target_step_median: int | None  # lower median over the runs that reached it
    target_wall_s_median: float | None  # lower median, same runs
    ess_ratio_min_median: float | None  # lower median over runs of each run's minimum ESS ratio
    ess_ratio_min_lowest: float | None
    grad_norm_max: float | None  # the largest over runs (NaN if any run logged a NaN)
    lag_mean: float | None  # mean over runs of each run's mean lag
    wall_s_mean: float | None


Value = TypeVar("Value")
Number = TypeVar("Number", bound=float)


def _present(values: Sequence[Value | None]) -> list[Value]:
    return [value for value in values if value is not None]


def _nan_lowest(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def _lower_median(values: Sequence[Number]) -> Number | None:
    if not values:
        return None
    return sorted(values, key=_nan_lowest)[(len(values) - 1) // 2]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def lag_order(max_lag: int | None) -> int:
    return -1 if max_lag is None else max_lag


class _InCell(Protocol):
    """What `by_cell` groups by: a run's data or its summary."""

    @property
    def job(self) -> str: ...

    @property
    def stabilizer(self) -> str: ...

    @property
    def max_lag(self) -> int | None: ...


Run = TypeVar("Run", bound=_InCell)


Cell = tuple[str, str, int | None]  # job, stabilizer, max lag


def by_cell(runs: Sequence[Run]) -> dict[Cell, list[Run]]:
    """Runs (anything with `job`, `stabilizer` and `max_lag`) grouped by cell: runs of different jobs never
    share one; jobs and stabilizers in the order they first appear, each one's lags ascending (a shell glob
    lists lag 16 before lag 2)."""
    jobs = list(dict.fromkeys(run.job for run in runs))
    stabilizers = list(dict.fromkeys(run.stabilizer for run in runs))

    def order(run: Run) -> tuple[int, int, int]:
        return jobs.index(run.job), stabilizers.index(run.stabilizer), lag_order(run.max_lag)

    cells: dict[Cell, list[Run]] = {}
    for run in sorted(runs, key=order):
        cells.setdefault((run.job, run.stabilizer, run.max_lag), []).append(run)
    return cells


def summarise_cells(summaries: Sequence[RunSummary]) -> list[CellSummary]:
    """One row per (job, stabilizer, max_lag) cell, in `by_cell` order."""
    out = []
    for (job, stabilizer, max_lag), runs in by_cell(summaries).items():
        finals = _present([run.final_reward for run in runs])
        reached = [run for run in runs if run.target_step is not None]
        ess = _present([run.ess_ratio_min for run in runs])
        out.append(
            CellSummary(
                job=job,
                stabilizer=stabilizer,
                max_lag=max_lag,
                runs=len(runs),
                seeds=tuple(run.seed for run in runs),
                collapsed=sum(run.collapsed for run in runs),
                reward_fell=sum(run.reward_fell for run in runs),
                evaluated=sum(run.held_out_fell is not None for run in runs),
                held_out_fell=sum(bool(run.held_out_fell) for run in runs),
                final_reward_mean=_mean(finals),
                final_reward_min=min(finals, default=None),
                final_reward_max=max(finals, default=None),
                best_reward_ma_mean=_mean(_present([run.best_reward_ma for run in runs])),
                eval_solved_mean=_mean(_present([run.eval_solved for run in runs])),
                eval_solved_lowest_mean=_mean(_present([run.eval_solved_lowest for run in runs])),
                target_reached=len(reached),
                target_step_median=_lower_median(_present([run.target_step for run in reached])),
                target_wall_s_median=_lower_median(_present([run.target_wall_s for run in reached])),
                ess_ratio_min_median=_lower_median(ess),
                ess_ratio_min_lowest=min(ess, key=_nan_lowest, default=None),
                grad_norm_max=_grad_norm_max(_present([run.grad_norm_max for run in runs])),
                lag_mean=_mean(_present([run.lag_mean for run in runs])),
                wall_s_mean=_mean(_present([run.wall_s for run in runs])),
            )
        )
    return out


def _shown(value: Any, show: Callable[[Any], str]) -> str:
    return MISSING if value is None else show(value)


def _of_runs(count: int, cell: CellSummary) -> str:
    return f"{count}/{cell.runs}"


# (header, how the markdown/HTML table shows a cell)
CELL_COLUMNS: list[tuple[str, Callable[[CellSummary], str]]] = [
    ("job", lambda c: c.job),
    ("stabilizer", lambda c: c.stabilizer),
    ("max lag", lambda c: _shown(c.max_lag, plain)),
    ("seeds", lambda c: ",".join(MISSING if seed is None else str(seed) for seed in c.seeds)),
    ("collapsed", lambda c: _of_runs(c.collapsed, c)),
    ("reward fell", lambda c: _of_runs(c.reward_fell, c)),
    ("held-out fell", lambda c: f"{c.held_out_fell}/{c.evaluated}" if c.evaluated else MISSING),
    ("final reward mean", lambda c: _shown(c.final_reward_mean, fixed(3))),
    (
        "final reward min–max",
        lambda c: MISSING
        if c.final_reward_min is None
        else f"{fixed(3)(c.final_reward_min)}–{fixed(3)(c.final_reward_max)}",
    ),
    ("best reward MA mean", lambda c: _shown(c.best_reward_ma_mean, fixed(3))),
    ("last eval solved mean", lambda c: _shown(c.eval_solved_mean, fixed(3))),
    ("lowest eval solved mean", lambda c: _shown(c.eval_solved_lowest_mean, fixed(3))),
    ("reached target", lambda c: _of_runs(c.target_reached, c)),
    ("median target step", lambda c: _shown(c.target_step_median, plain)),
    ("median target wall s", lambda c: _shown(c.target_wall_s_median, fixed(0))),
    ("median min ESS ratio", lambda c: _shown(c.ess_ratio_min_median, fixed(3))),
    ("lowest min ESS ratio", lambda c: _shown(c.ess_ratio_min_lowest, fixed(3))),
    ("max grad norm", lambda c: _shown(c.grad_norm_max, general)),
    ("mean lag", lambda c: _shown(c.lag_mean, fixed(2))),
    ("mean wall s", lambda c: _shown(c.wall_s_mean, fixed(0))),
]


def cells_markdown_table(cells: Sequence[CellSummary], only: Sequence[str] | None = None) -> str:
    """One row per (job, stabilizer, max lag) over its runs, for the terminal (`only` TERMINAL_CELL_COLUMNS) and
    cells.md."""
    headers = [name for name, _ in CELL_COLUMNS]
    shown = shown_columns(headers, {cell.job for cell in cells}, only)
    return markdown([headers[i] for i in shown], [[CELL_COLUMNS[i][1](cell) for i in shown] for cell in cells])


def write_cells_csv(cells: Sequence[CellSummary], path: Path) -> None:
    """cells.csv: every `CellSummary` field."""
    write_dataclass_csv(CellSummary, cells, path)


def has_repeats(cells: Sequence[CellSummary]) -> bool:
    """Whether any cell holds more than one run (then the cell table says more than the run table)."""
    return any(cell.runs > 1 for cell in cells)


# ---- the HTML page ----------------------------------------------------------------------------------
