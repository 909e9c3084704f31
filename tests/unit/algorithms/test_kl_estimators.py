"""Each KL estimator as a loss term, exactly in expectation over a 6-way categorical: the expected gradient (the
policy's samples held fixed, the gradient through log pi) against the exact gradients of KL(pi || ref) and
KL(ref || pi), and the expected value against KL(pi || ref). The estimators' docstring and the job schema say
which gradient each follows (algorithms.regularizers.KL_GRADIENTS); this holds them to it."""

from __future__ import annotations

import pytest
import torch

from algorithms.regularizers import KL_ESTIMATORS, KL_GRADIENTS, kl_penalty

# float64 sums over 6 outcomes: the exact identities hold to rounding
EXACT = 1e-10


def _categoricals() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    policy_logits = torch.randn(6, generator=generator, dtype=torch.float64)
    reference_logits = policy_logits + 0.8 * torch.randn(6, generator=generator, dtype=torch.float64)
    return policy_logits, reference_logits


def _expected_loss_gradient(estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    """E_{x ~ pi}[d/dtheta k(log pi(x) - log ref(x))] and E_{x ~ pi}[k], summed exactly over the outcomes."""
    theta, reference_logits = _categoricals()
    theta.requires_grad_(True)
    logprobs = torch.log_softmax(theta, dim=0)
    reference = torch.log_softmax(reference_logits, dim=0)
    terms = kl_penalty(logprobs[None], reference[None], estimator, torch.ones(1, 6, dtype=torch.float64))[0]
    expected = (logprobs.exp().detach() * terms).sum()
    (gradient,) = torch.autograd.grad(expected, theta)
    return gradient, expected.detach()


def _exact_gradients() -> dict[str, torch.Tensor]:
    theta, reference_logits = _categoricals()
    theta.requires_grad_(True)
    logprobs = torch.log_softmax(theta, dim=0)
    reference = torch.log_softmax(reference_logits, dim=0)
    forward = (logprobs.exp() * (logprobs - reference)).sum()
    reverse = (reference.exp() * (reference - logprobs)).sum()
    return {
        "KL(pi || ref)": torch.autograd.grad(forward, theta, retain_graph=True)[0],
        "KL(ref || pi)": torch.autograd.grad(reverse, theta)[0],
        "none": torch.zeros(6, dtype=torch.float64),
    }


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_each_estimator_follows_the_gradient_it_claims_and_not_the_other(estimator):
    gradient, _ = _expected_loss_gradient(estimator)
    exact = _exact_gradients()
    claimed = KL_GRADIENTS[estimator]
    assert torch.allclose(gradient, exact[claimed], atol=EXACT, rtol=0), (gradient, exact[claimed])
    others = [name for name in exact if name != claimed]
    assert all((gradient - exact[name]).abs().max() > 1e-3 for name in others)  # the three really differ here


@pytest.mark.parametrize("estimator", ["k1", "k3", "low_var", "k3+", "low_var+"])
def test_the_unbiased_estimators_value_is_kl_of_the_policy_to_the_reference(estimator):
    _, value = _expected_loss_gradient(estimator)
    theta, reference_logits = _categoricals()
    logprobs, reference = torch.log_softmax(theta, dim=0), torch.log_softmax(reference_logits, dim=0)
    kl = (logprobs.exp() * (logprobs - reference)).sum()
    assert abs(float(value - kl)) < EXACT


def test_the_straight_through_forms_log_k3s_value_per_token():
    log_ratio = torch.tensor([[-2.0, -0.3, 0.0, 0.7, 3.0]], dtype=torch.float64, requires_grad=True)
    zeros, mask = torch.zeros_like(log_ratio), torch.ones_like(log_ratio)
    plus = kl_penalty(log_ratio, zeros, "k3+", mask)
    assert torch.equal(plus.detach(), kl_penalty(log_ratio, zeros, "k3", mask).detach())
    (gradient,) = torch.autograd.grad(plus.sum(), log_ratio)
    assert torch.equal(gradient, log_ratio.detach())  # k2's: d(l^2 / 2)/dl = l
