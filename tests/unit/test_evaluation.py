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


# ---- scoring and logging an evaluation's answers (Evaluator.record: no Ray, the real verifier workers) ----


def _answers(problems, texts: list[str], version: int):
    from actors.generator import GeneratedGroup

    return [GeneratedGroup(-1 - i, problem.problem_id, [1, 2], [{"completion_ids": [7] * (i + 1), "text": text}],
                           version_start=version, version_end=version)
            for i, (problem, text) in enumerate(zip(problems, texts))]


def _evaluator(tmp_path, problems):
    from cluster.evaluation import Evaluator
    from cluster.job import section_config
    from cluster.metrics import MetricSink
    from tasks.config import TASK_CONFIGS
    from tasks.scoring import ScorePool

    job = validate_job({"task": {"name": "arithmetic"}})
    scorer = ScorePool("arithmetic", section_config(job.task, TASK_CONFIGS))
    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=False)
    return Evaluator(problems, 0.0, 0, scorer, sink), scorer, sink


def test_an_evaluation_is_scored_into_its_own_row_and_answers_from_other_weights_are_skipped(tmp_path, caplog):
    """The row of step 5 holds the verifier's view of the answers: 2 of 4 correct (1.0 each), one well-formed
    wrong (0.1), one without an answer (0.0). Answers a generator gave with step 3's weights when step 5 was
    asked for (restarted before it loaded them) are not step 5's evaluation: an alert, and no row."""
    from cluster.evaluation import RunningEvaluation

    problems = _set({"task": {"name": "arithmetic"}, "eval": {"every_steps": 5, "num_problems": 4}})
    evaluator, scorer, sink = _evaluator(tmp_path, problems)
    gold = [problem.answer for problem, _ in problems]
    texts = [f"<answer>{gold[0]}</answer>", f"so <answer>{gold[1]}</answer>", f"<answer>{int(gold[2]) + 1}</answer>",
             "no idea"]
    try:
        with caplog.at_level("INFO", logger="stableasync"):
            evaluator.record(RunningEvaluation(index=1, step=5, sent=0.0), _answers([p for p, _ in problems], texts, 5))
            evaluator.record(RunningEvaluation(index=1, step=6, sent=0.0), _answers([p for p, _ in problems], texts, 3))
    finally:
        scorer.close()
        sink.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["train/step"] == 5 and row["eval/policy_version"] == 5 and row["eval/problems"] == 4
    assert row["eval/solved"] == 0.5 and row["eval/reward_mean"] == (1.0 + 1.0 + 0.1 + 0.0) / 4
    assert row["eval/response_len"] == 2.5 and row["eval/score_errors"] == 0 and row["eval/seconds"] > 0
    assert "evaluation at step 5: 2 of 4 problems solved, mean reward 0.525" in caplog.text
    assert "ALERT evaluation skipped: step 6: generator 1 still had the weights of step 3" in caplog.text
