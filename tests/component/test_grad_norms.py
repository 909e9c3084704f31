"""Ghost per-sample gradient norms against each sample's own backward, on real HF tiny models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from learner.batch import collate, sequence_logprob_grad, token_logprobs
from learner.grad_norms import GhostGradNorms, UncoveredParameters, per_sample_loop_norms


@pytest.fixture(scope="module")
def tiny_qwen2_tied(tmp_path_factory):
    from learner.models import build_tiny_model
    from tests.conftest import arithmetic_corpus

    path = tmp_path_factory.mktemp("models") / "tiny-qwen2-tied"
    return str(build_tiny_model(path, arithmetic_corpus(), arch="qwen2", tie_word_embeddings=True))


def _samples(pad_id: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i in range(5):
        prompt = torch.randint(3, 200, (4 + i % 3,), generator=gen).tolist()
        completion = torch.randint(3, 200, (2 + i,), generator=gen).tolist()
        if i == 3:
            completion[0] = pad_id  # a pad token inside a sequence: its embedding row gets no gradient
        samples.append(dict(prompt_ids=prompt, completion_ids=completion, behaviour_logprobs=[0.0] * len(completion),
                            reward=0.0, group_id=0, version=0))
    return samples


TEMPERATURE = 0.7


def _logits(model, batch):
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def _seq_logp(model, batch):
    return (token_logprobs(_logits(model, batch), batch.input_ids, TEMPERATURE) * batch.loss_mask).sum(1)


def _ghost(model, batch, from_logits=False):
    norms = GhostGradNorms(model)
    with norms.recording():
        logits = _logits(model, batch)
    logits_grad = sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, TEMPERATURE)
    return logits, norms.squared_norms(logits_grad, from_logits=from_logits)


def _alone(model, sample, pad_id) -> float:
    """||grad log pi(tau)||^2 from this sample's own unpadded forward and backward."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(_seq_logp(model, collate([sample], pad_id))[0], params)
    return float(sum(g.double().square().sum() for g in grads))


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama", "tiny_qwen2_tied"])
def test_ghost_norms_equal_each_samples_own_backward(model_name, request):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.float32)
    pad_id = model.config.pad_token_id
    assert model.model.embed_tokens.padding_idx == pad_id
    samples = _samples(pad_id)
    batch = collate(samples, pad_id)

    _, fast = _ghost(model, batch)
    _, fast_from_logits = _ghost(model, batch, from_logits=True)
    loop = per_sample_loop_norms(lambda i: _seq_logp(model, collate([samples[i]], pad_id))[0], len(samples),
                                 [p for p in model.parameters() if p.requires_grad])
    alone = torch.tensor([_alone(model, s, pad_id) for s in samples], dtype=torch.float32)

    assert torch.allclose(fast, alone, rtol=1e-4, atol=0), (fast, alone)
    assert torch.allclose(fast_from_logits, alone, rtol=1e-4, atol=0), (fast_from_logits, alone)
    assert torch.allclose(loop, alone, rtol=1e-4, atol=0), (loop, alone)
    assert len(set(alone.tolist())) == len(samples)  # distinct norms: a mixed-up sample would show


def test_the_graph_survives_for_the_loss_backward(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    batch = collate(_samples(model.config.pad_token_id), model.config.pad_token_id)
    logits, _ = _ghost(model, batch)
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


class _WithHead(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body, self.head = body, nn.Linear(4, 6)

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, x):
        return self.head(self.body(x))


def test_a_parameter_without_a_rule_is_reported():
    with pytest.raises(UncoveredParameters, match=r"body\.1\.weight"):
        GhostGradNorms(_WithHead(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))))


def test_squared_norms_needs_a_recorded_forward():
    norms = GhostGradNorms(_WithHead(nn.Linear(4, 4)))
    with pytest.raises(RuntimeError, match="recording"):
        norms.squared_norms(torch.zeros(2, 3, 6))


def test_logprob_grad_is_the_autograd_gradient():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=gen, requires_grad=True)
    ids = torch.randint(0, 7, (3, 5), generator=gen)
    mask = torch.rand(3, 4, generator=gen) > 0.3
    (token_logprobs(logits, ids, TEMPERATURE) * mask).sum().backward()
    assert torch.allclose(sequence_logprob_grad(logits, ids, mask, TEMPERATURE), logits.grad, atol=1e-6)
