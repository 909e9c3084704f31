"""Reading finished run directories for `stableasync report`: a run's job.yaml and metrics.jsonl as one
`RunData`, and the metric series the tables and plots are computed from. Apart so that every rule about
what a run directory holds is in one place."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from algorithms.errors import StableAsyncError
from cluster.job import job_section_defaults
from cluster.telemetry.run_files import STEP_KEY, WALL_KEY, metric_number, read_jsonl_rows, read_run_job

DEFAULT_ALERTS = job_section_defaults("logging.alerts")  # for a collapse rule turned off by a null

REWARD_KEY = "rollout/reward_mean"
ESS_KEY = "stability/ess_ratio"
GRAD_NORM_KEY = "optim/grad_norm"
KL_K3_KEY = "stability/kl_k3"
LAG_HIST_KEY = "async/lag"
LAG_MEAN_KEY = "async/lag_mean"
EVAL_SOLVED_KEY = "eval/solved"
RECORD_METRICS = "metrics.jsonl.gz"  # a run record's metrics: the keys above, compressed

MOVING_AVERAGE_STEPS = 10  # window of the reward moving average (time to target, the collapse peak)

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
    # the evaluation of the policy before any RL step (eval.before_training), with its wall time: plotted, not
    # an RL row for the tables' rules
    start_rows: list[tuple[Row, float]] = field(default_factory=list)

    @property
    def job(self) -> str:
        """The job it ran (cells group runs by job, stabilizer and lag)."""
        return self.name


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


def metrics_path(run_dir: Path) -> Path:
    """A run's metrics.jsonl, or the metrics.jsonl.gz of its record (`stableasync report --records`)."""
    plain = run_dir / "metrics.jsonl"
    record = run_dir / RECORD_METRICS
    return record if record.is_file() and not plain.exists() else plain


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
    fixed_lag = _int_or_none(_section(job, "async", job_path).get("fixed_lag"), "async.fixed_lag", job_path)
    steps_planned = _int_or_none(_section(job, "learner", job_path).get("steps"), "learner.steps", job_path)
    seed = _int_or_none(job.get("seed"), "seed", job_path)
    alerts = _section(job, "logging.alerts", job_path)
    below = alerts["ess_ratio_below"]
    if below is not None and (isinstance(below, bool) or not isinstance(below, (int, float))):
        raise ReportError(f"{job_path}: 'logging.alerts.ess_ratio_below' must be a number or null, not {below!r}")
    needed = _int_or_none(alerts["ess_collapse_steps"], "logging.alerts.ess_collapse_steps", job_path)
    all_rows = _read_metrics(metrics_path(run_dir))
    wall_s = _continued_wall_s(all_rows)
    rl = [(row, w) for row, w in zip(all_rows, wall_s) if row[STEP_KEY] > 0]
    start = [(row, w) for row, w in zip(all_rows, wall_s) if row[STEP_KEY] == 0 and EVAL_SOLVED_KEY in row]
    return RunData(
        path=run_dir,
        name=str(job.get("name") or run_dir.name),
        label=f"{stabilizer} lag {'?' if max_lag is None else max_lag}"
        if fixed_lag is None
        else f"{stabilizer} fixed lag {fixed_lag}",
        stabilizer=str(stabilizer),
        max_lag=max_lag,
        seed=seed,
        steps_planned=steps_planned,
        ess_collapse_below=None if below is None else float(below),
        ess_collapse_steps=needed if needed is not None else DEFAULT_ALERTS["ess_collapse_steps"],
        rows=[row for row, _ in rl],
        wall_s=[w for _, w in rl],
        start_rows=start,
    )


# ---- the series a run logged ------------------------------------------------------------------------


def metric_series(run: RunData, key: str, from_start: bool = False) -> list[tuple[int, float, float]]:
    """(step, run wall s, value) of every RL row that logged `key` as a number (NaN included); `from_start`:
    the step-0 evaluation's first (the policy before RL)."""
    rows = [*(run.start_rows if from_start else []), *zip(run.rows, run.wall_s)]
    return [
        (int(row[STEP_KEY]), wall_s, row[key]) for row, wall_s in rows if key in row and not isinstance(row[key], list)
    ]


def reward_moving_average(rewards: Sequence[float]) -> list[float]:
    """Trailing moving average of the reward over `min(10, len(rewards))` steps; entry i is for the step
    of rewards[i + window - 1] (full windows only, so one lucky early step cannot reach a target)."""
    window = min(MOVING_AVERAGE_STEPS, len(rewards))
    if window == 0:
        return []
    return [statistics.fmean(rewards[i - window + 1 : i + 1]) for i in range(window - 1, len(rewards))]


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


# ---- labels -----------------------------------------------------------------------------------------


def unique_labels(runs: list[RunData]) -> list[RunData]:
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
