"""`stableasync report`: compare finished runs in one table, plots and a self-contained HTML page.

Reads only what a run directory already holds (`job.yaml`, `metrics.jsonl`), so any run can be
compared after the fact, on any machine: standard library, PyYAML, and matplotlib (imported only when
plotting). No torch, no ray. The rules behind every number are in `summarise`; docs/report.md shows
the command.
"""

from __future__ import annotations

import base64
import csv
import html
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

from algorithms.errors import StableAsyncError
from cluster.job import job_section_defaults
from cluster.telemetry.run_files import (STEP_KEY, WALL_KEY, metric_number, read_jsonl_rows, read_run_job,
                                         step_rows)

DEFAULT_ALERTS = job_section_defaults("logging.alerts")  # for a collapse rule turned off by a null

REWARD_KEY = "rollout/reward_mean"
ESS_KEY = "stability/ess_ratio"
GRAD_NORM_KEY = "optim/grad_norm"
KL_K3_KEY = "stability/kl_k3"
LAG_HIST_KEY = "async/lag"
LAG_MEAN_KEY = "async/lag_mean"
EVAL_SOLVED_KEY = "eval/solved"

MOVING_AVERAGE_STEPS = 10  # window of the reward moving average (time to target, the collapse peak)
FINAL_FRACTION = 0.1  # the final reward is the mean over this last share of RL steps (at least one)
REWARD_DROP_FRACTION = 0.5  # collapse: final reward below this share of the best moving average

# one RL row of metrics.jsonl (a step's, or an evaluation's own): floats (NaN/inf parsed), lists for histograms
Row = dict[str, Any]


class ReportError(StableAsyncError, ValueError):
    """A run directory cannot be read; the message names the file (and the line, for metrics.jsonl)."""


@dataclass(frozen=True)
class RunData:
    """One finished run as the report needs it: who it is, and its RL rows in logged order."""

    path: Path
    name: str  # job.name
    label: str  # legend and table name, e.g. "tis_seq lag 2"; made unique by `write_report`
    stabilizer: str  # algorithm.stabilizer.name ("?" when job.yaml lacks it)
    max_lag: int | None  # async.max_lag
    seed: int | None  # the job's seed (prompt order, sampling, warm-up data)
    steps_planned: int | None  # learner.steps
    ess_collapse_below: float | None  # logging.alerts.ess_ratio_below (None: the job turned the ESS rule off)
    ess_collapse_steps: int  # logging.alerts.ess_collapse_steps
    rows: list[Row]  # RL rows only (train/step > 0); SFT warm-up rows are dropped
    wall_s: list[float]  # per row: seconds since the run's sink started, continued across resumes


@dataclass(frozen=True)
class RunSummary:
    """The numbers of one run's table row; None where the run logged nothing to compute it from."""

    run_dir: Path
    label: str
    stabilizer: str
    max_lag: int | None
    seed: int | None
    steps_planned: int | None
    steps_done: int  # RL step rows in metrics.jsonl (evaluation rows not counted)
    wall_s: float | None  # run wall time at the last RL row
    final_reward: float | None
    best_reward_ma: float | None  # best trailing moving average of the reward
    eval_solved: float | None  # the last evaluation's solved share (eval.every_steps); None: never evaluated
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


# ---- reading a run directory ------------------------------------------------------------------------


def _parse_value(value: Any) -> Any:
    if isinstance(value, list):
        return [metric_number(v) for v in value]
    return metric_number(value)


def _section(job: dict[str, Any], dotted: str, path: Path) -> dict[str, Any]:
    """A nested job section (e.g. "logging.alerts"); {} if absent, an error if it is not a mapping."""
    current: Any = job
    for part in dotted.split("."):
        current = current.get(part) if isinstance(current, dict) else None
        if current is None:
            return {}
        if not isinstance(current, dict):
            raise ReportError(f"{path}: '{dotted}' must be a mapping, not {type(current).__name__}")
    return current


def _int_or_none(value: Any, field_name: str, path: Path) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReportError(f"{path}: '{field_name}' must be an integer, not {value!r}")
    return value


