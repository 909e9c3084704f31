"""The output layer's share of VCPO's per-sample norms, without a [tokens, vocabulary] tensor.

The norms' backward (`learner/vcpo/ghost_norms.py`) starts at the decoder's last hidden states H [N, d], from the
gradient of sum_i log pi(tau_i) there, G W: G [N, V] is the gradient at the logits,
G_t = scale_t (onehot(target_t) - softmax(h_t W^T / T)) with scale_t = mask_t / T. The output layer's own
per-sample gradient is sum_t G_t (x) h_t, whose squared norm is <G_i G_i^T, H_i H_i^T> (two Gram matrices) or
its dense [V, d] form's squared sum, whichever costs fewer FLOPs. Here G is formed one chunk of the vocabulary
at a time from the forward's log-normalisers: each chunk adds its share of G W, of each row's Gram G_i G_i^T
(or of its dense gradient's squared sum) and, for book-keeping, of the update sum_i c_i G_i^T H_i. Nothing
holds more than [N, chunk] of it (`learner.batch.CHUNK_LOGIT_ELEMENTS`), where the logits path held the
[N, V] logits, their gradient and book-keeping's kept factors of it.

A tied output layer and embedding share one weight, whose per-sample norm adds twice the cross term
<sum_t G_t (x) h_t, sum_s onehot(x_s) (x) e_s> = sum_{t,s} G_t[x_s] (h_t . e_s): the logits at the row's own
input tokens, [T, T] per row, formed again from H and the weight's rows at those tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from learner.batch import position_chunks
from learner.vcpo.products import Factors, dense_costs_less, sample_chunks, self_dot

if TYPE_CHECKING:
    from learner.micro_batches import RowBucket


def laid_out(bucket: RowBucket | None, values: Tensor, batch: int, zero_padding: bool) -> Tensor:
    """Per-position values [N, ...] as a row bucket's [rows, width, ...] (`RowBucket.unpack`); without a bucket,
    as the micro-batch's own right-padded [batch, L, ...]."""
    if bucket is None:
        return values.view(batch, -1, *values.shape[1:])
    return bucket.unpack(values[None], zero_padding)


