"""Tasks: every score branch, demonstrations that score 1.0, seeded streams, bad data rows."""

import json
from itertools import islice
from pathlib import Path

import pytest

from cluster.cli import main as cli_main
from tasks.base import ANSWER_FORMAT, Problem, TaskError, build_task, last_answer
from tasks.config import ArithmeticConfig, CountdownConfig, DatasetConfig, GSM8KConfig
from tasks.countdown import evaluate, solve
from tasks.scoring import ScorePool

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tasks" / "fixtures" / "gsm8k_sample.jsonl"
DATASET = ROOT / "tasks" / "fixtures" / "dataset_sample.jsonl"
GSM8K_DATA = ROOT / "tasks" / "data" / "gsm8k"


def test_last_answer_takes_the_last_tag():
    assert last_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert last_answer("no tag") is None


def test_arithmetic_scores():
    task = build_task("arithmetic", ArithmeticConfig())
    problem = Problem("p", "What is 3 + 5?", "8")
    assert task.score(problem, "<answer>8</answer>") == 1.0
    assert task.score(problem, "<answer>9</answer>") == 0.1
    assert task.score(problem, "<answer>eight</answer>") == 0.1
    assert task.score(problem, "8") == 0.0


def test_arithmetic_precedence_and_config_errors():
    task = build_task("arithmetic", ArithmeticConfig(operations=("*", "+", "-"), num_operands=3))
    for problem in islice(task.problems("train", 1), 200):
        expression = problem.question.removeprefix("What is ").removesuffix("?")
        assert int(problem.answer) == eval(expression)
    with pytest.raises(ValueError, match="min_operand"):
        build_task("arithmetic", ArithmeticConfig(min_operand=5, max_operand=1))


@pytest.mark.parametrize("name, config", [("arithmetic", ArithmeticConfig()), ("countdown", CountdownConfig())])
def test_demonstrations_score_one_and_seeds_reproduce(name, config):
    task = build_task(name, config)
    problems = list(islice(task.problems("train", 0), 200))
    assert all(task.score(p, task.demonstration(p)) == 1.0 for p in problems)
    assert [p.question for p in islice(task.problems("train", 0), 20)] == [p.question for p in problems[:20]]
    assert [p.question for p in islice(task.problems("test", 0), 20)] != [p.question for p in problems[:20]]
    assert len({p.problem_id for p in problems}) == len(problems)


def test_countdown_problems_respect_the_config_and_are_solvable():
    config = CountdownConfig(min_numbers=3, max_numbers=4, min_target=10, max_target=100)
    task = build_task("countdown", config)
    for problem in islice(task.problems("train", 3), 100):
        numbers, target = problem.metadata["numbers"], problem.metadata["target"]
        assert 3 <= len(numbers) <= 4 and 10 <= target <= 100
        assert solve(numbers, target) is not None


def test_countdown_scores():
    task = build_task("countdown", CountdownConfig())
    problem = Problem("p", "q", "(3 * 4) + 5", {"numbers": [3, 4, 5], "target": 17, "solution": "(3 * 4) + 5"})
    assert task.score(problem, "<answer>5 + 3 * 4</answer>") == 1.0
    assert task.score(problem, "<answer>3 * 4 + 5 + 0</answer>") == 0.1  # an extra number
    assert task.score(problem, "<answer>3 * 4 * 5</answer>") == 0.1  # wrong value
    assert task.score(problem, "<answer>__import__('os')</answer>") == 0.1
    assert task.score(problem, "17") == 0.0


def test_countdown_evaluator_refuses_anything_but_arithmetic():
    assert evaluate("(1 + 2) / 3") == 1
    for bad in ("__import__('os')", "2**99999", "1/0", "3 4", "()"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_gsm8k_fixture_rows_and_scores():
    task = build_task("gsm8k", GSM8KConfig(path=str(FIXTURE)))
    problems = list(islice(task.problems("test", 0), 10))
    assert len(problems) == 5  # a test split is one pass
    for problem in problems:
        assert task.score(problem, task.demonstration(problem)) == 1.0
    sara = next(p for p in problems if "Sara" in p.question)
    assert sara.answer == "1250"
    assert task.score(sara, "<answer>$1,250</answer>") == 1.0
    assert task.score(sara, "<answer>1000</answer>") == 0.1
    assert task.score(sara, "It is 1250") == 0.0


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "q"}', "field 'answer'"),
        ('{"question": "q", "answer": "no gold"}', "no '#### <gold>' line"),
        ('{"question": "q", "answer": "x #### many"}', "is not a number"),
        ("not json", "not valid JSON"),
    ],
)
def test_gsm8k_bad_rows_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "ok", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"data.jsonl:2: .*{message}"):
        build_task("gsm8k", GSM8KConfig(path=str(path)))


