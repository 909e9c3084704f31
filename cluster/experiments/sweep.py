"""`stableasync sweep`: one job over a grid of stabilizers and lag bounds, then a report.

Every cell is the same job (same seed, so the same prompts and the same initial model) with only
`algorithm.stabilizer` and `async.max_lag` changed, run one after another on the current Ray cluster
(with `fixed_lag`, each lag is exact: `async.fixed_lag` and `async.max_lag` both set to it).
With `seeds`, the whole grid runs once per job seed (prompt order, sampling, warm-up data), one seed
after another, so a stopped sweep still holds complete grids; the report then adds a table over the
seeds of each cell. A cell that fails (a numerical stop, a crash) is recorded and the sweep goes on: a
collapse is a result, not an error.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.job import Job, JobValidationError, validate_job
from cluster.run.stopping import JobStopped, StopRequest

log = logging.getLogger("stableasync")


@dataclass(frozen=True)
class Cell:
    stabilizer: str
    max_lag: int
    job: Job
    run_name: str


def _repeated(values: list[Any]) -> list[Any]:
    return sorted({value for value in values if values.count(value) > 1}, key=str)


def grid(
    job: Job,
    stabilizers: list[str],
    max_lags: list[int],
    out_dir: Path,
    overrides: dict[str, dict[str, Any]] | None = None,
    seeds: list[int] | None = None,
    fixed_lag: bool = False,
) -> list[Cell]:
    """Every (seed, stabilizer, max_lag) variant of `job`, validated up front: a bad cell stops the sweep
    before anything runs, with the cell named. `overrides` are section updates applied to every cell.
    `seeds` None: the job's own seed, and run names without one (`tis_seq-lag2`); else each seed in turn
    (`tis_seq-lag2-seed1`); with `fixed_lag` each lag is a fixed lag (`tis_seq-fixed16`)."""
    problems = [
        f"{what} {value!r} is listed twice"
        for what, values in (("stabilizer", stabilizers), ("max_lag", max_lags), ("seed", seeds or []))
        for value in _repeated(values)
    ]
    if problems:
        raise ValueError("sweep grid: " + "; ".join(problems))
    base = job.model_dump(mode="json", by_alias=True)
    for section, values in (overrides or {}).items():
        base[section] = {**base[section], **values}
    cells, errors = [], []
    for seed in seeds if seeds is not None else [job.seed]:
        for stabilizer in stabilizers:
            for max_lag in max_lags:
                lag_name = f"fixed{max_lag}" if fixed_lag else f"lag{max_lag}"
                run_name = f"{stabilizer}-{lag_name}" + ("" if seeds is None else f"-seed{seed}")
                data = {
                    **base,
                    "seed": seed,
                    "algorithm": {**base["algorithm"], "stabilizer": {"name": stabilizer}},
                    "async": {**base["async"], "max_lag": max_lag, "fixed_lag": max_lag if fixed_lag else None},
                    "logging": {**base["logging"], "run_dir": str(out_dir / "runs"), "run_name": run_name},
                }
                where = f"{stabilizer} {'fixed_lag' if fixed_lag else 'max_lag'} {max_lag}"
                where += "" if seeds is None else f" seed {seed}"
                try:
                    cells.append(Cell(stabilizer, max_lag, validate_job(data, where), run_name))
                except JobValidationError as error:
                    errors.append(str(error))
    if errors:
        raise ValueError("sweep cells that are not valid jobs:\n" + "\n".join(errors))
    return cells


def sweep(
    job: Job,
    stabilizers: list[str],
    max_lags: list[int],
    out_dir: Path,
    overrides: dict[str, dict[str, Any]] | None = None,
    target_reward: float | None = None,
    stop: StopRequest | None = None,
    seeds: list[int] | None = None,
    fixed_lag: bool = False,
) -> list[Any]:
    """Run every cell, then write the report (table, plots, HTML) over the runs into `out_dir`.

    A cell that `stop` stops raises `JobStopped`: the sweep ends there, with no report.
    """
    from cluster.experiments.report import write_report
    from cluster.run.driver import run_job

    cells = grid(job, stabilizers, max_lags, out_dir, overrides, seeds, fixed_lag)
    run_dirs = []
    for n, cell in enumerate(cells, 1):
        run_dir = out_dir / "runs" / cell.run_name
        if run_dir.exists():
            raise FileExistsError(f"{run_dir} exists: give the sweep a new --out directory")
        log.info("sweep cell %d/%d: %s", n, len(cells), cell.run_name)
        try:
            run_job(cell.job, stop=stop)
        except JobStopped:
            raise
        except Exception:
            run_dir.mkdir(parents=True, exist_ok=True)  # a cell can fail before its run directory exists
            (run_dir / "failed.txt").write_text(traceback.format_exc())
            log.warning("sweep cell %s stopped early; see %s", cell.run_name, run_dir / "failed.txt")
        if (run_dir / "metrics.jsonl").exists():
            run_dirs.append(run_dir)
        else:  # stopped before its first metric row: nothing to plot, its failed.txt says why
            log.warning("sweep cell %s logged no metrics; left out of the report", cell.run_name)
    return write_report(run_dirs, out_dir, target_reward=target_reward)
