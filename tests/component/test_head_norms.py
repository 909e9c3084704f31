"""VCPO's per-sample norms and book-kept gradients from the hidden states through the fused output layer (no
[tokens, vocabulary] tensor), against each sample's own backward, on real HF tiny models."""

from __future__ import annotations

import pytest
import torch

from learner.batch import collate
from learner.vcpo.ghost_norms import GhostGradNorms, per_sample_loop_norms
from tests.component.test_grad_norms import BF16_NORM_RTOL, TEMPERATURE, _alone, _kept_bytes, _seq_logp

# responses of drawn lengths (a long one: its bucket's head norm takes the dense route, the short ones the Gram's)
LENGTHS = (2, 40, 5, 150, 3, 18, 60, 4)


def _batch(pad_id: int, lengths: tuple[int, ...]):
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i, length in enumerate(lengths):
        completion = torch.randint(3, 200, (length,), generator=gen).tolist()
        if i == 2:
            completion[0] = pad_id  # a pad token inside a sequence: its embedding row gets no gradient
        samples.append(
            dict(
                prompt_ids=torch.randint(3, 200, (4,), generator=gen).tolist(),
                completion_ids=completion,
                behaviour_logprobs=[0.0] * length,
                reward=0.0,
                group_id=0,
                version=0,
            )
        )
    return samples, collate(samples, pad_id)


def _head(model):
    from learner.fused_head import fused_head

    head, why = fused_head(model)
    assert head is not None, why
    return head


def _fused_norms(model, batch, packed: bool, keep: bool, head=None):
    """The learner's fused forward (`PolicyForwards.head_forward`) recorded, then the norms from its
    `HeadGradient`: padded rows, or packed in buckets of similar length."""
    from learner.micro_batches import Packing
    from learner.packing import packing_support
    from learner.policy import PolicyForwards

    head = _head(model) if head is None else head
    packing = None
    if packed:
        assert packing_support(model)[0]
        real = batch.attention_mask.sum(1).tolist()
        packing = Packing.of(real, batch.input_ids.shape[1], torch.device("cpu"), bucket_cost=0.0)
        assert len(packing.buckets) > 1
    norms = GhostGradNorms(model, fused_head=True)
    with norms.recording():
        logprobs, entropy, gradient = PolicyForwards(model, head, TEMPERATURE).head_forward(batch, packing)
    assert logprobs.shape == entropy.shape == batch.loss_mask.shape
    if keep:
        return norms, packing, norms.sample_gradients(gradient, packed=packing)
    return norms, packing, norms.squared_norms(gradient, packed=packing)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_llama", "tiny_qwen2_tied"])
