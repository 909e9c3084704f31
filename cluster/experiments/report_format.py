"""How the report's tables are shown: numbers as text, markdown tables, CSV of dataclasses."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

MISSING = "—"  # a value the run did not log


def fixed(digits: int) -> Callable[[Any], str]:
    """A number with `digits` decimals (NaN and inf as such)."""
    return lambda value: f"{value:.{digits}f}" if math.isfinite(value) else str(value)


def general(value: float) -> str:
    """Four significant digits (NaN and inf as such)."""
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def plain(value: Any) -> str:
    return str(value)


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; a `|` inside a cell escaped."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|"] + [line(row) for row in rows]) + "\n"


def shown_columns(headers: Sequence[str], jobs: set[str], only: Sequence[str] | None) -> list[int]:
    """The columns to show: `only` those named (all when None), and "job" only when the runs come from more
    than one."""
    return [
        index
        for index, header in enumerate(headers)
        if (only is None or header in only) and (header != "job" or len(jobs) > 1)
    ]


def write_dataclass_csv(kind: type, rows: Sequence[Any], path: Path) -> None:
    """Every dataclass field at full precision for other tools (header: the field names); empty cell for
    None, "nan"/"inf" for non-finite values, tuples joined by ";"."""
    names = [f.name for f in fields(kind)]
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(names)
        for row in rows:
            values = [getattr(row, name) for name in names]
            writer.writerow(
                [
                    ";".join("" if item is None else str(item) for item in value)
                    if isinstance(value, tuple)
                    else ""
                    if value is None
                    else value
                    for value in values
                ]
            )
