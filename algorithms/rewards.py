"""Reward shaping applied to each response's verifier reward before the group advantages see it."""

from __future__ import annotations


def overlong_penalty(response_tokens: int, max_new_tokens: int, buffer_tokens: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to max_new_tokens - buffer_tokens, then
    falling linearly to -penalty at max_new_tokens, where the generator cuts a response off.

    A response that reaches the cap is usually unfinished; a hard -penalty at the cap alone would punish a
    sound answer one token too long as hard as rambling, so the buffer grades the approach. 0 when
    `buffer_tokens` is 0 (off).
    """
    if buffer_tokens <= 0:
        return 0.0
    excess = response_tokens - (max_new_tokens - buffer_tokens)
    if excess <= 0:
        return 0.0
    return -penalty * min(excess, buffer_tokens) / buffer_tokens
