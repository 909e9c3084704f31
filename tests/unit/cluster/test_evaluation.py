"""The fixed evaluation set (from the task's eval stream, or from held-out data named by eval.task_path), and how
an evaluation's answers are scored and logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.job import evaluation_set, job_task, validate_job

FIXTURE = Path(__file__).resolve().parents[3] / "tasks" / "fixtures" / "gsm8k_sample.jsonl"


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
    job = {
        "task": {"name": "gsm8k", "path": str(FIXTURE)},
        "eval": {"every_steps": 5, "num_problems": 64, "task_path": str(held_out)},
    }
    problems = [p for p, _ in _set(job)]
    assert sorted(p.question for p in problems) == sorted(json.loads(r)["question"].strip() for r in rows)
    assert all(p.problem_id.startswith("gsm8k-test-") for p in problems)  # the file's own row ids, not training's


# ---- scoring and logging an evaluation's answers (Evaluator.record: no Ray, the real verifier workers) ----


def _answers(problems, texts: list[list[str]], version: int):
    """One generated group per problem, with its answers (answer j of problem i is i + 1 tokens long)."""
    from actors.generator import GeneratedGroup

    return [
        GeneratedGroup(
            -1 - i,
            problem.problem_id,
            [1, 2],
            [{"completion_ids": [7] * (i + 1), "text": text} for text in answers],
            version_start=version,
            version_end=version,
        )
        for i, (problem, answers) in enumerate(zip(problems, texts))
    ]


def _evaluator(tmp_path, problems, samples_per_problem: int = 1):
    """An evaluator of the unnamed set `problems` of an arithmetic job, sampled at temperature 1."""
    from cluster.job import EvaluationSet, section_config
    from cluster.run.evaluation import Evaluator
    from cluster.telemetry.metrics import MetricSink
    from tasks.config import TASK_CONFIGS
    from tasks.scoring import ScorePool

    job = validate_job({"task": {"name": "arithmetic"}})
    config = section_config(job.task, TASK_CONFIGS)
    scorer = ScorePool("arithmetic", config)
    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=False)
    sets = [EvaluationSet(None, problems, 1.0, samples_per_problem, "arithmetic", config)]
    return Evaluator(sets, job, scorer, sink), scorer, sink


def test_an_evaluation_is_scored_into_its_own_row_and_answers_from_other_weights_are_skipped(tmp_path, caplog):
    """The row of step 5 holds the verifier's view of the answers: 2 of 4 correct (1.0 each), one well-formed
    wrong (0.1), one without an answer (0.0). Answers a generator gave with step 3's weights when step 5 was
    asked for (restarted before it loaded them) are not step 5's evaluation: an alert, and no row."""
    from cluster.run.evaluation import RunningEvaluation

    problems = _set({"task": {"name": "arithmetic"}, "eval": {"every_steps": 5, "num_problems": 4}})
    evaluator, scorer, sink = _evaluator(tmp_path, problems)
    gold = [problem.answer for problem, _ in problems]
    texts = [
        [f"<answer>{gold[0]}</answer>"],
        [f"so <answer>{gold[1]}</answer>"],
        [f"<answer>{int(gold[2]) + 1}</answer>"],
        ["no idea"],
    ]
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
    assert "ALERT evaluation skipped: step 6: generator 1 answered with the weights of step 3" in caplog.text


def test_an_evaluation_with_any_token_from_the_next_weights_is_skipped(tmp_path, caplog):
    """A streaming generator that loaded step 6's weights while answering step 5's evaluation: the first group
    is all step 5, a later one ends at 6. Not step 5's evaluation: an alert naming both, and no row."""
    from cluster.run.evaluation import RunningEvaluation

    problems = _set({"task": {"name": "arithmetic"}, "eval": {"every_steps": 5, "num_problems": 3}})
    evaluator, scorer, sink = _evaluator(tmp_path, problems)
    groups = _answers([p for p, _ in problems], [["<answer>1</answer>"]] * 3, 5)
    groups[2].version_end = 6
    try:
        with caplog.at_level("INFO", logger="stableasync"):
            evaluator.record(RunningEvaluation(index=0, step=5, sent=0.0), groups)
    finally:
        scorer.close()
        sink.close()
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()
    assert "ALERT evaluation skipped: step 5: generator 0 answered with the weights of steps 5, 6" in caplog.text


