"""M2PO: second-moment trust region (Zheng, Zhao, Chen; arXiv 2510.01161).

Two forms, selected by `M2POConfig.mode`:

- `mask` (the paper's Algorithm 1, default): among trust-region tokens, those where PPO clipping could
  bind ((A > 0 and r > 1) or (A < 0 and r < 1)), mask the largest (log r)^2 until their mean is at
  most tau. Greedy removal of the maximum always keeps a sorted prefix, so a walk down the largest
  values finds the shortest removal whose remaining mean is <= tau. The objective is unclipped r A over
  the kept tokens, normalised by all tokens: masked tokens get weight 0 but stay in the denominator.
- `adaptive_clip` (the released code): no masking; if the trust-region M2 exceeds tau, cap the
  (log r)^2 values at tau_c^2, with tau_c^2 the largest value whose capping keeps the M2 within budget,
  and apply the PPO clip range [exp(-tau_c), exp(tau_c)] (no dual clip).

Both start from the trust region's token count, the sum of its (log r)^2 and its values above tau.
On CPU the fused scan in algorithms/native.py finds those in one pass; elsewhere (CUDA, per-token
advantages, no compiler) torch ops build the region and search it; both take the same decisions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from algorithms import native
from algorithms.batch import PolicyBatch, TokenWeights, largest_entries, zero_outside
from algorithms.clipping import clipped_surrogate_weights
from algorithms.stabilizer import Stabilizer, register


def _trust_region_m2(log_ratio: Tensor, advantages: Tensor) -> tuple[Tensor, int]:
    """(log r)^2 on the trust-region tokens and 0 elsewhere, [B, T], and how many tokens the region has.

    `log_ratio` must be 0 on padding (padding then lies outside the region). sign(A) log r is |log r|
    in the region and <= 0 outside it, so relu() leaves |log r| exactly where it belongs, in float
    arithmetic (several times cheaper than boolean masks on CPU); squaring in place gives (log r)^2.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    region_abs = torch.mul(torch.sign(advantages), log_ratio).relu_()
    n_region = int(torch.sign(region_abs).sum())
    return region_abs.mul_(region_abs), n_region


@dataclass
class BoundedSum:
    """A sum of non-negative fp32 values, and a bound on its distance from their fp64 sum."""

    value: float
    error: float

    def settled(self, values: Callable[[], Tensor], threshold: float) -> BoundedSum:
        """This sum, or the fp64 sum of `values()` where the error leaves its side of `threshold` open."""
        if abs(self.value - threshold) <= self.error:
            return BoundedSum(float(values().sum(dtype=torch.float64)), 0.0)
        return self


def sum_of(values: Tensor, group: int = 16) -> BoundedSum:
    """The sum of non-negative fp32 `values`, at half the cost of converting each to fp64 on CPU.

    fp32 sums down the columns of a [group, N / group] view (a vectorised reduction), then fp64 over the
    column sums. Summed in any order, `group` non-negative terms land within (group - 1) units of
    rounding of their exact sum. So the result is within about group * 2^-24 of the exact sum, and the
    fp64 sum is within N * 2^-53 of it too: `error` bounds both.
    """
    n = values.numel()
    if n % group or n < group * group:
        return BoundedSum(float(values.sum(dtype=torch.float64)), 0.0)
    value = float(values.reshape(group, -1).sum(dim=0).sum(dtype=torch.float64))
    return BoundedSum(value, value * (group * 2.0**-24 + 2 * n * 2.0**-53))


@functools.lru_cache(maxsize=16)
def _largest_fp32_at_most(value: float) -> float:
    """The largest fp32 number <= `value`: an fp32 x exceeds `value` exactly when it exceeds this one."""
    nearest = torch.tensor(value, dtype=torch.float32, device="cpu")  # host arithmetic on one number
    if nearest.item() > value:
        nearest = torch.nextafter(nearest, torch.tensor(-math.inf, device="cpu"))
    return nearest.item()


