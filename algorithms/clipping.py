"""Clipped-surrogate stabilizers: PPO-clip, GSPO, BAPO.

The gradient of min(r A, clip(r, lo, hi) A) is r A grad log pi where the unclipped branch is active
and 0 where the clip binds, so each is expressed as the detached weight r * active; the learner's
single policy-gradient loss then gives exactly the clipped surrogate's gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights, fraction, safe_exp
from algorithms.config import LOG_RATIO_BOUND
from algorithms.stabilizer import Stabilizer, register


def step_indicator(x: Tensor) -> Tensor:
    """1.0 where x > 0, else 0.0, in float arithmetic (boolean masks cost several times more on CPU)."""
    return torch.sign(x).clamp(min=0)


def clip_active(log_ratio: Tensor, advantages: Tensor, low: float, high: float, dual_clip_c: float | None) -> Tensor:
    """1.0 where the clipped PPO surrogate still has gradient for ratio bounds [low, high], else 0.0.

    A > 0 loses gradient above `high`; A < 0 below `low`, and above `dual_clip_c` (dual clip).
    Compared in log space so that +-1000 log-ratios never overflow. `advantages` broadcasts against
    `log_ratio` ([B, 1] against [B, T] costs nothing per token). With low < 1 < high, a padded token
    (log-ratio 0) is never clipped: the caller multiplies by its mask.
    """
    log_low = math.log(low) if low > 0 else -math.inf
    sign = torch.sign(advantages)
    clipped_low = step_indicator(log_low - log_ratio)
    if dual_clip_c is not None:
        clipped_low = clipped_low + step_indicator(log_ratio - math.log(dual_clip_c))
    clipped = sign.clamp(min=0) * step_indicator(log_ratio - math.log(high)) + (-sign).clamp(min=0) * clipped_low
    return 1.0 - clipped


def clipped_surrogate_weights(
    batch: PolicyBatch, low: float, high: float, dual_clip_c: float | None
) -> TokenWeights:
    """Token PPO surrogate with ratio bounds [low, high] as detached weights, with its clip fraction."""
    advantages = batch.advantages.unsqueeze(1) if batch.advantages.dim() == 1 else batch.advantages
    active = clip_active(batch.log_ratio, advantages, low, high, dual_clip_c) * batch.mask_float
    weights = torch.exp(batch.log_ratio.clamp(max=LOG_RATIO_BOUND)) * active
    clipped = (batch.mask_float - active) * torch.sign(advantages).abs()
    return TokenWeights(weights, batch.mask, {"stability/clip_frac": batch.token_mean(clipped)})


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
        has_tokens = batch.token_lengths > 0
        weights = (safe_exp(log_s) * active).unsqueeze(1) * batch.mask_float
        clipped = (1.0 - active) * torch.sign(batch.seq_advantages).abs()
        metrics = {"stability/clip_frac": fraction(clipped > 0, has_tokens)}
        return TokenWeights(weights, batch.mask, metrics)
