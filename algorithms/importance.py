"""Importance-weighting stabilizers: the REINFORCE form sg(weight) * A * grad log pi.

Truncation (TIS) caps the weight; masking (MIS, IcePop, OPSM) zeroes it. CISPO is a two-sided
truncation. Ratios are learner over behaviour (verl's bypass mode): the generator's log-probs are the
only behaviour record an asynchronous rollout carries.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights, broadcast_seq, fraction
from algorithms.stabilizer import Stabilizer, register


def _weight_metrics(batch: PolicyBatch, weights: Tensor, clipped: Tensor | None = None) -> dict[str, Tensor]:
    """Mean and max IS weight over the loss tokens, and the share of tokens a cap or clip changed."""
    metrics = {"stability/is_weight_mean": batch.token_mean(weights), "stability/is_weight_max": weights.max()}
    if clipped is not None:
        metrics["stability/clip_frac"] = batch.token_mean((clipped & batch.mask).float())
    return metrics


def _capped_exp(log_value: Tensor, cap: float, mask_float: Tensor) -> Tensor:
    """min(exp(l), cap) on loss tokens, 0 on padding; capping in log space keeps it finite."""
    return torch.exp(log_value.clamp(max=math.log(cap))) * mask_float


def _in_bounds(log_stat: Tensor, low: float, high: float) -> Tensor:
    """low <= exp(log_stat) <= high, decided in log space so +-1000 never overflows."""
    return (log_stat >= math.log(low)) & (log_stat <= math.log(high))


@register("none")
class NoStabilizer(Stabilizer):
    """On-policy REINFORCE/GRPO: every loss token has weight 1; behaviour log-probs are ignored."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return TokenWeights(batch.mask_float, batch.mask, {})


@register("tis_token")
class TokenTIS(Stabilizer):
    """Token TIS: sg(min(rho_t, C))."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        weights = _capped_exp(batch.log_ratio, self.config.cap, batch.mask_float)
        capped = batch.log_ratio > math.log(self.config.cap)
        return TokenWeights(weights, batch.mask, _weight_metrics(batch, weights, capped))


def sequence_tis_weights(batch: PolicyBatch, cap: float) -> TokenWeights:
    """sg(min(w, C)) on every token of a sequence, w = exp(clamp(sum_t l_t, +-20))."""
    seq_weight = torch.exp(batch.seq_log_ratio.clamp(max=math.log(cap)))
    weights = broadcast_seq(seq_weight, batch.mask) * batch.mask_float
    capped = broadcast_seq(batch.seq_log_ratio > math.log(cap), batch.mask)
    return TokenWeights(weights, batch.mask, _weight_metrics(batch, weights, capped))


@register("tis_seq")
class SequenceTIS(Stabilizer):
    """Sequence TIS: one truncated weight per sequence, shared by its tokens."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return sequence_tis_weights(batch, self.config.cap)


def _masked_is(batch: PolicyBatch, log_stat: Tensor, low: float, high: float) -> TokenWeights:
    """MIS: weight = the ratio statistic where it lies in [low, high]; elsewhere the unit leaves the loss."""
    keep = _in_bounds(log_stat, low, high) & batch.mask
    weights = torch.exp(log_stat.clamp(max=math.log(high))) * keep
    metrics = _weight_metrics(batch, weights)
    metrics["stability/mask_frac"] = 1 - keep.sum() / batch.token_count
    metrics["stability/seq_mask_frac"] = fraction((batch.mask & ~keep).any(1), batch.mask.any(1))
    return TokenWeights(weights, keep, metrics)


@register("mis_token")
class TokenMIS(Stabilizer):
    """Token MIS: tokens with rho_t outside [low, high] are removed from the loss and its denominator."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return _masked_is(batch, batch.log_ratio, self.config.low, self.config.high)


@register("mis_seq")
class SequenceMIS(Stabilizer):
    """Sequence MIS: a sequence with w outside [low, high] is dropped; kept ones get weight w."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return _masked_is(batch, broadcast_seq(batch.seq_log_ratio, batch.log_ratio), self.config.low, self.config.high)


@register("mis_geo")
class GeometricMIS(Stabilizer):
    """Geometric MIS: drop a sequence whose exp(mean_t l_t) leaves a tight band around 1."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        log_geo = batch.seq_log_ratio / batch.token_lengths.clamp(min=1)
        return _masked_is(batch, broadcast_seq(log_geo, batch.log_ratio), self.config.low, self.config.high)


@register("icepop")
class IcePop(Stabilizer):
    """IcePop: weight rho_t inside [low, high], else 0; masked tokens keep their place in the denominator."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        keep = _in_bounds(batch.log_ratio, self.config.low, self.config.high) & batch.mask
        weights = torch.exp(batch.log_ratio.clamp(max=math.log(self.config.high))) * keep
        metrics = _weight_metrics(batch, weights)
        metrics["stability/mask_frac"] = 1 - keep.sum() / batch.token_count
        return TokenWeights(weights, batch.mask, metrics)


@register("opsm")
class OffPolicySequenceMasking(Stabilizer):
    """DeepSeek-V3.2 OPSM: zero a sequence with A < 0 whose mean_t log(mu/pi) exceeds delta.

    Positive-advantage sequences are always kept; dropped ones stay in the denominator as in the
    paper's formula, where the mask multiplies the summand.
    """

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        mean_log_mu_over_pi = -batch.seq_log_ratio / batch.token_lengths.clamp(min=1)
        drop = (batch.seq_advantages < 0) & (mean_log_mu_over_pi > self.config.delta)
        weights = batch.mask_float * ~broadcast_seq(drop, batch.mask)
        metrics = {
            "stability/mask_frac": batch.token_mean(batch.mask_float - weights),
            "stability/seq_mask_frac": fraction(drop, batch.mask.any(1)),
        }
        return TokenWeights(weights, batch.mask, metrics)


@register("cispo")
class CISPO(Stabilizer):
    """CISPO: sg(clip(rho_t, 1 - eps_low, 1 + eps_high)); clipped tokens still get gradient."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        low, high = max(0.0, 1.0 - self.config.eps_low), 1.0 + self.config.eps_high
        weights = _capped_exp(batch.log_ratio, high, batch.mask_float).clamp(min=low) * batch.mask_float
        log_low = math.log(low) if low > 0 else -math.inf
        clipped = (batch.log_ratio > math.log(high)) | (batch.log_ratio < log_low)
        return TokenWeights(weights, batch.mask, _weight_metrics(batch, weights, clipped))
