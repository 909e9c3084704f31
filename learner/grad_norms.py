"""Exact per-sample gradient norms ||grad log pi(tau_i)||^2 for VCPO's off-policy optimal baseline.

Fast path (`ghost`): the book-keeping / ghost-norm technique of DP training (Li et al. 2022; Bu et al.
2023). Forward hooks keep every layer's input and output; one backward of sum_i log pi(tau_i) to the
layer *outputs* (no parameter gradients) gives each sample's output gradients, and each parameter's
per-sample gradient is a sum of outer products whose squared norm needs only Gram matrices:

    G_i = sum_t a_it (x) b_it   =>   ||G_i||^2 = sum_{t,s} (a_it . a_is)(b_it . b_is)

A linear weight has a = output grad, b = input; an embedding has a = one-hot token, b = output grad;
a tied lm_head/embedding weight sums both, so its norm adds their cross term. Bias and RMSNorm weights
get their per-sample gradient directly. Any trainable parameter outside these kinds is reported, and
the learner falls back (loudly) to the reference loop.

The backward starts below the output layer, from the closed-form gradient of the logits that the
caller passes: a training engine's hooks on the logits (DeepSpeed's backward prologue and epilogue)
then see only the real loss backward.

Reference (`per_sample_loop`): one backward per trajectory, as the official VCPO code does.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

# Samples per Gram-matrix chunk: bounds the [chunk, T, T] and [chunk, out, in] temporaries.
CHUNK_ELEMENTS = 1 << 25


class UncoveredParameters(RuntimeError):
    """Trainable parameters that the ghost-norm path cannot account for."""


@dataclass
class _Factors:
    """A per-sample gradient sum_t left_t (x) right_t; `left` is dense [B,T,m] or token ids [B,T]."""

    left: Tensor
    right: Tensor

    @property
    def indexed(self) -> bool:
        return self.left.dim() == 2


def _left_gram(p: _Factors, q: _Factors) -> Tensor:
    """[B, T_p, T_q] inner products of the left factors (one-hot rows become gathers)."""
    if p.indexed and q.indexed:
        return (p.left[:, :, None] == q.left[:, None, :]).to(p.right.dtype)
    if p.indexed:
        return _left_gram(q, p).transpose(1, 2)
    if q.indexed:  # dense a_t . onehot(id_s) = a_t[id_s]
        index = q.left[:, None, :].expand(-1, p.left.shape[1], -1)
        return torch.gather(p.left, 2, index)
    return torch.bmm(p.left, q.left.transpose(1, 2))


def _inner(p: _Factors, q: _Factors) -> Tensor:
    """Per-sample <G_p, G_q>, [B], in chunks of samples; materialises G when that is cheaper."""
    batch, steps = p.right.shape[:2]
    if p is q and not p.indexed:
        rows, cols = p.left.shape[-1], p.right.shape[-1]
        if rows * cols < steps * (rows + cols):
            per_sample = rows * cols
            return torch.cat([
                torch.bmm(p.left[i:i + n].transpose(1, 2), p.right[i:i + n]).square().sum((1, 2))
                for i, n in _chunks(batch, per_sample)
            ])
    per_sample = steps * q.right.shape[1]
    return torch.cat([
        (_left_gram(_Factors(p.left[i:i + n], p.right[i:i + n]), _Factors(q.left[i:i + n], q.right[i:i + n]))
         * torch.bmm(p.right[i:i + n], q.right[i:i + n].transpose(1, 2))).sum((1, 2))
        for i, n in _chunks(batch, per_sample)
    ])


def _chunks(batch: int, elements_per_sample: int) -> Iterator[tuple[int, int]]:
    size = max(1, CHUNK_ELEMENTS // max(1, elements_per_sample))
    for start in range(0, batch, size):
        yield start, min(size, batch - start)


def _is_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), nn.Parameter)
            and hasattr(module, "variance_epsilon") and getattr(module, "bias", None) is None)


def _covered_parameters(module: nn.Module) -> list[nn.Parameter]:
    if isinstance(module, nn.Linear):
        return [p for p in (module.weight, module.bias) if p is not None]
    if isinstance(module, nn.Embedding) or _is_rms_norm(module):
        return [module.weight]
    return []


class GhostGradNorms:
    """Per-sample squared gradient norms of a HF causal LM from one batched backward."""

    def __init__(self, model: nn.Module) -> None:
        self.output_layer = model.get_output_embeddings()
        if not isinstance(self.output_layer, nn.Linear):
            raise UncoveredParameters(f"output layer {type(self.output_layer).__name__} is not a linear layer")
        self.modules = [m for m in model.modules() if _covered_parameters(m)]
        owned = {id(p) for m in self.modules for p in _covered_parameters(m)}
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise UncoveredParameters(f"no ghost-norm rule for parameters {missing[:5]}"
                                      + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        self._records: list[tuple[nn.Module, Tensor, Tensor]] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Keep (module, input, output) of every covered module during the forward inside."""
        self._records = []

        def keep(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            if torch.is_grad_enabled() and output.requires_grad:
                self._records.append((module, inputs[0], output))

        handles = [m.register_forward_hook(keep) for m in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def squared_norms(self, logits_grad: Tensor, from_logits: bool = False) -> Tensor:
        """||grad_theta log pi(tau_i)||^2 for each sample, [B] fp32, given d(sum_i log pi(tau_i))/d logits
        ([B, L, V], e.g. `sequence_logprob_grad`).

        By default the backward starts below the output layer (which needs its whole weight, so not
        under ZeRO-3) and the forward graph stays for the loss backward. `from_logits` starts at the
        logits and frees the graph: for a forward of its own under ZeRO-3, whose per-module backward
        hooks expect every backward to enter at the top.
        """
        records, self._records = self._records, []
        heads = [r for r in records if r[0] is self.output_layer]
        if len(heads) != 1:
            raise RuntimeError(f"squared_norms needs one recorded forward inside recording(), saw {len(heads)}")
        head, hidden, logits = heads[0]
        body = [r for r in records if r[0] is not head]
        if from_logits:
            start, start_grad = logits, logits_grad.to(logits.dtype)
        else:
            start, start_grad = hidden, (logits_grad.to(head.weight.dtype) @ head.weight).to(hidden.dtype)
        batch = logits_grad.shape[0]
        uses = Counter(id(p) for module, _, _ in records for p in _covered_parameters(module))
        total = torch.zeros(batch, dtype=torch.float32, device=logits_grad.device)
        shared: dict[int, list[object]] = {}

        def consume(module: nn.Module, x: Tensor, grad: Tensor) -> None:
            """Add a call's contributions now (its gradients are freed after), or keep shared ones."""
            for param, contribution in self._contributions(module, x.detach(), grad.float(), batch):
                if uses[id(param)] > 1:
                    shared.setdefault(id(param), []).append(contribution)
                elif isinstance(contribution, _Factors):
                    total.add_(_inner(contribution, contribution))
                else:
                    total.add_(contribution.square().sum(-1))

        reached: set[int] = set()

        def on_grad(index: int, module: nn.Module, x: Tensor, grad: Tensor) -> None:
            reached.add(index)
            consume(module, x, grad)

        consume(head, hidden, logits_grad)
        handles = [out.register_hook(partial(on_grad, i, m, x)) for i, (m, x, out) in enumerate(body)]
        try:
            # Asking only for the first layer's output runs the whole backward below `start` while each
            # layer's hook consumes its gradient at once: one layer's output gradient alive at a time.
            torch.autograd.grad(start, [body[0][2]], grad_outputs=start_grad, retain_graph=not from_logits)
        finally:
            for handle in handles:
                handle.remove()
        missed = [type(body[i][0]).__name__ for i in range(len(body)) if i not in reached]
        if missed:
            raise UncoveredParameters(f"no gradient reached the outputs of {missed[:5]} on the way to the first layer")
        for parts in shared.values():
            if any(not isinstance(part, _Factors) for part in parts):
                total.add_(sum(parts).square().sum(-1))
                continue
            for j, p in enumerate(parts):
                total.add_(_inner(p, p))
                for q in parts[j + 1:]:
                    total.add_(2 * _inner(p, q))
        return total

    @staticmethod
    def _contributions(module: nn.Module, x: Tensor, grad: Tensor, batch: int) -> list[tuple[nn.Parameter, object]]:
        """Each parameter's per-sample gradient of this call: factors, or a direct [B, n] vector."""
        if isinstance(module, nn.Embedding):
            ids = x.reshape(batch, -1)
            right = grad.reshape(batch, ids.shape[1], -1)
            if module.padding_idx is not None:  # that row gets no gradient
                right = right * (ids != module.padding_idx).unsqueeze(-1)
            return [(module.weight, _Factors(ids, right))]
        grad = grad.reshape(batch, -1, grad.shape[-1])
        if isinstance(module, nn.Linear):
            out: list[tuple[nn.Parameter, object]] = [
                (module.weight, _Factors(grad, x.reshape(batch, -1, x.shape[-1]).float()))
            ]
            if module.bias is not None:
                out.append((module.bias, grad.sum(1)))
            return out
        hidden = x.reshape(batch, -1, x.shape[-1]).float()
        normalised = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        return [(module.weight, (grad * normalised.to(x.dtype).float()).sum(1))]


def per_sample_loop_norms(sample_logp: Callable[[int], Tensor], count: int, parameters: list[nn.Parameter]) -> Tensor:
    """Reference: for each sample, its own forward (`sample_logp(i)`, a scalar log pi(tau_i)) and backward."""
    norms = []
    for i in range(count):
        grads = torch.autograd.grad(sample_logp(i), parameters, allow_unused=True)
        norms.append(sum((g.float().square().sum() for g in grads if g is not None), torch.zeros(())))
    return torch.stack(norms)
