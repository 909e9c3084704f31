"""`stableasync report --records`: a run cut to what the report reads reports the same as the run itself."""

from __future__ import annotations

import csv
import gzip
import json
import shutil

import pytest
import yaml

from cluster.cli import main
from cluster.experiments.report import ReportError
from cluster.experiments.report_records import RECORD_KEYS, write_records
from cluster.job import load_job
from tests.fixtures import BENCH_ASYNC, metric_rows

RUNS = [BENCH_ASYNC / "lag0", BENCH_ASYNC / "lag1"]


def _table(out):
    with (out / "table.csv").open() as table:
        return [{key: value for key, value in row.items() if key != "run_dir"} for row in csv.DictReader(table)]


def test_records_report_what_their_runs_report(tmp_path, capsys):
    """Two real runs (evaluation rows, SFT rows, lag histograms): the report of their records matches theirs
    in every column but the folder, and the records hold only the report's keys."""
    records = tmp_path / "records"
    assert main(["report", *map(str, RUNS), "--out", str(tmp_path / "direct"), "--records", str(records)]) == 0
    assert f"wrote 2 run records (job.yaml, metrics.jsonl.gz) in {records}" in capsys.readouterr().out
    assert sorted(path.name for path in (records / "lag0").iterdir()) == ["job.yaml", "metrics.jsonl.gz"]
    assert main(["report", str(records / "lag0"), str(records / "lag1"), "--out", str(tmp_path / "again")]) == 0
    assert _table(tmp_path / "again") == _table(tmp_path / "direct")
    for run in RUNS:
        with gzip.open(records / run.name / "metrics.jsonl.gz", "rt") as kept:
            rows = [json.loads(line) for line in kept]
        original = metric_rows(run)
        assert len(rows) == len(original)  # every row, evaluations and SFT rows included
        assert {key for row in rows for key in row} < {key for row in original for key in row}
        assert all(key in RECORD_KEYS or key.startswith("eval/") for row in rows for key in row)


def test_a_records_job_names_no_folder_of_its_machine_and_runs_again(tmp_path):
    """The job.yaml of a record is its run's but `logging.run_dir` (a folder of the machine it ran on), which
    takes the default; it is a valid job, and recording the record again leaves it as it is."""
    first = write_records(RUNS, tmp_path / "one")
    again = write_records(first, tmp_path / "two")
    for run, record, rerecord in zip(RUNS, first, again):
        ran, kept = (yaml.safe_load((folder / "job.yaml").read_text()) for folder in (run, record))
        assert ran["logging"]["run_dir"] == "/tmp/rec-async"
        assert "/tmp/rec-async" not in (record / "job.yaml").read_text()
        assert kept["logging"] == {**ran["logging"], "run_dir": "runs"}
        assert {key: value for key, value in kept.items() if key != "logging"} == {
            key: value for key, value in ran.items() if key != "logging"
        }
        assert load_job(record / "job.yaml").logging.run_dir == "runs"
        assert (rerecord / "job.yaml").read_bytes() == (record / "job.yaml").read_bytes()


def test_a_record_of_a_record_and_a_rewritten_record_read_the_same(tmp_path):
    first = write_records(RUNS, tmp_path / "one")
    again = write_records(first, tmp_path / "two")  # a record is a run to the report, so it records again
    write_records(RUNS, tmp_path / "one")  # replacing an earlier record
    for a, b in zip(first, again):
        with gzip.open(a / "metrics.jsonl.gz", "rt") as left, gzip.open(b / "metrics.jsonl.gz", "rt") as right:
            assert left.read() == right.read()


def test_runs_sharing_a_folder_name_or_a_record_on_its_own_run_are_refused(tmp_path):
    other = tmp_path / "elsewhere" / "lag0"
    shutil.copytree(RUNS[0], other)
    with pytest.raises(ReportError, match="two runs named 'lag0'"):
        write_records([RUNS[0], other], tmp_path / "records")
    assert not (tmp_path / "records").exists()  # refused before anything is written
    with pytest.raises(ReportError, match="would replace the run itself"):
        write_records([other], tmp_path / "elsewhere")
    with pytest.raises(ReportError, match="holds a run"):  # another run's folder of the same name
        write_records([RUNS[0]], tmp_path / "elsewhere")
    assert (other / "metrics.jsonl").read_bytes() == (RUNS[0] / "metrics.jsonl").read_bytes()


def test_a_record_cut_short_is_named(tmp_path, capsys):
    (record,) = write_records([RUNS[0]], tmp_path / "records")
    data = (record / "metrics.jsonl.gz").read_bytes()
    (record / "metrics.jsonl.gz").write_bytes(data[: len(data) // 2])
    assert main(["report", str(record), "--out", str(tmp_path / "out")]) == 2
    assert f"{record / 'metrics.jsonl.gz'}: cannot be read" in capsys.readouterr().err
