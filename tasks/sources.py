"""Where a task's rows come from (`task.path`): a JSONL file, a Parquet file (verl's format), a folder a Hugging
Face `datasets` call reads (Parquet or JSON shards, a Hub dataset's snapshot, or `save_to_disk`'s output), or a
Hub dataset as `hf:OWNER/NAME`, read from the local cache when the Hub is out of reach.

Each row comes with where it is, for errors a person can act on ("train.parquet row 12"), and a stable id for
the problem it becomes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.base import TaskError, read_jsonl
from tasks.config import HUB_PREFIX, is_hub_dataset

PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class SourceRow:
    where: str  # "data.jsonl:12", "train.parquet row 12", "hf:openai/gsm8k[train] row 12"
    name: str  # the file's name without its suffix, or the dataset's and split's ("gsm8k-train"): ids start with it
    number: int  # the row's line in a JSONL file, else its place from 1
    row: dict[str, Any]


def source_problem(path: str) -> str | None:
    """What is wrong with `path` as a source of rows before reading it (None: nothing seen): a file or folder that
    is not there. A Hub id is checked when it is read."""
    if is_hub_dataset(path):
        return None if "/" in path[len(HUB_PREFIX) :] else f"{path} is not a Hub dataset id (hf:OWNER/NAME)"
    if not Path(path).expanduser().exists():
        return f"no data file at {Path(path).expanduser()}"
    return None


def source_rows(path: str, split: str, subset: str | None, max_rows: int | None) -> Iterator[SourceRow]:
    """The rows of `path` (see the module's docstring), the first `max_rows` of them (None: all); `split` and
    `subset` (a Hub dataset's configuration name) choose the table of a folder or Hub dataset."""
    problem = source_problem(path)
    if problem is not None:
        raise TaskError(f"task.path: {problem}")
    if is_hub_dataset(path):
        return _dataset_rows(path, _hub_dataset(path[len(HUB_PREFIX) :], split, subset), split, max_rows)
    local = Path(path).expanduser()
    if local.is_dir():
        return _dataset_rows(path, _folder_dataset(local, split, subset), split, max_rows)
    if local.suffix == ".parquet":
        return _parquet_rows(local, max_rows)
    rows = read_jsonl(local, max_rows)
    return (SourceRow(f"{local}:{line}", local.stem, line, row) for line, row in rows)


def _parquet_rows(path: Path, max_rows: int | None) -> Iterator[SourceRow]:
    import pyarrow
    import pyarrow.parquet as parquet

    try:
        table = parquet.ParquetFile(path)
        batches = table.iter_batches(batch_size=PARQUET_BATCH_ROWS)
        rows = (row for batch in batches for row in batch.to_pylist())
        for number, row in enumerate(itertools.islice(rows, max_rows), start=1):
            yield SourceRow(f"{path} row {number}", path.stem, number, row)
    except (OSError, pyarrow.ArrowException) as problem:  # not a Parquet file, or cut short
        raise TaskError(f"task.path: {path} cannot be read as Parquet ({problem})") from None


def _folder_dataset(folder: Path, split: str, subset: str | None) -> Any:
    """A folder's table: `save_to_disk`'s output (a dataset, or a dict of splits), else what `load_dataset` reads
    from it (Parquet, JSON or CSV files, named by split or not)."""
    import datasets

    saved = any((folder / marker).is_file() for marker in ("dataset_dict.json", "state.json"))
    try:
        if not saved:
            return datasets.load_dataset(str(folder), subset, split=split)
        loaded = datasets.load_from_disk(str(folder))
    except (ValueError, FileNotFoundError, datasets.exceptions.DatasetsError) as problem:
        raise TaskError(f"task.path: {folder} has no split {split!r} that datasets can read ({problem})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise TaskError(f"task.split: {folder} has the splits {', '.join(loaded)}, not {split!r}")
        return loaded[split]
    return loaded


def _hub_dataset(name: str, split: str, subset: str | None) -> Any:
    import datasets

    try:
        return datasets.load_dataset(name, subset, split=split)
    except (ValueError, OSError, datasets.exceptions.DatasetsError) as problem:
        raise TaskError(
            f"task.path: {HUB_PREFIX}{name} (subset {subset!r}, split {split!r}) is neither in the Hugging Face "
            f"cache (HF_HOME) nor reachable ({type(problem).__name__}: {problem}); load it once where the Hub is "
            "reachable, or save it as a Parquet file"
        ) from None


def _dataset_rows(path: str, table: Any, split: str, max_rows: int | None) -> Iterator[SourceRow]:
    stem = Path(path.removeprefix(HUB_PREFIX)).name
    rows = table if max_rows is None else table.select(range(min(max_rows, len(table))))
    for number, row in enumerate(rows, start=1):
        yield SourceRow(f"{path}[{split}] row {number}", f"{stem}-{split}", number, dict(row))