def test_gsm8k_missing_file_and_unknown_task():
    with pytest.raises(TaskError, match=r"task.path: no data file"):
        build_task("gsm8k", GSM8KConfig(path="/nonexistent/gsm8k.jsonl"))
    with pytest.raises(KeyError, match="registered: arithmetic"):
        build_task("chess", None)


def test_the_shipped_gsm8k_splits_load_and_demonstrations_verify():
    assert "MIT License" in (GSM8K_DATA / "LICENSE").read_text()
    assert len(build_task("gsm8k", GSM8KConfig(path=str(GSM8K_DATA / "train.jsonl"))).rows) == 7473
    task = build_task("gsm8k", GSM8KConfig(path=str(GSM8K_DATA / "test.jsonl")))
    problems = list(task.problems("test", 0))
    assert len(problems) == 1319
    for problem in problems[:200]:  # math-verify on all 1319 takes long; the loader checked every row
        assert task.score(problem, task.demonstration(problem)) == 1.0


def _dataset(**config):
    return build_task("dataset", DatasetConfig(**{"path": str(DATASET), **config}))


def _by_line(task, line: int) -> Problem:
    return next(p for p in task.rows if p.problem_id == f"dataset_sample-{line:06d}")


def test_dataset_prompts_become_chat_messages():
    task = _dataset(system_prompt="Think step by step.")
    assert task.messages(_by_line(task, 1)) == [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": f"What is 3 + 4? {ANSWER_FORMAT}"},
    ]
    own_system = task.messages(_by_line(task, 3))  # a row's own system message is kept, not doubled
    assert [m["role"] for m in own_system] == ["system", "user"]
    assert own_system[0]["content"] == "You are a careful tutor."
    turns = task.messages(_by_line(task, 4))  # earlier turns stay; the instruction ends the last user turn
    assert [m["role"] for m in turns] == ["system", "user", "assistant", "user"]
    assert turns[-1]["content"] == f"And 10 - 3? {ANSWER_FORMAT}" and turns[1]["content"] == "What is 10 - 2?"
    plain = _dataset(answer_format=False)
    assert plain.messages(_by_line(plain, 1)) == [{"role": "user", "content": "What is 3 + 4?"}]


def test_dataset_built_in_rewards():
    math, exact = _dataset(), _dataset(reward="exact")
    seven = _by_line(math, 1)
    assert seven.answer == "7"  # a number in the file is compared as text
    assert [
        math.score(seven, c) for c in ("<answer>7</answer>", "<answer>7.0</answer>", "<answer>8</answer>", "7")
    ] == [1.0, 1.0, 0.1, 0.0]
    assert exact.score(_by_line(exact, 1), "<answer>7.0</answer>") == 0.1
    assert math.score(_by_line(math, 2), "<answer> Paris </answer>") == 1.0  # text golds count when equal
    assert math.score(_by_line(math, 3), "<answer>0.75</answer>") == 1.0
    for task in (math, exact):
        for problem in task.rows:
            assert task.score(problem, task.demonstration(problem)) == 1.0
    with pytest.raises(TaskError, match=r"dataset_sample.jsonl:1: field 'solution' \(task.demonstration_field\)"):
        _dataset(demonstration_field="solution")  # every row needs one, not only line 3


def test_dataset_demonstrations_from_a_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": "3/4", "solution": "halve\n<answer>3/4</answer>"}) + "\n")
    task = _dataset(path=str(path), demonstration_field="solution")
    assert task.demonstration(task.rows[0]) == "halve\n<answer>3/4</answer>"


