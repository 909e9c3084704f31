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

The whole walk is evaluated at once from one pass of search: pos depends only on c_high and neg only
on c_low. Only the tokens that the narrowest clip [b-, a+] (with dual clip) clips can be clipped
anywhere on the walk; they are few. Every other token carries gradient at every step, so it adds the
same to every candidate: those are summed once. The few "movers" are bucketed by the first bound
that admits them and summed per bucket, so every candidate's pos and neg is a sum of non-negative
parts (no cancellation). The final clip then only ever zeroes some of the movers.

When the share misses the target even at the widest bounds, the walk runs to its end, and one
clipped-surrogate pass at those bounds is cheaper than the mover search. The share only grows along
the walk, so that pass alone decides whether the walk runs to its end. Consecutive steps tend to end
alike, so a BAPO instance tries that pass first only when its last walk ran to the end: the result is
the same either way, only the cost differs.

On CPU the movers, their buckets and the stayers' sums come from one fused scan (algorithms/native.py);
torch ops find the same ones elsewhere (CUDA, per-token advantages, no compiler).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from algorithms import native
from algorithms.batch import PolicyBatch, TokenWeights, indices_above, zero_outside, zero_where_set
from algorithms.clipping import clip_excess, clip_flags, clips_padding
from algorithms.config import LOG_RATIO_BOUND, BAPOConfig
from algorithms.stabilizer import Stabilizer, register


def bound_grid(lowest: float, highest: float, step: float) -> list[float]:
    """lowest, lowest + step, ... and finally `highest` itself (the walk stops at the cap)."""
    values = [lowest]
    while values[-1] < highest - 1e-9:
        values.append(min(lowest + len(values) * step, highest))
    return values


@dataclass(frozen=True)
class BoundGrids:
    """The walk's bounds, and their fp32 logs (bounds are compared in log space)."""

    lows: list[float]
    highs: list[float]
    log_lows: Tensor
    log_highs: Tensor


@functools.lru_cache(maxsize=8)
def bound_grids(config: BAPOConfig) -> BoundGrids:
    """Built once per config: the grids depend on nothing else."""
    lows = bound_grid(config.clip_low_min, config.clip_low_max, config.step)
    highs = bound_grid(config.clip_high_min, config.clip_high_max, config.step)
    # host tensors, cached: the torch path moves them to the batch's device, the fused scan runs on the host
    log = lambda values: torch.tensor([math.log(v) for v in values], dtype=torch.float32, device="cpu")  # noqa: E731
    return BoundGrids(lows, highs, log(lows), log(highs))


@dataclass
class _Walk:
    """Where the walk stopped, the positive share there, the movers' flat indices and ratios, and
    whether the final clip removes each mover (0/1 float)."""

    low: float
    high: float
    share: float
    movers: Tensor
    movers_ratio: Tensor
    clipped: Tensor


def _signed_sums(weights: Tensor, advantages: Tensor) -> tuple[float, float]:
    """pos = sum of weights * A over A > 0 and neg = sum of weights * |A| over A < 0 (fp64 floats).

    The weights must be non-negative: fp32 row sums of non-negative values cancel nothing, so they
    are within a few ulps of exact, and the row results are combined in fp64.
    """
    if advantages.dim() == 1:  # B row sums, then plain floats: fewer tensor ops
        rows = list(zip(weights.sum(dim=1).tolist(), advantages.tolist()))
        return sum(w * a for w, a in rows if a > 0), sum(-w * a for w, a in rows if a < 0)
    pos = (weights * advantages.clamp(min=0)).sum(dtype=torch.float64)
    neg = (weights * advantages.clamp(max=0)).sum(dtype=torch.float64).neg()
    return float(pos), float(neg)


def _share(pos: float, neg: float) -> float:
    """pos / (pos + neg); 1 when nothing carries gradient (nothing to rebalance)."""
    total = pos + neg
    return pos / total if total > 0 else 1.0


