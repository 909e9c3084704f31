"""Tasks: every score branch, demonstrations that score 1.0, seeded streams, bad data rows."""

from itertools import islice
from pathlib import Path

import pytest

from tasks.base import Problem, build_task, last_answer
from tasks.config import ArithmeticConfig, CountdownConfig, GSM8KConfig
from tasks.countdown import evaluate, solve

FIXTURE = Path(__file__).resolve().parents[2] / "tasks" / "fixtures" / "gsm8k_sample.jsonl"
SHARED_GSM8K = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


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
        assert int(problem.answer) == eval(expression)  # noqa: S307 - test oracle on our own digits
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


@pytest.mark.parametrize("line, message", [
    ('{"question": "q"}', "field 'answer'"),
    ('{"question": "q", "answer": "no gold"}', "no '#### <gold>' line"),
    ('{"question": "q", "answer": "x #### many"}', "is not a number"),
    ("not json", "not valid JSON"),
])
def test_gsm8k_bad_rows_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "ok", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"data.jsonl:2: .*{message}"):
        build_task("gsm8k", GSM8KConfig(path=str(path)))


def test_gsm8k_missing_file_and_unknown_task():
    with pytest.raises(FileNotFoundError, match="task.path"):
        build_task("gsm8k", GSM8KConfig(path="/nonexistent/gsm8k.jsonl"))
    with pytest.raises(KeyError, match="registered: arithmetic"):
        build_task("chess", None)


@pytest.mark.skipif(not SHARED_GSM8K.is_file(), reason="shared GSM8K data not present")
def test_real_gsm8k_test_split_loads_and_demonstrations_verify():
    task = build_task("gsm8k", GSM8KConfig(path=str(SHARED_GSM8K)))
    problems = list(task.problems("test", 0))
    assert len(problems) == 1319
    for problem in problems[:200]:  # math-verify on all 1319 takes long; the loader checked every row
        assert task.score(problem, task.demonstration(problem)) == 1.0
