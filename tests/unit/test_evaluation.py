"""The fixed evaluation set: from the task's eval stream, or from held-out data named by eval.task_path."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.job import evaluation_set, job_task, validate_job

FIXTURE = Path(__file__).resolve().parents[2] / "tasks" / "fixtures" / "gsm8k_sample.jsonl"


def _set(job: dict):
    loaded = validate_job(job)
    return evaluation_set(loaded, job_task(loaded))


def test_no_evaluation_no_set():
    assert _set({"task": {"name": "arithmetic"}}) == []


def test_the_set_is_the_same_at_every_call_and_differs_from_training():
    job = {"task": {"name": "arithmetic"}, "eval": {"every_steps": 5, "num_problems": 6}}
    first, again = _set(job), _set(job)
    assert [p for p, _ in first] == [p for p, _ in again] and len(first) == 6
    assert all(p.problem_id.startswith("arithmetic-eval-") for p, _ in first)
    assert first[0][0].question in first[0][1][-1]["content"]  # the chat messages of each problem


def test_eval_task_path_takes_the_held_out_file(tmp_path):
    held_out = tmp_path / "test.jsonl"
    rows = FIXTURE.read_text().splitlines()[:2]
    held_out.write_text("\n".join(rows) + "\n")
    job = {"task": {"name": "gsm8k", "path": str(FIXTURE)},
           "eval": {"every_steps": 5, "num_problems": 64, "task_path": str(held_out)}}
    problems = [p for p, _ in _set(job)]
    assert sorted(p.question for p in problems) == sorted(json.loads(r)["question"].strip() for r in rows)
    assert all(p.problem_id.startswith("gsm8k-test-") for p in problems)  # the file's own row ids, not training's
