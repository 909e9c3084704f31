"""Properties every registered stabilizer must keep, over random shapes, masks and advantages."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import registry
from algorithms.aggregation import AGGREGATIONS, policy_gradient_loss
from algorithms.batch import PolicyBatch

NAMES = sorted(registry.STABILIZERS)
MODES = [m for m in AGGREGATIONS if m != "constant"]


def _random_batch(seed: int, batch: int, tokens: int, log_ratio_scale: float, seq_advantages: bool) -> PolicyBatch:
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, tokens, generator=gen) * 3
    behaviour = logprobs - torch.randn(batch, tokens, generator=gen) * log_ratio_scale
    shape = (batch,) if seq_advantages else (batch, tokens)
    advantages = torch.randn(shape, generator=gen)
    mask = torch.rand(batch, tokens, generator=gen) < 0.8
    mask[:, 0] = True
    return PolicyBatch(logprobs.requires_grad_(True), behaviour, advantages, mask)


def _gradient(name: str, batch: PolicyBatch, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = registry.build(name).token_weights(batch)
    loss = policy_gradient_loss(batch.logprobs, out.weights, batch.token_advantages, out.mask, mode, constant_tokens=8)
    (grad,) = torch.autograd.grad(loss, batch.logprobs)
    return loss, grad


shapes = st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 12), st.booleans())


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(shape=shapes, mode=st.sampled_from(MODES))
def test_on_policy_gradient_equals_none(name, shape, mode):
    seed, b, t, seq_adv = shape
    batch = _random_batch(seed, b, t, 0.0, seq_adv)  # behaviour == learner log-probs
    _, ours = _gradient(name, batch, mode)
    _, reference = _gradient("none", batch, mode)
    assert torch.allclose(ours, reference, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None)
@given(shape=shapes)
def test_weights_are_detached(name, shape):
    seed, b, t, seq_adv = shape
    batch = _random_batch(seed, b, t, 1.0, seq_adv)
    out = registry.build(name).token_weights(batch)
    assert not out.weights.requires_grad and out.weights.grad_fn is None
    assert not out.mask.requires_grad


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_extreme_log_ratios_give_finite_loss_and_gradient(name, mode):
    batch = _random_batch(0, 4, 6, 0.0, True)
    flip = torch.tensor([[1000.0, -1000.0, 1000.0, -1000.0, 0.0, 3.0]]).expand(4, 6)
    batch = PolicyBatch(batch.logprobs, batch.logprobs.detach() - flip, batch.advantages, batch.mask)
    loss, grad = _gradient(name, batch, mode)
    assert torch.isfinite(loss) and loss.requires_grad
    assert torch.isfinite(grad).all()
    metrics = registry.build(name).token_weights(batch).metrics
    assert all(torch.isfinite(v).all() for v in metrics.values()), metrics


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(name, mode):
    batch = _random_batch(1, 3, 5, 2.0, False)
    batch = PolicyBatch(batch.logprobs, batch.behaviour_logprobs, batch.advantages, torch.zeros(3, 5))
    loss, grad = _gradient(name, batch, mode)
    assert loss.item() == 0.0 and loss.requires_grad
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", NAMES)
def test_padding_never_gets_gradient(name):
    batch = _random_batch(2, 3, 7, 1.5, False)
    _, grad = _gradient(name, batch, "token-mean")
    assert grad[~batch.mask].eq(0).all()
