"""The fused output layer and log-softmax against logits formed whole: same values, same gradients, and no
[tokens, vocabulary] tensor kept for the backward."""

from __future__ import annotations

import pytest
import torch

from learner import batch as learner_batch
from learner.batch import token_logprobs_and_entropy
from learner.fused_head import fused_token_logprobs


def _inputs(dtype: torch.dtype, vocab: int = 50):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=gen).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(vocab, 16, generator=gen)).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (3, 7), generator=gen)
    return hidden, weight, ids


@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_log_probs_entropy_and_gradients_equal_the_whole_logits(monkeypatch, with_entropy):
    monkeypatch.setattr(learner_batch, "CHUNK_LOGIT_ELEMENTS", 100)  # several chunks of positions
    hidden, weight, ids = _inputs(torch.float32)
    gen = torch.Generator().manual_seed(1)
    coefficient, entropy_coefficient = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)

    logprobs, entropy = fused_token_logprobs(hidden, weight, ids, 0.7, with_entropy)
    objective = (coefficient * logprobs).sum() + ((entropy_coefficient * entropy).sum() if with_entropy else 0)
    fused_grads = torch.autograd.grad(objective, (hidden, weight))

    whole_logprobs, whole_entropy = token_logprobs_and_entropy(hidden @ weight.T, ids, 0.7)
    whole = (coefficient * whole_logprobs).sum() + ((entropy_coefficient * whole_entropy).sum() if with_entropy else 0)
    whole_grads = torch.autograd.grad(whole, (hidden, weight))

    assert torch.allclose(logprobs, whole_logprobs, atol=1e-5)
    if with_entropy:
        assert torch.allclose(entropy, whole_entropy, atol=1e-5)
    for fused, want in zip(fused_grads, whole_grads):
        assert torch.allclose(fused, want, atol=1e-5), (fused - want).abs().max()


def test_fused_gradients_check_against_finite_differences():
    hidden, weight, ids = _inputs(torch.float64, vocab=9)

    def objective(h, w):
        logprobs, entropy = fused_token_logprobs(h, w, ids, 1.3, True)
        return logprobs.sum() + 0.5 * entropy.sum()

    assert torch.autograd.gradcheck(objective, (hidden, weight))


def test_bf16_products_stay_in_bf16_and_keep_no_whole_logits():
    """The graph keeps the hidden states and the weight, not a [tokens, vocabulary] tensor: what lets a long
    sequence through a large vocabulary."""
    hidden, weight, ids = _inputs(torch.bfloat16, vocab=4096)
    saved: list[torch.Size] = []

    def pack(tensor):
        saved.append(tensor.shape)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = fused_token_logprobs(hidden, weight, ids)
    logprobs.sum().backward()
    assert logprobs.dtype == torch.float32
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    assert all(shape.numel() < 3 * 7 * 4096 for shape in saved), saved
    whole, _ = token_logprobs_and_entropy((hidden @ weight.T).float(), ids)
    assert torch.allclose(logprobs, whole, atol=2e-2)  # bf16 products: logits rounded to 8 bits of mantissa


class _ScaledLogits(torch.nn.Module):
    """A model whose logits are not h W^T of its decoder's output (a logit scale, as some models have)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def get_decoder(self):
        return self.model.get_decoder()

    def forward(self, input_ids):
        output = self.model(input_ids=input_ids)
        output.logits = 2 * output.logits
        return output


def test_the_probe_fuses_a_plain_causal_lm_and_refuses_one_whose_logits_differ(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    from learner.fused_head import fused_head

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).train()
    head, why = fused_head(model)
    assert head is not None and head.head is model.lm_head, why
    assert model.training  # the probe ran in eval mode and gave the mode back
    scaled, why = fused_head(_ScaledLogits(model))
    assert scaled is None and "differ" in why
