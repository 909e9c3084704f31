"""BAPO: balanced policy optimisation with adaptive clipping (Xi et al., arXiv 2510.18927).

Each step starts from the lowest bounds [a-, a+] and widens them until the positive-advantage tokens
hold at least `positive_share` (rho_0) of the policy-gradient contribution:

    pos = sum over A > 0 tokens with gradient of r * A,   neg = sum over A < 0 tokens with gradient of r * |A|
    share = pos / (pos + neg)

Raising c_low clips away more negative tokens (r < c_low), raising c_high lets more positive tokens
through (r <= c_high); so c_low moves first, by `step` up to b-, then c_high up to b+. The update is
then the PPO clipped surrogate with [c_low, c_high] and dual clip.

The README states the target as a positive share rho_0 = 0.5; the released code compares a pos/neg
ratio with its target instead. We follow the paper's share (a share of rho_0 is a pos/neg ratio of
rho_0 / (1 - rho_0)); pass positive_share = 1/3 to reproduce the released script's 0.5 ratio.
"""

from __future__ import annotations

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights, safe_exp
from algorithms.clipping import clip_active, clipped_surrogate_weights
from algorithms.config import BAPOConfig
from algorithms.stabilizer import Stabilizer, register

_ROUNDING = 1e-9  # bounds move in float steps; keep b- and b+ themselves reachable


def positive_share(log_ratio: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float, dual_c: float) -> Tensor:
    """Share of the positive-advantage tokens in the gradient-carrying contribution sum r |A|."""
    active = clip_active(log_ratio, advantages, low, high, dual_c) & mask
    contribution = torch.where(active, safe_exp(log_ratio) * advantages.abs(), torch.zeros_like(log_ratio))
    pos = contribution[advantages > 0].sum()
    total = contribution.sum()
    return pos / total if total > 0 else torch.ones(())


def adapt_bounds(log_ratio: Tensor, advantages: Tensor, mask: Tensor, config: BAPOConfig) -> tuple[float, float, Tensor]:
    """The narrowest bounds (c_low first, then c_high) reaching the positive share; and the share."""
    low, high = config.clip_low_min, config.clip_high_min
    share = positive_share(log_ratio, advantages, mask, low, high, config.dual_clip_c)
    while share < config.positive_share:
        if low + config.step <= config.clip_low_max + _ROUNDING:
            low = min(low + config.step, config.clip_low_max)
        elif high + config.step <= config.clip_high_max + _ROUNDING:
            high = min(high + config.step, config.clip_high_max)
        else:
            break
        share = positive_share(log_ratio, advantages, mask, low, high, config.dual_clip_c)
    return low, high, share


@register("bapo")
class BAPO(Stabilizer):
    """PPO clip whose bounds adapt each step to keep positive tokens' share of the gradient."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        advantages = batch.token_advantages
        low, high, share = adapt_bounds(batch.log_ratio, advantages, batch.mask, self.config)
        result = clipped_surrogate_weights(batch, low, high, self.config.dual_clip_c)
        result.metrics["stability/clip_low"] = torch.tensor(low)
        result.metrics["stability/clip_high"] = torch.tensor(high)
        result.metrics["stability/positive_share"] = share
        return result