def test_several_answers_per_problem_give_the_mean_over_answers_and_pass_at_k(tmp_path):
    """Two sampled answers per problem: eval/solved counts every answer alike (avg@2: 3 of 8 correct), and
    eval/pass_at_k counts the problems with a correct one among theirs (2 of 4)."""
    from cluster.run.evaluation import RunningEvaluation

    problems = _set(
        {
            "task": {"name": "arithmetic"},
            "eval": {"every_steps": 5, "num_problems": 4, "samples_per_problem": 2, "temperature": 1.0},
        }
    )
    evaluator, scorer, sink = _evaluator(tmp_path, problems, samples_per_problem=2)
    gold = [int(problem.answer) for problem, _ in problems]
    texts = [
        [f"<answer>{gold[0]}</answer>", f"<answer>{gold[0] + 1}</answer>"],  # one of two right
        [f"<answer>{gold[1] + 1}</answer>", "no idea"],
        [f"<answer>{gold[2]}</answer>", f"= <answer>{gold[2]}</answer>"],  # both right
        ["?", "??"],
    ]
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
    job = validate_job(
        {"task": {"name": "arithmetic"}, "eval": {"every_steps": 5, "samples_per_problem": 4, "temperature": 0.6}}
    )
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
        "the next one is at its step"
    ]
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
        assert (
            "the evaluation of step 3 was in flight at the checkpoint of step 4 and is lost: the weights of "
            "step 3 are not kept"
        ) in caplog.text
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        caplog.clear()
        assert not evaluate_again_on_resume([], restored_step=4) and not caplog.records


# ---- named evaluation sets (eval.sets): schema, reading, per-set rows ----

GSM8K_TEST = Path(__file__).resolve().parents[3] / "tasks" / "data" / "gsm8k" / "test.jsonl"


def _errors(job: dict) -> dict[str, str]:
    from cluster.job import JobValidationError

    with pytest.raises(JobValidationError) as raised:
        validate_job(job)
    return {error.path: error.message for error in raised.value.errors}


def _math_file(tmp_path, rows: list[dict]) -> str:
    """A MATH-500 / AIME style file: {problem, answer} rows."""
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_a_bad_eval_set_is_refused_naming_its_field():
    """Every problem of every set at once, each under eval.sets.NAME: a name that cannot be a metric key or is the
    unnamed set's, an unknown field, a file format the job's task cannot give, a field the format lacks, and
    several greedy answers (from the set's own samples, or inherited from eval.samples_per_problem)."""
    errors = _errors(
        {
            "task": {"name": "arithmetic"},
            "eval": {
                "samples_per_problem": 2,
                "temperature": 0.5,
                "sets": {
                    "a/b": {"path": "x.jsonl", "task": "gsm8k"},
                    "default": {"path": "x.jsonl", "task": "gsm8k"},
                    "typo": {"path": "x.jsonl", "task": "gsm8k", "num_problem": 5},
                    "no_task": {"path": "x.jsonl"},
                    "fields": {"path": "x.jsonl", "task": "gsm8k", "prompt_field": "problem"},
                    "greedy": {"path": "x.jsonl", "task": "dataset", "samples_per_problem": 4, "temperature": 0},
                    "inherits": {"path": "x.jsonl", "task": "dataset", "temperature": 0},
                },
            },
        }
    )
    assert "letters, digits, _ and -" in errors["eval.sets.a/b"]
    assert "'default' names the unnamed set" in errors["eval.sets.default"]
    assert "Extra inputs are not permitted" in errors["eval.sets.typo.num_problem"]
    assert "required: the job's task 'arithmetic' reads no data file" in errors["eval.sets.no_task.task"]
    assert errors["eval.sets.fields.prompt_field"] == (
        "the 'gsm8k' format has no prompt_field; only dataset sets read one"
    )
    assert "4 greedy answers" in errors["eval.sets.greedy.samples_per_problem"]
    assert "2 greedy answers" in errors["eval.sets.inherits.temperature"]
    assert len(errors) == 7, errors
    with pytest.raises(Exception, match="Input should be 'gsm8k' or 'dataset'"):
        validate_job({"task": {"name": "arithmetic"}, "eval": {"sets": {"x": {"path": "x", "task": "countdown"}}}})


