"""The records of a response as the tasks' layer sees it: sampled by a generator (`Completion`, a turn or a
tool episode of `tasks/environment.py`), then scored (`ScoredCompletion`, as the rollout buffer keeps it), with
the helpers that tag its tokens with policy versions. The learner's own input, `TrainingSample`, lives in
`learner/records.py`.

They are typed dicts: at run time plain dicts, so Ray ships them, checkpoints write them as JSON and
older checkpoints read back unchanged; to a reader and to mypy, records with named, typed fields.
Standard library only (the simulator uses them).
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class Completion(TypedDict):
    """One response as a generator sampled it: one turn, or a multi-turn episode (`tasks/environment.py`)
    whose tool results sit between the policy's turns."""

    completion_ids: list[int]  # [T] sampled token ids, end-of-turn included when the model stopped
    behaviour_logprobs: list[float]  # [T] log-prob of each sampled token under the generator's weights
    text: str  # the decoded response, what the verifier reads
    finish_reason: str  # "stop", or "length" when cut off at generator.max_new_tokens
    # [[version, first token, end token), ...] in token order: the policy version that sampled each token
    # (several when the weights changed while the response was being sampled)
    version_spans: list[list[int]]
    # Episodes only (absent: every token is the policy's). [T] 1 for a token the policy sampled, 0 for a token of
    # a tool's result: those are context, never trained on, and carry behaviour log-prob 0 and no version span.
    policy_mask: NotRequired[list[int]]
    turns: NotRequired[int]  # policy turns sampled
    tool_calls: NotRequired[int]  # tool calls run
    tool_errors: NotRequired[int]  # calls answered with an error the model reads (malformed, unknown tool, ...)
    episode_error: NotRequired[str | None]  # why the episode failed (a tool raised, hung, printed too much): no score
    transcript: NotRequired[str]  # the policy's turns and the tools' messages as text, for a person to read


class ScoredCompletion(Completion):
    """A response with its reward, as the rollout buffer keeps it."""

    reward: float  # the verifier's reward plus any overlong penalty: what the learner trains on
    score_error: str | None  # why the verifier failed on it (then the reward is the task's failure reward)


def version_spans(labelled: list[Any] | None, tokens: int, fallback_version: int) -> list[list[int]]:
    """`Completion.version_spans` from vLLM's `WeightVersionSpan`s (version label, start, end); tokens the
    engine did not label with a version of ours (its initial label is "default") take `fallback_version`.
    Neighbouring spans of one version are merged."""
    if not labelled:
        return [[fallback_version, 0, tokens]] if tokens else []
    spans: list[list[int]] = []
    for span in labelled:
        version = int(span.version) if str(span.version).isdigit() else fallback_version
        if span.end <= span.start:
            continue
        if spans and spans[-1][0] == version and spans[-1][2] == span.start:
            spans[-1][2] = span.end
        else:
            spans.append([version, span.start, span.end])
    return spans


def oldest_version(completions: list[Completion], fallback_version: int) -> int:
    """The oldest policy version among the tokens of a group: its lag is measured from this one."""
    return min((span[0] for c in completions for span in c["version_spans"]), default=fallback_version)


def newest_version(completions: list[Completion], fallback_version: int) -> int:
    return max((span[0] for c in completions for span in c["version_spans"]), default=fallback_version)
