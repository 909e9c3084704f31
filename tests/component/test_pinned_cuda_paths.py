"""The learner's CUDA-only branches, driven on the CPU through the pinned versions' Python layer.

A GPU machine may run another PyTorch than the `gpu` extra pins (the lent one had 2.11, the extra 2.13), so a
branch that only CUDA takes is also run here wherever its op accepts meta tensors: meta tensors go through the
same Python checks and the op's fake kernel, and give shapes and dtypes without a device. API drift in a pinned
version then fails on the CPU. Where an op has no meta kernel (the allocator's queries), its signature is checked.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from benchmarks.model_configs import ARCHITECTURES
from learner import micro_batches, packing
from learner.fused_head import FusedHead
from tests.component.test_packing import _batch

META = torch.device("meta")


def _drawn(heads: int, tokens: int, head_dim: int) -> torch.Tensor:
    return torch.empty(1, heads, tokens, head_dim, device=META, dtype=torch.bfloat16).requires_grad_()


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (12, 2), (4, 4)], ids=["smollm2", "qwen2.5", "equal"])
def test_varlen_attention_takes_grouped_query_heads_through_the_pinned_torch(heads, kv_heads):
    """SmolLM2's 9 query heads over 3 key/value heads, Qwen2.5's 12 over 2: torch 2.13's `varlen_attn` refuses
    them without `enable_gqa`, a check that runs before any kernel, on meta tensors as on CUDA ones."""
    lengths, head_dim = (1, 90, 4, 33), 64
    tokens = sum(lengths)
    query, key, value = (
        _drawn(heads, tokens, head_dim),
        _drawn(kv_heads, tokens, head_dim),
        _drawn(kv_heads, tokens, 64),
    )
    cu_seqlens = torch.tensor([0, 1, 91, 95, 128], dtype=torch.int32, device=META)
    assert packing.varlen_serves(META.type, torch.bfloat16, head_dim)
    output = packing.varlen_sdpa(query, key, value, cu_seqlens, max(lengths), None)
    assert output is not None and output.shape == (1, tokens, heads, head_dim) and output.dtype == torch.bfloat16
    grads = torch.autograd.grad(output.float().square().sum(), (query, key, value))
    assert [g.shape for g in grads] == [query.shape, key.shape, value.shape]


def test_varlen_serves_cuda_and_meta_in_half_precision_only():
    assert packing.varlen_serves("cuda", torch.bfloat16, 128) and packing.varlen_serves("cuda", torch.float16, 256)
    assert not packing.varlen_serves("cuda", torch.float32, 64)  # flash attention has no fp32 kernel
    assert not packing.varlen_serves("cuda", torch.bfloat16, 512)  # nor one for heads over 256 wide
    assert not packing.varlen_serves("cpu", torch.bfloat16, 64)  # the CPU runs the rows as a padded batch (rows_sdpa)


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["torch-2.13", "torch-2.11"])
def test_enable_gqa_goes_only_to_a_varlen_attn_that_takes_it(monkeypatch, takes_gqa):
    """torch 2.11's `varlen_attn` has no `enable_gqa` keyword (its kernel takes grouped heads as they are), 2.13's
    needs it for them: the call names it exactly where the signature has it and the head counts differ."""
    calls: list[dict] = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append(kwargs)
        return q

    monkeypatch.setattr(packing, "_varlen_kernel", lambda: (varlen_attn, takes_gqa))
    cu_seqlens = torch.tensor([0, 8], dtype=torch.int32)
    for kv_heads in (2, 4):
        query, key = torch.zeros(1, 4, 8, 16), torch.zeros(1, kv_heads, 8, 16)
        assert packing.varlen_attention(query, key, key, cu_seqlens, 8, None).shape == (1, 8, 4, 16)
    assert [call.get("enable_gqa") for call in calls] == ([True, None] if takes_gqa else [None, None])
    assert all(call["window_size"] == (-1, 0) for call in calls)  # causal within each row


def _smollm2_on_meta(layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    _, values = ARCHITECTURES["smollm2-135m"]
    config = LlamaConfig(**{**values, "num_hidden_layers": layers})
    with META:
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
def test_a_packed_bf16_step_of_smollm2_takes_the_varlen_kernel_in_every_layer(monkeypatch, fused):
    """A SmolLM2-shaped model (grouped-query heads, bf16) on meta runs a packed forward and backward as on a GPU:
    each layer's attention is one varlen call, and log-probs and gradients come back in their shapes."""
    model = _smollm2_on_meta(layers=2)
    supported, why = packing.packing_support(model)
    assert supported, why
    calls = []
    real = packing.varlen_attention
    monkeypatch.setattr(packing, "varlen_attention", lambda *args: calls.append(args[1].shape) or real(*args))
    host_batch = _batch(model.config.vocab_size)
    plan = micro_batches.plan(host_batch.sequence_lengths, host_batch.group_ids, None, False, packed=True)
    (run,) = plan.micro_batches
    micro = host_batch.rows(run.rows).trimmed(run.width).to(META)
    packed = micro_batches.Packing.of(list(run.packing.lengths), run.packing.width, META)
    # the fused head as `fused_head` builds it, without its probe (which compares values)
    head = FusedHead(model.get_decoder(), model.get_output_embeddings()) if fused else None
    logprobs, entropy = packing.packed_token_logprobs(model, head, micro, packed, 1.0, with_entropy=True)
    assert logprobs.shape == micro.loss_mask.shape and logprobs.dtype == torch.float32
    assert entropy is not None and entropy.shape == logprobs.shape
    (logprobs * micro.loss_mask).sum().backward()
    assert len(calls) == 2 and all(shape[1] == 3 for shape in calls)  # 3 key/value heads, one call a layer
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.shape == parameter.shape, name
        assert parameter.grad.dtype == torch.bfloat16, name


def test_the_pinned_torch_keeps_the_cuda_calls_the_learner_makes():
    """The CUDA calls with no meta kernel: their names and the arguments the learner and benchmarks pass."""
    for call in (torch.cuda.mem_get_info, torch.cuda.memory_reserved, torch.cuda.memory_allocated):
        assert "device" in inspect.signature(call).parameters, call.__name__
    for call in (torch.cuda.max_memory_allocated, torch.cuda.reset_peak_memory_stats, torch.cuda.synchronize):
        assert "device" in inspect.signature(call).parameters, call.__name__
    from learner.vcpo.products import tensor_core_products

    before = torch.backends.cuda.matmul.allow_tf32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated flag would warn before it goes
        with tensor_core_products(torch.device("cuda")):
            assert torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before
