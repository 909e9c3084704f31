"""The learner's input record: one response as `learner/batch.py`'s collate takes it. A typed dict, so Ray ships
it and checkpoints write it as a plain dict."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TrainingSample(TypedDict):
    """One response as the learner's collate takes it (`learner/batch.py` pads these into a TrainBatch)."""

    prompt_ids: list[int]  # [P] the chat prompt's token ids
    completion_ids: list[int]  # [T]
    behaviour_logprobs: list[float]  # [T]; zeros for supervised samples (their ratio is unused)
    policy_mask: NotRequired[list[int]]  # [T] 0 on tool-result tokens, which are not trained on (absent: all 1)
    reward: float
    group_id: int  # the prompt group: advantages are computed within it
    version: int  # the policy version that sampled it
