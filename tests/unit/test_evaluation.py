"""The fixed evaluation set (from the task's eval stream, or from held-out data named by eval.task_path), and how
an evaluation's answers are scored and logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def _answers(problems, texts: list[list[str]], version: int):
    """One generated group per problem, with its answers (answer j of problem i is i + 1 tokens long)."""
    from actors.generator import GeneratedGroup

    return [GeneratedGroup(-1 - i, problem.problem_id, [1, 2],
                           [{"completion_ids": [7] * (i + 1), "text": text} for text in answers],
                           version_start=version, version_end=version)
            for i, (problem, answers) in enumerate(zip(problems, texts))]


def _evaluator(tmp_path, problems, samples_per_problem: int = 1):
    from cluster.run.evaluation import Evaluator
    from cluster.job import section_config
    from cluster.telemetry.metrics import MetricSink
    from tasks.config import TASK_CONFIGS
    from tasks.scoring import ScorePool

    job = validate_job({"task": {"name": "arithmetic"}})
    scorer = ScorePool("arithmetic", section_config(job.task, TASK_CONFIGS))
    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=False)
    return Evaluator(problems, 1.0, samples_per_problem, 0, scorer, sink), scorer, sink


def test_an_evaluation_is_scored_into_its_own_row_and_answers_from_other_weights_are_skipped(tmp_path, caplog):
    """The row of step 5 holds the verifier's view of the answers: 2 of 4 correct (1.0 each), one well-formed
    wrong (0.1), one without an answer (0.0). Answers a generator gave with step 3's weights when step 5 was
    asked for (restarted before it loaded them) are not step 5's evaluation: an alert, and no row."""
    from cluster.run.evaluation import RunningEvaluation

    problems = _set({"task": {"name": "arithmetic"}, "eval": {"every_steps": 5, "num_problems": 4}})
    evaluator, scorer, sink = _evaluator(tmp_path, problems)
    gold = [problem.answer for problem, _ in problems]
    texts = [[f"<answer>{gold[0]}</answer>"], [f"so <answer>{gold[1]}</answer>"],
             [f"<answer>{int(gold[2]) + 1}</answer>"], ["no idea"]]
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
    assert row["eval/solved"] == row["eval/pass_at_k"] == 0.5 and row["eval/reward_mean"] == (1.0 + 1.0 + 0.1 + 0.0) / 4
    assert row["eval/response_len"] == 2.5 and row["eval/score_errors"] == 0 and row["eval/seconds"] > 0
    assert "evaluation at step 5: 2 of 4 problems solved, 50.0% of 4 answers correct, mean reward 0.525" in caplog.text
    assert "ALERT evaluation skipped: step 6: generator 1 still had the weights of step 3" in caplog.text


def test_several_answers_per_problem_give_the_mean_over_answers_and_pass_at_k(tmp_path):
    """Two sampled answers per problem: eval/solved counts every answer alike (avg@2: 3 of 8 correct), and
    eval/pass_at_k counts the problems with a correct one among theirs (2 of 4)."""
    from cluster.run.evaluation import RunningEvaluation

    problems = _set({"task": {"name": "arithmetic"},
                     "eval": {"every_steps": 5, "num_problems": 4, "samples_per_problem": 2, "temperature": 1.0}})
    evaluator, scorer, sink = _evaluator(tmp_path, problems, samples_per_problem=2)
    gold = [int(problem.answer) for problem, _ in problems]
    texts = [[f"<answer>{gold[0]}</answer>", f"<answer>{gold[0] + 1}</answer>"],  # one of two right
             [f"<answer>{gold[1] + 1}</answer>", "no idea"],
             [f"<answer>{gold[2]}</answer>", f"= <answer>{gold[2]}</answer>"],  # both right
             ["?", "??"]]
    try:
        evaluator.record(RunningEvaluation(index=0, step=5, sent=0.0), _answers([p for p, _ in problems], texts, 5))
    finally:
        scorer.close()
        sink.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["eval/solved"] == 3 / 8 and row["eval/pass_at_k"] == 2 / 4 and row["eval/problems"] == 4
    assert row["eval/reward_mean"] == pytest.approx((1.0 + 0.1 + 0.1 + 0.0 + 1.0 + 1.0 + 0.0 + 0.0) / 8)


def test_several_greedy_answers_are_refused():
    from cluster.job import JobValidationError

    with pytest.raises(JobValidationError, match=r"eval.samples_per_problem.*eval.temperature > 0"):
        validate_job({"task": {"name": "arithmetic"}, "eval": {"every_steps": 5, "samples_per_problem": 4}})
    job = validate_job({"task": {"name": "arithmetic"},
                        "eval": {"every_steps": 5, "samples_per_problem": 4, "temperature": 0.6}})
    assert job.eval.samples_per_problem == 4


# ---- where an evaluation runs, and what a resume does with one in flight at its checkpoint ----


def test_an_evaluation_goes_to_an_idle_generator_else_to_the_one_sent_its_call_first():
    from cluster.run.evaluation import evaluation_generator

    assert evaluation_generator([0, 1, 2], busy_in_send_order=[0, 2]) == 1
    assert evaluation_generator([0, 1, 2, 3], busy_in_send_order=[0]) == 1  # the lowest idle one
    assert evaluation_generator([0, 1, 2], busy_in_send_order=[2, 0, 1]) == 2  # all busy: its call is oldest
    assert evaluation_generator([4, 7], busy_in_send_order=[]) == 4  # elastic indices need not start at 0
    assert evaluation_generator([4, 7], busy_in_send_order=[3, 7, 4]) == 7  # 3 left the job since its call
    assert evaluation_generator([], busy_in_send_order=[]) is None  # every generator left an elastic job


def test_an_evaluation_due_when_no_generator_is_left_is_skipped_with_an_alert(tmp_path, caplog):
    """Every generator of an elastic job has left when step 7 is to be evaluated: an alert naming the step, and the
    loop goes on (no wait, nothing in flight, no row), where picking a generator from none used to end the run."""
    problems = _set({"task": {"name": "arithmetic"}, "eval": {"every_steps": 7, "num_problems": 2}})
    evaluator, scorer, sink = _evaluator(tmp_path, problems)
    try:
        with caplog.at_level("WARNING", logger="stableasync"):
            assert evaluator.start({}, busy_in_send_order=[3], step=7) == 0.0
    finally:
        scorer.close()
        sink.close()
    assert [r.getMessage() for r in caplog.records] == [
        "ALERT evaluation skipped: step 7: no generator is left to answer it (every one left the elastic job); "
        "the next one is at its step"]
    assert evaluator.steps_running() == [] and (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_resume_answers_again_its_own_steps_evaluation_and_warns_of_an_earlier_one(caplog):
    """A checkpoint of step 4 taken while step 4 was being evaluated: the resume evaluates step 4 again on the
    restored weights. Taken while step 3 was (eval every 3 steps, checkpoints every 4): step 3's weights are
    gone, so its evaluation is lost, and the log says so."""
    from cluster.run.evaluation import evaluate_again_on_resume

    with caplog.at_level("INFO", logger="stableasync"):
        assert evaluate_again_on_resume([4], restored_step=4)
        assert "evaluating step 4 again" in caplog.text and "lost" not in caplog.text
        caplog.clear()
        assert not evaluate_again_on_resume([3], restored_step=4)
        assert ("the evaluation of step 3 was in flight at the checkpoint of step 4 and is lost: the weights of "
                "step 3 are not kept") in caplog.text
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        caplog.clear()
        assert not evaluate_again_on_resume([], restored_step=4) and not caplog.records
