"""Reading a run directory's job.yaml and JSONL files: one reader for the report, the simulator and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tasks.base import jsonl_objects

STEP_KEY = "train/step"  # the x-axis of every W&B chart: the policy version (negative during the SFT warm-up)
WALL_KEY = "time/wall_s"  # seconds since the metric sink started, in every row
EVAL_PREFIX = "eval/"  # an evaluation's metrics: they make up its own row (`MetricSink.log_evaluation`)


def metric_number(value: Any) -> float:
    """A logged metric as a float: the strings "nan", "inf", "-inf" (how the sink writes non-finite floats)
    parsed; NaN for anything missing or not a number."""
    if isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def read_jsonl_rows(path: Path, error: type[Exception] = ValueError) -> list[dict[str, Any]]:
    """Every JSON object of a JSONL file, blank lines skipped; `error` names the file (and line) otherwise."""
    if not path.is_file():
        raise error(f"{path}: not found (a finished run directory holds job.yaml and metrics.jsonl)")
    return [row for _, row in jsonl_objects(path, error)]


def is_evaluation_row(row: dict[str, Any]) -> bool:
    """Whether a metrics.jsonl row is an evaluation's own row (its `train/step` is the policy version it
    evaluated) rather than a step's: readers that count or time steps leave these out. Runs from before
    evaluations ran beside training have their `eval/*` keys in step rows, which stay step rows."""
    return any(key.startswith(EVAL_PREFIX) for key in row) and all(
        key.startswith(EVAL_PREFIX) or key in (STEP_KEY, WALL_KEY) for key in row
    )


def step_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The RL step rows of a metrics.jsonl, in logged order: one per learner step (`train/step` > 0, the
    learner's and driver's keys), without the SFT warm-up's rows and the evaluations' own rows. Every
    reader that counts or times steps (the report, the simulator's calibration, the benchmarks) reads these."""
    return [row for row in rows if metric_number(row.get(STEP_KEY)) > 0 and not is_evaluation_row(row)]


def read_run_job(path: Path, error: type[Exception] = ValueError, defaulted: Iterable[str] = ()) -> dict[str, Any]:
    """A finished run's resolved job.yaml as a mapping. It is read as plain YAML, not validated against today's
    schema, so older runs still load; the `defaulted` sections ("learner", "logging.alerts") get the schema's
    defaults for the keys they lack. `error` names the file (and line) when it cannot be read."""
    import yaml

    from cluster.job import job_section_defaults

    if not path.is_file():
        raise error(f"{path}: not found (a finished run directory holds job.yaml and metrics.jsonl)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as problem:
        mark = getattr(problem, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise error(f"{where}: not YAML ({getattr(problem, 'problem', None) or problem})") from None
    except (OSError, UnicodeDecodeError) as problem:
        raise error(f"{path}: cannot be read ({problem})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected the resolved job (a mapping with name, algorithm, async, ...)")
    for dotted in defaulted:
        *parents, name = dotted.split(".")
        holder: Any = data
        for part in parents:
            holder = holder.get(part) if isinstance(holder.get(part), dict) else holder.setdefault(part, {})
            if not isinstance(holder, dict):
                raise error(f"{path}: '{part}' must be a mapping, not {type(holder).__name__}")
        given = holder.get(name) or {}
        if not isinstance(given, dict):
            raise error(f"{path}: '{dotted}' must be a mapping, not {type(given).__name__}")
        holder[name] = {**job_section_defaults(dotted), **given}
    return data
