"""The records a response passes through on its way from a generator to the learner.

They are typed dicts: at run time plain dicts, so Ray ships them, checkpoints write them as JSON and
older checkpoints read back unchanged; to a reader and to mypy, records with named, typed fields.
Standard library only (the simulator uses them).
"""

from __future__ import annotations

from typing import TypedDict


class Completion(TypedDict):
    """One response as a generator sampled it."""

    completion_ids: list[int]  # [T] sampled token ids, end-of-turn included when the model stopped
    behaviour_logprobs: list[float]  # [T] log-prob of each sampled token under the generator's weights
    text: str  # the decoded response, what the verifier reads
    finish_reason: str  # "stop", or "length" when cut off at generator.max_new_tokens


class ScoredCompletion(Completion):
    """A response with its reward, as the rollout buffer keeps it."""

    reward: float  # the verifier's reward plus any overlong penalty: what the learner trains on
    score_error: str | None  # why the verifier failed on it (then the reward is the task's failure reward)


class TrainingSample(TypedDict):
    """One response as the learner's collate takes it (`learner/batch.py` pads these into a TrainBatch)."""

    prompt_ids: list[int]  # [P] the chat prompt's token ids
    completion_ids: list[int]  # [T]
    behaviour_logprobs: list[float]  # [T]; zeros for supervised samples (their ratio is unused)
    reward: float
    group_id: int  # the prompt group: advantages are computed within it
    version: int  # the policy version that sampled it
