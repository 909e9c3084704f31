"""M2PO: second-moment trust region (Zheng, Zhao, Chen; arXiv 2510.01161).

Two forms, selected by `M2POConfig.mode`:

- `mask` (the paper's Algorithm 1, default): among trust-region tokens, those where PPO clipping could
  bind ((A > 0 and r > 1) or (A < 0 and r < 1)), mask the largest (log r)^2 until their mean is at
  most tau. Greedy removal of the maximum always keeps a sorted prefix, so one sort finds the longest
  prefix whose running mean is <= tau. The objective is unclipped r A over the kept tokens, normalised
  by all tokens: masked tokens get weight 0 but stay in the denominator.
- `adaptive_clip` (the released code): no masking; if the trust-region M2 exceeds tau, cap the
  (log r)^2 values at tau_c^2, with tau_c^2 the largest value whose capping keeps the M2 within budget,
  and apply the PPO clip range [exp(-tau_c), exp(tau_c)] (no dual clip).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights, fraction, safe_exp
from algorithms.clipping import clipped_surrogate_weights
from algorithms.stabilizer import Stabilizer, register


def trust_region_tokens(log_ratio: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Tokens where a PPO clip could bind: (A > 0 and r > 1) or (A < 0 and r < 1)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return mask.bool() & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))


def m2po_token_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor, tau: float = 0.04) -> Tensor:
    """M2PO Algorithm 1: True where a token is kept.

    Padding (mask False) is returned False. Masked tokens are the trust-region tokens with the largest
    (log r)^2, removed until the mean over the remaining trust-region tokens is <= tau.
    """
    log_ratio = log_ratio.detach().float()
    mask = mask.bool()
    region = trust_region_tokens(log_ratio, advantages, mask)
    m2 = torch.where(region, log_ratio * log_ratio, torch.zeros_like(log_ratio))
    n_region = region.sum()
    if n_region == 0 or m2.sum() <= tau * n_region:
        return mask
    values = m2[region]
    sorted_values, order = torch.sort(values)
    running_mean = torch.cumsum(sorted_values.double(), 0) / torch.arange(
        1, values.numel() + 1, dtype=torch.float64, device=values.device
    )
    # The running mean of an ascending sequence never decreases, so the kept set is a prefix.
    n_keep = int((running_mean <= tau).sum())
    keep_region = torch.zeros_like(values, dtype=torch.bool)
    keep_region[order[:n_keep]] = True
    keep = mask.clone()
    keep[region] = keep_region
    return keep


def adaptive_clip_tau(region_m2: Tensor, tau: float) -> float | None:
    """The released code's clip half-width: None (no clipping) when mean M2 <= tau, else tau_c.

    tau_c^2 is the largest trust-region (log r)^2 value v such that sum_i min(v_i, v) <= tau * N.
    """
    n = region_m2.numel()
    if n == 0 or float(region_m2.mean()) <= tau:
        return None
    sorted_values, _ = torch.sort(region_m2.double())
    prefix = torch.cumsum(sorted_values, 0) - sorted_values  # sum of values strictly before index j
    remaining = torch.arange(n, 0, -1, dtype=torch.float64, device=sorted_values.device)
    capped_total = prefix + remaining * sorted_values
    fits = capped_total <= tau * n
    if not bool(fits.any()):
        return 0.0
    return math.sqrt(float(sorted_values[fits].max()))


@register("m2po")
class M2PO(Stabilizer):
    """Second-moment trust region; see the module docstring for the two forms."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        region = trust_region_tokens(batch.log_ratio, batch.advantages, batch.mask)
        m2_before = batch.log_ratio.square()[region]
        metrics = {"stability/m2": m2_before.mean() if m2_before.numel() else torch.zeros(())}
        if self.config.mode == "adaptive_clip":
            return self._adaptive_clip(batch, m2_before, metrics)
        keep = m2po_token_mask(batch.log_ratio, batch.advantages, batch.mask, self.config.tau)
        weights = torch.where(keep, safe_exp(batch.log_ratio), torch.zeros_like(batch.log_ratio))
        kept_region = batch.log_ratio.square()[region & keep]
        metrics["stability/m2_after"] = kept_region.mean() if kept_region.numel() else torch.zeros(())
        metrics["stability/mask_frac"] = fraction(~keep, batch.mask)
        return TokenWeights(weights, batch.mask, metrics)

    def _adaptive_clip(self, batch: PolicyBatch, m2_before: Tensor, metrics: dict[str, Tensor]) -> TokenWeights:
        tau_c = adaptive_clip_tau(m2_before, self.config.tau)
        if tau_c is None:
            low, high, m2_after = 0.0, 1e5, metrics["stability/m2"]
        else:
            low, high = math.exp(-tau_c), math.exp(tau_c)
            m2_after = m2_before.clamp(max=tau_c * tau_c).mean()
        result = clipped_surrogate_weights(batch, low, high, None)
        result.metrics.update(metrics)
        result.metrics["stability/m2_after"] = m2_after
        result.metrics["stability/clip_low"] = torch.tensor(low)
        result.metrics["stability/clip_high"] = torch.tensor(high)
        return result
