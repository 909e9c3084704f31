"""Rollout samples a person reads: what the policy wrote, what it scored, and how off-policy it was.

Every `logging.samples.every_steps` steps a few of the step's trained prompt groups go to
`RUN_DIR/samples.jsonl` (one line per response) and to W&B as a table, so a run whose reward stays at
0 shows why (a wrong answer format, truncation, a verifier error) without any code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from actors.buffer import ScoredGroup


@dataclass(frozen=True)
class RolloutSample:
    """One response of a trained prompt group, as logged."""

    step: int  # the policy version this step produced
    group_id: int
    problem_id: str
    question: str
    answer: str  # the reference answer
    completion: str  # the response text (a tool episode's transcript), cut to logging.samples.max_chars
    reward: float  # as trained on (verifier plus any overlong penalty)
    score_error: str | None  # why the verifier failed this response, if it did
    finish_reason: str  # "stop", or "length" when cut off at generator.max_new_tokens
    completion_tokens: int  # the policy's (a tool episode's results left out)
    lag: int  # policy versions between the weights that sampled it and the step that trained on it
    log_ratio: float  # sum over its tokens of log pi_learner - log pi_behaviour (0: on-policy)
    log_ratio_per_token: float  # the same, divided by its tokens


COLUMNS = [f.name for f in fields(RolloutSample)]


def rollout_samples(
    step: int, trained_version: int, groups: list[ScoredGroup], log_ratios: list[float], max_chars: int
) -> list[RolloutSample]:
    """The responses of `groups`, in order, paired with `log_ratios` (one per response, same order).

    `trained_version` is the policy version the step started from (the lag's reference)."""
    completions = [(group, c) for group in groups for c in group.completions]
    if len(log_ratios) < len(completions):
        raise ValueError(f"{len(completions)} responses but {len(log_ratios)} learner log-ratios")
    rows = []
    for (group, completion), log_ratio in zip(completions, log_ratios):
        mask = completion.get("policy_mask")  # a tool episode's results carry no ratio: its policy's tokens count
        tokens = sum(mask) if mask is not None else len(completion["completion_ids"])
        text = completion.get("transcript") or completion["text"]
        rows.append(
            RolloutSample(
                step=step,
                group_id=group.group_id,
                problem_id=group.problem_id,
                question=group.question,
                answer=group.answer,
                completion=text if len(text) <= max_chars else text[:max_chars] + " [...]",
                reward=float(completion["reward"]),
                score_error=completion.get("score_error"),
                finish_reason=completion["finish_reason"],
                completion_tokens=tokens,
                lag=trained_version - group.version_start,
                log_ratio=float(log_ratio),
                log_ratio_per_token=float(log_ratio) / max(tokens, 1),
            )
        )
    return rows


def as_rows(samples: list[RolloutSample]) -> list[dict]:
    return [asdict(sample) for sample in samples]
