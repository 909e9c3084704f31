"""The decoupled objective's trust-region weights against the literal clipped surrogate."""

import torch

from algorithms.proximal import trust_region_weights


def test_at_the_proximal_policy_every_loss_token_weighs_exactly_one():
    logprobs = torch.tensor([[-1.0, -2.5, 0.0], [-0.3, -4.0, -7.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    weights, clipped = trust_region_weights(logprobs, logprobs.clone(), torch.tensor([1.0, -2.0]), mask, 0.2, 0.28)
    assert torch.equal(weights, mask.float())  # bit for bit: the first update is the plain stabilized one
    assert clipped.sum() == 0


def test_weights_give_the_literal_clipped_surrogates_gradient():
    gen = torch.Generator().manual_seed(3)
    proximal = -3.0 + torch.randn(6, 9, generator=gen)
    logprobs = (proximal + 0.5 * torch.randn(6, 9, generator=gen)).requires_grad_(True)
    advantages = torch.tensor([1.5, -1.0, 0.0, 2.0, -0.5, 1.0])
    mask = torch.rand(6, 9, generator=gen) > 0.2
    stabilizer_weights = torch.rand(6, 9, generator=gen) * 2  # the staleness correction pi_prox / mu, detached
    eps_low, eps_high = 0.2, 0.28

    ratio = torch.exp(logprobs - proximal)
    a = advantages.unsqueeze(1)
    literal = -(stabilizer_weights * torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a))
    (literal_grad,) = torch.autograd.grad((literal * mask).sum(), logprobs)

    weights, clipped = trust_region_weights(logprobs, proximal, advantages, mask, eps_low, eps_high)
    weight_form = -(stabilizer_weights * weights * a * logprobs)
    (weight_grad,) = torch.autograd.grad((weight_form * mask).sum(), logprobs)
    torch.testing.assert_close(weight_grad, literal_grad, rtol=1e-6, atol=1e-7)

    r = ratio.detach()
    expected = mask & (((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low)))
    assert torch.equal(clipped.bool(), expected)
    assert 0 < expected.sum() < mask.sum()  # the case really has both clipped and unclipped tokens
    assert torch.all(weights[expected] == 0) and torch.all(weights[~mask] == 0)