def test_dataset_training_and_warm_up_cycle_evaluation_is_one_pass():
    task = _dataset()
    assert len(list(islice(task.problems("train", 0), 10))) == 10
    assert len(list(islice(task.problems("sft", 0), 10))) == 10  # a warm-up longer than the file
    once = list(islice(task.problems("eval", 0), 10))
    assert sorted(p.problem_id for p in once) == sorted(p.problem_id for p in task.rows)
    assert [p.problem_id for p in islice(task.problems("train", 1), 4)] == [
        p.problem_id for p in islice(task.problems("train", 1), 4)
    ]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"answer": 1}, r"field 'prompt' \(task.prompt_field\) is missing"),
        ({"prompt": None, "answer": 1}, "field 'prompt' must be text or a non-empty list"),
        ({"prompt": "  ", "answer": 1}, "field 'prompt' is empty"),
        ({"prompt": [], "answer": 1}, "must be text or a non-empty list"),
        ({"prompt": [{"role": "robot", "content": "hi"}], "answer": 1}, r"field 'prompt'\[0\] must be \{role"),
        ({"prompt": [{"role": "user", "content": 3}], "answer": 1}, r"field 'prompt'\[0\]"),
        (
            {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": 1},
            "must end with a user message",
        ),
        ({"prompt": "q"}, "field 'answer' \\(task.answer_field\\) is missing"),
        ({"prompt": "q", "answer": True}, "must be non-empty text or a number"),
        ({"prompt": "q", "answer": ["a"]}, "must be non-empty text or a number"),
        ({"prompt": "q", "answer": " "}, "must be non-empty text or a number"),
        ([1, 2], "a row must be a JSON object"),
    ],
)
def test_dataset_bad_rows_name_file_line_and_field(tmp_path, row, message):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": 1}) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskError, match=rf"mine.jsonl:3: .*{message}"):
        _dataset(path=str(path))


def test_dataset_file_errors():
    with pytest.raises(TaskError, match=r"task.path: the dataset task needs"):
        build_task("dataset", DatasetConfig())
    with pytest.raises(TaskError, match=r"task.path: no data file at /nonexistent"):
        _dataset(path="/nonexistent/data.jsonl")


REWARD_MODULE = """
calls = []

def score(completion, answer, row):
    if row.get("explode"):
        raise RuntimeError("boom on " + row["prompt"])
    return row["weight"] * (1.0 if str(answer) in completion else 0.5)

def two_arguments(completion, answer):
    return 1.0

not_a_function = 3
"""


