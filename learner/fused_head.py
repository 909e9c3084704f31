"""The output layer and the log-softmax fused, one chunk of positions at a time, forward and backward.

A causal LM's last step, logits = h W^T, makes a [tokens, vocabulary] tensor in the forward and its
gradient in the backward (4.6 GiB each for Qwen2.5-1.5B at 16k bf16 tokens), although the loss needs only
each position's target log-prob (and entropy). Here each chunk's logits are formed, reduced to those
numbers and dropped; the backward forms each chunk's logits again and turns them into the chunk's hidden
gradient and its share of the weight gradient. The same idea as Liger-Kernel's fused linear cross-entropy
and verl's fused linear log-prob, in plain torch: the products run in the model's dtype (tensor cores on a
GPU), and only one chunk's logits exist at a time, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from learner.batch import chunk_logits_gradient, next_tokens, position_chunks, position_scales, token_logprobs
from learner.vcpo.output_layer import HeadGradient


class _FusedTargetLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] and the entropy per position, differentiable in h and W."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor, Tensor]:  # hidden [N, d], weight [V, d], targets [N]
        """The log-probs [N], the entropies ([N], or empty) and the log-normalisers logsumexp(h W^T / T) [N]
        (not differentiable: what VCPO's norms rebuild the softmax from, `learner.vcpo.output_layer`)."""
        ctx.set_materialize_grads(False)
        logprobs = torch.empty(hidden.shape[0], dtype=_reduced_dtype(hidden), device=hidden.device)
        normalisers = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_zeros(0)
        for rows in position_chunks(hidden.shape[0], weight.shape[0]):
            chunk = (hidden[rows] @ weight.T).to(logprobs.dtype).div_(temperature)
            normalisers[rows] = torch.logsumexp(chunk, dim=-1)
            logprobs[rows] = chunk.gather(-1, targets[rows, None]).squeeze(-1) - normalisers[rows]
            if with_entropy:
                log_p = chunk.sub_(normalisers[rows, None])
                entropy[rows] = -(log_p.exp() * log_p).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, targets, normalisers, entropy)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(normalisers)
        return logprobs, entropy, normalisers

    @staticmethod
    def backward(
        ctx: Any,
        grad_logprobs: Tensor | None,
        grad_entropy: Tensor | None,  # type: ignore[override]
        grad_normalisers: Tensor | None,
    ) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        """Per chunk: the logits' gradient (`chunk_logits_gradient`), then dh = dlogits W and dW += dlogits^T h."""
        hidden, weight, targets, normalisers, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None
        if grad_logprobs is not None:
            grad_logprobs = grad_logprobs.to(normalisers.dtype)
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(normalisers.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for rows in position_chunks(hidden.shape[0], weight.shape[0]):
            log_p = (hidden[rows] @ weight.T).to(normalisers.dtype).div_(temperature).sub_(normalisers[rows, None])
            grad_logits = chunk_logits_gradient(
                log_p,
                targets[rows],
                entropy[rows] if entropy.numel() else None,
                None if grad_logprobs is None else grad_logprobs[rows],
                None if grad_entropy is None else grad_entropy[rows],
                temperature,
            ).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, hidden[rows])
        return grad_hidden, grad_weight, None, None, None


def _reduced_dtype(hidden: Tensor) -> torch.dtype:
    """Where a chunk's softmax is reduced: fp32, or the inputs' own dtype when that is wider (fp64 checks)."""
    return torch.promote_types(hidden.dtype, torch.float32)


def fused_token_logprobs(
    hidden: Tensor, weight: Tensor, input_ids: Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[Tensor, Tensor]:
    """`learner.batch.token_logprobs_and_entropy` of the logits h W^T without forming them: from the last
    hidden states [B, L, d] and the output layer's weight [V, d], each next token's log-prob [B, L-1] fp32
    and, `with_entropy`, the entropy at each position [B, L-1] (else an empty tensor)."""
    batch, length, width = hidden.shape
    logprobs, entropy, _ = _FusedTargetLogprobs.apply(
        hidden.reshape(batch * length, width), weight, next_tokens(input_ids), float(temperature), with_entropy
    )
    entropy = entropy.view(batch, length)[:, :-1] if with_entropy else entropy
    return logprobs.view(batch, length)[:, :-1], entropy


def fused_logprobs_and_gradient(
    hidden: Tensor, weight: Tensor, input_ids: Tensor, loss_mask: Tensor, rows: Tensor, temperature: float
) -> tuple[Tensor, Tensor, HeadGradient]:
    """`fused_token_logprobs` with the entropy, [B, L-1] each, and the gradient of the masked log-prob sum
    sum_i log pi(tau_i) at the logits, never formed whole (`HeadGradient`): where VCPO's per-sample norms
    start. `loss_mask` [B, L-1]; `rows` [B * L], each position's sample in the micro-batch."""
    batch, length, width = hidden.shape
    targets = next_tokens(input_ids)
    logprobs, entropy, normalisers = _FusedTargetLogprobs.apply(
        hidden.reshape(batch * length, width), weight, targets, float(temperature), True
    )
    gradient = HeadGradient(
        start=hidden,
        weight=weight.detach(),
        targets=targets,
        scale=position_scales(loss_mask, temperature),  # d log p_t[target_t] / d logits = scale_t (onehot - p_t)
        normalisers=normalisers,
        rows=rows,
        temperature=float(temperature),
    )
    return logprobs.view(batch, length)[:, :-1], entropy.view(batch, length)[:, :-1], gradient


# How far the fused log-probs may differ from the model's own logits on the probe and still be the same function:
# fp32 sums in another order, or bf16 products rounded to 8 bits of mantissa.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@dataclass(frozen=True)
class FusedHead:
    """A causal LM split at its output layer: the decoder up to the last hidden states, and the head's weight."""

    decoder: nn.Module
    head: nn.Linear

    def token_logprobs(self, input_ids: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
        """`fused_token_logprobs` of right-padded rows, without a padding mask (see learner.step.causal_logits)."""
        hidden = self.decoder(input_ids=input_ids).last_hidden_state
        return fused_token_logprobs(hidden, self.head.weight, input_ids, temperature, with_entropy)


def fused_head(model: Any) -> tuple[FusedHead | None, str]:
    """The model (a HF causal LM or a peft model of one) as decoder and output layer where its logits are
    exactly h W^T of the decoder's last hidden states, shown by a probe against the model's own forward; else
    None and why (a bias, a logit scale or soft cap, no decoder to call), and the caller keeps forming the logits."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the adapted model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None or not isinstance(head, nn.Linear) or head.bias is not None:
        return None, f"{type(base).__name__} has no decoder and bias-free linear output layer to fuse"
    fused = FusedHead(decoder, head)
    device, dtype = head.weight.device, head.weight.dtype
    ids = torch.arange(16, device=device).reshape(2, 8) * 7 % head.out_features
    training = model.training
    model.eval()  # the same function on both sides (no dropout masks)
    try:
        with torch.no_grad():
            whole = token_logprobs(model(input_ids=ids).logits, ids)
            fused_logprobs, _ = fused.token_logprobs(ids, 1.0, with_entropy=False)
    finally:
        model.train(training)
    gap = float((whole - fused_logprobs).abs().max())
    if not gap <= PROBE_TOLERANCE.get(dtype, 1e-4):
        return None, f"the model's logits are not h W^T of its decoder's output (log-probs differ by {gap:.3g})"
    return fused, f"fused output layer (probe within {gap:.2g} of the model's logits)"
