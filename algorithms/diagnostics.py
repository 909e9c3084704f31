"""Off-policy health diagnostics: ESS, KL estimators, chi-square, second moment, lag statistics.

Every function works in log space or clamps before exp, so log-ratios of +-1000 give finite numbers.
Inputs are detached; results are 0-dim tensors (the caller decides when to sync to Python floats).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from algorithms.advantages import group_std
from algorithms.batch import PolicyBatch, masked_mean, safe_exp, zero_outside


def sequence_log_weights(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """log w_i = sum_t mask * (log pi - log mu), [B]: the log of the sequence importance weight."""
    return zero_outside(log_ratio.float(), mask.bool()).sum(dim=1)


def ess_ratio(log_w: Tensor) -> Tensor:
    """Normalised effective sample size (sum w)^2 / (B sum w^2) in (0, 1], from log-weights.

    Computed as exp(2 LSE(l) - LSE(2l)) / B, which is exact and finite for any finite log-weights.
    """
    log_w = log_w.detach().double().reshape(-1)  # fp64: 2 LSE(l) - LSE(2l) cancels large terms
    n = log_w.numel()
    if n == 0:
        raise ValueError("ess_ratio needs at least one sequence log-weight")
    log_ess = 2 * torch.logsumexp(log_w, 0) - torch.logsumexp(2 * log_w, 0)
    return (torch.exp(log_ess) / n).clamp(1.0 / n, 1.0).float()


def ess_ratio_clipped(log_w: Tensor, cap: float) -> Tensor:
    """ESS ratio of the capped weights min(w, cap), still in log space."""
    return ess_ratio(log_w.clamp(max=math.log(cap)))


def kl_k1(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """K1 estimate of KL(mu || pi): token mean of log mu - log pi."""
    return masked_mean(-log_ratio.float(), mask.bool())


def kl_k3(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """K3 estimate of KL(mu || pi): token mean of exp(l) - l - 1, l = log pi - log mu (always >= 0)."""
    l = log_ratio.float()
    return masked_mean(safe_exp(l) - l.clamp(-1e4, 1e4) - 1, mask.bool())


def chi2_token(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Token chi-square: mean_t rho_t^2 - 1 (log-ratio clamped before exp)."""
    return masked_mean(safe_exp(2 * log_ratio.float()), mask.bool()) - 1


def chi2_seq(log_w: Tensor) -> Tensor:
    """Sequence chi-square: mean_i w_i^2 - 1 (log-sum clamped before exp)."""
    return safe_exp(2 * log_w.float()).mean() - 1


def second_moment(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """M2: mean (log r)^2 over the selected tokens (M2PO's trust-region statistic)."""
    l = log_ratio.float()
    return masked_mean(l * l, mask.bool())


def lag_stats(lags: Tensor, max_lag: int | None = None) -> dict[str, Tensor]:
    """Mean and max lag plus a histogram of integer lags (index k counts samples with lag k)."""
    lags = lags.detach().long().reshape(-1)
    if lags.numel() == 0:
        zero = torch.zeros(())
        return {"lag_mean": zero, "lag_max": zero, "lag_hist": torch.zeros(1, dtype=torch.long)}
    if (lags < 0).any():
        raise ValueError(f"negative lag {int(lags.min())}: a rollout is newer than the learner")
    bins = int(lags.max()) + 1 if max_lag is None else max(max_lag, int(lags.max())) + 1
    return {
        "lag_mean": lags.float().mean(),
        "lag_max": lags.max().float(),
        "lag_hist": torch.bincount(lags, minlength=bins),
    }


def zero_std_share(rewards: Tensor, group_ids: Tensor, trained: Tensor, tolerance: float = 1e-6) -> Tensor:
    """Share of the `trained` rows [B] bool whose prompt group scored every response the same (reward std within
    `tolerance`): such a group has no advantage to learn from (TRL's frac_reward_zero_std). 0-d float32."""
    flat = group_std(rewards, group_ids) <= tolerance
    return (flat & trained).sum().float() / trained.sum().clamp(min=1)


def health_metrics(batch: PolicyBatch) -> dict[str, Tensor]:
    """The per-step health metrics every job logs whatever its stabilizer, named as docs/wandb.md lists them.

    Uses that the batch's log-ratio and ratio are already 0 on padding, so each statistic is a plain
    sum, and shares the ratio's exp with the stabilizer: this runs every step and must stay cheap.
    """
    l = batch.log_ratio
    count = batch.token_count
    ratio = batch.ratio
    has_tokens = batch.token_lengths > 0
    metrics = {
        "stability/kl_k1": -l.sum() / count,
        # exp(l) - l - 1 on loss tokens; the mask stands in for the 1 so that padding adds 0 - 0 - 0
        "stability/kl_k3": (ratio - l.clamp(-1e4, 1e4)).sub_(batch.mask_float).sum() / count,
        "stability/chi2_token": (ratio * ratio).sum() / count - 1,
        "stability/m2": (l * l).sum() / count,
    }
    if bool(has_tokens.any()):
        log_w = batch.seq_log_ratio[has_tokens]
        metrics["stability/ess_ratio"] = ess_ratio(log_w)
        metrics["stability/chi2_seq"] = chi2_seq(log_w)
    return metrics
