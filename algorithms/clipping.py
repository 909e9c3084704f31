"""Clipped-surrogate stabilizers: PPO-clip, GSPO, BAPO.

The gradient of min(r A, clip(r, lo, hi) A) is r A grad log pi where the unclipped branch is active
and 0 where the clip binds, so each is expressed as the detached weight r * active; the learner's
single policy-gradient loss then gives exactly the clipped surrogate's gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights, fraction, safe_exp, zero_where_set
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


def unclipped_log_bounds(
    advantages: Tensor, low: float, high: float, dual_clip_c: float | None
) -> tuple[Tensor, Tensor]:
    """Per row (or per token) log-ratio interval [lo, hi] where the clipped surrogate keeps its gradient.

    A > 0: (-inf, log high]; A < 0: [log low, log c] (log c = inf without dual clip); A = 0: everywhere.
    For [B] advantages the bounds are [B, 1] columns, so a token pass broadcasts them for free.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_low = math.log(low) if low > 0 else -math.inf
    log_c = math.log(dual_clip_c) if dual_clip_c is not None else math.inf
    negative = advantages < 0
    lo = torch.where(negative, log_low, -math.inf)
    hi = torch.where(advantages > 0, math.log(high), torch.where(negative, log_c, math.inf))
    return lo, hi


def clip_excess(log_ratio: Tensor, advantages: Tensor, low: float, high: float, dual_clip_c: float | None) -> Tensor:
    """max(lo - l, l - hi) over each token's unclipped interval [lo, hi], a fresh [B, T] tensor: > 0 exactly
    where the clip binds (by how far l lies outside), <= 0 inside. Exact: a difference of two floats is
    > 0 exactly when the first is larger.

    NaN only for an infinite log-ratio at an open side of its interval, which the clip leaves alone.
    """
    lo, hi = unclipped_log_bounds(advantages, low, high, dual_clip_c)
    below = torch.sub(lo, log_ratio)
    return torch.maximum(below, torch.sub(log_ratio, hi), out=below)


def clips_padding(low: float, high: float, dual_clip_c: float | None) -> bool:
    """Whether these bounds clip a log-ratio of 0, which padding has: then a caller must mask it out."""
    return not (low <= 1.0 <= high and (dual_clip_c is None or dual_clip_c >= 1.0))


def clip_flags(
    log_ratio: Tensor, advantages: Tensor, mask_float: Tensor, low: float, high: float, dual_clip_c: float | None
) -> Tensor:
    """Float 0/1 [B, T], a fresh tensor: 1 on the loss tokens where the clipped surrogate has no gradient.

    `log_ratio` must be 0 on padding. Without dual clip each row has a single bound, so
    sign((l - bound) * sign(A)) flags it in fewer passes than the interval clamp.
    """
    if dual_clip_c is None:
        advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        log_low = math.log(low) if low > 0 else -math.inf
        bound = torch.where(advantages > 0, math.log(high), log_low)
        # A > 0: l > log high; A < 0: l < log low; A = 0: never
        clipped = torch.sub(log_ratio, bound).sign_().mul_(torch.sign(advantages)).clamp_(min=0)
    else:
        # inf - inf is NaN only for an infinite log-ratio at an open side, i.e. unclipped
        clipped = clip_excess(log_ratio, advantages, low, high, dual_clip_c).sign_().clamp_(min=0).nan_to_num_(0.0)
    if clips_padding(low, high, dual_clip_c):
        clipped.mul_(mask_float)  # padding (log-ratio 0) would count as clipped
    return clipped


def clipped_surrogate_weights(batch: PolicyBatch, low: float, high: float, dual_clip_c: float | None) -> TokenWeights:
    """Token PPO surrogate with ratio bounds [low, high] as detached weights, with its clip fraction.

    One fresh [B, T] tensor carries the 0/1 clip flags and then the weights.
    """
    clipped = clip_flags(batch.log_ratio, batch.advantages, batch.mask_float, low, high, dual_clip_c)
    # A = 0 is never clipped, so every counted token is a loss token with A != 0, as the metric asks
    clip_frac = clipped.sum() / batch.token_count
    weights = zero_where_set(batch.ratio, clipped)
    return TokenWeights(weights, batch.mask, {"stability/clip_frac": clip_frac})


@register("ppo_clip")
class PPOClip(Stabilizer):
    """Token PPO-clip against the behaviour policy, with dual clip: the DAPO/GRPO surrogate."""

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        c = self.config
        return clipped_surrogate_weights(batch, 1.0 - c.eps_low, 1.0 + c.eps_high, c.dual_clip_c)


@register("gspo")
class GSPO(Stabilizer):
    """GSPO: clip the geometric sequence ratio s_i = exp(mean_t l_t); GSPO-token gradient form.

    With seq-mean-token-mean aggregation the weight s_i on each token reproduces
    grad s_i = s_i (1/|y_i|) sum_t grad log pi exactly.
    """

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        c = self.config
        log_s = batch.seq_log_ratio / batch.token_lengths.clamp(min=1)
        active = clip_active(log_s, batch.seq_advantages, 1.0 - c.eps_low, 1.0 + c.eps_high, None)
        has_tokens = batch.token_lengths > 0
        weights = (safe_exp(log_s) * active).unsqueeze(1) * batch.mask_float
        clipped = (1.0 - active) * torch.sign(batch.seq_advantages).abs()
        metrics = {"stability/clip_frac": fraction(clipped > 0, has_tokens)}
        return TokenWeights(weights, batch.mask, metrics)
