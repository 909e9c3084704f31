"""`task.path` beyond JSONL: a Parquet file, a folder Hugging Face `datasets` reads (shards by split, or
`save_to_disk`'s output), and `hf:OWNER/NAME`; each row's errors name where it is, and the same task settings
serve every source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import main as cli_main
from cluster.job import validate_job
from tasks.base import TaskError, build_task
from tasks.config import DatasetConfig, GSM8KConfig

ROOT = Path(__file__).resolve().parents[3]
ROWS = [{"prompt": f"What is {n} + 1?", "answer": n + 1, "topic": "sums"} for n in range(6)]


def _table(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


def test_a_parquet_file_gives_the_rows_a_jsonl_file_does(tmp_path):
    jsonl, parquet = tmp_path / "mine.jsonl", tmp_path / "mine.parquet"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    _table(ROWS).to_parquet(str(parquet))
    from_jsonl, from_parquet = (build_task("dataset", DatasetConfig(path=str(path))) for path in (jsonl, parquet))
    assert (
        [p.problem_id for p in from_parquet.rows]
        == [p.problem_id for p in from_jsonl.rows]
        == [f"mine-{n:06d}" for n in range(1, 7)]
    )
    for a, b in zip(from_jsonl.rows, from_parquet.rows, strict=True):
        assert (a.question, a.answer, a.metadata) == (b.question, b.answer, b.metadata)
    assert len(build_task("dataset", DatasetConfig(path=str(parquet), max_rows=2)).rows) == 2


def test_a_parquet_rows_error_names_the_row_and_the_field(tmp_path):
    parquet = tmp_path / "broken.parquet"
    _table([{"question": "no prompt here", "answer": 1}]).to_parquet(str(parquet))
    with pytest.raises(TaskError, match=r"broken\.parquet row 1: field 'prompt' \(task\.prompt_field\) is missing"):
        build_task("dataset", DatasetConfig(path=str(parquet)))
    (tmp_path / "not.parquet").write_text("{}")
    with pytest.raises(TaskError, match=r"not\.parquet cannot be read as Parquet"):
        build_task("dataset", DatasetConfig(path=str(tmp_path / "not.parquet")))


def test_a_folder_of_shards_and_a_saved_dataset_give_the_split_asked_for(tmp_path):
    import datasets

    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    _table(ROWS[:4]).to_parquet(str(shards / "train-00000-of-00001.parquet"))
    _table(ROWS[4:]).to_parquet(str(shards / "test-00000-of-00001.parquet"))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": _table(ROWS[:4]), "test": _table(ROWS[4:])}).save_to_disk(str(saved))
    for folder in (tmp_path / "shards", saved):
        train = build_task("dataset", DatasetConfig(path=str(folder)))
        test = build_task("dataset", DatasetConfig(path=str(folder), split="test"))
        assert [p.metadata["gold"] for p in train.rows] == [1, 2, 3, 4]
        assert [p.metadata["gold"] for p in test.rows] == [5, 6]
        assert test.rows[0].problem_id == f"{folder.name}-test-000001"
    with pytest.raises(TaskError, match=r"has no split 'validation'.*'train', 'test'"):
        build_task("dataset", DatasetConfig(path=str(tmp_path / "shards"), split="validation"))
    with pytest.raises(TaskError, match=r"task\.split: .*saved has the splits train, test, not 'validation'"):
        build_task("dataset", DatasetConfig(path=str(saved), split="validation"))


def test_gsm8k_reads_its_rows_from_parquet_as_from_its_jsonl(tmp_path):
    source = ROOT / "tasks" / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in source.read_text().splitlines()[:5]]
    _table(rows).to_parquet(str(tmp_path / "test.parquet"))
    from_jsonl = build_task("gsm8k", GSM8KConfig(path=str(source), max_rows=5))
    from_parquet = build_task("gsm8k", GSM8KConfig(path=str(tmp_path / "test.parquet")))
    assert [(p.problem_id, p.answer) for p in from_parquet.rows] == [(p.problem_id, p.answer) for p in from_jsonl.rows]


def test_a_hub_dataset_neither_cached_nor_reachable_is_refused_naming_the_field(tmp_path):
    """Run where the Hub is out of reach (offline, an empty cache): the error says what to do."""
    code = (
        "from tasks.base import TaskError, build_task\n"
        "from tasks.config import DatasetConfig\n"
        "try:\n"
        "    build_task('dataset', DatasetConfig(path='hf:nobody/no-such-dataset', subset='main'))\n"
        "except TaskError as error:\n"
        "    print(error)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "task.path: hf:nobody/no-such-dataset (subset 'main', split 'train') is neither in the Hugging Face " in (
        out.stdout
    ), out.stdout + out.stderr
    assert "save it as a Parquet file" in out.stdout
    assert (
        validate_job({"task": {"name": "dataset", "path": "hf:openai/gsm8k", "subset": "main"}}).task.split == "train"
    )
    with pytest.raises(TaskError, match=r"hf:gsm8k is not a Hub dataset id \(hf:OWNER/NAME\)"):
        build_task("dataset", DatasetConfig(path="hf:gsm8k"))


def test_validate_reads_a_parquet_job_and_an_evaluation_set_on_its_test_split(tmp_path, capsys):
    shards = tmp_path / "mine" / "data"
    shards.mkdir(parents=True)
    _table(ROWS[:4]).to_parquet(str(shards / "train-00000-of-00001.parquet"))
    _table(ROWS[4:]).to_parquet(str(shards / "test-00000-of-00001.parquet"))
    _table(ROWS).to_parquet(str(tmp_path / "train.parquet"))
    job = tmp_path / "job.yaml"
    job.write_text(
        f"task: {{name: dataset, path: {tmp_path}/train.parquet, reward: exact}}\n"
        f"eval: {{every_steps: 5, sets: {{held: {{path: {tmp_path}/mine, split: test}}}}}}\n"
    )
    assert cli_main(["validate", str(job)]) == 0, capsys.readouterr().err
    assert f"6 rows of {tmp_path}/train.parquet" in capsys.readouterr().out
    from cluster.job import load_job
    from cluster.job.derived import evaluation_sets, job_task

    loaded = load_job(str(job))
    (_, held) = evaluation_sets(loaded, job_task(loaded))
    assert held.name == "held" and sorted(problem.answer for problem, _ in held.problems) == ["5", "6"]
