"""`stableasync report`: compare finished runs in one table, plots and a self-contained HTML page.

Reads only what a run directory already holds (`job.yaml`, `metrics.jsonl`), so any run can be
compared after the fact, on any machine: standard library, PyYAML, and matplotlib (imported only when
plotting). No torch, no ray. This module writes the report and is its CLI; the reading, the numbers and
tables (every rule in `summarise`) and the plots are report_reading.py, report_tables.py and report_plots.py;
docs/report.md shows the command.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cluster.experiments.report_html import render_html
from cluster.experiments.report_plots import CURVES, plot_cells, plot_eval_by_lag, plot_runs
from cluster.experiments.report_reading import ReportError, load_run, unique_labels
from cluster.experiments.report_records import write_records
from cluster.experiments.report_tables import (
    TERMINAL_CELL_COLUMNS,
    TERMINAL_COLUMNS,
    RunSummary,
    cells_markdown_table,
    has_repeats,
    markdown_table,
    summarise,
    summarise_cells,
    write_cells_csv,
    write_csv,
)

# what the CLI, the sweep and the tests import from here, and the summary `write_report` returns
__all__ = [
    "ReportError",
    "RunSummary",
    "load_run",
    "print_tables",
    "run_cli",
    "summarise",
    "summarise_cells",
    "unique_labels",
    "write_report",
]


def write_report(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path = "report",
    target_reward: float | None = None,
    collapse_below: float | None = None,
    collapse_steps: int | None = None,
) -> list[RunSummary]:
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
    runs = unique_labels([load_run(path) for path in run_dirs])
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
    images = [
        *plot_runs(runs, summaries, out, target_reward),
        plot_cells(runs, out, target_reward),
        plot_eval_by_lag(summaries, out),
    ]
    (out / "report.html").write_text(render_html(summaries, cells, images, target_reward))
    return summaries


def run_cli(
    run_dirs: Sequence[str],
    out_dir: str,
    target_reward: float | None,
    collapse_below: float | None,
    collapse_steps: int | None,
    records_dir: str | None = None,
) -> int:
    """`stableasync report`: print the table, write the files (and with `records_dir`, each run's record);
    exit 2 naming the file that cannot be read."""
    import sys

    try:
        summaries = write_report(run_dirs, out_dir, target_reward, collapse_below, collapse_steps)
        records = write_records(run_dirs, records_dir) if records_dir is not None else []
    except ReportError as error:
        print(f"stableasync report: {error}", file=sys.stderr)
        return 2
    print_tables(summaries)
    out = Path(out_dir)
    print(
        f"\nwrote {out / 'report.html'} (self-contained), table.md, table.csv, cells.md, cells.csv and "
        f"{len(CURVES) + 3} PNGs in {out}"
    )
    if records:
        print(f"wrote {len(records)} run records (job.yaml, metrics.jsonl.gz) in {records_dir}")
    return 0


def print_tables(summaries: Sequence[RunSummary]) -> None:
    """The run table, then the table over seeds when some cell holds more than one run: the columns that tell
    runs apart and how each ended (the report's table.md and cells.md have every one)."""
    print(markdown_table(summaries, TERMINAL_COLUMNS), end="")
    cells = summarise_cells(summaries)
    if has_repeats(cells):
        print("\nover seeds, one row per job, stabilizer and max lag:\n")
        print(cells_markdown_table(cells, TERMINAL_CELL_COLUMNS), end="")
