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

The whole walk is evaluated at once: pos depends only on c_high and neg only on c_low, so one pass
buckets every token by the first bound that admits it and cumulative sums give each candidate's share.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.clipping import step_indicator, clipped_surrogate_weights
from algorithms.config import LOG_RATIO_BOUND, BAPOConfig
from algorithms.stabilizer import Stabilizer, register


def bound_grid(lowest: float, highest: float, step: float) -> list[float]:
    """lowest, lowest + step, ... and finally `highest` itself (the walk stops at the cap)."""
    values = [lowest]
    while values[-1] < highest - 1e-9:
        values.append(min(lowest + len(values) * step, highest))
    return values


def adapt_bounds(log_ratio: Tensor, advantages: Tensor, mask: Tensor, config: BAPOConfig) -> tuple[float, float, Tensor]:
    """The first bounds on the walk (c_low first, then c_high) that reach the positive share; and the share."""
    lows = bound_grid(config.clip_low_min, config.clip_low_max, config.step)
    highs = bound_grid(config.clip_high_min, config.clip_high_max, config.step)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    contribution = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND)) * advantages.abs() * mask
    log_lows = torch.tensor([math.log(v) for v in lows], dtype=log_ratio.dtype)
    log_highs = torch.tensor([math.log(v) for v in highs], dtype=log_ratio.dtype)
    log_c = math.log(config.dual_clip_c)
    sign = torch.sign(advantages)
    # A positive token counts for every c_high >= r: always when r <= a+, from the first grid bound
    # above r when r lies inside the grid (few tokens: they alone are bucketed), never above b+.
    positive = contribution * sign.clamp(min=0)
    pos_always = (positive * (1 - step_indicator(log_ratio - float(log_highs[0])))).sum(dtype=torch.float64)
    inside = (positive > 0) & (log_ratio > float(log_highs[0])) & (log_ratio <= float(log_highs[-1]))
    first_high = torch.searchsorted(log_highs, log_ratio[inside], side="left")
    pos = pos_always + torch.cumsum(torch.bincount(first_high, positive[inside].double(), len(highs)), 0)
    # A negative token (not dual-clipped) counts for every c_low <= r: always when r >= b-, for the
    # grid lows <= r when r lies inside the grid, never below a-.
    negative = contribution * (-sign).clamp(min=0) * (1 - step_indicator(log_ratio - log_c))
    neg_always = (negative * (1 - step_indicator(float(log_lows[-1]) - log_ratio))).sum(dtype=torch.float64)
    inside = (negative > 0) & (log_ratio >= float(log_lows[0])) & (log_ratio < float(log_lows[-1]))
    n_lows = torch.searchsorted(log_lows, log_ratio[inside], side="right")
    neg_from = torch.bincount(n_lows, negative[inside].double(), len(lows) + 1)
    neg = neg_always + torch.flip(torch.cumsum(torch.flip(neg_from, (0,)), 0), (0,))[1:]
    # The walk: (low_0, high_0) ... (low_last, high_0), then (low_last, high_1) ... (low_last, high_last).
    walk_pos = torch.cat([pos[:1].expand(len(lows)), pos[1:]])
    walk_neg = torch.cat([neg, neg[-1:].expand(len(highs) - 1)])
    total = walk_pos + walk_neg
    share = torch.where(total > 0, walk_pos / total.clamp(min=1e-300), torch.ones_like(total))
    reached = share >= config.positive_share
    index = int(torch.argmax(reached.to(torch.uint8))) if bool(reached.any()) else len(share) - 1
    low = lows[min(index, len(lows) - 1)]
    high = highs[max(0, index - len(lows) + 1)]
    return low, high, share[index].float()


@register("bapo")
class BAPO(Stabilizer):
    """PPO clip whose bounds adapt each step to keep positive tokens' share of the gradient."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        low, high, share = adapt_bounds(batch.log_ratio, batch.advantages, batch.mask_float, self.config)
        result = clipped_surrogate_weights(batch, low, high, self.config.dual_clip_c)
        result.metrics["stability/clip_low"] = torch.tensor(low)
        result.metrics["stability/clip_high"] = torch.tensor(high)
        result.metrics["stability/positive_share"] = share
        return result
