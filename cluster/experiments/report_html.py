"""The self-contained HTML page of `stableasync report`: the tables of report_tables.py and the plots inline."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from cluster.experiments.report_reading import MOVING_AVERAGE_STEPS
from cluster.experiments.report_tables import (
    CELL_COLUMNS,
    COLUMNS,
    HELD_OUT_DROP_FRACTION,
    REWARD_DROP_FRACTION,
    CellSummary,
    RunSummary,
    has_repeats,
    row_cells,
)


def _html_table(header: Sequence[str], rows: Sequence[tuple[Sequence[str], bool]]) -> str:
    """A table of (cells, shaded) rows; shaded rows (a collapse) get the `collapsed` class."""
    esc = html.escape
    head = "".join(f"<th>{esc(name)}</th>" for name in header)
    body = "".join(
        "<tr"
        + (' class="collapsed"' if shaded else "")
        + ">"
        + "".join(f"<td>{esc(cell)}</td>" for cell in cells)
        + "</tr>\n"
        for cells, shaded in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>\n"


def _cells_html(cells: Sequence[CellSummary]) -> str:
    """The table over each cell's runs, when some cell has more than one (else it repeats the run table)."""
    if not has_repeats(cells):
        return ""
    table = _html_table(
        [name for name, _ in CELL_COLUMNS],
        [([show(cell) for _, show in CELL_COLUMNS], cell.collapsed + cell.held_out_fell > 0) for cell in cells],
    )
    return (
        f"<h2>Over seeds: one row per stabilizer and max lag</h2>\n<p>Means and min–max over each cell's "
        f"runs; medians are the middle run's value. A row is shaded when any of its runs collapsed or its "
        f"held-out solved share fell.</p>\n"
        f"{table}<h2>Every run</h2>\n"
    )


def render_html(
    summaries: Sequence[RunSummary], cells: Sequence[CellSummary], images: Sequence[Path], target_reward: float | None
) -> str:
    """One self-contained page: the tables and every PNG inline as base64 data URIs (no external
    files, scripts or network), so it can be mailed or attached to an issue as is."""
    esc = html.escape
    table = _html_table(
        [name for name, _, _ in COLUMNS], [(row_cells(s), s.collapsed or bool(s.held_out_fell)) for s in summaries]
    )
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
        f"Held-out fell (shaded too): the last eval/solved below {HELD_OUT_DROP_FRACTION:.0%} of the best one. "
        "Thresholds per run: "
        + ", ".join(
            f"{esc(s.label)}: ESS &lt; {'off' if s.ess_collapse_below is None else f'{s.ess_collapse_below:g}'} "
            f"for {s.ess_collapse_steps}"
            for s in summaries
        )
        + "."
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
{len(summaries)} run director{"y" if len(summaries) == 1 else "ies"}:</p>
<ul>{sources}</ul>
<p>{rules}</p>
{_cells_html(cells)}{table}{figures}</body></html>
"""