def test_a_set_defaults_to_the_eval_section_and_every_row_of_its_file(tmp_path):
    """A gsm8k set of an arithmetic job: every row of the file unless num_problems, sampled like the eval section
    unless the set says otherwise, the same problems at each call; a dataset set reads the fields it names."""
    from cluster.job import evaluation_sets

    math = _math_file(
        tmp_path,
        [{"problem": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"}, {"problem": "What is 2^10?", "answer": 1024}],
    )
    job = validate_job(
        {
            "task": {"name": "arithmetic"},
            "eval": {
                "every_steps": 5,
                "num_problems": 3,
                "temperature": 0.7,
                "samples_per_problem": 2,
                "sets": {
                    "gsm8k_test": {
                        "path": str(GSM8K_TEST),
                        "task": "gsm8k",
                        "num_problems": 4,
                        "temperature": 0.0,
                        "samples_per_problem": 1,
                    },
                    "math": {"path": math, "task": "dataset", "prompt_field": "problem"},
                },
            },
        }
    )
    unnamed, gsm8k, math_set = evaluation_sets(job, job_task(job))
    assert (unnamed.name, unnamed.label, len(unnamed.problems), unnamed.task_name) == (None, "default", 3, "arithmetic")
    assert (gsm8k.label, len(gsm8k.problems), gsm8k.temperature, gsm8k.samples_per_problem) == ("gsm8k_test", 4, 0, 1)
    assert gsm8k.task_name == "gsm8k" and all(p.problem_id.startswith("gsm8k-test-") for p, _ in gsm8k.problems)
    assert [p for p, _ in gsm8k.problems] == [p for p, _ in evaluation_sets(job, job_task(job))[1].problems]
    assert (len(math_set.problems), math_set.temperature, math_set.samples_per_problem) == (2, 0.7, 2)
    assert sorted(p.answer for p, _ in math_set.problems) == ["1024", "\\frac{3}{4}"]
    assert all("<answer></answer>" in messages[-1]["content"] for _, messages in math_set.problems)
    assert [s.key("eval/solved") for s in (unnamed, gsm8k)] == ["eval/solved", "eval/gsm8k_test/solved"]
    rows = sum(1 for line in GSM8K_TEST.read_text().splitlines() if line.strip())
    every_row = validate_job(
        {"task": {"name": "arithmetic"}, "eval": {"sets": {"all": {"path": str(GSM8K_TEST), "task": "gsm8k"}}}}
    )
    assert evaluation_sets(every_row, job_task(every_row)) == []  # the job does not evaluate while training
    (answered,) = evaluation_sets(every_row, job_task(every_row), always=True, labels=["all"])
    assert len(answered.problems) == rows == 1319


def test_a_set_of_the_jobs_own_task_keeps_its_reward_but_not_its_training_only_fields(tmp_path):
    """A dataset set of a dataset job: the job's reward and fields carry over; task.max_rows and
    task.demonstration_field (training only) do not, so a held-out file without worked solutions loads whole."""
    from cluster.job import evaluation_sets

    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"prompt": f"{i} + 1?", "answer": i + 1, "worked": f"<answer>{i + 1}</answer>"}) + "\n"
            for i in range(3)
        )
    )
    test = _math_file(tmp_path, [{"prompt": f"{i} + 2?", "answer": i + 2} for i in range(5)])
    job = validate_job(
        {
            "task": {
                "name": "dataset",
                "path": str(train),
                "reward": "exact",
                "max_rows": 2,
                "demonstration_field": "worked",
            },
            "eval": {"every_steps": 1, "sets": {"held_out": {"path": test}}},
        }
    )
    _, held_out = evaluation_sets(job, job_task(job))
    assert held_out.task_name == "dataset" and len(held_out.problems) == 5
    assert held_out.task_config.reward == "exact" and held_out.task_config.max_rows is None


