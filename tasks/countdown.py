"""Countdown: combine every given number once with + - * / to reach the target.

Problems are solvable by construction (numbers are resampled until a search finds a solution), and
answers are checked by a small arithmetic evaluator, never by Python's eval.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterator
from fractions import Fraction
from itertools import count

from tasks.base import Problem, Task, graded_answer, register, split_seed, tool_call_text
from tasks.config import CountdownConfig

_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_MAX_LITERAL = 10**6


def solve(numbers: list[int], target: int) -> str | None:
    """An expression using every number once that equals `target` (+, *, non-negative -, exact /)."""
    items = [(Fraction(n), str(n)) for n in numbers]
    return _search(items, Fraction(target))


def _search(items: list[tuple[Fraction, str]], target: Fraction) -> str | None:
    if len(items) == 1:
        return items[0][1] if items[0][0] == target else None
    for i in range(len(items)):
        for j in range(len(items)):
            if i == j:
                continue
            (a, ea), (b, eb) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            candidates = [(a + b, f"({ea} + {eb})"), (a * b, f"({ea} * {eb})")]
            if a >= b:
                candidates.append((a - b, f"({ea} - {eb})"))
            if b != 0 and (a / b).denominator == 1:
                candidates.append((a / b, f"({ea} / {eb})"))
            for value, expr in candidates:
                found = _search([*rest, (value, expr)], target)
                if found is not None:
                    return found
    return None


def reaches_target(answer: str, problem: Problem) -> bool:
    """Every given number used once, and the expression's value is the target."""
    if sorted(int(n) for n in re.findall(r"\d+", answer)) != sorted(problem.metadata["numbers"]):
        return False
    try:
        value = evaluate(answer)
    except (ValueError, RecursionError):
        return False
    return abs(value - problem.metadata["target"]) < Fraction(1, 10**5)


def evaluate(expression: str) -> Fraction:
    """Value of an expression of integers, + - * / and parentheses; ValueError for anything else."""
    if not _ALLOWED.match(expression):
        raise ValueError("only digits, + - * / and parentheses are allowed")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"not an expression: {error.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        if abs(node.value) > _MAX_LITERAL:
            raise ValueError("number too large")
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise ValueError("division by zero")
        return left / right
    raise ValueError(f"unsupported syntax {type(node).__name__}")


@register("countdown")
class Countdown(Task):
    def __init__(self, config: CountdownConfig) -> None:
        self.config = config

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        rng = random.Random(split_seed(seed, split))
        c = self.config
        for index in count():
            while True:
                numbers = [
                    rng.randint(1, max(2, c.max_target - 1)) for _ in range(rng.randint(c.min_numbers, c.max_numbers))
                ]
                target = rng.randint(c.min_target, c.max_target)
                solution = solve(numbers, target)
                if solution is not None:
                    break
            question = (
                f"Using the numbers {numbers}, create an equation that equals {target}. You can use "
                "+, -, * and / and each number exactly once."
            )
            yield Problem(
                f"countdown-{split}-{index:06d}",
                question,
                solution,
                {"numbers": numbers, "target": target, "solution": solution},
            )

    def score(self, problem: Problem, completion: str) -> float:
        return graded_answer(completion, lambda answer: reaches_target(answer, problem))

    def demonstration(self, problem: Problem) -> str:
        return f"<answer>{problem.metadata['solution']}</answer>"

    def tool_demonstration(self, problem: Problem, tools: frozenset[str]) -> list[dict[str, str]] | None:
        """Check the solution with the countdown checker, then answer it."""
        if "countdown_check" not in tools:
            return None
        solution = problem.metadata["solution"]
        return [
            {"role": "assistant", "content": tool_call_text("countdown_check", {"expression": solution})},
            {"role": "tool", "content": f"correct: {solution} = {problem.metadata['target']}"},
            {"role": "assistant", "content": self.demonstration(problem)},
        ]