def _widest(batch: PolicyBatch, config: BAPOConfig) -> tuple[TokenWeights, float]:
    """The clipped surrogate at the widest bounds (b-, b+), the walk's last step, and its share."""
    low, high = config.clip_low_max, config.clip_high_max
    flags = clip_flags(batch.log_ratio, batch.advantages, batch.mask_float, low, high, config.dual_clip_c)
    clip_frac = flags.sum() / batch.token_count
    weights = zero_where_set(batch.ratio, flags)
    share = _share(*_signed_sums(weights, batch.advantages))
    return TokenWeights(weights, batch.mask, {"stability/clip_frac": clip_frac}), share


@dataclass
class _Movers:
    """The tokens the narrowest clip [b-, a+] clips (flat indices), their ratios, their bucket keys and
    the bucket sums of ratio * |A| (fp64); and the sums over every other token (the stayers, which keep
    their gradient at every step of the walk): pos of ratio * A over A > 0, neg of ratio * |A| over A < 0."""

    index: Tensor
    ratio: Tensor
    key: Tensor
    buckets: list[float]
    pos_stayers: float
    neg_stayers: float


def _find_movers(
    log_ratio: Tensor, ratio: Tensor, advantages: Tensor, mask_float: Tensor, config: BAPOConfig
) -> tuple[_Movers, Tensor]:
    """The movers of a log-ratio that is 0 on padding and its ratio exp(min(l, bound)), 0 on padding;
    and a fresh [B, T] tensor, the ratio with every mover zeroed. Through the fused scan where it
    applies (it selects the same movers); padding it would clip takes the torch path, which masks it."""
    grids = bound_grids(config)
    narrowest = (grids.lows[-1], grids.highs[0], config.dual_clip_c)
    if not clips_padding(*narrowest) and native.usable((log_ratio, ratio), advantages):
        interval = (math.log(narrowest[0]), math.log(narrowest[1]), math.log(narrowest[2]))
        dual_clip_below_lows = config.dual_clip_c < grids.lows[-1]
        index, movers_ratio, key, buckets, stayers, pos, neg = native.bapo_movers(
            log_ratio, ratio, advantages, interval, grids.log_highs, grids.log_lows, dual_clip_below_lows
        )
        return _Movers(index, movers_ratio, key, buckets.tolist(), pos, neg), stayers
    return _find_movers_torch(log_ratio, ratio, advantages, mask_float, config)


