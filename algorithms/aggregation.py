"""Token-loss aggregation: the one place that turns per-token losses into a scalar.

Stabilizers never normalise. The learner calls `loss_denominator` on its local batch, may all-reduce
it across data-parallel ranks, and passes it back to `aggregate_token_loss`, so every rank divides by
the global count.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.config import LossAggregation

AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)


def _as_float(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    if mask.dtype == torch.bool:  # via uint8: bool -> float is several times slower on CPU
        return mask.view(torch.uint8).to(dtype)
    return mask if mask.dtype == dtype else mask.to(dtype)


def loss_denominator(mask: Tensor, mode: LossAggregation, constant_tokens: float | None = None) -> Tensor:
    """Local denominator of `mode`: tokens for token-mean, non-empty sequences for seq-mean-*.

    For `constant` (Dr.GRPO) it is non-empty sequences times the constant length `constant_tokens`.
    `mask` may be boolean or a float 0/1 mask (cheaper on CPU when the caller already has one).
    """
    lengths = _as_float(mask).sum(dim=1)
    if mode == "token-mean":
        return lengths.sum()
    sequences = (lengths > 0).sum().float()
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return sequences
    if mode == "constant":
        if constant_tokens is None or constant_tokens <= 0:
            raise ValueError("loss aggregation 'constant' needs constant_tokens > 0 (e.g. max response tokens)")
        return sequences * constant_tokens
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGGREGATIONS}")


def aggregate_token_loss(
    token_loss: Tensor,
    mask: Tensor,
    mode: LossAggregation,
    denominator: Tensor | None = None,
    constant_tokens: float | None = None,
) -> Tensor:
    """Scalar loss from per-token losses [B, T] over `mask`.

    token-mean: sum / tokens. seq-mean-token-mean: mean over sequences of each sequence's token mean.
    seq-mean-token-sum: mean over sequences of token sums. constant: token sums / (sequences * C).
    An all-masked batch gives an exact 0 that still carries the graph (zero gradient, no NaN).
    """
    mask = _as_float(mask, token_loss.dtype)
    masked = token_loss * mask
    if denominator is None:
        denominator = loss_denominator(mask, mode, constant_tokens)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        numerator = per_seq.sum()
    else:
        numerator = masked.sum()
    return numerator / denominator.clamp(min=1).to(token_loss.dtype)


def policy_gradient_loss(
    logprobs: Tensor,
    weights: Tensor,
    advantages: Tensor,
    mask: Tensor,
    mode: LossAggregation,
    denominator: Tensor | None = None,
    constant_tokens: float | None = None,
) -> Tensor:
    """-agg(sg(weights) * A * log pi): its gradient is every stabilizer's policy gradient."""
    token_loss = -(weights.detach() * advantages * logprobs)
    return aggregate_token_loss(token_loss, mask, mode, denominator, constant_tokens)


def policy_loss(
    batch: PolicyBatch,
    decision: TokenWeights,
    mode: LossAggregation,
    denominator: Tensor | None = None,
    constant_tokens: float | None = None,
) -> Tensor:
    """The learner's loss for one batch and its stabilizer's decision (reuses the batch's float mask)."""
    mask = batch.mask_float if decision.mask is batch.mask else decision.mask
    return policy_gradient_loss(
        batch.logprobs, decision.weights, batch.token_advantages, mask, mode, denominator, constant_tokens
    )
