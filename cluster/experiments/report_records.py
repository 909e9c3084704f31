"""Run records (`stableasync report --records DIR`): each run directory cut to what the report reads, its
job.yaml and the report's metrics, gzip-compressed (tens of KB for a 1,000-step run where the run directory
holds megabytes), in a folder `stableasync report` reads again like the run itself. Why: a grid of runs
spread over machines or days can be reported in one table and figure after the run directories are gone.
A record's job.yaml has `logging.run_dir` set back to its default, so a record kept in a repository names no
folder of the machine it ran on, and `stableasync train RECORD/job.yaml` runs the same job again anywhere."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from cluster.experiments.report_reading import (
    ESS_KEY,
    GRAD_NORM_KEY,
    KL_K3_KEY,
    LAG_HIST_KEY,
    LAG_MEAN_KEY,
    RECORD_METRICS,
    REWARD_KEY,
    ReportError,
    metrics_path,
)
from cluster.job import job_section_defaults
from cluster.telemetry.run_files import EVAL_PREFIX, STEP_KEY, WALL_KEY, read_jsonl_rows, read_run_job

# every key the report reads; evaluation rows keep all their eval/* keys, which mark them as evaluations
RECORD_KEYS = frozenset({STEP_KEY, WALL_KEY, REWARD_KEY, ESS_KEY, GRAD_NORM_KEY, KL_K3_KEY, LAG_HIST_KEY, LAG_MEAN_KEY})


def _kept(row: dict[str, object]) -> dict[str, object]:
    return {key: value for key, value in row.items() if key in RECORD_KEYS or key.startswith(EVAL_PREFIX)}


def portable_job(job: dict[str, Any]) -> str:
    """A run's resolved job as a record keeps it: every key as the run wrote it but `logging.run_dir`, which
    takes its default (the run's was a folder of the machine it ran on)."""
    logging = job.get("logging")
    if isinstance(logging, dict) and "run_dir" in logging:
        job = {**job, "logging": {**logging, "run_dir": job_section_defaults("logging")["run_dir"]}}
    return yaml.safe_dump(job, sort_keys=False)


def write_records(run_dirs: Sequence[str | Path], records_dir: str | Path) -> list[Path]:
    """Write `records_dir/<run folder name>/` (job.yaml, metrics.jsonl.gz) for every run, replacing an
    earlier record of the same name; returns the record folders. Every run is read before anything is
    written; two runs whose folders share a name, or a record that would land on its own run or on another
    run's folder, are refused (`ReportError` naming them)."""
    runs = [Path(run_dir) for run_dir in run_dirs]
    by_name: dict[str, Path] = {}
    for run in runs:
        if run.name in by_name:
            raise ReportError(f"{by_name[run.name]} and {run}: two runs named {run.name!r} would share one record")
        by_name[run.name] = run
    for run in runs:
        record = Path(records_dir) / run.name
        if record.resolve() == run.resolve():
            raise ReportError(f"{run}: its record would replace the run itself; give --records another folder")
        if (record / "metrics.jsonl").exists():  # a run folder, not a record: replacing it would lose the run
            raise ReportError(f"{record} holds a run (metrics.jsonl), not a record; give --records another folder")
    rows = {run: [_kept(row) for row in read_jsonl_rows(metrics_path(run), ReportError)] for run in runs}
    jobs = {run: portable_job(read_run_job(run / "job.yaml", ReportError)) for run in runs}
    written = []
    for run in runs:
        record = Path(records_dir) / run.name
        record.mkdir(parents=True, exist_ok=True)
        (record / "job.yaml").write_text(jobs[run])
        with gzip.open(record / RECORD_METRICS, "wt", encoding="utf-8") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows[run])
        written.append(record)
    return written
