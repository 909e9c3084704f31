"""Composite rewards: a weighted sum of components (the task's verifier, a reward model, the answer format).

Each component scores a batch into `ScoreResult`s, never raising for one sample: a component that fails a
sample (a verifier error, a reward model that raised, timed out or gave NaN) fails the whole sample, reward
0.0 and the reason prefixed with the component's kind, as a verifier's failure does on its own. No Ray here:
`cluster/run/rewards.py` puts the reward model in an actor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tasks.base import Problem, TaskError, last_answer
from tasks.scoring import ScoreResult

Messages = list[dict[str, str]]


class RewardComponent(Protocol):
    """What a composite reward sums: one result per completion, in order; a failure is a result, not a raise."""

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]: ...

    def close(self) -> None: ...


class FormatReward:
    """1.0 for a completion with an <answer></answer>, 0.0 without: a shaping term beside a reward model."""

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
        return [ScoreResult(float(last_answer(c) is not None)) for c in completions]

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class WeightedComponent:
    kind: str  # the `name` of its scoring.rewards entry: its metric and the prefix of its failures
    weight: float
    component: RewardComponent


class CompositeScorer:
    """The sum of weight x component over `components`, with each component's score kept in the result.

    `closing` are further scorers closed with it (the task's verifier pool the evaluation shares)."""

    def __init__(self, components: Sequence[WeightedComponent], closing: Sequence[Any] = ()) -> None:
        if not components:
            raise ValueError("a composite reward needs at least one component")
        self.components = list(components)
        self._closing = [*(c.component for c in components), *closing]
        self.failures = 0

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        per_component = [(c, c.component.score_many(problems, completions)) for c in self.components]
        results = []
        for i in range(len(completions)):
            scores = {c.kind: r[i].reward for c, r in per_component if r[i].error is None}
            errors = [f"{c.kind}: {r[i].error}" for c, r in per_component if r[i].error is not None]
            reward = sum(c.weight * r[i].reward for c, r in per_component)
            results.append(
                ScoreResult(0.0, "; ".join(errors)[:300], scores) if errors else ScoreResult(reward, None, scores)
            )
        self.failures += sum(r.error is not None for r in results)
        return results

    def close(self) -> None:
        seen: set[int] = set()
        for scorer in self._closing:
            if id(scorer) not in seen:
                seen.add(id(scorer))
                scorer.close()

    def __enter__(self) -> CompositeScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RewardModelScorer:
    """A Hugging Face sequence-classification model with one output (num_labels 1): its logit is the reward.

    The text is the prompt's messages plus the completion as the assistant's turn, through the reward
    model's own chat template (plain lines without one), cut from the left to `max_length` tokens so that
    the completion's end, which the last-token head reads, stays. Batches of `batch_size`, right-padded.
    """

    def __init__(self, path: str, max_length: int = 1024, batch_size: int = 8, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side, self.tokenizer.padding_side = "left", "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=dtype).to(device).eval()
        if self.model.config.num_labels != 1:
            raise TaskError(
                f"{path}: a reward model has one output (num_labels 1), this one has {self.model.config.num_labels}"
            )
        if self.model.config.pad_token_id is None:  # the head finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length, self.batch_size, self.device = max_length, batch_size, device

    def text(self, messages: Messages, completion: str) -> str:
        conversation = [*messages, {"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            return str(self.tokenizer.apply_chat_template(conversation, tokenize=False))
        return "\n".join(m["content"] for m in conversation)

    def score(self, conversations: Sequence[tuple[Messages, str]]) -> list[ScoreResult]:
        """One result per (messages, completion); a batch that raises fails its samples, a non-finite score
        its own."""
        results: list[ScoreResult] = []
        for start in range(0, len(conversations), self.batch_size):
            batch = conversations[start : start + self.batch_size]
            try:
                scores = self._logits([self.text(m, c) for m, c in batch])
            except Exception as error:
                results += [ScoreResult(0.0, f"raised {type(error).__name__}: {error}"[:300])] * len(batch)
                continue
            results += [
                ScoreResult(s) if math.isfinite(s) else ScoreResult(0.0, f"non-finite score {s}") for s in scores
            ]
        return results

    def encode(self, texts: list[str]) -> Any:
        """The batch's tensors. A chat template already writes the special tokens (a Llama template's BOS):
        tokenizing its text adds none, or the model would read two BOS (OpenRLHF and TRL do the same)."""
        templated = bool(getattr(self.tokenizer, "chat_template", None))
        return self.tokenizer(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not templated,
        ).to(self.device)

    def _logits(self, texts: list[str]) -> list[float]:
        import torch

        encoded = self.encode(texts)
        with torch.no_grad():
            logits = self.model(**encoded).logits
        return [float(x) for x in logits[:, 0].float().tolist()]


def reward_model_problem(path: str) -> str | None:
    """Why `path` would not load as a reward model (a sequence-classification model with one output and a
    tokenizer), or None: from its config and tokenizer files, without the weights."""
    from transformers import AutoConfig, AutoTokenizer

    if not Path(path).is_dir() and (path.startswith(("/", ".", "~")) or Path(path).exists() or path.count("/") != 1):
        return f"{path!r}: no such folder (a reward model is a local Hugging Face model folder or a hub id)"
    try:  # a hub id: its config and tokenizer come to the cache here, the actor loads the weights by the id
        config = AutoConfig.from_pretrained(path)
    except Exception as error:
        if not Path(path).is_dir():
            return (
                f"{path!r} is no local folder and does not load as a Hugging Face hub id: {error}"[:400]
                + "; with no network (HF_HUB_OFFLINE=1) it must be in the cache already (HF_HOME), else give a "
                "local model folder"
            )
        return f"{path!r} does not load as a model: {error}"[:500]
    architectures = getattr(config, "architectures", None) or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        return (
            f"{path!r} is {', '.join(architectures) or 'no architecture'}, not a sequence-classification "
            "model (a reward model has a score head)"
        )
    if config.num_labels != 1:
        return f"{path!r} has {config.num_labels} outputs; a reward model has one (num_labels 1)"
    try:
        AutoTokenizer.from_pretrained(path)
    except Exception as error:
        return f"{path!r} has no tokenizer that loads: {error}"[:500]
    return None


class InlineRewardModel:
    """A reward model scored in this process (no timeout): for tests and the reference loop."""

    def __init__(self, scorer: Any, messages: Callable[[Problem], Messages]) -> None:
        self.scorer, self.messages = scorer, messages

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
        return list(self.scorer.score([(self.messages(p), c) for p, c in zip(problems, completions, strict=True)]))

    def close(self) -> None:
        pass
