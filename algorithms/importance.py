"""Importance-weighting stabilizers: the REINFORCE form sg(weight) * A * grad log pi.

Truncation (TIS) caps the weight; masking (MIS, IcePop, OPSM) zeroes it. CISPO is a two-sided
truncation; TOPR truncates the negative-advantage sequences only. Ratios are learner over behaviour
(verl's bypass mode): the generator's log-probs are the only behaviour record an asynchronous
rollout carries.

Token rules start from the batch's cached ratio (0 on padding, its exp shared with the health
metrics) and use float 0/1 arithmetic; sequence rules decide per sequence and spend one [B, T] pass
on the weights, taking their metrics from the [B] sequence values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights, count_above, outside_band, zero_where_set
from algorithms.stabilizer import Stabilizer, register


def _weight_metrics(batch: PolicyBatch, weights: Tensor, clipped_count: Tensor | None = None) -> dict[str, Tensor]:
    """Mean and max IS weight over the loss tokens, and the share of tokens a cap or clip changed."""
    metrics = {"stability/is_weight_mean": batch.token_mean(weights), "stability/is_weight_max": weights.max()}
    if clipped_count is not None:
        metrics["stability/clip_frac"] = clipped_count / batch.token_count
    return metrics


def _loss_tokens_above(batch: PolicyBatch, log_bound: float) -> Tensor:
    """How many loss tokens have a log-ratio above `log_bound` (padding, at log-ratio 0, only if it can count)."""
    if log_bound >= 0:
        return count_above(batch.log_ratio, log_bound)
    return torch.sub(batch.log_ratio, log_bound).sign_().clamp_(min=0).mul_(batch.mask_float).sum()


def _token_mean_of(seq_values: Tensor, batch: PolicyBatch) -> Tensor:
    """Mean over the loss tokens of a [B] value each token takes from its sequence (for 0/1 flags, the
    share of the loss tokens whose sequence is flagged), from the [B] values alone."""
    return (seq_values * batch.token_lengths).sum() / batch.token_count


def _sequence_weight_metrics(batch: PolicyBatch, seq_weights: Tensor) -> dict[str, Tensor]:
    """`_weight_metrics` of weights shared by all tokens of a sequence, from the [B] values alone."""
    has_tokens = (batch.token_lengths > 0).float()
    return {
        "stability/is_weight_mean": _token_mean_of(seq_weights, batch),
        # padding (weight 0) lowers no maximum of non-negative weights; an empty batch gives 0
        "stability/is_weight_max": (seq_weights * has_tokens).max(),
    }


def _sequence_fraction(flags: Tensor, batch: PolicyBatch) -> Tensor:
    """Share of the non-empty sequences whose float 0/1 flag [B] is set."""
    has_tokens = (batch.token_lengths > 0).float()
    return (flags * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def _per_token(seq_values: Tensor, batch: PolicyBatch) -> Tensor:
    """A [B] value on every loss token of its sequence, 0 on padding: one [B, T] pass."""
    return seq_values.unsqueeze(1) * batch.mask_float


@register("none")
class NoStabilizer(Stabilizer):
    """On-policy REINFORCE/GRPO: every loss token has weight 1; behaviour log-probs are ignored."""

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return TokenWeights(batch.mask_float, batch.mask, {})


@register("tis_token")
class TokenTIS(Stabilizer):
    """Token TIS: sg(min(rho_t, C))."""

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        weights = batch.ratio.clamp(max=self.config.cap)
        capped = _loss_tokens_above(batch, math.log(self.config.cap))
        return TokenWeights(weights, batch.mask, _weight_metrics(batch, weights, capped))


def _capped_sequence_weights(batch: PolicyBatch, cap: float) -> tuple[Tensor, Tensor]:
    """min(w, C) per sequence [B], compared in log space, and a 0/1 flag [B] where the cap changed it."""
    log_cap = math.log(cap)
    capped = torch.sign(batch.seq_log_ratio - log_cap).clamp_(min=0)
    return torch.exp(batch.seq_log_ratio.clamp(max=log_cap)), capped


def sequence_tis_weights(batch: PolicyBatch, cap: float) -> TokenWeights:
    """sg(min(w, C)) on every token of a sequence, w = exp(clamp(sum_t l_t, +-20))."""
    seq_weights, capped = _capped_sequence_weights(batch, cap)
    metrics = _sequence_weight_metrics(batch, seq_weights)
    metrics["stability/clip_frac"] = _token_mean_of(capped, batch)
    return TokenWeights(_per_token(seq_weights, batch), batch.mask, metrics)


@register("tis_seq")
class SequenceTIS(Stabilizer):
    """Sequence TIS: one truncated weight per sequence, shared by its tokens."""

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return sequence_tis_weights(batch, self.config.cap)


def _sequence_mis(batch: PolicyBatch, log_stat: Tensor, low: float, high: float) -> TokenWeights:
    """MIS on a per-sequence log statistic [B]: weight exp(stat) inside [low, high], else the sequence leaves
    the loss."""
    keep = 1.0 - outside_band(log_stat, math.log(low), math.log(high))
    seq_weights = torch.exp(log_stat.clamp(max=math.log(high))) * keep
    metrics = _sequence_weight_metrics(batch, seq_weights)
    metrics["stability/mask_frac"] = 1 - _token_mean_of(keep, batch)
    metrics["stability/seq_mask_frac"] = _sequence_fraction(1.0 - keep, batch)
    return TokenWeights(_per_token(seq_weights, batch), _per_token(keep, batch), metrics)


@register("mis_token")
class TokenMIS(Stabilizer):
    """Token MIS: tokens with rho_t outside [low, high] are removed from the loss and its denominator."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        c = self.config
        outside = outside_band(batch.log_ratio, math.log(c.low), math.log(c.high))
        keep = torch.addcmul(batch.mask_float, batch.mask_float, outside, value=-1.0)
        kept_per_seq = keep.sum(dim=1)
        weights = zero_where_set(batch.ratio, outside)
        metrics = _weight_metrics(batch, weights)
        metrics["stability/mask_frac"] = 1 - kept_per_seq.sum() / batch.token_count
        dropped_any = torch.sign(batch.token_lengths - kept_per_seq)
        metrics["stability/seq_mask_frac"] = _sequence_fraction(dropped_any, batch)
        return TokenWeights(weights, keep, metrics)


