"""VCPO: variance-controlled off-policy RL (Huang et al., arXiv 2602.17616).

Three parts, each usable alone:

1. Base loss: sequence TIS with cap C = 8, detached, aggregated seq-mean-token-mean.
2. ESS learning-rate scale: eta_t = eta * sqrt(min(1, ess_ratio / rho_on)) (or the linear rule), from
   the unclipped sequence weights of the whole global batch, recomputed every step, never above 1.
3. Off-policy optimal baseline (OPOB) per prompt group: b*_g = sum W_i R_i / sum W_i with
   W_i = w_i^2 |grad log pi(tau_i)|^2, replacing the group mean; advantages (R_i - b*_g) / sigma_g.

How the IS weight enters W: the published formula counts it once (w_i^2 times the raw score norm),
`baseline_is_weight: once`. The official code measures the norm of the already IS-weighted gradient
and multiplies by w_i^2 again, so W_i = min(w_i, C)^2 w_i^2 |s_i|^2: `baseline_is_weight: twice`.
W is formed in log space and rescaled per group (the baseline is scale-invariant within a group), so
sequence log-weights of +-1000 give a finite baseline.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.advantages import group_mean_advantages, group_std
from algorithms.batch import PolicyBatch, TokenWeights, group_index, group_sum
from algorithms.diagnostics import ess_ratio, ess_ratio_clipped
from algorithms.importance import sequence_tis_weights
from algorithms.stabilizer import Stabilizer, register

LR_RULES = ("sqrt", "linear")
STD_FLOOR = 1e-8


def ess_lr_scale(ess_ratio: float, rho_on: float = 1.0, rule: str = "sqrt") -> float:
    """LR factor sqrt(s) (or s), s = min(1, ess_ratio / rho_on); 0 for a non-finite ESS ratio."""
    if rule not in LR_RULES:
        raise ValueError(f"unknown ESS LR rule {rule!r}; choose one of {LR_RULES}")
    if not math.isfinite(ess_ratio):
        return 0.0
    scale = min(1.0, max(0.0, ess_ratio) / max(rho_on, 1e-8))
    return math.sqrt(scale) if rule == "sqrt" else scale


def opob_baseline(rewards: Tensor, sample_weights: Tensor, group_ids: Tensor) -> Tensor:
    """Per-sample OPOB baseline b*_g = sum_g W R / sum_g W of its group, [B].

    A group whose weights sum to zero (or are not finite) falls back to its plain reward mean.
    """
    index, n_groups = group_index(group_ids)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    rewards = rewards.double()
    weights = sample_weights.double()
    weight_sum = group_sum(weights, index, n_groups)
    weighted = group_sum(weights * rewards, index, n_groups) / weight_sum.where(
        weight_sum > 0, torch.ones_like(weight_sum)
    )
    plain = group_sum(rewards, index, n_groups) / group_sum(torch.ones_like(rewards), index, n_groups)
    usable = (weight_sum > 0) & torch.isfinite(weighted)
    return torch.where(usable, weighted, plain)[index].to(out_dtype)


def opob_log_weights(
    log_w: Tensor, grad_sq_norms: Tensor, cap: float, is_weight: str, token_lengths: Tensor | None
) -> Tensor:
    """log W_i of the OPOB weight; see the module docstring for `is_weight` once/twice."""
    if is_weight not in ("once", "twice"):
        raise ValueError(f"baseline_is_weight must be 'once' or 'twice', got {is_weight!r}")
    log_w = log_w.double()
    log_weight = 2 * log_w + torch.log(grad_sq_norms.double().clamp(min=0))
    if is_weight == "twice":
        log_weight = log_weight + 2 * log_w.clamp(max=math.log(cap))
    if token_lengths is not None:
        log_weight = log_weight - 2 * torch.log(token_lengths.double().clamp(min=1))
    return log_weight


def group_normalised_weights(log_weight: Tensor, group_ids: Tensor) -> Tensor:
    """exp(log W - max_g log W): each group's largest weight becomes 1, none overflows."""
    index, n_groups = group_index(group_ids)
    group_max = torch.full((n_groups,), -math.inf, dtype=log_weight.dtype, device=log_weight.device)
    group_max = group_max.scatter_reduce(0, index, log_weight, reduce="amax")
    group_max = torch.where(torch.isfinite(group_max), group_max, torch.zeros_like(group_max))
    return torch.exp(log_weight - group_max[index])


@register("vcpo")
class VCPO(Stabilizer):
    """Seq-TIS base loss, ESS-scaled LR and the off-policy optimal baseline."""

    decides_per_row = True

    @property
    def needs_grad_norms(self) -> bool:
        return self.config.use_baseline

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        return sequence_tis_weights(batch, self.config.cap)

    def global_metrics(self, log_w: Tensor) -> dict[str, Tensor]:
        if log_w.numel() == 0:
            return {}
        return {"stability/ess_ratio_clipped": ess_ratio_clipped(log_w, self.config.cap)}

    def lr_scale(self, log_w: Tensor) -> float:
        if log_w.numel() == 0:
            return 1.0
        ess = ess_ratio_clipped(log_w, self.config.cap) if self.config.ess_from_clipped else ess_ratio(log_w)
        return ess_lr_scale(float(ess), self.config.rho_on, self.config.lr_rule)

    def baseline(
        self, rewards: Tensor, log_w: Tensor, grad_sq_norms: Tensor | None, group_ids: Tensor, token_lengths: Tensor
    ) -> Tensor | None:
        if not self.config.use_baseline:
            return None
        if grad_sq_norms is None:
            raise ValueError("vcpo with use_baseline needs per-sample squared gradient norms from the learner")
        lengths = token_lengths if self.config.normalize_by_length else None
        log_weight = opob_log_weights(log_w, grad_sq_norms, self.config.cap, self.config.baseline_is_weight, lengths)
        return opob_baseline(rewards, group_normalised_weights(log_weight, group_ids), group_ids)

    def advantages(
        self, rewards: Tensor, log_w: Tensor, grad_sq_norms: Tensor | None, group_ids: Tensor, token_lengths: Tensor
    ) -> Tensor | None:
        """(R - b) / sigma_g with b the OPOB (or the group mean when the baseline is off)."""
        b = self.baseline(rewards, log_w, grad_sq_norms, group_ids, token_lengths)
        if b is not None:
            return self.advantages_from_baseline(rewards, b, group_ids)
        return self._scaled(rewards, group_mean_advantages(rewards, group_ids), group_ids)

    def advantages_from_baseline(self, rewards: Tensor, baseline: Tensor, group_ids: Tensor) -> Tensor:
        """(R - b) / sigma_g, or R - b where the group's rewards do not vary."""
        return self._scaled(rewards, rewards.float() - baseline.float(), group_ids)

    def _scaled(self, rewards: Tensor, centred: Tensor, group_ids: Tensor) -> Tensor:
        if not self.config.norm_by_std:
            return centred
        sigma = group_std(rewards, group_ids, unbiased=False)
        return torch.where(sigma > STD_FLOOR, centred / sigma.clamp(min=STD_FLOOR), centred)