@dataclass
class _Region:
    """M2PO's trust region in one batch: its token count, the sum of its (log r)^2, and a search for
    the values above tau.

    The torch path builds `values` ([B, T]: (log r)^2 on the region, 0 elsewhere) and searches it in
    columns. The fused scan (algorithms/native.py) finds the count, the sum and every value above the
    fp32 `threshold` in one pass, without the [B, T] tensor; it is then built only when a sum too close
    to call or the adaptive clip's last resort needs it.
    """

    n_region: int
    total: BoundedSum
    tokens: Tensor  # a [B, T] tensor of the batch: the region's size and device
    build_values: Callable[[], Tensor]
    found: tuple[Tensor, Tensor] | None = None
    threshold: float = math.nan
    built: Tensor | None = None

    @property
    def values(self) -> Tensor:
        if self.built is None:
            self.built = self.build_values()
        return self.built

    def largest(self, above: float, count: int) -> tuple[Tensor, Tensor, float]:
        """The largest values above `above`, largest first, their flat indices, and a floor: every value
        above both `above` and the floor is among them. The scan's finds give the `count` largest (all
        of them, floor -inf, when there are no more); the torch path searches `count` columns."""
        if self.found is None or above != self.threshold:
            return largest_entries(self.values, above, count)
        found, index = self.found
        if found.numel() <= count:
            top, order = torch.sort(found, descending=True)
            return top, index[order], -math.inf
        top, order = torch.topk(found, count + 1)
        floor = float(top[count])
        taken = int(torch.searchsorted(-top, -floor))  # the values above the floor (ties with it stay out)
        return top[:taken], index[order[:taken]], floor


def trust_region(log_ratio: Tensor, advantages: Tensor, tau: float) -> _Region:
    """The trust region of `log_ratio` (0 on padding), through the fused scan where it applies."""

    def build() -> Tensor:
        return _trust_region_m2(log_ratio, advantages)[0]

    if not native.usable((log_ratio,), advantages):
        values, n_region = _trust_region_m2(log_ratio, advantages)
        return _Region(n_region, sum_of(values), values, build, built=values)
    threshold = _largest_fp32_at_most(tau)
    n_region, total, found, index = native.m2po_region_scan(log_ratio, advantages, threshold)
    # an fp64 sum of non-negative terms in numel + 9 B additions lies within that many 2^-53 of the
    # exact sum (relative); twice that leaves room
    error = 2.0 * (log_ratio.numel() + 9 * log_ratio.shape[0]) * 2.0**-53 * total
    return _Region(n_region, BoundedSum(total, error), log_ratio, build, (found, index), threshold)


def _over_budget(region: _Region, tau: float) -> BoundedSum | None:
    """The region's total, settled against the budget tau * n_region, when the region's mean exceeds
    tau; None when it is within budget (or empty), where both M2PO forms leave every token alone."""
    if region.n_region == 0:
        return None
    total = region.total.settled(lambda: region.values, tau * region.n_region)
    return total if total.value > tau * region.n_region else None


@dataclass
class _Fit:
    """Where a budget rule first holds along the values above tau, largest first (None: nowhere).

    `top` (descending) and `index` (flat) hold every value down to position `first` (every value above
    tau when it is None); `others` is the fp64 sum of all values but the largest down to `first` (down
    to the last found one when it is None).
    """

    first: int | None
    top: Tensor
    index: Tensor
    others: float


# A budget rule's margin at position j from j, the value there and the fp64 sum of all values but the
# j + 1 largest; the rule holds where the margin is <= 0. Written once, it runs on floats or tensors.
BudgetRule = Callable[[Any, Any, Any], Any]

# Up to this many positions are walked in Python floats: a handful of tensor ops would cost more.
_PYTHON_WALK = 512


def walk_floats(rule: BudgetRule, top: list[float], total: float) -> tuple[int | None, list[float], float]:
    """The first position where `rule` holds, the margins up to it, and `others` there (fp64 floats)."""
    removed, margins = 0.0, []
    for j, value in enumerate(top):
        removed += value
        margins.append(rule(j, value, total - removed))
        if margins[-1] <= 0:
            return j, margins, total - removed
    return None, margins, total - removed


def walk_tensors(rule: BudgetRule, top: Tensor, others: Tensor) -> tuple[int | None, Tensor, float]:
    """`walk_floats` in tensor ops, given `others` for every position."""
    margins = rule(torch.arange(top.numel(), dtype=torch.float64, device=top.device), top, others)
    hits = (margins <= 0).nonzero()
    first = int(hits[0]) if hits.numel() else None
    return first, margins, float(others[-1 if first is None else first]) if top.numel() else math.nan


def _close_call(margins: Tensor | list[float], first: int | None, slack: float) -> bool:
    """Whether the margins that decide `first` are within `slack` of flipping. Both rules' margins fall
    along the walk, so those are the last one above 0 and the first one at or below it."""
    deciding = margins[-1:] if first is None else margins[max(first - 1, 0) : first + 1]
    return any(abs(float(m)) <= slack for m in deciding)


