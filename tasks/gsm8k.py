"""GSM8K from a JSONL file, scored with math-verify.

Rows are checked when the task is built: a row with a missing or unparsable field is an error that
names the file and line, never silently skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from tasks.base import Problem, Task, TaskError, file_problems, graded_answer, register, tool_call_text
from tasks.config import GSM8KConfig
from tasks.sources import source_rows

_CALC = re.compile(r"<<[^>]*>>")
_CALC_PARTS = re.compile(r"<<([^>]*)>>")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_rows(config: GSM8KConfig) -> list[Problem]:
    """GSM8K's rows from `config.path` (any source `tasks.sources` reads: the Hub's openai/gsm8k has these
    columns), each checked: question and answer text, the answer's last '#### GOLD' a number."""
    problems = []
    for source in source_rows(config.path, config.split, config.subset, config.max_rows):
        row, where = source.row, source.where
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise TaskError(f"{where}: field {key!r} is missing or not text")
        if "####" not in row["answer"]:
            raise TaskError(f"{where}: field 'answer' has no '#### <gold>' line")
        reasoning, gold = row["answer"].rsplit("####", 1)
        gold = gold.strip().replace(",", "")
        if not _NUMBER.fullmatch(gold):
            raise TaskError(f"{where}: gold answer {gold!r} is not a number")
        problems.append(
            Problem(
                f"gsm8k-{source.name}-{source.number:05d}",
                row["question"].strip(),
                gold,
                {"reasoning": _CALC.sub("", reasoning).strip(), "annotated": reasoning.strip()},
            )
        )
    return problems


@register("gsm8k")
class GSM8K(Task):
    def __init__(self, config: GSM8KConfig) -> None:
        if not config.path:
            raise TaskError("task.path: the gsm8k task needs a JSONL or Parquet file, a folder or hf:openai/gsm8k")
        self.rows = load_rows(config)
        if not self.rows:
            raise TaskError(f"task.path: {config.path} has no rows")

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        return file_problems(self.rows, split, seed)

    def score(self, problem: Problem, completion: str) -> float:
        return graded_answer(completion, lambda answer: math_equivalent(problem.answer, answer), boxed=True)

    def demonstration(self, problem: Problem) -> str:
        return f"{problem.metadata['reasoning']}\n<answer>{problem.answer}</answer>"

    def tool_demonstration(self, problem: Problem, tools: frozenset[str]) -> list[dict[str, str]] | None:
        """The worked solution with each of its <<expression=result>> calculations asked of the calculator: a
        turn ends at a calculation, whose result comes back as the tool's message."""
        if "calculator" not in tools or "annotated" not in problem.metadata:
            return None
        parts = _CALC_PARTS.split(problem.metadata["annotated"])  # text, calculation, text, ..., text
        messages: list[dict[str, str]] = []
        for text, calculation in zip(parts[0::2], parts[1::2]):
            expression, _, result = calculation.partition("=")
            call = tool_call_text("calculator", {"expression": expression.strip()})
            messages += [
                {"role": "assistant", "content": f"{text.strip()} {call}".strip()},
                {"role": "tool", "content": result.strip()},
            ]
        messages.append({"role": "assistant", "content": f"{parts[-1].strip()}\n<answer>{problem.answer}</answer>"})
        return messages


def math_equivalent(gold: str, answer: str) -> bool:
    """Whether `answer` is mathematically the gold (math-verify), or its last bare number is."""
    from math_verify import parse, verify

    target = _math_reading(gold)
    if verify(target, _math_reading(answer)):
        return True
    numbers = _NUMBER.findall(answer)  # a bare final number counts too
    return bool(numbers) and verify(target, parse(numbers[-1].replace(",", "")))


def _math_reading(text: str) -> list[object]:
    """math-verify's reading of `text`. LaTeX without $ delimiters (a \\boxed{} answer's content, a MATH-style gold
    such as \\dfrac{14}{3}) is read as LaTeX first: read plainly, only a number inside it may be found, or none."""
    from math_verify import parse

    readings = (f"${text}$", text) if "\\" in text else (text, f"${text}$")
    return next((parsed for parsed in map(parse, readings) if parsed), [])