@register("mis_seq")
class SequenceMIS(Stabilizer):
    """Sequence MIS: a sequence with w outside [low, high] is dropped; kept ones get weight w."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return _sequence_mis(batch, batch.seq_log_ratio, self.config.low, self.config.high)


@register("mis_geo")
class GeometricMIS(Stabilizer):
    """Geometric MIS: drop a sequence whose exp(mean_t l_t) leaves a tight band around 1."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        log_geo = batch.seq_log_ratio / batch.token_lengths.clamp(min=1)
        return _sequence_mis(batch, log_geo, self.config.low, self.config.high)


@register("icepop")
class IcePop(Stabilizer):
    """IcePop: weight rho_t inside [low, high], else 0; masked tokens keep their place in the denominator."""

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        c = self.config
        zeroed = outside_band(batch.log_ratio, math.log(c.low), math.log(c.high))
        if not c.low <= 1.0 <= c.high:
            zeroed.mul_(batch.mask_float)  # padding (log-ratio 0) would count as zeroed
        n_kept = batch.token_lengths.sum() - zeroed.sum()
        weights = zero_where_set(batch.ratio, zeroed)
        metrics = _weight_metrics(batch, weights)
        metrics["stability/mask_frac"] = 1 - n_kept / batch.token_count
        return TokenWeights(weights, batch.mask, metrics)


@register("opsm")
class OffPolicySequenceMasking(Stabilizer):
    """DeepSeek-V3.2 OPSM: zero a sequence with A < 0 whose mean_t log(mu/pi) exceeds delta.

    Positive-advantage sequences are always kept; dropped ones stay in the denominator as in the
    paper's formula, where the mask multiplies the summand.
    """

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        mean_log_mu_over_pi = -batch.seq_log_ratio / batch.token_lengths.clamp(min=1)
        drop = ((batch.seq_advantages < 0) & (mean_log_mu_over_pi > self.config.delta)).float()
        metrics = {
            "stability/mask_frac": _token_mean_of(drop, batch),
            "stability/seq_mask_frac": _sequence_fraction(drop, batch),
        }
        return TokenWeights(_per_token(1.0 - drop, batch), batch.mask, metrics)


@register("topr")
class TOPR(Stabilizer):
    """Tapered off-policy REINFORCE: sequences with A >= 0 keep weight 1, those with A < 0 get sg(min(w, C)).

    A stale good answer is learned from as if on-policy, however unlikely the learner now finds it; a
    stale bad one is pushed down only as far as the learner still produces it, which keeps the
    objective bounded (the paper's C is 1).
    """

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        negative = batch.seq_advantages < 0
        truncated, capped = _capped_sequence_weights(batch, self.config.cap)
        seq_weights = torch.where(negative, truncated, 1.0)
        metrics = _sequence_weight_metrics(batch, seq_weights)
        metrics["stability/clip_frac"] = _token_mean_of(capped * negative.float(), batch)
        return TokenWeights(_per_token(seq_weights, batch), batch.mask, metrics)


@register("cispo")
class CISPO(Stabilizer):
    """CISPO: sg(clip(rho_t, 1 - eps_low, 1 + eps_high)); clipped tokens still get gradient."""

    decides_per_row = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        low, high = max(0.0, 1.0 - self.config.eps_low), 1.0 + self.config.eps_high
        weights = batch.ratio.clamp(low, high)
        if low > 0:
            weights.mul_(batch.mask_float)  # the floor lifted padding's 0 to `low`
            outside = outside_band(batch.log_ratio, math.log(low), math.log(high))
            if not low <= 1.0 <= high:
                outside.mul_(batch.mask_float)  # padding (log-ratio 0) would count as clipped
            clipped = outside.sum()
        else:
            clipped = _loss_tokens_above(batch, math.log(high))
        return TokenWeights(weights, batch.mask, _weight_metrics(batch, weights, clipped))
