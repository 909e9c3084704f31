"""Seeded integer arithmetic."""

from __future__ import annotations

import random
from collections.abc import Iterator
from itertools import count

from tasks.base import Problem, Task, graded_answer, register, split_seed, tool_call_text
from tasks.config import ArithmeticConfig


@register("arithmetic")
class Arithmetic(Task):
    def __init__(self, config: ArithmeticConfig) -> None:
        self.config = config

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        rng = random.Random(split_seed(seed, split))
        c = self.config
        for index in count():
            operands = [rng.randint(c.min_operand, c.max_operand) for _ in range(c.num_operands)]
            expression = str(operands[0])
            for operand in operands[1:]:
                expression += f" {rng.choice(c.operations)} {operand}"
            value = _evaluate_left_to_right(expression)
            yield Problem(f"arithmetic-{split}-{index:06d}", f"What is {expression}?", str(value))

    def score(self, problem: Problem, completion: str) -> float:
        return graded_answer(completion, lambda answer: _same_integer(answer, problem.answer))

    def demonstration(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>"

    def tool_demonstration(self, problem: Problem, tools: frozenset[str]) -> list[dict[str, str]] | None:
        """Ask the calculator for the question's expression, then answer with its result."""
        if "calculator" not in tools:
            return None
        expression = problem.question.removeprefix("What is ").removesuffix("?")
        return [
            {"role": "assistant", "content": tool_call_text("calculator", {"expression": expression})},
            {"role": "tool", "content": problem.answer},
            {"role": "assistant", "content": self.demonstration(problem)},
        ]


def _same_integer(answer: str, gold: str) -> bool:
    try:
        return int(answer) == int(gold)
    except ValueError:
        return False


def _evaluate_left_to_right(expression: str) -> int:
    """Operators apply with the usual precedence (* before + and -)."""
    tokens = expression.split()
    terms: list[int] = [int(tokens[0])]
    ops: list[str] = []
    for op, value in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] *= int(value)
        else:
            ops.append(op)
            terms.append(int(value))
    total = terms[0]
    for op, term in zip(ops, terms[1:]):
        total = total + term if op == "+" else total - term
    return total