def _find_movers_torch(
    log_ratio: Tensor, ratio: Tensor, advantages: Tensor, mask_float: Tensor, config: BAPOConfig
) -> tuple[_Movers, Tensor]:
    """`_find_movers` in torch ops: any device, per-token advantages."""
    grids = bound_grids(config)
    lows, highs = grids.lows, grids.highs
    n_lows, n_highs = len(lows), len(highs)
    excess = clip_excess(log_ratio, advantages, lows[-1], highs[0], config.dual_clip_c)
    if clips_padding(lows[-1], highs[0], config.dual_clip_c):
        excess.mul_(mask_float)  # padding (log-ratio 0) would be clipped too
    index = indices_above(excess, 0.0)
    stayers = excess.copy_(ratio)
    stayers.view(-1)[index] = 0.0
    pos_stayers, neg_stayers = _signed_sums(stayers, advantages)
    movers_log_ratio = torch.take(log_ratio, index)
    if advantages.dim() == 1:
        movers_advantage = advantages[index // log_ratio.shape[1]]
    else:
        movers_advantage = torch.take(advantages, index)
    # Bucket keys: a positive mover counts for c_high >= r, i.e. from highs[key] on (key n_highs: never);
    # a negative one for c_low <= r, i.e. for the first `key` lows; key n_lows marks one above the dual
    # clip c, which never counts (a negative mover below c is below b- = lows[-1], so its key is smaller).
    pos_key = torch.searchsorted(grids.log_highs.to(index.device), movers_log_ratio, side="left")
    neg_key = torch.searchsorted(grids.log_lows.to(index.device), movers_log_ratio, side="right")
    if config.dual_clip_c < lows[-1]:
        neg_key = torch.where(movers_log_ratio > math.log(config.dual_clip_c), n_lows, neg_key)
    key = torch.where(movers_advantage > 0, pos_key, neg_key + (n_highs + 1))
    movers_ratio = torch.take(ratio, index)
    contribution = (movers_ratio * movers_advantage.abs()).double()
    buckets = torch.bincount(key, contribution, n_highs + n_lows + 2).tolist()
    return _Movers(index, movers_ratio, key, buckets, pos_stayers, neg_stayers), stayers


def _walk(
    log_ratio: Tensor, ratio: Tensor, advantages: Tensor, mask_float: Tensor, config: BAPOConfig
) -> tuple[_Walk, Tensor]:
    """The BAPO walk on a log-ratio that is 0 on padding and its ratio exp(min(l, bound)), 0 on padding.

    Also returns a fresh [B, T] tensor: the ratio with every mover zeroed, for the caller to finish.
    """
    grids = bound_grids(config)
    lows, highs = grids.lows, grids.highs
    n_lows, n_highs = len(lows), len(highs)
    movers, stayers = _find_movers(log_ratio, ratio, advantages, mask_float, config)
    buckets, pos_stayers, neg_stayers = movers.buckets, movers.pos_stayers, movers.neg_stayers
    # pos at highs[k]: the stayers plus the positive movers with key <= k; neg at lows[j]: the stayers
    # plus the negative movers with j < key < n_lows.
    pos = list(itertools.accumulate(buckets[:n_highs], initial=pos_stayers))[1:]
    neg = list(itertools.accumulate(reversed(buckets[n_highs + 2 : n_highs + 1 + n_lows]), initial=neg_stayers))[::-1]
    # The walk: (low_0, high_0) ... (low_last, high_0), then (low_last, high_1) ... (low_last, high_last).
    walk = [(j, 0) for j in range(n_lows)] + [(n_lows - 1, k) for k in range(1, n_highs)]
    for j, k in walk:
        share = _share(pos[k], neg[j])
        if share >= config.positive_share:
            break
    # The final clip, per key: a positive mover above highs[k], a negative one below lows[j] or above c.
    clips = [0.0] * (k + 1) + [1.0] * (n_highs - k) + [1.0] * (j + 1) + [0.0] * (n_lows - j - 1) + [1.0]
    clipped = torch.tensor(clips, device=movers.key.device)[movers.key]
    return _Walk(lows[j], highs[k], share, movers.index, movers.ratio, clipped), stayers


def adapt_bounds(
    log_ratio: Tensor, advantages: Tensor, mask: Tensor, config: BAPOConfig
) -> tuple[float, float, Tensor]:
    """The first bounds on the walk (c_low first, then c_high) that reach the positive share; and the share."""
    mask = mask.bool()
    log_ratio = zero_outside(log_ratio.float(), mask)
    mask_float = mask.float()
    ratio = torch.exp(log_ratio.clamp(max=LOG_RATIO_BOUND)) * mask_float
    walk, _ = _walk(log_ratio, ratio, advantages, mask_float, config)
    return walk.low, walk.high, torch.tensor(walk.share, dtype=torch.float32, device=log_ratio.device)


@register("bapo")
class BAPO(Stabilizer):
    """PPO clip whose bounds adapt each step to keep positive tokens' share of the gradient."""

    def __init__(self, config: BAPOConfig | None = None) -> None:
        super().__init__(config)
        self._last_walk_ran_to_the_end = True

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        c = self.config
        if self._last_walk_ran_to_the_end:
            result, share = _widest(batch, c)
            if share < c.positive_share:  # the share only grows along the walk: it runs to the end
                return self._result(result, c.clip_low_max, c.clip_high_max, share)
        walk, weights = _walk(batch.log_ratio, batch.ratio, batch.advantages, batch.mask_float, c)
        # the stayers' ratio is already there; the movers the final clip keeps get theirs back
        weights.view(-1).index_put_((walk.movers,), walk.movers_ratio * (1.0 - walk.clipped))
        result = TokenWeights(weights, batch.mask, {"stability/clip_frac": walk.clipped.sum() / batch.token_count})
        return self._result(result, walk.low, walk.high, walk.share)

    def _result(self, result: TokenWeights, low: float, high: float, share: float) -> TokenWeights:
        self._last_walk_ran_to_the_end = share < self.config.positive_share
        device = result.weights.device
        result.metrics["stability/clip_low"] = torch.tensor(low, device=device)
        result.metrics["stability/clip_high"] = torch.tensor(high, device=device)
        result.metrics["stability/positive_share"] = torch.tensor(share, dtype=torch.float32, device=device)
        return result
