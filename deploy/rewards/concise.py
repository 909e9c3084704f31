"""An example reward function for the `dataset` task (`task.reward: deploy/rewards/concise.py:score`).

It is called as score(completion, answer, row) in a reward worker process: `answer` is the row's
`task.answer_field` value as it is in the file, `row` the whole JSON row. Return a float; an exception,
a hang past `scoring.timeout_s` or a non-number fails that sample only (reward 0, a score error in the
ledger).
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def score(completion: str, answer: Any, row: dict[str, Any]) -> float:
    """1.0 for the gold inside the last <answer></answer> tags, less 0.1 per 100 characters over 200."""
    found = _ANSWER.findall(completion)
    if not found:
        return 0.0
    if found[-1].strip() != str(answer).strip():
        return 0.1
    return max(0.5, 1.0 - 0.1 * (max(0, len(completion) - 200) // 100))
