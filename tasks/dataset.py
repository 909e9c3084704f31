"""Your own problems from a JSONL or Parquet file, a dataset folder or a Hub dataset (`tasks.sources`), scored by
a built-in verifier or by your own reward function.

Every row is checked when the task is built, in the driver and in each reward worker: a missing field,
a prompt that is neither text nor chat messages, or a reward function that cannot be imported or called
with (completion, answer, row) is a `TaskError` naming the field and the file's line or row, before anything
starts. A reward function that raises, hangs or returns a non-number at run time fails only that sample
(`tasks.scoring`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tasks.base import ANSWER_FORMAT, Problem, Task, TaskError, file_problems, graded_answer, register, user_function
from tasks.config import DatasetConfig
from tasks.gsm8k import math_equivalent
from tasks.sources import source_rows

ROLES = ("system", "user", "assistant")


def _exact(gold: str, answer: str) -> bool:
    return gold.strip() == answer.strip()


def _math(gold: str, answer: str) -> bool:
    return _exact(gold, answer) or math_equivalent(gold, answer)  # text golds ('Paris') count when equal


BUILT_IN_REWARDS: dict[str, Callable[[str, str], bool]] = {"math": _math, "exact": _exact}
BOXED_REWARDS = frozenset({"math"})  # also read a \boxed{} answer (without <answer> tags): math-verify's format


@register("dataset")
class Dataset(Task):
    def __init__(self, config: DatasetConfig) -> None:
        if not config.path:
            raise TaskError("task.path: the dataset task needs a JSONL or Parquet file, a folder or hf:OWNER/NAME")
        self.config = config
        self.equivalent = BUILT_IN_REWARDS.get(config.reward)
        if config.reward_batched and self.equivalent:
            raise TaskError(f"task.reward_batched: the built-in reward {config.reward!r} scores one answer at a time")
        self.reward_function = (
            None if self.equivalent else load_reward_function(config.reward, batched=config.reward_batched)
        )
        sourced = source_rows(config.path, config.split, config.subset, config.max_rows)
        self.rows = [
            self._problem(source.where, f"{source.name}-{source.number:06d}", source.row) for source in sourced
        ]
        if not self.rows:
            raise TaskError(f"task.path: {config.path} has no rows")

    def _problem(self, where: str, problem_id: str, row: dict[str, Any]) -> Problem:
        config = self.config
        if config.prompt_field not in row:
            raise TaskError(f"{where}: field {config.prompt_field!r} (task.prompt_field) is missing")
        messages = _messages(row[config.prompt_field], f"{where}: field {config.prompt_field!r}")
        if config.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": config.system_prompt})
        if config.answer_format:
            messages[-1] = {"role": "user", "content": f"{messages[-1]['content']} {ANSWER_FORMAT}"}
        if config.answer_field not in row:
            raise TaskError(f"{where}: field {config.answer_field!r} (task.answer_field) is missing")
        gold = row[config.answer_field]
        textual = not isinstance(gold, bool) and isinstance(gold, (str, int, float)) and bool(str(gold).strip())
        if self.reward_function is None and not textual:  # the built-in verifiers compare text
            raise TaskError(
                f"{where}: field {config.answer_field!r} must be non-empty text or a number for "
                f"reward {config.reward!r}, got {json.dumps(gold)[:80]}"
            )
        demonstration = None
        if config.demonstration_field is not None:
            demonstration = row.get(config.demonstration_field)
            if not isinstance(demonstration, str) or not demonstration.strip():
                raise TaskError(
                    f"{where}: field {config.demonstration_field!r} (task.demonstration_field) is missing or not text"
                )
        answer = gold if isinstance(gold, str) else json.dumps(gold)
        return Problem(
            problem_id,
            messages[-1]["content"],
            answer,
            {"messages": messages, "gold": gold, "row": row, "demonstration": demonstration},
        )

    def problems(self, split: str, seed: int) -> Iterator[Problem]:
        return file_problems(self.rows, split, seed)

    def data_read(self) -> str:
        return f"{len(self.rows)} rows of {self.config.path}"

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [dict(message) for message in problem.metadata["messages"]]

    def score(self, problem: Problem, completion: str) -> float:
        if self.batched_reward:
            (reward,) = self.score_batch([problem], [completion])
            return reward
        if self.reward_function is not None:
            return self.reward_function(completion, problem.metadata["gold"], problem.metadata["row"])
        equivalent = self.equivalent
        assert equivalent is not None  # without a reward function, a built-in verifier scores
        return graded_answer(
            completion, lambda answer: equivalent(problem.answer, answer), boxed=self.config.reward in BOXED_REWARDS
        )

    @property
    def batched_reward(self) -> bool:
        return self.config.reward_batched

    @property
    def _not_columns(self) -> frozenset[str]:
        """Row fields not passed as columns: the prompt (it is `prompts`) and the arguments' own names."""
        return frozenset({self.config.prompt_field, "prompts", "completions"})

    def score_batch(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[Any]:
        """A batched reward function's values for these answers, called as TRL calls one: the prompts (the chat
        messages), the completions, and every column of the rows as a list (None where a row lacks it); a
        result that is not a list of one value per completion raises `TaskError` (each value is checked by
        the caller, as a single reward's is)."""
        assert self.reward_function is not None and self.batched_reward
        rows = [problem.metadata["row"] for problem in problems]
        names = dict.fromkeys(key for row in rows for key in row if key not in self._not_columns)
        columns = {name: [row.get(name) for row in rows] for name in names}
        prompts = [problem.metadata["messages"] for problem in problems]
        rewards = self.reward_function(prompts=prompts, completions=list(completions), **columns)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(completions):
            got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else f"{type(rewards).__name__}"
            raise TaskError(f"returned {got} for {len(completions)} completions, not a list of one value each")
        return list(rewards)

    def demonstration(self, problem: Problem) -> str:
        return problem.metadata["demonstration"] or f"<answer>{problem.answer}</answer>"


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    """A row's prompt as chat messages: text becomes one user message; a list must be {role, content}
    messages ending with the user's."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise TaskError(f"{where} is empty")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise TaskError(f"{where} must be text or a non-empty list of chat messages, got {json.dumps(prompt)[:80]}")
    messages = []
    for index, message in enumerate(prompt):
        if (
            not isinstance(message, dict)
            or set(message) != {"role", "content"}
            or message["role"] not in ROLES
            or not isinstance(message["content"], str)
        ):
            raise TaskError(
                f"{where}[{index}] must be {{role: {'|'.join(ROLES)}, content: text}}, got {json.dumps(message)[:80]}"
            )
        messages.append(dict(message))
    if messages[-1]["role"] != "user":
        raise TaskError(f"{where} must end with a user message (the model answers it), not {messages[-1]['role']!r}")
    return messages


def load_reward_function(spec: str, batched: bool = False) -> Callable[..., Any]:
    """`task.reward` 'FILE.py:NAME' or 'module:NAME' as a function (completion, answer, row) -> float, or with
    `batched` (prompts, completions, **columns) -> list[float]."""
    source, _, name = spec.rpartition(":")
    if not source or not name.isidentifier():
        raise TaskError(
            f"task.reward: {spec!r} is neither a built-in ({', '.join(BUILT_IN_REWARDS)}) nor "
            "'FILE.py:NAME' or 'module:NAME'"
        )
    function = user_function(spec, "task.reward")
    try:
        if batched:
            inspect.signature(function).bind_partial(prompts=[], completions=[])  # columns come by name
        else:
            inspect.signature(function).bind("completion", "answer", {})
    except TypeError:
        call = (
            "(prompts=..., completions=..., **columns) (task.reward_batched)"
            if batched
            else "(completion, answer, row)"
        )
        raise TaskError(f"task.reward: {name}{inspect.signature(function)} cannot be called as {name}{call}") from None
    except ValueError:  # no signature to inspect (some builtins): it is tried on the first sample
        pass
    return function
