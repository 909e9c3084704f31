"""The learning-rate schedule of the RL steps: a linear warm-up, then constant or a decay to a floor.

Pure Python: a function of the RL step alone (the SFT warm-up's steps, which make policy versions too, do not
count), so a resumed run continues the schedule from the RL step count its checkpoint restored.
"""

from __future__ import annotations

import math
from typing import Literal

LRSchedule = Literal["constant", "linear", "cosine"]


def lr_factor(
    step: int, total_steps: int, warmup_steps: int = 0, schedule: LRSchedule = "constant", min_ratio: float = 0.0
) -> float:
    """Multiplier on `learner.learning_rate` for RL step `step` (0-based; the SFT warm-up's steps do not count).

    The first `warmup_steps` steps ramp linearly from 1/warmup_steps to 1; after them `constant` stays at 1,
    while `linear` and `cosine` decay to `min_ratio`, reached at the last step (total_steps - 1).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = total_steps - 1 - warmup_steps
    progress = min(1.0, (step - warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    if schedule == "linear":
        shape = 1.0 - progress
    elif schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; choose constant, linear or cosine")
    return min_ratio + (1.0 - min_ratio) * shape
