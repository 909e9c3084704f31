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

from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.config import LOG_RATIO_BOUND
from algorithms.clipping import clipped_surrogate_weights
from algorithms.stabilizer import Stabilizer, register


def trust_region_tokens(log_ratio: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Tokens where a PPO clip could bind: (A > 0 and r > 1) or (A < 0 and r < 1)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return mask.bool() & (advantages * log_ratio > 0)


def _region_indicator(log_ratio: Tensor, advantages: Tensor) -> Tensor:
    """Float 1/0 trust-region indicator for a log-ratio that is already 0 on padding.

    A and log r share a sign exactly in the trust region, and padding has log r = 0; sign() and
    clamp() keep this in float arithmetic, several times cheaper than boolean masks on CPU.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    return torch.sign(advantages * log_ratio).clamp(min=0)


def _candidates_descending(values: Tensor, threshold: float) -> tuple[Tensor, Tensor, Tensor]:
    """Values above `threshold`, largest first (fp64), with their flat indices, and `tail`.

    `tail[m]` for m = 0..K is the sum of all values except the m largest. The candidates' part is
    summed from the small end and the rest as sum(min(v, threshold)) - K threshold, never as
    total - removed, so tiny values keep their weight.
    """
    values = values.double()  # compare and sum in one precision, or ties at tau flip sides
    index = (values > threshold).nonzero().squeeze(1)
    top, order = torch.sort(values[index], descending=True)
    rest = values.clamp(max=threshold).sum() - top.numel() * threshold
    suffix = torch.flip(torch.cumsum(torch.flip(top, (0,)), 0), (0,))
    return top, index[order], rest + torch.cat([suffix, top.new_zeros(1)])


def m2po_token_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor, tau: float = 0.04) -> Tensor:
    """M2PO Algorithm 1: True where a token is kept.

    Padding (mask False) is returned False. Masked tokens are the trust-region tokens with the largest
    (log r)^2, removed until the mean over the remaining trust-region tokens is <= tau.
    """
    mask = mask.bool()
    log_ratio = torch.where(mask, log_ratio.detach().float(), torch.zeros(()))
    region = _region_indicator(log_ratio, advantages)
    dropped, _ = _drop_within_budget(log_ratio * log_ratio * region, int(region.sum()), tau)
    keep = mask.clone()
    keep.view(-1)[dropped] = False
    return keep


def _drop_within_budget(region_m2: Tensor, n_region: int, tau: float) -> tuple[Tensor, Tensor | None]:
    """Algorithm 1 on (log r)^2 that is > 0 on the n_region trust-region tokens and 0 elsewhere.

    Returns the flat indices to mask and the M2 of the kept trust-region tokens (None if nothing is
    masked). Removing the m largest is the sorted-prefix form: find the smallest m whose remaining
    mean is <= tau. Each removed value was the maximum of a set whose mean exceeded tau, so only
    values above tau can be removed: sorting those few replaces a sort of the batch.
    """
    no_drop = torch.zeros(0, dtype=torch.long, device=region_m2.device)
    if n_region == 0 or region_m2.sum(dtype=torch.float64) <= tau * n_region:
        return no_drop, None
    top, index, tail = _candidates_descending(region_m2.reshape(-1), tau)
    removed = torch.arange(0, top.numel() + 1, dtype=torch.float64)
    fits = tail <= tau * (n_region - removed)
    n_drop = int(torch.argmax(fits.to(torch.uint8))) if bool(fits.any()) else top.numel()
    kept = n_region - n_drop
    return index[:n_drop], (tail[n_drop] / kept).float() if kept else torch.zeros(())


def adaptive_clip_tau(region_m2: Tensor, tau: float) -> float | None:
    """The released code's clip half-width: None (no clipping) when mean M2 <= tau, else tau_c.

    tau_c^2 is the largest trust-region (log r)^2 value v such that sum_i min(v_i, v) <= tau * N.
    Capping at the j-th largest value v_j (0-based) gives (sum of all but the j largest) + j v_j.
    Every value <= tau fits, so only values above tau and the largest value <= tau are candidates.
    """
    n = region_m2.numel()
    if n == 0 or region_m2.sum(dtype=torch.float64) <= tau * n:
        return None
    top, _, tail = _candidates_descending(region_m2, tau)
    j = torch.arange(0, top.numel(), dtype=torch.float64)
    fits = (tail[:-1] + j * top) <= tau * n
    if bool(fits.any()):
        return math.sqrt(float(top[int(torch.argmax(fits.to(torch.uint8)))]))
    values = region_m2.double()
    largest_within = float((values * (values <= tau)).max())
    return math.sqrt(largest_within)


@register("m2po")
class M2PO(Stabilizer):
    """Second-moment trust region; see the module docstring for the two forms."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        region = _region_indicator(batch.log_ratio, batch.advantages)
        region_m2 = batch.log_ratio * batch.log_ratio * region
        n_region = int(region.sum())
        m2_before = region_m2.sum() / max(n_region, 1)
        metrics = {"stability/m2": m2_before}
        if self.config.mode == "adaptive_clip":
            return self._adaptive_clip(batch, region_m2[region > 0], metrics)
        dropped, m2_after = _drop_within_budget(region_m2, n_region, self.config.tau)
        keep = batch.mask_float.clone()
        keep.view(-1)[dropped] = 0.0
        weights = torch.exp(batch.log_ratio.clamp(max=LOG_RATIO_BOUND)) * keep
        metrics["stability/m2_after"] = m2_before if m2_after is None else m2_after
        metrics["stability/mask_frac"] = dropped.numel() / batch.token_count
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
