"""The task contract: problems, chat messages, a demonstration, and a score that never raises."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

ANSWER_FORMAT = "Reply with the final answer inside <answer></answer> tags."
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Problem:
    problem_id: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)


def last_answer(completion: str) -> str | None:
    """The content of the last <answer>...</answer>, or None when there is none."""
    found = _ANSWER.findall(completion)
    return found[-1].strip() if found else None


class Task:
    """Base class: subclasses set `name` and implement problems, score and demonstration."""

    name = ""

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        raise NotImplementedError

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 correct, 0.1 well-formed but wrong, 0.0 otherwise; never raises on any text."""
        raise NotImplementedError

    def demonstration(self, problem: Problem) -> str:
        """A correct completion in the exact format `score` accepts (for supervised warm-up)."""
        raise NotImplementedError

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{problem.question} {ANSWER_FORMAT}"}]


TASKS: dict[str, Callable[[Any], Task]] = {}


def register(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        cls.name = name
        TASKS[name] = cls
        return cls

    return wrap


def build_task(name: str, config: Any) -> Task:
    """The task registered as `name`; the error lists the valid names."""
    from tasks import arithmetic, countdown, gsm8k  # noqa: F401  (registers them)

    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {', '.join(sorted(TASKS))}")
    return TASKS[name](config)


def split_seed(seed: int, split: str) -> int:
    """A stream per split, so train, test and warm-up problems differ for the same job seed."""
    return seed * 1_000_003 + sum(ord(ch) * 31**i for i, ch in enumerate(split)) % 1_000_003