def _exact_others(region_m2: Tensor, top: Tensor, cut: float) -> Tensor:
    """`others` without the cancellation of total - removed: the sum of the values <= cut (fp64), plus
    the smaller found values summed from the small end, so tiny values keep their weight."""
    rest = float(region_m2.clamp(max=cut).sum(dtype=torch.float64)) - top.numel() * cut
    from_small_end = torch.flip(torch.cumsum(torch.flip(top, (0,)), 0, dtype=torch.float64), (0,))
    return rest + torch.cat([from_small_end[1:], from_small_end.new_zeros(1)])


def _first_fit(region: _Region, total: BoundedSum, tau: float, rule: BudgetRule, columns: int) -> _Fit:
    """Walk the values above tau, largest first, to the first position where `rule` holds.

    `total` is the region's settled sum. Values are compared in fp32 against the fp32 number that
    splits them exactly as tau does in fp64, so a value at tau never flips side. Only the largest few
    are found and sorted, more only while the rule holds nowhere among them. `others` is total minus
    the running sum; where that is too close to call, it is summed again without the cancellation.
    """
    threshold = _largest_fp32_at_most(tau)
    # bounds the error of the total and the rounding of total - running sum
    slack = total.error + 4 * region.tokens.numel() * 2.0**-53 * total.value
    while True:
        top, index, floor = region.largest(threshold, columns)
        margins: Tensor | list[float]
        if top.numel() <= _PYTHON_WALK:
            first, margins, others = walk_floats(rule, top.tolist(), total.value)
        else:
            running = torch.cumsum(top, 0, dtype=torch.float64)
            first, margins, others = walk_tensors(rule, top, total.value - running)
        if len(margins) and _close_call(margins, first, slack):
            first, _, others = walk_tensors(rule, top, _exact_others(region.values, top, max(threshold, floor)))
        if first is not None or floor <= threshold:
            return _Fit(first, top, index, others)
        columns *= 8


def m2po_token_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor, tau: float = 0.04) -> Tensor:
    """M2PO Algorithm 1: True where a token is kept.

    Padding (mask False) is returned False. Masked tokens are the trust-region tokens with the largest
    (log r)^2, removed until the mean over the remaining trust-region tokens is <= tau.
    """
    mask = mask.bool()
    region = trust_region(zero_outside(log_ratio.detach().float(), mask), advantages.detach(), tau)
    dropped, _ = _drop_within_budget(region, tau)
    keep = mask.clone()
    keep.view(-1)[dropped] = False
    return keep


def _drop_within_budget(region: _Region, tau: float) -> tuple[Tensor, float | None]:
    """Algorithm 1 on the trust region's (log r)^2.

    Returns the flat indices to mask and the M2 of the kept trust-region tokens (None if nothing is
    masked). Removing the m largest is the sorted-prefix form:
    find the smallest m whose remaining mean is <= tau. Each removed value was the maximum of a set
    whose mean exceeded tau, so only values above tau can be removed, largest first.
    """
    n_region, total = region.n_region, _over_budget(region, tau)
    if total is None:
        return torch.zeros(0, dtype=torch.long, device=region.tokens.device), None

    def remaining_over_budget(j: Any, value: Any, others: Any) -> Any:
        return others - tau * (n_region - 1 - j)

    fit = _first_fit(region, total, tau, remaining_over_budget, columns=64)
    n_drop = fit.top.numel() if fit.first is None else fit.first + 1
    if n_drop == 0:  # rounding put the mean above tau with no value above it: nothing to remove
        return fit.index, total.value / n_region
    kept = n_region - n_drop
    return fit.index[:n_drop], fit.others / kept if kept else 0.0


def adaptive_clip_tau(region_m2: Tensor, tau: float) -> float | None:
    """The released code's clip half-width: None (no clipping) when mean M2 <= tau, else tau_c.

    tau_c^2 is the largest trust-region (log r)^2 value v such that sum_i min(v_i, v) <= tau * N.
    Capping at the j-th largest value v_j (0-based) gives (sum of all but the j largest) + j v_j.
    Every value <= tau fits, so only values above tau and the largest value <= tau are candidates.
    """
    region = _Region(region_m2.numel(), sum_of(region_m2), region_m2, lambda: region_m2, built=region_m2)
    cap = _solve_adaptive_clip(region, tau)
    return None if cap is None else cap.tau_c


