"""Answers in \\boxed{} for the math-verified verifiers (gsm8k, dataset reward 'math'): read from the last box
(a last box cut off is no answer) when a completion has no <answer></answer>; the tag keeps precedence, and
the other verifiers (exact, arithmetic, countdown) still want the tag."""

from __future__ import annotations

import json

import pytest

from tasks.base import Problem, build_task, last_boxed
from tasks.config import ArithmeticConfig, DatasetConfig, GSM8KConfig

FIXTURE = __import__("pathlib").Path(__file__).resolve().parents[3] / "tasks" / "fixtures" / "gsm8k_sample.jsonl"


@pytest.mark.parametrize(
    "completion, content",
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} first, then \\boxed{ 2 }", "2"),  # the last one, stripped
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\left\\{ 1, \\sqrt{\\frac{a}{b}} \\right\\}}", "\\left\\{ 1, \\sqrt{\\frac{a}{b}} \\right\\}"),
        ("\\boxed {7}", "7"),
        ("\\boxed{3} but then \\boxed{\\frac{7}{", None),  # the last box never closes (cut off): no answer
        ("so \\boxed 5.", "5"),  # a box of one token
        ("\\boxed{4} or rather $\\boxed 5$", "5"),
        ("\\fbox{12}", "12"),
        ("\\boxed{1} then \\fbox{\\frac{2}{3}}", "\\frac{2}{3}"),
        ("\\boxed{}", ""),
        ("no box {here}", None),
        ("\\boxed{\\frac{1}{2}", None),
        ("boxed{5}", None),
    ],
)
def test_last_boxed_reads_the_last_box_and_none_when_it_never_closes(completion, content):
    assert last_boxed(completion) == content


def _dataset(tmp_path, reward: str, answer: object) -> tuple:
    path = tmp_path / "math.jsonl"
    path.write_text(json.dumps({"problem": "p", "answer": answer}) + "\n")
    task = build_task("dataset", DatasetConfig(path=str(path), prompt_field="problem", reward=reward))
    return task, task.rows[0]


def test_math_verified_verifiers_grade_a_boxed_answer(tmp_path):
    gsm8k = build_task("gsm8k", GSM8KConfig(path=str(FIXTURE)))
    problem = gsm8k.rows[0]
    gold = problem.answer
    assert gsm8k.score(problem, f"Adding up, \\boxed{{{gold}}}") == 1.0
    assert gsm8k.score(problem, f"\\boxed{{{int(gold) + 1}}}") == 0.1  # well-formed, wrong
    assert gsm8k.score(problem, f"\\boxed{{{gold}}} <answer>{int(gold) + 1}</answer>") == 0.1  # the tag first
    assert gsm8k.score(problem, f"\\boxed{{{int(gold) + 1}}} <answer>{gold}</answer>") == 1.0
    assert gsm8k.score(problem, f"the answer is {gold}") == 0.0  # neither: no answer
    math, fraction = _dataset(tmp_path, "math", "\\frac{14}{3}")  # a MATH-500 style gold, LaTeX without $
    assert math.score(fraction, "\\boxed{\\dfrac{14}{3}}") == 1.0
    assert math.score(fraction, "<answer>14/3</answer>") == 1.0
    assert math.score(fraction, "\\boxed{\\frac{3}{14}}") == 0.1
    pair, point = _dataset(tmp_path, "math", "(3, \\frac{\\pi}{2})")
    assert pair.score(point, "so the point is \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}") == 1.0


def test_the_other_verifiers_still_want_the_tag(tmp_path):
    exact, seven = _dataset(tmp_path, "exact", 7)
    assert exact.score(seven, "\\boxed{7}") == 0.0 and exact.score(seven, "<answer>7</answer>") == 1.0
    arithmetic = build_task("arithmetic", ArithmeticConfig())
    assert arithmetic.score(Problem("p", "What is 3 + 5?", "8"), "\\boxed{8}") == 0.0