def _read_metrics(path: Path) -> list[Row]:
    rows = []
    for number, raw in enumerate(read_jsonl_rows(path, ReportError), start=1):
        row = {key: _parse_value(value) for key, value in raw.items()}
        step = row.get(STEP_KEY)
        if not isinstance(step, float) or not math.isfinite(step):
            raise ReportError(f"{path}:{number}: no numeric '{STEP_KEY}'")
        rows.append(row)
    return rows


def _continued_wall_s(rows: list[Row]) -> list[float]:
    """`time/wall_s` per row, made monotonic: a resumed run's sink restarts its clock at 0, so each drop
    continues from the last time logged before it (the time lost between crash and resume is not seen)."""
    out, offset_s, previous_s = [], 0.0, None
    for row in rows:
        wall_s = row.get(WALL_KEY, math.nan)
        if isinstance(wall_s, list) or not math.isfinite(wall_s):
            out.append(math.nan)
            continue
        if previous_s is not None and wall_s < previous_s:
            offset_s += previous_s
        previous_s = wall_s
        out.append(wall_s + offset_s)
    return out


def load_run(path: str | Path) -> RunData:
    """Read one finished run directory; `ReportError` naming the file (and line) if it cannot be read.

    job.yaml is read as `read_run_job` reads it (older runs load, their missing keys take today's defaults);
    a run without a stabilizer name is labelled "?"."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a run directory (expected job.yaml and metrics.jsonl in it)")
    job_path = run_dir / "job.yaml"
    job = read_run_job(job_path, ReportError, defaulted=["logging.alerts"])  # a missing label key reads "?"
    stabilizer = _section(job, "algorithm.stabilizer", job_path).get("name") or "?"
    max_lag = _int_or_none(_section(job, "async", job_path).get("max_lag"), "async.max_lag", job_path)
    steps_planned = _int_or_none(_section(job, "learner", job_path).get("steps"), "learner.steps", job_path)
    seed = _int_or_none(job.get("seed"), "seed", job_path)
    alerts = _section(job, "logging.alerts", job_path)
    below = alerts["ess_ratio_below"]
    if below is not None and (isinstance(below, bool) or not isinstance(below, (int, float))):
        raise ReportError(f"{job_path}: 'logging.alerts.ess_ratio_below' must be a number or null, not {below!r}")
    needed = _int_or_none(alerts["ess_collapse_steps"], "logging.alerts.ess_collapse_steps", job_path)
    all_rows = _read_metrics(run_dir / "metrics.jsonl")
    wall_s = _continued_wall_s(all_rows)
    rl = [(row, w) for row, w in zip(all_rows, wall_s) if row[STEP_KEY] > 0]
    return RunData(
        path=run_dir, name=str(job.get("name") or run_dir.name),
        label=f"{stabilizer} lag {'?' if max_lag is None else max_lag}",
        stabilizer=str(stabilizer), max_lag=max_lag, seed=seed, steps_planned=steps_planned,
        ess_collapse_below=None if below is None else float(below),
        ess_collapse_steps=needed if needed is not None else DEFAULT_ALERTS["ess_collapse_steps"],
        rows=[row for row, _ in rl], wall_s=[w for _, w in rl],
    )


# ---- the numbers ------------------------------------------------------------------------------------


def _series(run: RunData, key: str) -> list[tuple[int, float, float]]:
    """(step, run wall s, value) of every RL row that logged `key` as a number (NaN included)."""
    return [(int(row[STEP_KEY]), wall_s, row[key]) for row, wall_s in zip(run.rows, run.wall_s)
            if key in row and not isinstance(row[key], list)]


def reward_moving_average(rewards: Sequence[float]) -> list[float]:
    """Trailing moving average of the reward over `min(10, len(rewards))` steps; entry i is for the step
    of rewards[i + window - 1] (full windows only, so one lucky early step cannot reach a target)."""
    window = min(MOVING_AVERAGE_STEPS, len(rewards))
    if window == 0:
        return []
    return [statistics.fmean(rewards[i - window + 1:i + 1]) for i in range(window - 1, len(rewards))]


def lag_counts(run: RunData) -> list[float]:
    """`async/lag` summed over the run: bin k = trained samples that were k policy versions old."""
    total: list[float] = []
    for row in run.rows:
        counts = row.get(LAG_HIST_KEY)
        if not isinstance(counts, list):
            continue
        total += [0.0] * (len(counts) - len(total))
        for k, count in enumerate(counts):
            if math.isfinite(count):
                total[k] += count
    return total


def _lag_mean(run: RunData) -> float | None:
    counts = lag_counts(run)
    if sum(counts) > 0:
        return sum(k * c for k, c in enumerate(counts)) / sum(counts)
    means = [v for _, _, v in _series(run, LAG_MEAN_KEY) if math.isfinite(v)]
    return statistics.fmean(means) if means else None


def _grad_norm_max(values: list[float]) -> float | None:
    if not values:
        return None
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values)


def summarise(run: RunData, target_reward: float | None = None, collapse_below: float | None = None,
              collapse_steps: int | None = None) -> RunSummary:
    """One run's table row. Every rule, over RL steps only (train/step > 0), in logged order:

    - final reward: mean `rollout/reward_mean` of the last max(1, n // 10) of the n steps with a finite
      reward.
    - moving average: trailing mean over min(10, n) steps, full windows only (`reward_moving_average`).
    - last eval solved: `eval/solved` of the last step that logged a finite one (held-out accuracy when the
      job evaluates; the training reward alone can rise on a policy that games its verifier).
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
    rewards = [(s, w, r) for s, w, r in _series(run, REWARD_KEY) if math.isfinite(r)]
    reward_values = [r for _, _, r in rewards]
    final_reward = (statistics.fmean(reward_values[-max(1, len(reward_values) // 10):])
                    if reward_values else None)
    evaluations = [v for _, _, v in _series(run, EVAL_SOLVED_KEY) if math.isfinite(v)]
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

    ess = _series(run, ESS_KEY)
    finite_ess = [v for _, _, v in ess if math.isfinite(v)]
    grad_norms = _series(run, GRAD_NORM_KEY)
    kl = [v for _, _, v in _series(run, KL_K3_KEY) if math.isfinite(v)]

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
    reward_fell = best_ma is not None and final_reward is not None and best_ma > 0 \
        and final_reward < REWARD_DROP_FRACTION * best_ma
    if reward_fell and best_ma is not None:  # reward_fell implies best_ma is not None
        peak = moving.index(best_ma)
        drop = next((i for i in range(peak + 1, len(moving)) if moving[i] < REWARD_DROP_FRACTION * best_ma),
                    len(moving) - 1)
        step = rewards[drop + offset][0]
        fired.append((step, f"final reward {final_reward:.3g} < {REWARD_DROP_FRACTION:.0%} of the best "
                            f"moving average {best_ma:.3g} (step {rewards[peak + offset][0]})"))
    fired.sort(key=lambda item: item[0])
    finite_wall = [w for w in run.wall_s if math.isfinite(w)]
    return RunSummary(
        run_dir=run.path, label=run.label, stabilizer=run.stabilizer, max_lag=run.max_lag, seed=run.seed,
        steps_planned=run.steps_planned, steps_done=len(step_rows(run.rows)),
        wall_s=finite_wall[-1] if finite_wall else None,
        final_reward=final_reward, best_reward_ma=best_ma, eval_solved=evaluations[-1] if evaluations else None,
        target_reward=target_reward,
        target_step=target_step, target_wall_s=target_wall_s,
        ess_ratio_min=(min(finite_ess) if finite_ess else math.nan) if ess else None,
        grad_norm_max=_grad_norm_max([v for _, _, v in grad_norms]), kl_k3_max=max(kl) if kl else None,
        lag_mean=_lag_mean(run), ess_collapse_below=below, ess_collapse_steps=needed,
        collapsed=bool(fired), collapse_step=fired[0][0] if fired else None,
        collapse_reason="; ".join(why for _, why in fired), reward_fell=reward_fell,
    )


# ---- the table --------------------------------------------------------------------------------------


def _fixed(digits: int) -> Callable[[Any], str]:
    return lambda value: f"{value:.{digits}f}" if math.isfinite(value) else str(value)


def _general(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _plain(value: Any) -> str:
    return str(value)


# (header, RunSummary attribute, how the markdown/HTML table shows a value that is not None)
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("run", "label", _plain),
    ("stabilizer", "stabilizer", _plain),
    ("max lag", "max_lag", _plain),
    ("seed", "seed", _plain),
    ("steps", "steps_done", _plain),
    ("final reward", "final_reward", _fixed(3)),
    ("best reward MA", "best_reward_ma", _fixed(3)),
    ("last eval solved", "eval_solved", _fixed(3)),
    ("target step", "target_step", _plain),
    ("target wall s", "target_wall_s", _fixed(0)),
    ("min ESS ratio", "ess_ratio_min", _fixed(3)),
    ("max grad norm", "grad_norm_max", _general),
    ("max KL k3", "kl_k3_max", _general),
    ("mean lag", "lag_mean", _fixed(2)),
    ("wall s", "wall_s", _fixed(0)),
    ("collapse", "collapsed", lambda collapsed: "yes" if collapsed else "no"),
    ("collapse reason", "collapse_reason", _plain),
    ("run dir", "run_dir", _plain),
]
MISSING = "—"


def _cells(summary: RunSummary) -> list[str]:
    return [MISSING if getattr(summary, attr) is None else show(getattr(summary, attr)) for _, attr, show in COLUMNS]


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|"] + [line(row) for row in rows]) + "\n"


def markdown_table(summaries: Sequence[RunSummary]) -> str:
    """One row per run, for the terminal and table.md ("—": the run logged nothing to compute it from)."""
    return _markdown([name for name, _, _ in COLUMNS], [_cells(summary) for summary in summaries])


def _write_dataclass_csv(kind: type, rows: Sequence[Any], path: Path) -> None:
    """Every dataclass field at full precision for other tools (header: the field names); empty cell for
    None, "nan"/"inf" for non-finite values, tuples joined by ";"."""
    names = [f.name for f in fields(kind)]
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(names)
        for row in rows:
            values = [getattr(row, name) for name in names]
            writer.writerow([";".join("" if item is None else str(item) for item in value) if isinstance(value, tuple)
                             else "" if value is None else value for value in values])


def write_csv(summaries: Sequence[RunSummary], path: Path) -> None:
    """table.csv: every `RunSummary` field."""
    _write_dataclass_csv(RunSummary, summaries, path)


# ---- the cells: one row per (stabilizer, max lag) over its seeds ---------------------------------------


@dataclass(frozen=True)
class CellSummary:
    """The runs of one (stabilizer, max_lag) cell, usually one per seed (`stableasync sweep --seeds`).
    Rules: means and ranges over the runs that have the value; "lower median" is the middle run's value
    (the lower of the two middle ones for an even count), NaN ranked lowest, so a run whose ESS was never
    finite pulls the median down instead of vanishing."""

    stabilizer: str
    max_lag: int | None
    runs: int
    seeds: tuple[int | None, ...]
    collapsed: int  # runs flagged collapsed, by any rule
    reward_fell: int  # runs flagged by the reward rule (c): the outcome, not only the ESS warning
    final_reward_mean: float | None
    final_reward_min: float | None
    final_reward_max: float | None
    best_reward_ma_mean: float | None
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


def _lag_order(max_lag: int | None) -> int:
    return -1 if max_lag is None else max_lag


class _InCell(Protocol):
    """What `_by_cell` groups by: a run's data or its summary."""

    @property
    def stabilizer(self) -> str: ...

    @property
    def max_lag(self) -> int | None: ...


Run = TypeVar("Run", bound=_InCell)


def _by_cell(runs: Sequence[Run]) -> dict[tuple[str, int | None], list[Run]]:
    """Runs (anything with `stabilizer` and `max_lag`) grouped by cell: stabilizers in the order they first
    appear, each one's lags ascending (a shell glob lists lag 16 before lag 2)."""
    stabilizers = list(dict.fromkeys(run.stabilizer for run in runs))
    cells: dict[tuple[str, int | None], list[Run]] = {}
    for run in sorted(runs, key=lambda run: (stabilizers.index(run.stabilizer), _lag_order(run.max_lag))):
        cells.setdefault((run.stabilizer, run.max_lag), []).append(run)
    return cells


def summarise_cells(summaries: Sequence[RunSummary]) -> list[CellSummary]:
    """One row per (stabilizer, max_lag) cell, in `_by_cell` order."""
    out = []
    for (stabilizer, max_lag), runs in _by_cell(summaries).items():
        finals = _present([run.final_reward for run in runs])
        reached = [run for run in runs if run.target_step is not None]
        ess = _present([run.ess_ratio_min for run in runs])
        out.append(CellSummary(
            stabilizer=stabilizer, max_lag=max_lag, runs=len(runs), seeds=tuple(run.seed for run in runs),
            collapsed=sum(run.collapsed for run in runs), reward_fell=sum(run.reward_fell for run in runs),
            final_reward_mean=_mean(finals), final_reward_min=min(finals, default=None),
            final_reward_max=max(finals, default=None),
            best_reward_ma_mean=_mean(_present([run.best_reward_ma for run in runs])),
            target_reached=len(reached),
            target_step_median=_lower_median(_present([run.target_step for run in reached])),
            target_wall_s_median=_lower_median(_present([run.target_wall_s for run in reached])),
            ess_ratio_min_median=_lower_median(ess),
            ess_ratio_min_lowest=min(ess, key=_nan_lowest, default=None),
            grad_norm_max=_grad_norm_max(_present([run.grad_norm_max for run in runs])),
            lag_mean=_mean(_present([run.lag_mean for run in runs])),
            wall_s_mean=_mean(_present([run.wall_s for run in runs])),
        ))
    return out


def _shown(value: Any, show: Callable[[Any], str]) -> str:
    return MISSING if value is None else show(value)


def _of_runs(count: int, cell: CellSummary) -> str:
    return f"{count}/{cell.runs}"


# (header, how the markdown/HTML table shows a cell)
CELL_COLUMNS: list[tuple[str, Callable[[CellSummary], str]]] = [
    ("stabilizer", lambda c: c.stabilizer),
    ("max lag", lambda c: _shown(c.max_lag, _plain)),
    ("seeds", lambda c: ",".join(MISSING if seed is None else str(seed) for seed in c.seeds)),
    ("collapsed", lambda c: _of_runs(c.collapsed, c)),
    ("reward fell", lambda c: _of_runs(c.reward_fell, c)),
    ("final reward mean", lambda c: _shown(c.final_reward_mean, _fixed(3))),
    ("final reward min–max", lambda c: MISSING if c.final_reward_min is None
        else f"{_fixed(3)(c.final_reward_min)}–{_fixed(3)(c.final_reward_max)}"),
    ("best reward MA mean", lambda c: _shown(c.best_reward_ma_mean, _fixed(3))),
    ("reached target", lambda c: _of_runs(c.target_reached, c)),
    ("median target step", lambda c: _shown(c.target_step_median, _plain)),
    ("median target wall s", lambda c: _shown(c.target_wall_s_median, _fixed(0))),
    ("median min ESS ratio", lambda c: _shown(c.ess_ratio_min_median, _fixed(3))),
    ("lowest min ESS ratio", lambda c: _shown(c.ess_ratio_min_lowest, _fixed(3))),
    ("max grad norm", lambda c: _shown(c.grad_norm_max, _general)),
    ("mean lag", lambda c: _shown(c.lag_mean, _fixed(2))),
    ("mean wall s", lambda c: _shown(c.wall_s_mean, _fixed(0))),
]


def cells_markdown_table(cells: Sequence[CellSummary]) -> str:
    """One row per (stabilizer, max lag) over its runs, for the terminal and cells.md."""
    return _markdown([name for name, _ in CELL_COLUMNS], [[show(cell) for _, show in CELL_COLUMNS] for cell in cells])


def write_cells_csv(cells: Sequence[CellSummary], path: Path) -> None:
    """cells.csv: every `CellSummary` field."""
    _write_dataclass_csv(CellSummary, cells, path)


def has_repeats(cells: Sequence[CellSummary]) -> bool:
    """Whether any cell holds more than one run (then the cell table says more than the run table)."""
    return any(cell.runs > 1 for cell in cells)


# ---- the plots --------------------------------------------------------------------------------------

# (file stem, metric key, y-axis label, log y)
CURVES: list[tuple[str, str, str, bool]] = [
    ("reward", REWARD_KEY, "reward (mean of the step's samples)", False),
    ("ess_ratio", ESS_KEY, "ESS ratio (1: on-policy)", False),
    ("grad_norm", GRAD_NORM_KEY, "gradient norm before clipping (log)", True),
    ("kl_k3", KL_K3_KEY, "KL k3 per token (behaviour || learner)", False),
]
LAG_PLOT = "lag_hist"


def _style(index: int) -> dict[str, Any]:
    """A colour per run (tab10), and a new line style every 10 runs so more than 10 stay distinct."""
    return {"color": f"C{index % 10}", "linestyle": ("-", "--", ":", "-.")[index // 10 % 4]}


def plot_runs(runs: Sequence[RunData], summaries: Sequence[RunSummary], out_dir: Path,
              target_reward: float | None = None) -> list[Path]:
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
            series = _series(run, key)
            if not series:
                continue
            any_line = True
            style = _style(index)
            steps: list[float] = [s for s, _, _ in series]
            walls = [w for _, w, _ in series]
            values = [v for _, _, v in series]
            any_positive = any_positive or any(math.isfinite(v) and v > 0 for v in values)
            for ax, xs in zip(axes, (steps, walls)):
                if key == REWARD_KEY:  # raw rewards faint, the moving average (what the table uses) bold
                    ax.plot(xs, values, alpha=0.25, linewidth=0.8, color=style["color"])
                    finite = [(x, v) for x, v in zip(xs, values) if math.isfinite(v)]
                    moving = reward_moving_average([v for _, v in finite])
                    ax.plot([x for x, _ in finite][len(finite) - len(moving):], moving, label=run.label, **style)
                else:
                    ax.plot(xs, values, label=run.label, linewidth=1.2, **style)
                bad = [x for x, v in zip(xs, values) if not math.isfinite(v)]
                if bad:  # NaN/inf leave gaps in the line: mark them at the top of the panel
                    ax.plot(bad, [0.98] * len(bad), "x", color=style["color"], markersize=6,
                            transform=blended_transform_factory(ax.transData, ax.transAxes))
        for ax, xlabel in zip(axes, ("RL step (policy version)", "run wall time (s since the run started)")):
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            if not any_line:
                ax.text(0.5, 0.5, f"no run logged {key}", ha="center", va="center", transform=ax.transAxes)
            if key == REWARD_KEY and target_reward is not None:
                ax.axhline(target_reward, color="black", linestyle="--", linewidth=0.8,
                           label=f"target {target_reward:g}")
            if key == ESS_KEY and any_line and ess_threshold is not None:
                ax.axhline(ess_threshold, color="red", linestyle="--", linewidth=0.8,
                           label=f"collapse below {ess_threshold:g}")
        if log_y and any_positive:
            axes[0].set_yscale("log")
        axes[0].set_ylabel(ylabel)
        if any_line:
            axes[1].legend(fontsize="small", loc="best")
        title = f"{key} against step and wall time"
        if key == REWARD_KEY:
            title += f" (bold: trailing {MOVING_AVERAGE_STEPS}-step moving average)"
        if any_line and any(not math.isfinite(v) for run in runs for _, _, v in _series(run, key)):
            title += "; x: NaN/inf"
        figure.suptitle(title)
        path = out_dir / f"{stem}.png"
        figure.savefig(path, dpi=90)
        paths.append(path)

    figure = Figure(figsize=(9, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    hists = [(index, run, lag_counts(run)) for index, run in enumerate(runs)]
    hists = [(index, run, counts) for index, run, counts in hists if sum(counts) > 0]
    width = 0.8 / max(1, len(hists))
    for slot, (index, run, counts) in enumerate(hists):
        ax.bar([k - 0.4 + width * (slot + 0.5) for k in range(len(counts))], counts, width=width,
               color=_style(index)["color"], label=f"{run.label} ({sum(counts):.0f} samples)")
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
    paths.append(path)
    return paths


def _reward_ma_by_step(run: RunData) -> dict[int, float]:
    finite = [(step, value) for step, _, value in _series(run, REWARD_KEY) if math.isfinite(value)]
    moving = reward_moving_average([value for _, value in finite])
    return dict(zip([step for step, _ in finite][len(finite) - len(moving):], moving))


def plot_cells(runs: Sequence[RunData], out_dir: Path, target_reward: float | None = None) -> Path:
    """reward_by_cell.png: per (stabilizer, max lag), the mean over its runs of the reward moving average
    at each step every run reached, with the runs' min–max as a band: the seed-to-seed spread next to the
    gaps between cells."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = {key: [_reward_ma_by_step(run) for run in same] for key, same in _by_cell(runs).items()}
    lags = sorted({lag for _, lag in cells}, key=_lag_order)
    figure = Figure(figsize=(4.2 * max(1, len(lags)), 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, max(1, len(lags)), sharey=True, squeeze=False)[0]
    stabilizers = list(dict.fromkeys(stabilizer for stabilizer, _ in cells))
    any_line = False
    for ax, lag in zip(axes, lags):
        for (stabilizer, max_lag), curves in cells.items():
            if max_lag != lag:
                continue
            steps = sorted(set.intersection(*(set(curve) for curve in curves)))
            if not steps:
                continue
            any_line = True
            color = _style(stabilizers.index(stabilizer))["color"]
            values = [[curve[step] for curve in curves] for step in steps]
            ax.plot(steps, [statistics.fmean(v) for v in values], color=color,
                    label=f"{stabilizer} ({len(curves)} run{'s' if len(curves) > 1 else ''})")
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
    figure.suptitle("reward by cell: mean over runs (band: min–max over runs)")
    path = out_dir / "reward_by_cell.png"
    figure.savefig(path, dpi=90)
    return path


# ---- the HTML page ----------------------------------------------------------------------------------


def _html_table(header: Sequence[str], rows: Sequence[tuple[Sequence[str], bool]]) -> str:
    """A table of (cells, shaded) rows; shaded rows (a collapse) get the `collapsed` class."""
    esc = html.escape
    head = "".join(f"<th>{esc(name)}</th>" for name in header)
    body = "".join(
        "<tr" + (' class="collapsed"' if shaded else "") + ">"
        + "".join(f"<td>{esc(cell)}</td>" for cell in cells) + "</tr>\n"
        for cells, shaded in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>\n"


def _cells_html(cells: Sequence[CellSummary]) -> str:
    """The table over each cell's runs, when some cell has more than one (else it repeats the run table)."""
    if not has_repeats(cells):
        return ""
    table = _html_table([name for name, _ in CELL_COLUMNS],
                        [([show(cell) for _, show in CELL_COLUMNS], cell.collapsed > 0) for cell in cells])
    return (f"<h2>Over seeds: one row per stabilizer and max lag</h2>\n<p>Means and min–max over each cell's "
            f"runs; medians are the middle run's value. A row is shaded when any of its runs collapsed.</p>\n"
            f"{table}<h2>Every run</h2>\n")


def render_html(summaries: Sequence[RunSummary], cells: Sequence[CellSummary], images: Sequence[Path],
                target_reward: float | None) -> str:
    """One self-contained page: the tables and every PNG inline as base64 data URIs (no external
    files, scripts or network), so it can be mailed or attached to an issue as is."""
    esc = html.escape
    table = _html_table([name for name, _, _ in COLUMNS], [(_cells(s), s.collapsed) for s in summaries])
    sources = "".join(f"<li><code>{esc(str(s.run_dir.resolve()))}</code> ({esc(s.label)})</li>" for s in summaries)
    figures = "".join(
        f'<figure><img alt="{esc(path.stem)}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode("ascii")}"><figcaption>{esc(path.name)}</figcaption></figure>\n'
        for path in images
    )
    target = f"{target_reward:g}" if target_reward is not None else "none given (--target-reward)"
    rules = (
        f"Final reward: mean over the last 10% of RL steps (at least one). Target reward: {esc(target)}; "
        f"reached at the first step whose trailing {MOVING_AVERAGE_STEPS}-step moving average is at or above it. "
        "Collapse: ESS ratio below the threshold (or NaN) for N consecutive steps, or a non-finite grad norm, "
        f"or a final reward below {REWARD_DROP_FRACTION:.0%} of the best moving average. "
        "Thresholds per run: " + ", ".join(
            f"{esc(s.label)}: ESS &lt; {'off' if s.ess_collapse_below is None else f'{s.ess_collapse_below:g}'} "
            f"for {s.ess_collapse_steps}" for s in summaries) + "."
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>StableAsync report</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
th, td {{ border: 1px solid #bbb; padding: 0.25em 0.5em; text-align: right; }}
td:first-child, td:last-child, th {{ text-align: left; }}
tr.collapsed td {{ background: #fde4e4; }}
img {{ max-width: 100%; }}
figure {{ margin: 1em 0; }}
</style></head><body>
<h1>StableAsync report</h1>
<p>Generated {esc(datetime.now().isoformat(timespec="seconds"))} by <code>stableasync report</code> from
{len(summaries)} run director{'y' if len(summaries) == 1 else 'ies'}:</p>
<ul>{sources}</ul>
<p>{rules}</p>
{_cells_html(cells)}{table}{figures}</body></html>
"""


# ---- the entry point --------------------------------------------------------------------------------


def _unique_labels(runs: list[RunData]) -> list[RunData]:
    """Runs sharing a label (same stabilizer and lag) get their seed added when that tells them apart,
    else their directory name, then a number."""
    seeds: dict[str, list[int | None]] = {}
    for run in runs:
        seeds.setdefault(run.label, []).append(run.seed)

    def told_apart(run: RunData) -> str:
        same = seeds[run.label]
        if len(same) == 1:
            return run.label
        if None not in same and len(set(same)) == len(same):
            return f"{run.label} seed {run.seed}"
        return f"{run.label} ({run.path.name})"

    runs = [replace(run, label=told_apart(run)) for run in runs]
    seen: dict[str, int] = {}
    unique = []
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
        unique.append(replace(run, label=f"{run.label} #{seen[run.label]}") if seen[run.label] > 1 else run)
    return unique


def write_report(run_dirs: Sequence[str | Path], out_dir: str | Path = "report", target_reward: float | None = None,
                 collapse_below: float | None = None, collapse_steps: int | None = None) -> list[RunSummary]:
    """Read every run (all errors before anything is written), then write table.md, table.csv, cells.md
    and cells.csv (one row per stabilizer and max lag, over its seeds), the PNGs and report.html into
    `out_dir`; returns the summaries in the order given. `collapse_below` and `collapse_steps` None: each
    run's own `logging.alerts`. Raises `ReportError` for an unreadable run."""
    if not run_dirs:
        raise ReportError("no run directories given")
    if collapse_below is not None and not (collapse_below >= 0):
        raise ReportError(f"ESS collapse threshold must be >= 0, not {collapse_below}")
    if collapse_steps is not None and collapse_steps <= 0:
        raise ReportError(f"ESS collapse steps must be > 0, not {collapse_steps}")
    runs = _unique_labels([load_run(path) for path in run_dirs])
    summaries = [summarise(run, target_reward, collapse_below, collapse_steps) for run in runs]
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ReportError(f"{out}: cannot create the output folder ({error})") from None
    (out / "table.md").write_text(markdown_table(summaries))
    write_csv(summaries, out / "table.csv")
    cells = summarise_cells(summaries)
    (out / "cells.md").write_text(cells_markdown_table(cells))
    write_cells_csv(cells, out / "cells.csv")
    images = plot_runs(runs, summaries, out, target_reward) + [plot_cells(runs, out, target_reward)]
    (out / "report.html").write_text(render_html(summaries, cells, images, target_reward))
    return summaries


def run_cli(run_dirs: Sequence[str], out_dir: str, target_reward: float | None, collapse_below: float | None,
            collapse_steps: int | None) -> int:
    """`stableasync report`: print the table, write the files; exit 2 naming the file that cannot be read."""
    import sys

    try:
        summaries = write_report(run_dirs, out_dir, target_reward, collapse_below, collapse_steps)
    except ReportError as error:
        print(f"stableasync report: {error}", file=sys.stderr)
        return 2
    print_tables(summaries)
    out = Path(out_dir)
    print(f"\nwrote {out / 'report.html'} (self-contained), table.md, table.csv, cells.md, cells.csv and "
          f"{len(CURVES) + 2} PNGs in {out}")
    return 0


def print_tables(summaries: Sequence[RunSummary]) -> None:
    """The run table, then the table over seeds when some cell holds more than one run."""
    print(markdown_table(summaries), end="")
    cells = summarise_cells(summaries)
    if has_repeats(cells):
        print("\nover seeds, one row per stabilizer and max lag:\n")
        print(cells_markdown_table(cells), end="")
