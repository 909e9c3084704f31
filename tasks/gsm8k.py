"""GSM8K from a JSONL file, scored with math-verify.

Rows are checked when the task is built: a row with a missing or unparsable field is an error that
names the file and line, never silently skipped.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from itertools import count
from pathlib import Path

from tasks.base import Problem, Task, last_answer, register, split_seed
from tasks.config import GSM8KConfig

_CALC = re.compile(r"<<[^>]*>>")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_rows(path: Path, max_rows: int | None = None) -> list[Problem]:
    if not path.is_file():
        raise FileNotFoundError(f"task.path: no GSM8K file at {path}")
    problems = []
    with path.open() as handle:
        for line_number, line in enumerate(handle, start=1):
            if max_rows is not None and len(problems) >= max_rows:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            for key in ("question", "answer"):
                if not isinstance(row.get(key), str) or not row[key].strip():
                    raise ValueError(f"{path}:{line_number}: field {key!r} is missing or not text")
            if "####" not in row["answer"]:
                raise ValueError(f"{path}:{line_number}: field 'answer' has no '#### <gold>' line")
            reasoning, gold = row["answer"].rsplit("####", 1)
            gold = gold.strip().replace(",", "")
            if not _NUMBER.fullmatch(gold):
                raise ValueError(f"{path}:{line_number}: gold answer {gold!r} is not a number")
            problems.append(Problem(f"gsm8k-{path.stem}-{line_number:05d}", row["question"].strip(), gold,
                                    {"reasoning": _CALC.sub("", reasoning).strip()}))
    return problems


@register("gsm8k")
class GSM8K(Task):
    def __init__(self, config: GSM8KConfig) -> None:
        if not config.path:
            raise ValueError("task.path: the gsm8k task needs the path of a JSONL file")
        self.rows = load_rows(Path(config.path).expanduser(), config.max_rows)
        if not self.rows:
            raise ValueError(f"task.path: {config.path} has no rows")

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        order = list(range(len(self.rows)))
        rng = random.Random(split_seed(seed, split))
        for epoch in count():
            rng.shuffle(order)
            yield from (self.rows[i] for i in order)
            if split != "train" and epoch == 0:
                return

    def score(self, problem: Problem, completion: str) -> float:
        answer = last_answer(completion)
        if answer is None:
            return 0.0
        return 1.0 if _equivalent(problem.answer, answer) else 0.1

    def demonstration(self, problem: Problem) -> str:
        return f"{problem.metadata['reasoning']}\n<answer>{problem.answer}</answer>"


def _equivalent(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    target = parse(gold)
    if verify(target, parse(answer)):
        return True
    numbers = _NUMBER.findall(answer)  # a bare final number counts too
    return bool(numbers) and verify(target, parse(numbers[-1].replace(",", "")))
