import pytest
import torch

from algorithms.aggregation import aggregate_token_loss, loss_denominator, policy_gradient_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]).bool()


@pytest.mark.parametrize(
    "mode, expected",
    [("token-mean", (1 + 2 + 3 + 4) / 4), ("seq-mean-token-mean", (2 + 4) / 2), ("seq-mean-token-sum", (6 + 4) / 2)],
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


def test_float_and_bool_masks_agree():
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate_token_loss(LOSS, MASK.float(), mode).item() == aggregate_token_loss(LOSS, MASK, mode).item()


def test_policy_loss_uses_the_decision_mask():
    from algorithms import registry
    from algorithms.aggregation import policy_loss
    from algorithms.batch import PolicyBatch

    logprobs = torch.log(torch.tensor([[0.5, 0.5, 0.5]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.5]]))  # the middle token has ratio 5
    batch = PolicyBatch(logprobs, behaviour, torch.ones(1), torch.ones(1, 3))
    kept = policy_loss(batch, registry.build("mis_token").token_weights(batch), "token-mean")
    # mis_token drops the ratio-5 token from the denominator: mean over 2 tokens of -log 0.5
    assert kept.item() == pytest.approx(-torch.log(torch.tensor(0.5)).item())
    icepop = policy_loss(batch, registry.build("icepop", high=4.0).token_weights(batch), "token-mean")
    assert icepop.item() == pytest.approx(2 / 3 * -torch.log(torch.tensor(0.5)).item())