def test_a_missing_or_bad_set_file_names_the_set(tmp_path, monkeypatch, capsys):
    """Read with the task's data (train, validate, evaluate), before anything starts: a missing file names
    eval.sets.NAME.path, a bad row the set, file and line. `validate --schema-only` leaves the files alone."""
    from cluster.cli import main as cli_main
    from cluster.job import evaluation_sets
    from tasks.base import TaskError

    job = {
        "task": {"name": "arithmetic"},
        "eval": {"every_steps": 1, "sets": {"gone": {"path": str(tmp_path / "nowhere.jsonl"), "task": "gsm8k"}}},
    }
    with pytest.raises(TaskError, match=r"^eval.sets.gone.path: no data file at .*nowhere.jsonl$"):
        evaluation_sets(validate_job(job), job_task(validate_job(job)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Why?", "answer": "no gold"}) + "\n")
    job["eval"]["sets"] = {"bad": {"path": str(bad), "task": "gsm8k"}}
    with pytest.raises(TaskError, match=r"^eval.sets.bad: .*bad.jsonl:1: field 'answer' has no '#### <gold>' line"):
        evaluation_sets(validate_job(job), job_task(validate_job(job)))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(json.dumps(job))
    assert cli_main(["validate", "--schema-only", str(job_file)]) == 0
    assert cli_main(["validate", str(job_file)]) == 2
    assert "eval.sets.bad: " in capsys.readouterr().err


def test_answer_metrics_are_avg_at_k_and_pass_at_k():
    """Three problems, k = 3 answers each: 1, 0 and 3 correct. avg@3 = 4/9 (every answer alike), pass@3 = 2/3
    (problems with any correct answer); a 0.1 (well-formed, wrong) is not correct."""
    from actors.generator import GeneratedGroup
    from cluster.run.evaluation import answer_metrics, summary_line
    from tasks.scoring import ScoreResult

    rewards = [[1.0, 0.1, 0.0], [0.1, 0.1, 0.0], [1.0, 1.0, 1.0]]
    groups = [GeneratedGroup(-1 - i, f"p{i}", [1], [{"completion_ids": [7] * 2, "text": ""}] * 3) for i in range(3)]
    scores = [ScoreResult(r) for row in rewards for r in row]
    scores[5] = ScoreResult(0.0, "raised ValueError")
    metrics = answer_metrics(groups, scores)
    assert metrics["eval/solved"] == 4 / 9 and metrics["eval/pass_at_k"] == 2 / 3
    assert metrics["eval/problems"] == 3 and metrics["eval/answers"] == 9 and metrics["eval/score_errors"] == 1
    assert metrics["eval/reward_mean"] == pytest.approx(sum(map(sum, rewards)) / 9)
    assert metrics["eval/response_len"] == 2
    assert summary_line(metrics) == "2 of 3 problems solved, 44.4% of 9 answers correct, mean reward 0.478"


def test_pass_at_k_is_estimated_without_bias_from_more_answers_and_maj_at_k_votes_on_final_answers():
    """Two problems, n = 4 answers each. Problem 0: 1 correct of 4, so pass@1 = 1/4 and pass@2 = 1 - C(3,2)/C(4,2)
    = 1/2, and its majority answer (7, said twice) is wrong. Problem 1: 2 correct, pass@2 = 1 - 1/6; the two
    correct answers (5, one boxed) outvote the wrong 6 and the answer-less one. The empirical pass@k of exactly
    k answers would have given 1.0 for pass@4 alone; the estimate for k = n equals it."""
    from actors.generator import GeneratedGroup
    from cluster.run.evaluation import answer_metrics, unbiased_pass_at
    from tasks.scoring import ScoreResult

    texts = [
        ["<answer>7</answer>", "<answer>7</answer>", "<answer>3</answer>", "<answer>8</answer>"],
        ["<answer>5</answer>", "so \\boxed{5}", "<answer>6</answer>", "no answer"],
    ]
    rewards = [[0.1, 0.1, 1.0, 0.1], [1.0, 1.0, 0.1, 0.0]]
    groups = [
        GeneratedGroup(-1 - i, f"p{i}", [1], [{"completion_ids": [7], "text": text} for text in row])
        for i, row in enumerate(texts)
    ]
    scores = [ScoreResult(r) for row in rewards for r in row]
    metrics = answer_metrics(groups, scores, pass_at=(1, 2, 4))
    assert metrics["eval/pass_at_1"] == pytest.approx((1 / 4 + 2 / 4) / 2) == metrics["eval/solved"]
    assert metrics["eval/pass_at_2"] == pytest.approx((1 / 2 + (1 - 1 / 6)) / 2)
    assert metrics["eval/pass_at_4"] == metrics["eval/pass_at_k"] == 1.0
    assert metrics["eval/maj_at_k"] == 0.5
    assert unbiased_pass_at(10, 0, 3) == 0.0 and unbiased_pass_at(10, 8, 3) == 1.0  # fewer wrong than k: certain


def test_pass_at_needs_at_least_k_answers_in_every_set():
    task = {"name": "arithmetic"}
    errors = _errors(
        {"task": task, "eval": {"every_steps": 5, "samples_per_problem": 4, "temperature": 1.0, "pass_at": [1, 8]}}
    )
    assert "eval.pass_at" in errors and "from 1 to eval.samples_per_problem (4)" in errors["eval.pass_at"]
    job = validate_job(
        {"task": task, "eval": {"every_steps": 5, "samples_per_problem": 4, "temperature": 1.0, "pass_at": [1, 2]}}
    )
    assert job.eval.pass_at == [1, 2]


def test_each_named_set_is_scored_by_its_own_format_and_logged_under_its_own_keys(tmp_path, caplog):
    """An arithmetic job with a gsm8k set: one row per set at the step, the unnamed set's under eval/* as before and
    the gsm8k set's under eval/gsm8k_test/*, scored by a gsm8k verifier (a \\boxed{} answer counts there, not in
    arithmetic); k = 2 sampled answers give avg@2 and pass@2."""
    from cluster.job import evaluation_sets, section_config
    from cluster.run.evaluation import Evaluator, RunningEvaluation
    from cluster.telemetry.metrics import MetricSink
    from tasks.config import TASK_CONFIGS
    from tasks.scoring import ScorePool

    job = validate_job(
        {
            "task": {"name": "arithmetic"},
            "eval": {
                "every_steps": 5,
                "num_problems": 2,
                "sets": {
                    "gsm8k_test": {
                        "path": str(GSM8K_TEST),
                        "task": "gsm8k",
                        "num_problems": 3,
                        "samples_per_problem": 2,
                        "temperature": 1.0,
                    }
                },
            },
        }
    )
    sets = evaluation_sets(job, job_task(job))
    scorer = ScorePool("arithmetic", section_config(job.task, TASK_CONFIGS))
    sink = MetricSink(tmp_path, "run", {}, "disabled", progress_bar=False)
    evaluator = Evaluator(sets, job, scorer, sink)
    unnamed, gsm8k = sets
    assert evaluator.scorers[None] is scorer and evaluator.scorers["gsm8k_test"] is not scorer
    # request ids below zero and distinct over the sets; each set's seeds repeat from the job's seed
    ids = [r.group_id for requests in evaluator.requests.values() for r in requests]
    assert sorted(ids) == list(range(-5, 0)) and [r.seed for r in evaluator.requests["gsm8k_test"]] == [0, 1, 2]
    gold = [p.answer for p, _ in gsm8k.problems]
    texts = [
        [f"so \\boxed{{{gold[0]}}}", "no idea"],
        [f"<answer>{gold[1]}</answer>", f"<answer>{gold[1]}</answer>"],
        [f"\\boxed{{{int(gold[2]) + 1}}}", "?"],
    ]
    try:
        with caplog.at_level("INFO", logger="stableasync"):
            evaluator.record(
                RunningEvaluation(0, 5, 0.0),
                _answers(
                    [p for p, _ in unnamed.problems], [[f"\\boxed{{{p.answer}}}"] for p, _ in unnamed.problems], 5
                ),
            )
            evaluator.record(
                RunningEvaluation(0, 5, 0.0, "gsm8k_test"), _answers([p for p, _ in gsm8k.problems], texts, 5)
            )
            evaluator.record(
                RunningEvaluation(0, 6, 0.0, "gsm8k_test"), _answers([p for p, _ in gsm8k.problems], texts, 4)
            )
    finally:
        evaluator.close()
        scorer.close()
        sink.close()
    first, second = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first["train/step"] == second["train/step"] == 5
    assert first["eval/solved"] == first["eval/pass_at_k"] == 0.0 and first["eval/problems"] == 2  # no boxed here
    assert not any(key.startswith("eval/gsm8k_test/") for key in first)
    assert {key for key in second if key.startswith("eval/")} == {
        f"eval/gsm8k_test/{name}"
        for name in (
            "reward_mean",
            "solved",
            "pass_at_k",
            "maj_at_k",
            "response_len",
            "score_errors",
            "problems",
            "answers",
            "policy_version",
            "seconds",
        )
    }
    assert second["eval/gsm8k_test/solved"] == 3 / 6 and second["eval/gsm8k_test/pass_at_k"] == 2 / 3
    assert second["eval/gsm8k_test/reward_mean"] == pytest.approx((1 + 0 + 1 + 1 + 0.1 + 0) / 6)
    assert second["eval/gsm8k_test/answers"] == 6 and second["eval/gsm8k_test/policy_version"] == 5
    assert "evaluation at step 5 (set gsm8k_test): 2 of 3 problems solved, 50.0% of 6 answers correct" in caplog.text
    assert "step 6 (set gsm8k_test): generator 0 answered with the weights of step 4" in caplog.text
    assert not evaluator.close.alive  # its own gsm8k pool is closed


def test_evaluate_refuses_bad_input_with_exit_2_before_loading_a_model(tmp_path, capsys):
    """`stableasync evaluate`: what to fix, and exit 2, for no model folder, a run without a saved model, no job,
    a job error, a set whose file is missing and an unknown --sets name; all before any engine starts."""
    from cluster.cli import main as cli_main
    from cluster.run.evaluation import saved_model_folder

    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        json.dumps(
            {
                "task": {"name": "arithmetic"},
                "eval": {"sets": {"held": {"path": str(tmp_path / "missing.jsonl"), "task": "gsm8k"}}},
            }
        )
    )
    model = tmp_path / "model-folder"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(job_file.read_text())

    def refused(*argv: str) -> str:
        assert cli_main(["evaluate", *argv]) == 2
        return capsys.readouterr().err

    assert "neither a Hugging Face model folder (no config.json) nor a run directory" in refused(
        str(tmp_path / "nothing"), "--job", str(job_file)
    )
    assert f"write one from its newest checkpoint with `stableasync export {run}`" in refused(str(run))
    assert "give --job JOB.yaml" in refused(str(model))
    assert "learner.steps: Input should be greater than 0" in refused(
        str(model), "--job", str(job_file), "--set", "learner.steps=0"
    )
    assert "eval.sets.held.path: no data file at" in refused(str(model), "--job", str(job_file))
    assert "--sets: no set nope in the job (its sets: default, held)" in refused(
        str(model), "--job", str(job_file), "--sets", "default,nope"
    )
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    assert saved_model_folder(run) == run / "model" and saved_model_folder(model) == model
    assert "eval.sets.held.path" in refused(str(run))  # the run's own job.yaml


def test_submit_carries_each_sets_file_and_the_cluster_job_names_it_there(tmp_path, monkeypatch):
    """`stableasync submit` uploads an eval set's local file with the job, beside the task's, and the job the
    cluster runs reads it from the working_dir; a set under a remote prefix stays as it is."""
    from cluster.job import evaluation_sets, load_job
    from cluster.remote.submit import stage_working_dir

    local = _math_file(tmp_path, [{"problem": "What is 2 + 2?", "answer": 4}])
    job = validate_job(
        {
            "task": {"name": "arithmetic"},
            "eval": {
                "every_steps": 1,
                "sets": {
                    "mine": {"path": local, "task": "dataset", "prompt_field": "problem"},
                    "theirs": {"path": "/mnt/shared/math500.jsonl", "task": "dataset"},
                },
            },
        }
    )
    staged = stage_working_dir(job, tmp_path / "wd")
    sent = load_job(staged / "job.yaml")
    assert {name: spec.path for name, spec in sent.eval.sets.items()} == {
        "mine": "user_files/math.jsonl",
        "theirs": "/mnt/shared/math500.jsonl",
    }
    assert sent.eval.sets["mine"].prompt_field == "problem"
    monkeypatch.chdir(staged)
    one_set = sent.model_copy(update={"eval": sent.eval.model_copy(update={"sets": {"mine": sent.eval.sets["mine"]}})})
    assert evaluation_sets(one_set, job_task(one_set))[1].problems[0][0].answer == "4"
