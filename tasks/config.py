"""Typed task configs. Standard library only: the job schema builds its task sections from these.

They use the stabilizer configs' field helper and checks, so a bad value is an error of `validate`
that names the field, before a run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from algorithms.config import CheckedConfig, config_field


@dataclass(frozen=True)
class ArithmeticConfig(CheckedConfig):
    """Seeded integer arithmetic: 'What is 3 + 5?' answered as <answer>8</answer>."""

    ORDERED = (("min_operand", "max_operand"),)

    min_operand: int = config_field("smallest operand", 0)
    max_operand: int = config_field("largest operand", 9)
    operations: tuple[Literal["+", "-", "*"], ...] = config_field("operators drawn uniformly", ("+",))
    num_operands: int = config_field("operands per problem", 2, ge=2)


@dataclass(frozen=True)
class CountdownConfig(CheckedConfig):
    """Countdown: reach the target with every given number once, using + - * / (solvable by construction)."""

    ORDERED = (("min_numbers", "max_numbers"), ("min_target", "max_target"))

    min_numbers: int = config_field("fewest numbers per problem", 3, ge=2)
    max_numbers: int = config_field("most numbers per problem", 4)
    min_target: int = config_field("smallest target", 10, ge=1)
    max_target: int = config_field("largest target", 100)


@dataclass(frozen=True)
class GSM8KConfig(CheckedConfig):
    """GSM8K rows (question, answer with the gold after '####'), scored with math-verify."""

    path: str = config_field(
        "GSM8K's rows: a JSONL or Parquet file, a folder Hugging Face datasets reads, or hf:openai/gsm8k (with "
        "subset main)",
        "",
    )
    split: str = config_field("a folder's or Hub dataset's split", "train")
    subset: str | None = config_field(
        "a Hub dataset's configuration name (openai/gsm8k: main); none: its default", None
    )
    max_rows: int | None = config_field("use only the first rows (none: all)", None, ge=1)


HUB_PREFIX = "hf:"  # task.path hf:OWNER/NAME: a Hugging Face Hub dataset, read by each process from its own cache


def is_hub_dataset(path: str) -> bool:
    """Whether a data path names a Hugging Face Hub dataset (hf:OWNER/NAME) rather than a file or folder."""
    return path.startswith(HUB_PREFIX)


@dataclass(frozen=True)
class DatasetConfig(CheckedConfig):
    """Your own problems from a JSONL or Parquet file, a dataset folder or a Hugging Face Hub dataset, scored by a
    built-in verifier or by your own reward function."""

    path: str = config_field(
        "where the problems are: a JSONL file (one per line), a Parquet file, a folder Hugging Face datasets reads "
        "(Parquet or JSON shards, a Hub snapshot, save_to_disk's output), or hf:OWNER/NAME, a Hub dataset (read "
        "from the local cache where the Hub is out of reach)",
        "",
    )
    split: str = config_field("a folder's or Hub dataset's split", "train")
    subset: str | None = config_field("a Hub dataset's configuration name (gsm8k's 'main'); none: its default", None)
    prompt_field: str = config_field(
        "the field with the prompt: text, or a list of chat messages {role, content}", "prompt"
    )
    answer_field: str = config_field(
        "the field with the gold answer (text or a number) the reward compares with", "answer"
    )
    reward: str = config_field(
        "'math' (the last <answer></answer> is the gold by math-verify), 'exact' (its text is the gold), or your "
        "own function as 'FILE.py:NAME' or 'module:NAME', called NAME(completion, answer, row) -> float",
        "math",
    )
    reward_batched: bool = config_field(
        "your function takes a batch, as TRL's reward functions do: NAME(prompts, completions, **columns) -> "
        "list[float], each column of the rows (the answer's among them) a list beside the completions",
        False,
    )
    answer_format: bool = config_field("end the last user message with the <answer></answer> instruction", True)
    system_prompt: str | None = config_field("a system message put before every prompt (none: no system message)", None)
    demonstration_field: str | None = config_field(
        "the field with a worked completion for model.sft_warmup (none: '<answer>GOLD</answer>')", None
    )
    max_rows: int | None = config_field("use only the first rows (none: all)", None, ge=1)


TASK_CONFIGS: dict[str, type] = {
    "arithmetic": ArithmeticConfig,
    "countdown": CountdownConfig,
    "gsm8k": GSM8KConfig,
    "dataset": DatasetConfig,
}
