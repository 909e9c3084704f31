"""Terms added to the policy-gradient loss: a KL penalty to a frozen reference policy and an entropy bonus.

Pure torch over [B, T] token tensors. The learner aggregates them with the policy loss's own mask and
denominator (`algorithms/aggregation.py`), so the three terms share one normalisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import torch
from torch import Tensor

from algorithms.config import LOG_RATIO_BOUND, KLEstimator

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# verl's low_var_kl clamps each token's k3 to this bound, so one token far from the reference cannot
# dominate the step's penalty.
LOW_VAR_KL_BOUND = 10.0


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    return torch.expm1(-log_ratio) + log_ratio


def _low_var(log_ratio: Tensor) -> Tensor:
    bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return _k3(bounded).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


def _straight_through(value: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """`value`'s number with k2's gradient (verl's `k3+` and `low_var_kl+`)."""

    def term(log_ratio: Tensor) -> Tensor:
        k2 = _k2(log_ratio)
        return k2 + (value(log_ratio) - k2).detach()

    return term


KL_TERMS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var": _low_var,
    "k3+": _straight_through(_k3),
    "low_var+": _straight_through(_low_var),
}
"""Schulman's estimators of KL(pi || ref) per token from l = log pi - log ref of a token sampled by pi:
k1 = l (unbiased, can be negative), k2 = l^2 / 2, k3 = exp(-l) - 1 + l (unbiased, never negative),
low_var = k3 with l clamped and the result bounded (verl's low_var_kl).

As a loss (the samples held fixed, the gradient through log pi only) their expected gradients differ from
their values': k1's is 0; k3's and low_var's are the gradient of KL(ref || pi), the reverse KL; only k2's is
the gradient of KL(pi || ref). `k3+` and `low_var+` take k3's and low_var's value with k2's gradient, so
the loss logs an unbiased KL(pi || ref) and follows its gradient (KL_GRADIENTS says which each follows)."""

KL_GRADIENTS: dict[str, str] = {
    "k1": "none",
    "k2": "KL(pi || ref)",
    "k3": "KL(ref || pi)",
    "low_var": "KL(ref || pi)",
    "k3+": "KL(pi || ref)",
    "low_var+": "KL(pi || ref)",
}
"""The divergence whose gradient each estimator gives in expectation as a loss term
(tests/unit/algorithms/test_kl_estimators.py checks each against the exact gradients on a small categorical)."""


def kl_penalty(logprobs: Tensor, reference_logprobs: Tensor, estimator: str, mask: Tensor) -> Tensor:
    """[B, T] per-token KL estimate of the policy against the reference, differentiable in `logprobs`; 0 off
    `mask`, where the log-ratio is zeroed first (so padding can never overflow exp)."""
    return KL_TERMS[estimator]((logprobs - reference_logprobs.detach()) * mask)


def sequence_kl(logprobs: Tensor, reference_logprobs: Tensor, mask: Tensor, estimator: str) -> Tensor:
    """[B] summed per-token KL of each sequence over `mask`: the penalty a KL-in-reward job subtracts."""
    return kl_penalty(logprobs, reference_logprobs, estimator, mask).sum(dim=1)


def adapted_kl_coef(coef: float, observed_kl: float, target_kl: float, horizon: int, sequences: int) -> float:
    """The adaptive controller of Ziegler et al. (verl's AdaptiveKLController): the coefficient moves towards
    keeping the observed KL at `target_kl`, by at most 20% of the error per `horizon` sequences."""
    error = min(max(observed_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * sequences / horizon)
