"""The built-in tools: a calculator that evaluates arithmetic without `eval`, and the countdown task's checker.
Each is a typed function whose docstring's first paragraph is what the model reads (`tasks/tools.py` turns the
signature into the tool's schema and runs calls sandboxed)."""

from __future__ import annotations

import ast
import math
import operator
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from algorithms.errors import StableAsyncError
from tasks.base import Problem, TaskError
from tasks.countdown import evaluate, reaches_target

Tool = Callable[..., Any]


class ToolError(StableAsyncError, ValueError):
    """A tool refuses its input (a bad expression, say): the model reads the message and may try again.
    Any other exception a tool raises is fatal to the episode."""


Number = int | float

_MAX_EXPRESSION_CHARS = 1000
_MAX_INT_BITS = 4096  # about 1,233 digits: beyond it an integer result is refused before it is computed
_CALCULATOR_SYNTAX = "only numbers, + - * / // % ** and parentheses"
_REFUSED_SYNTAX: dict[type[ast.AST], str] = {
    ast.Name: "names",
    ast.Attribute: "attributes",
    ast.Call: "function calls",
    ast.Subscript: "subscripts",
    ast.Compare: "comparisons",
    ast.BoolOp: "boolean operators",
    ast.Constant: "constants other than numbers",
}


def _checked_int(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise ToolError(f"result too large (over {_MAX_INT_BITS} bits)")
    return value


def _divide(left: Number, right: Number) -> Number:
    """Exact for integers that divide (6/3 is 2), a float otherwise."""
    if isinstance(left, int) and isinstance(right, int) and right and left % right == 0:
        return left // right
    return left / right


def _power(base: Number, exponent: Number) -> Number:
    """`base ** exponent`, refused before computing when an integer result would exceed the size bound."""
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and exponent > 0
        and abs(base) > 1
        and (abs(base).bit_length() - 1) * exponent > _MAX_INT_BITS
    ):
        raise ToolError(f"result too large: {base} ** {exponent} has over {_MAX_INT_BITS} bits")
    value = base**exponent
    if isinstance(value, complex):  # (-8) ** (1/3)
        raise ToolError("a negative number to a fractional power has no real value")
    return value


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _divide,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _calculate(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked_int(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_calculate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked_int(_BINARY[type(node.op)](_calculate(node.left), _calculate(node.right)))
    what = _REFUSED_SYNTAX.get(type(node), f"{type(node).__name__} syntax")
    raise ToolError(f"not allowed: {what} ({_CALCULATOR_SYNTAX})")


def _number_text(value: Number | Fraction) -> str:
    """Integers without '.0', other values to 15 significant digits (no float noise such as 0.30000000000000004)."""
    if isinstance(value, Fraction):
        value = value.numerator if value.denominator == 1 else float(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".15g")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ToolError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise ToolError(f"not an expression: {error.msg}") from None
    try:
        value = _calculate(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, RecursionError, MemoryError) as error:
        raise ToolError(f"the result cannot be computed: {type(error).__name__}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError(f"the result is {value}")
    return _number_text(value)


def countdown_check(expression: str, problem: Problem) -> str:
    """Check a countdown answer: whether the expression uses each given number exactly once and equals the
    target, and what is wrong otherwise."""
    if "numbers" not in problem.metadata or "target" not in problem.metadata:
        raise TaskError(
            f"countdown_check needs a countdown problem (metadata numbers and target); "
            f"{problem.problem_id} has {sorted(problem.metadata)}"
        )
    target = problem.metadata["target"]
    try:
        value = evaluate(expression)
    except (ValueError, RecursionError) as error:
        raise ToolError(str(error)) from None
    if reaches_target(expression, problem):  # the verifier's own verdict
        return f"correct: {expression} = {target}"
    used = Counter(int(n) for n in re.findall(r"\d+", expression))
    given = Counter(problem.metadata["numbers"])
    wrong = [
        f"uses {n} {used[n]} time(s) but it is given {given[n]} time(s)"
        for n in sorted(used | given)
        if used[n] != given[n]
    ]
    if value != target:
        wrong.append(f"equals {_number_text(value)}, not {target}")
    return f"wrong: {expression}: {'; '.join(wrong) or 'not accepted'}"


BUILTIN_TOOLS: dict[str, Tool] = {"calculator": calculator, "countdown_check": countdown_check}