@dataclass
class _Cap:
    """The adaptive clip: its half-width tau_c, the capped sum sum_i min(v_i, tau_c^2) in fp64, and the flat
    indices of the values above tau_c^2. Those are the tokens the clip [exp(-tau_c), exp(tau_c)] removes:
    it binds only in the trust region (A > 0 above the range, A < 0 below it), where (log r)^2 > tau_c^2
    says exactly that r is outside it."""

    tau_c: float
    capped_sum: float
    clipped: Tensor


def _solve_adaptive_clip(region: _Region, tau: float) -> _Cap | None:
    """`adaptive_clip_tau` on a trust region whose values may hold zeros beyond its n_region tokens
    (they never cap and add nothing), with the capped sum and the clipped tokens."""
    n_region, total = region.n_region, _over_budget(region, tau)
    if total is None:
        return None

    def capped_over_budget(j: Any, value: Any, others: Any) -> Any:
        # capping at the j-th largest (0-based) keeps all but the j + 1 largest, plus j + 1 copies of it
        return others + (j + 1) * value - tau * n_region

    fit = _first_fit(region, total, tau, capped_over_budget, columns=256)
    if fit.first is not None:
        value = float(fit.top[fit.first])
        n_above = int((fit.top[: fit.first] > value).sum())  # a prefix: values tied with the cap stay
        return _Cap(math.sqrt(value), fit.others + (fit.first + 1) * value, fit.index[:n_above])
    # The cap is the largest value <= tau, and the search found every value above tau: those are clipped.
    values = region.values.double()
    largest_within = float((values * (values <= tau)).max())
    return _Cap(math.sqrt(largest_within), float(values.clamp(max=largest_within).sum()), fit.index)


def _ratio_zeroed_at(batch: PolicyBatch, index: Tensor, buffer: Tensor | None) -> Tensor:
    """The batch's ratio with 0 at the flat `index` (the weights of both forms), written into `buffer`,
    a [B, T] fp32 tensor the caller no longer needs (or a new one); the ratio itself when nothing is zeroed."""
    if index.numel() == 0:
        return batch.ratio
    weights = batch.ratio.clone() if buffer is None else buffer.copy_(batch.ratio)
    weights.view(-1)[index] = 0.0
    return weights


@register("m2po")
class M2PO(Stabilizer):
    """Second-moment trust region; see the module docstring for the two forms."""

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        region = trust_region(batch.log_ratio, batch.advantages, self.config.tau)
        m2_before = region.total.value / max(region.n_region, 1)
        scalar = functools.partial(torch.tensor, dtype=torch.float32, device=batch.log_ratio.device)
        metrics = {"stability/m2": scalar(m2_before)}
        if self.config.mode == "adaptive_clip":
            return self._adaptive_clip(batch, region, metrics)
        dropped, m2_after = _drop_within_budget(region, self.config.tau)
        weights = _ratio_zeroed_at(batch, dropped, region.built)
        metrics["stability/m2_after"] = scalar(m2_before if m2_after is None else m2_after)
        metrics["stability/mask_frac"] = dropped.numel() / batch.token_count
        return TokenWeights(weights, batch.mask, metrics)

    def _adaptive_clip(self, batch: PolicyBatch, region: _Region, metrics: dict[str, Tensor]) -> TokenWeights:
        cap = _solve_adaptive_clip(region, self.config.tau)
        if cap is None:  # within budget the released code still clips, at [0, 1e5]
            low, high = 0.0, 1e5
            result = clipped_surrogate_weights(batch, low, high, None)
            result.metrics["stability/m2_after"] = metrics["stability/m2"]
        else:
            low, high = math.exp(-cap.tau_c), math.exp(cap.tau_c)
            weights = _ratio_zeroed_at(batch, cap.clipped, region.built)
            result = TokenWeights(weights, batch.mask, {"stability/clip_frac": cap.clipped.numel() / batch.token_count})
            result.metrics["stability/m2_after"] = metrics["stability/m2"].new_tensor(cap.capped_sum / region.n_region)
        result.metrics.update(metrics)
        result.metrics["stability/clip_low"] = metrics["stability/m2"].new_tensor(low)
        result.metrics["stability/clip_high"] = metrics["stability/m2"].new_tensor(high)
        return result