def test_norms_and_book_kept_gradients_from_the_hidden_states_equal_each_samples_own_backward(
    model_name, packed, request
):
    """The output layer's norm formed by vocabulary chunks (Gram for short rows, dense for the long one), the
    tied weight's cross term from the logits at the rows' own tokens, and book-keeping's update formed again by
    chunk: all equal autograd's per-sample gradients, and book-keeping keeps what its budget check counts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.float32)
    pad_id = model.config.pad_token_id
    samples, batch = _batch(pad_id, LENGTHS)
    alone = torch.tensor([_alone(model, s, pad_id) for s in samples], dtype=torch.float32)
    assert len(set(alone.tolist())) == len(samples)

    _, _, ghost = _fused_norms(model, batch, packed, keep=False)
    norms, packing, sample_grads = _fused_norms(model, batch, packed, keep=True)
    assert torch.allclose(ghost, alone, rtol=1e-4, atol=0), (ghost, alone)
    assert torch.allclose(sample_grads.squared_norms, alone, rtol=1e-4, atol=0)

    # book-keeping keeps the hidden states once for the output layer (its gradients are formed again by chunk)
    assert sample_grads.head is not None
    hidden = sample_grads.head[1].hidden
    kept = _kept_bytes(sample_grads) + hidden.numel() * hidden.element_size()
    if packing is None:
        assert kept == batch.size * norms.kept_bytes_per_sample(batch.input_ids.shape[1])
    else:  # the packed hidden states hold the real tokens only: less than the buckets' rows x widths
        assert kept <= sum(len(b.rows) * norms.kept_bytes_per_sample(b.width) for b in packing.buckets)

    coefficients = torch.linspace(-1.0, 2.0, batch.size)
    params = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad((coefficients * _seq_logp(model, batch)).sum(), params)
    formed = sample_grads.weighted_sum(coefficients)
    assert set(map(id, formed)) == set(map(id, params))
    for param, want in zip(params, expected, strict=True):
        assert torch.allclose(formed[param], want, rtol=1e-4, atol=1e-6 * want.abs().max()), param.shape


@pytest.mark.parametrize("model_name", ["tiny_qwen2", "tiny_qwen2_tied"])
def test_bf16_norms_from_the_hidden_states_agree_with_each_samples_own_bf16_backward(model_name, request):
    """A bf16 model's fused norms (bf16 products, fp32 sums over vocabulary chunks) match the per-sample loop to
    bf16 rounding, as the logits path's do (`BF16_NORM_RTOL`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_name), dtype=torch.bfloat16)
    pad_id = model.config.pad_token_id
    samples, batch = _batch(pad_id, LENGTHS[:5])
    params = [p for p in model.parameters() if p.requires_grad]
    loop = per_sample_loop_norms(lambda i: _seq_logp(model, collate([samples[i]], pad_id))[0], len(samples), params)
    for packed in (False, True):
        _, _, fused = _fused_norms(model, batch, packed, keep=False)
        assert fused.dtype == torch.float32
        assert torch.allclose(fused, loop, rtol=BF16_NORM_RTOL, atol=0), (packed, fused, loop)


def test_no_tokens_by_vocabulary_tensor_is_formed(tiny_qwen2_tied, monkeypatch):
    """With the chunk of logits made small, no operator of the fused forward and norms pass (book-keeping's
    update included) makes a tensor of more [*, vocabulary] numbers than one chunk: the logits path's [N, V]
    logits and gradient are gone."""
    from transformers import AutoModelForCausalLM

    import learner.batch
    from tests.component.test_matmul_dtypes import LargestVocabularyTensor

    chunk = 1024
    monkeypatch.setattr(learner.batch, "CHUNK_LOGIT_ELEMENTS", chunk)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_tied, dtype=torch.float32)
    vocab = model.config.vocab_size
    _, batch = _batch(model.config.pad_token_id, LENGTHS)
    tokens = int(batch.attention_mask.sum())
    assert tokens * vocab > 50 * chunk

    head = _head(model)  # its probe runs the model's own forward, logits and all
    with LargestVocabularyTensor(vocab) as mode:
        _, _, sample_grads = _fused_norms(model, batch, packed=True, keep=True, head=head)
        sample_grads.weighted_sum(torch.ones(batch.size))
    assert 0 < mode.largest <= chunk, (mode.largest, chunk, mode.op)


def test_the_fused_rule_covers_a_head_alone_or_tied_to_an_embedding_only():
    """The cross term of a fused head is the embedding's: a head weight that another kind of layer shares keeps
    the logits path (the norms would miss that layer's cross term)."""
    from torch import nn

    from tests.component.test_grad_norms import _WithHead

    alone = _WithHead(nn.Linear(4, 4))
    tied = _WithHead(nn.Embedding(6, 4))
    tied.body.weight = tied.head.weight
    shared = _WithHead(nn.Linear(6, 4))  # a [6, 4] weight, as the head's
    shared.body.weight = shared.head.weight
    assert GhostGradNorms(alone, fused_head=True).fused_head
    assert GhostGradNorms(tied, fused_head=True).fused_head
    assert not GhostGradNorms(shared, fused_head=True).fused_head
    assert not GhostGradNorms(alone).fused_head  # asked for by the learner only where its head fuses
