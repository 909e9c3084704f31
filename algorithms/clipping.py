"""Clipped-surrogate stabilizers: PPO-clip, GSPO, BAPO.

The gradient of min(r A, clip(r, lo, hi) A) is r A grad log pi where the unclipped branch is active
and 0 where the clip binds, so each is expressed as the detached weight r * active; the learner's
single policy-gradient loss then gives exactly the clipped surrogate's gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights, broadcast_seq, fraction, safe_exp
from algorithms.config import LOG_RATIO_BOUND
from algorithms.stabilizer import Stabilizer, register


def clip_active(log_ratio: Tensor, advantages: Tensor, low: float, high: float, dual_clip_c: float | None) -> Tensor:
    """Where the clipped PPO surrogate still has gradient, for ratio bounds [low, high].

    A > 0 loses gradient above `high`; A < 0 below `low`, and above `dual_clip_c` (dual clip).
    Compared in log space so that +-1000 log-ratios never overflow.
    """
    log_low = math.log(low) if low > 0 else -math.inf
    clipped = ((advantages > 0) & (log_ratio > math.log(high))) | ((advantages < 0) & (log_ratio < log_low))
    if dual_clip_c is not None:
        clipped |= (advantages < 0) & (log_ratio > math.log(dual_clip_c))
    return ~clipped


def clipped_surrogate_weights(
    batch: PolicyBatch, low: float, high: float, dual_clip_c: float | None
) -> TokenWeights:
    """Token PPO surrogate with ratio bounds [low, high] as detached weights, with its clip fraction."""
    advantages = batch.token_advantages
    active = clip_active(batch.log_ratio, advantages, low, high, dual_clip_c) & batch.mask
    weights = torch.exp(batch.log_ratio.clamp(max=LOG_RATIO_BOUND)) * active
    clipped = ~active & batch.mask & (advantages != 0)
    return TokenWeights(weights, batch.mask, {"stability/clip_frac": batch.token_mean(clipped.float())})


@register("ppo_clip")
class PPOClip(Stabilizer):
    """Token PPO-clip against the behaviour policy, with dual clip: the DAPO/GRPO surrogate."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        c = self.config
        return clipped_surrogate_weights(batch, 1.0 - c.eps_low, 1.0 + c.eps_high, c.dual_clip_c)


@register("gspo")
class GSPO(Stabilizer):
    """GSPO: clip the geometric sequence ratio s_i = exp(mean_t l_t); GSPO-token gradient form.

    With seq-mean-token-mean aggregation the weight s_i on each token reproduces
    grad s_i = s_i (1/|y_i|) sum_t grad log pi exactly.
    """

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        c = self.config
        log_s = batch.seq_log_ratio / batch.token_lengths.clamp(min=1)
        active = clip_active(log_s, batch.seq_advantages, 1.0 - c.eps_low, 1.0 + c.eps_high, None)
        has_tokens = batch.mask.any(1)
        weights = broadcast_seq(torch.where(active, safe_exp(log_s), torch.zeros_like(log_s)), batch.mask)
        metrics = {"stability/clip_frac": fraction(~active & (batch.seq_advantages != 0), has_tokens)}
        return TokenWeights(weights * batch.mask, batch.mask, metrics)
