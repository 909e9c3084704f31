import pytest
import torch

from algorithms.aggregation import aggregate_token_loss, loss_denominator, policy_gradient_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]).bool()


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum", (6 + 4) / 2),
    ],
)
def test_modes_by_hand(mode, expected):
    assert aggregate_token_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_constant_mode_divides_by_sequences_times_constant_length():
    assert aggregate_token_loss(LOSS, MASK, "constant", constant_tokens=5).item() == pytest.approx(10 / (2 * 5))
    with pytest.raises(ValueError, match="constant_tokens"):
        loss_denominator(MASK, "constant")


def test_unknown_mode_names_the_choices():
    with pytest.raises(ValueError, match="token-mean"):
        loss_denominator(MASK, "sum")


def test_global_denominator_override():
    # A data-parallel peer holds 6 more tokens: the local share divides by the global count.
    assert aggregate_token_loss(LOSS, MASK, "token-mean", denominator=torch.tensor(10.0)).item() == pytest.approx(1.0)


def test_all_masked_batch_is_zero_with_a_graph_and_zero_gradient():
    logprobs = torch.randn(2, 3, requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss = policy_gradient_loss(logprobs, torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3), mode)
        assert loss.item() == 0.0 and loss.requires_grad
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert torch.equal(grad, torch.zeros(2, 3))


def test_policy_gradient_loss_detaches_weights():
    logprobs = torch.randn(1, 2, requires_grad=True)
    weights = torch.tensor([[2.0, 3.0]], requires_grad=True)
    loss = policy_gradient_loss(logprobs, weights, torch.ones(1, 2), torch.ones(1, 2), "token-mean")
    loss.backward()
    assert weights.grad is None
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, -1.5]]))