def _reward_data(tmp_path) -> Path:
    rows = [
        {"prompt": "a", "answer": 7, "weight": 0.4},
        {"prompt": "b", "answer": {"tests": [1]}, "weight": 1.0},
        {"prompt": "c", "answer": 1, "weight": 1.0, "explode": True},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    return path


def test_dataset_custom_reward_from_a_file_or_a_module(tmp_path, monkeypatch):
    data = _reward_data(tmp_path)
    task = _dataset(path=str(data), reward=f"{tmp_path}/my_rewards.py:score")
    first, second, _ = task.rows
    assert task.score(first, "it is 7") == pytest.approx(0.4)  # the gold as the file has it, and the row
    assert task.score(first, "no") == pytest.approx(0.2)
    assert second.metadata["gold"] == {"tests": [1]}  # any JSON value reaches a custom reward as it is
    assert task.score(second, "{'tests': [1]}") == 1.0
    monkeypatch.chdir(tmp_path)  # a relative FILE.py is found from the working directory
    assert _dataset(path="data.jsonl", reward="my_rewards.py:score").score(first, "7") == pytest.approx(0.4)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _dataset(path=str(data), reward="my_rewards:score").score(first, "7") == pytest.approx(0.4)


@pytest.mark.parametrize(
    "reward, message",
    [
        ("my_rewards.py:missing", "'my_rewards.py' has no function 'missing'"),
        ("my_rewards.py:not_a_function", "has no function 'not_a_function'"),
        (
            "my_rewards.py:two_arguments",
            r"two_arguments\(completion, answer\) cannot be called as "
            r"two_arguments\(completion, answer, row\)",
        ),
        ("elsewhere.py:score", "task.reward: no file .*elsewhere.py"),
        ("no_such_module_here:score", "importing 'no_such_module_here' failed: ModuleNotFoundError"),
        ("math-verify", "neither a built-in \\(math, exact\\) nor 'FILE.py:NAME' or 'module:NAME'"),
    ],
)
def test_dataset_reward_function_errors_name_the_field(tmp_path, monkeypatch, reward, message):
    data = _reward_data(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskError, match=rf"task.reward: .*{message}|{message}"):
        _dataset(path=str(data), reward=reward)


def test_a_custom_reward_that_raises_fails_its_sample_in_the_reward_worker(tmp_path):
    """The reward workers (spawned processes) import the user's file themselves; its exception fails only
    the sample it was raised on."""
    data = _reward_data(tmp_path)
    config = DatasetConfig(path=str(data), reward=f"{tmp_path}/my_rewards.py:score")
    rows = build_task("dataset", config).rows
    pool = ScorePool("dataset", config, max_workers=1, timeout_s=10.0)
    try:
        results = pool.score_many(rows, ["7", "x", "1"])
    finally:
        pool.close()
    assert [r.reward for r in results] == [pytest.approx(0.4), 0.5, 0.0]
    assert results[0].error is None and results[1].error is None
    assert results[2].error == "raised RuntimeError: boom on c"


@pytest.mark.parametrize(
    "body, error",
    [
        ('return float(row["topic"] == "x")', "raised KeyError: 'topic'"),
        ("return None", "returned None (NoneType), not a number"),
        ('return float("nan")', "returned nan, not a finite number"),
    ],
)
def test_validate_scores_the_first_row_and_refuses_a_reward_that_cannot_score_it(tmp_path, capsys, body, error):
    """A reward function broken on every row is refused by `validate` (it used to say ok, and `train` trained
    on rewards of 0); one that scores, 0 included, passes, and `validate` says how many rows it read."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {n} + 1?", "answer": n + 1}) + "\n" for n in range(5)))
    (tmp_path / "mine_reward.py").write_text(f"def score(completion, answer, row):\n    {body}\n")
    job = tmp_path / "job.yaml"
    job.write_text(f"task: {{name: dataset, path: {data}, reward: {tmp_path}/mine_reward.py:score}}\n")
    assert cli_main(["validate", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"task.reward '{tmp_path}/mine_reward.py:score' {error} on the training row mine-" in err, err
    assert "with the completion '<answer>" in err and "Traceback" not in err
    (tmp_path / "mine_reward.py").write_text("def score(completion, answer, row):\n    return 0.0\n")
    assert cli_main(["validate", str(job)]) == 0
    assert f"5 rows of {data})" in capsys.readouterr().out


def test_validate_names_a_task_setting_out_of_range_instead_of_raising(tmp_path, capsys):
    # these were checked only when the task was built, and `validate` printed a traceback
    job = tmp_path / "job.yaml"
    job.write_text("task: {name: arithmetic, min_operand: 5, max_operand: 1}\n")
    assert cli_main(["validate", str(job)]) == 2
    assert "  task: min_operand (5) must not exceed max_operand (1)" in capsys.readouterr().err
    job.write_text("task: {name: countdown, min_numbers: 1, min_target: 50, max_target: 20}\n")
    assert cli_main(["validate", str(job)]) == 2
    err = capsys.readouterr().err
    assert "task.min_numbers: Input should be greater than or equal to 2" in err and "Traceback" not in err
    with pytest.raises(ValueError, match=r"min_target .* must not exceed max_target"):
        CountdownConfig(min_target=50, max_target=20)


def test_validate_checks_the_data_and_the_reward_function(tmp_path, capsys):
    data = _reward_data(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(f"task: {{name: dataset, path: {data}, reward: '{tmp_path}/my_rewards.py:missing'}}\n")
    assert cli_main(["validate", str(job)]) == 2
    assert f"job.yaml: task.reward: '{tmp_path}/my_rewards.py' has no function 'missing'" in capsys.readouterr().err
    job.write_text(
        f"task: {{name: dataset, path: {data}, reward: '{tmp_path}/my_rewards.py:score'}}\n"
        f"eval: {{every_steps: 5, task_path: {tmp_path}/held_out.jsonl}}\n"
    )
    assert cli_main(["validate", str(job)]) == 2
    assert f"eval.task_path: task.path: no data file at {tmp_path}/held_out.jsonl" in capsys.readouterr().err
    runs = tmp_path / "runs"
    job.write_text(
        f"task: {{name: dataset, path: {data}, reward: '{tmp_path}/my_rewards.py:missing'}}\n"
        f"logging: {{run_dir: {runs}}}\n"
    )
    assert cli_main(["train", str(job)]) == 2  # train finds it before anything starts
    assert capsys.readouterr().err.startswith("stableasync train: task.reward: ")
    assert not runs.exists(), "no run directory for a job that never started"
    job.write_text(f"task: {{name: dataset, path: {data}, reward: '{tmp_path}/my_rewards.py:score'}}\n")
    assert cli_main(["validate", str(job)]) == 0


BAD_VALUES_MODULE = """
import math

VALUES = {"nan": math.nan, "none": None, "text": "1.0", "inf": math.inf, "huge": 1e30, "edge": 1e6, "minus": -3}


def score(completion, answer, row):
    return VALUES[completion]
"""


def test_a_reward_that_is_not_a_finite_number_within_range_fails_its_sample(tmp_path):
    """NaN, None, the text "1.0", inf and 1e30 are scoring failures, each naming the value (never a silent 0
    to train on); 1e6 and -3 are rewards."""
    from tasks.scoring import REWARD_LIMIT, score_inline

    data = _reward_data(tmp_path)
    (tmp_path / "bad.py").write_text(BAD_VALUES_MODULE)
    task = _dataset(path=str(data), reward=f"{tmp_path}/bad.py:score")
    names = ["nan", "none", "text", "inf", "huge", "edge", "minus"]
    results = score_inline(task, [task.rows[0]] * len(names), names)
    assert [r.error for r in results] == [
        "returned nan, not a finite number",
        "returned None (NoneType), not a number",
        "returned '1.0' (str), not a number",
        "returned inf, not a finite number",
        f"returned 1e+30, beyond the {REWARD_LIMIT:g} any reward stays within",
        None,
        None,
    ]
    assert [r.reward for r in results] == [0.0] * 5 + [1e6, -3.0]


BATCHED_REWARD = """
def score(prompts, completions, answer, weight, **columns):
    if any(c == "boom" for c in completions):
        raise ValueError("boom in the batch")
    if any(c == "short" for c in completions):
        return [1.0]
    # TRL's call: chat prompts, the completions, each column of the rows as a list (None where a row lacks it)
    assert all(p[-1]["role"] == "user" for p in prompts) and set(columns) <= {"explode"}  # not the prompt
    return [w * (str(a) in c) + len(completions) / 100 for c, a, w in zip(completions, answer, weight)]
"""


def _batched_task(tmp_path):
    data = _reward_data(tmp_path)
    (tmp_path / "batched.py").write_text(BATCHED_REWARD)
    return _dataset(path=str(data), reward=f"{tmp_path}/batched.py:score", reward_batched=True), data


def test_a_batched_reward_is_called_as_trl_calls_one_and_each_value_checked(tmp_path):
    """TRL and verl users bring reward_funcs(prompts, completions, **kwargs) -> list[float] (reward models too)."""
    from tasks.scoring import checked_batch, checked_score

    task, _ = _batched_task(tmp_path)
    first, second, third = task.rows
    assert task.batched_reward and task.score(first, "it is 7") == pytest.approx(0.41)  # a batch of one
    results = checked_batch(task, [first, third, second], ["it is 7", "1", "no"])
    assert [r.reward for r in results] == pytest.approx([0.43, 1.03, 0.03]) and not any(r.error for r in results)
    failed = checked_batch(task, [first, second], ["boom", "x"])
    assert [r.error for r in failed] == ["raised ValueError: boom in the batch"] * 2
    short = checked_batch(task, [first, second], ["short", "x"])
    assert short[0].error == "returned 1 values for 2 completions, not a list of one value each" == short[1].error
    assert checked_score(task, first, "boom").error == "raised ValueError: boom in the batch"


def test_a_batched_reward_scores_one_chunk_per_worker_in_the_reward_workers(tmp_path):
    task, data = _batched_task(tmp_path)
    config = DatasetConfig(path=str(data), reward=f"{tmp_path}/batched.py:score", reward_batched=True)
    pool = ScorePool("dataset", config, max_workers=2, timeout_s=10.0)
    try:
        first, second, third = task.rows
        results = pool.score_many([first, second, third, first, third], ["7", "x", "1", "boom", "no"])
    finally:
        pool.close()
    # chunks of 3 and 2 completions, one call each: the second chunk's "boom" fails that chunk alone
    assert [r.reward for r in results[:3]] == pytest.approx([0.43, 0.03, 1.03])
    assert [r.error for r in results[3:]] == ["raised ValueError: boom in the batch"] * 2 and pool.failures == 2


def test_a_batched_flag_on_a_single_answer_function_or_a_built_in_names_the_fields(tmp_path):
    data = _reward_data(tmp_path)
    with pytest.raises(
        TaskError, match=r"cannot be called as score\(prompts=\.\.\., completions=\.\.\., \*\*columns\)"
    ):
        _dataset(path=str(data), reward=f"{tmp_path}/my_rewards.py:score", reward_batched=True)
    with pytest.raises(TaskError, match=r"task.reward_batched: the built-in reward 'exact' scores one answer"):
        _dataset(path=str(data), reward="exact", reward_batched=True)