@dataclass
class HeadRows:
    """A bucket's rows of what the output layer's norm needs: the hidden states [r, T, d], and each position's
    target, scale (0 past a row's end) and log-normaliser [r, T]."""

    hidden: Tensor
    targets: Tensor
    scale: Tensor
    normalisers: Tensor

    def cross_inner(self, weight: Tensor, embedding: Factors, temperature: float) -> Tensor:
        """Per row <sum_t G_t (x) h_t, sum_s onehot(x_s) (x) e_s>, [r] fp32: the tied weight's cross term
        with the embedding's factors of the same rows (`embedding.left` the input ids, `.right` the output
        gradients)."""
        ids, grads = embedding.left, embedding.right
        steps = ids.shape[1]
        parts = []
        for start, count in sample_chunks(ids.shape[0], steps * steps):
            rows = slice(start, start + count)
            hidden = self.hidden[rows]
            logits = torch.bmm(hidden, weight[ids[rows]].transpose(1, 2))  # [n, T, T]: h_t . w_{x_s}
            probs = logits.float().div_(temperature).sub_(self.normalisers[rows, :, None]).exp_()
            left = (self.targets[rows, :, None] == ids[rows, None, :]).to(torch.float32).sub_(probs)
            left.mul_(self.scale[rows, :, None])  # G_t[x_s]
            right = torch.bmm(hidden, grads[rows].transpose(1, 2))  # h_t . e_s
            parts.append((left * right).sum((1, 2), dtype=torch.float32))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class HeadGradient:
    """d(sum_i log pi(tau_i))/d logits of a micro-batch, kept as what forms it one vocabulary chunk at a time
    (`learner.fused_head.fused_logprobs_and_gradient` makes it)."""

    start: Tensor  # the decoder's last hidden states with their graph, [B, L, d] or packed [1, N, d]
    weight: Tensor  # the output layer's weight, detached, [V, d]
    targets: Tensor  # [N] each position's next token (a dummy at each row's last)
    scale: Tensor  # [N] fp32: mask / T, 0 at each row's last position
    normalisers: Tensor  # [N] fp32: logsumexp(h W^T / T), from the forward
    rows: Tensor  # [N] long: each position's row in the micro-batch
    temperature: float

    @property
    def hidden(self) -> Tensor:
        """The hidden states as the output layer's input, detached, [N, d] (a view of `start`)."""
        return self.start.detach().flatten(0, 1)

    def vocabulary_chunks(self) -> Iterator[slice]:
        """Slices of the vocabulary whose [N, chunk] fp32 gradient holds at most CHUNK_LOGIT_ELEMENTS numbers."""
        return position_chunks(self.weight.shape[0], self.hidden.shape[0])

    def logits_gradient(self, columns: slice, scale: Tensor | None = None) -> Tensor:
        """G[:, columns], [N, c] in the model's dtype (its products run on tensor cores), with `scale` [N] fp32
        in place of mask / T when given."""
        hidden = self.hidden
        chunk = (hidden @ self.weight[columns].T).float().div_(self.temperature)
        chunk.sub_(self.normalisers[:, None]).exp_().neg_()
        offsets = self.targets - columns.start
        inside = (offsets >= 0) & (offsets < chunk.shape[1])
        chunk.scatter_add_(1, offsets.clamp(0, chunk.shape[1] - 1)[:, None], inside[:, None].to(chunk.dtype))
        return chunk.mul_((self.scale if scale is None else scale)[:, None]).to(hidden.dtype)

    def norms_pass(
        self, buckets: list[RowBucket | None], batch: int, own_norms: bool
    ) -> tuple[Tensor, list[Tensor | None], list[HeadRows]]:
        """One pass over the vocabulary: G W shaped as `start` (where the backward enters); with `own_norms`
        each bucket's per-row ||sum_t G_t (x) h_t||^2 [rows] fp32 (else Nones); and each bucket's `HeadRows`.
        `buckets`: a packed micro-batch's row buckets, or [None] for right-padded rows (`batch` of them)."""
        hidden = self.hidden
        laid = [
            HeadRows(
                laid_out(bucket, hidden, batch, zero_padding=False),
                laid_out(bucket, self.targets, batch, zero_padding=False),
                laid_out(bucket, self.scale, batch, zero_padding=True),
                laid_out(bucket, self.normalisers, batch, zero_padding=False),
            )
            for bucket in buckets
        ]
        vocab, width = self.weight.shape
        dense = [dense_costs_less(rows.hidden.shape[1], vocab, width) for rows in laid]
        fp32 = torch.float32
        grams = [
            None
            if is_dense or not own_norms
            else rows.hidden.new_zeros(*rows.hidden.shape[:2], rows.hidden.shape[1], dtype=fp32)
            for rows, is_dense in zip(laid, dense, strict=True)
        ]
        dense_norms = [rows.hidden.new_zeros(rows.hidden.shape[0], dtype=fp32) for rows in laid]
        start_grad = hidden.new_zeros(hidden.shape, dtype=fp32)
        for columns in self.vocabulary_chunks():
            chunk = self.logits_gradient(columns)
            _accumulate(start_grad, chunk, self.weight[columns])
            if not own_norms:
                continue
            for bucket, rows, gram, norms in zip(buckets, laid, grams, dense_norms, strict=True):
                part = laid_out(bucket, chunk, batch, zero_padding=True)  # [r, T, c]
                if gram is not None:
                    _accumulate(gram, part, part.transpose(1, 2))
                    continue
                for i, n in sample_chunks(part.shape[0], part.shape[2] * width):  # the dense [n, c, d] share
                    norms[i : i + n] += self_dot(torch.bmm(part[i : i + n].transpose(1, 2), rows.hidden[i : i + n]))
        own: list[Tensor | None] = [None] * len(laid)
        if own_norms:
            for k, (rows, gram) in enumerate(zip(laid, grams, strict=True)):
                if gram is None:
                    own[k] = dense_norms[k]
                else:
                    right_gram = torch.bmm(rows.hidden, rows.hidden.transpose(1, 2))
                    own[k] = (gram * right_gram).sum((1, 2), dtype=fp32)
        return start_grad.to(hidden.dtype).view(self.start.shape), own, laid

    def weighted_sum(self, coefficients: Tensor, total: Tensor | None = None) -> Tensor:
        """sum_i c_i G_i^T H_i: the output layer's share of book-keeping's update for coefficients [b], [V, d] in
        the weight's dtype, added into `total` (the tied embedding's share) when given. One more pass over the
        vocabulary, each chunk writing its own rows of the result."""
        scale = self.scale * coefficients.float()[self.rows]
        out = torch.zeros_like(self.weight) if total is None else total
        hidden = self.hidden
        for columns in self.vocabulary_chunks():
            out[columns].addmm_(self.logits_gradient(columns, scale).T, hidden)
        return out


def _accumulate(total: Tensor, left: Tensor, right: Tensor) -> None:
    """total += left @ right (batched for 3-d operands), the product in the operands' dtype (tensor cores)
    and the sum in the fp32 `total`."""
    if left.dtype == total.dtype:
        if left.dim() == 3:
            total.baddbmm_(left, right)
        else:
            total.addmm_(left, right)
        return
    total.add_(torch.bmm(left, right) if left.dim() == 3 else left @ right)
