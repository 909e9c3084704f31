"""Typed task configs. Standard library only: the job schema builds its task sections from these."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def _doc(text: str, default: object) -> object:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class ArithmeticConfig:
    """Seeded integer arithmetic: 'What is 3 + 5?' answered as <answer>8</answer>."""

    min_operand: int = _doc("smallest operand", 0)
    max_operand: int = _doc("largest operand", 9)
    operations: tuple[Literal["+", "-", "*"], ...] = _doc("operators drawn uniformly", ("+",))
    num_operands: int = _doc("operands per problem", 2)


@dataclass(frozen=True)
class CountdownConfig:
    """Countdown: reach the target with every given number once, using + - * / (solvable by construction)."""

    min_numbers: int = _doc("fewest numbers per problem", 3)
    max_numbers: int = _doc("most numbers per problem", 4)
    min_target: int = _doc("smallest target", 10)
    max_target: int = _doc("largest target", 100)


@dataclass(frozen=True)
class GSM8KConfig:
    """GSM8K from a JSONL file (question, answer with the gold after '####'), scored with math-verify."""

    path: str = _doc("JSONL file of GSM8K rows", "")
    max_rows: int | None = _doc("use only the first rows (none: all)", None)


@dataclass(frozen=True)
class DatasetConfig:
    """Your own problems from a JSONL file, scored by a built-in verifier or by your own reward function."""

    path: str = _doc("JSONL file, one problem per line", "")
    prompt_field: str = _doc("the field with the prompt: text, or a list of chat messages {role, content}", "prompt")
    answer_field: str = _doc("the field with the gold answer (text or a number) the reward compares with", "answer")
    reward: str = _doc(
        "'math' (the last <answer></answer> is the gold by math-verify), 'exact' (its text is the gold), or your "
        "own function as 'FILE.py:NAME' or 'module:NAME', called NAME(completion, answer, row) -> float",
        "math",
    )
    answer_format: bool = _doc("end the last user message with the <answer></answer> instruction", True)
    system_prompt: str | None = _doc("a system message put before every prompt (none: no system message)", None)
    demonstration_field: str | None = _doc(
        "the field with a worked completion for model.sft_warmup (none: '<answer>GOLD</answer>')", None
    )
    max_rows: int | None = _doc("use only the first rows (none: all)", None)


TASK_CONFIGS: dict[str, type] = {
    "arithmetic": ArithmeticConfig, "countdown": CountdownConfig, "gsm8k": GSM8KConfig, "dataset": DatasetConfig,
}
