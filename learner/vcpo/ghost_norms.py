"""Exact per-sample gradient norms ||grad log pi(tau_i)||^2 for VCPO's off-policy optimal baseline.

Fast paths: the ghost-norm and book-keeping techniques of DP training (Li et al. 2022; Bu et al. 2023).
Forward hooks record every layer's input and hook its output; one backward of sum_i log pi(tau_i) to
the layer *outputs* (no parameter gradients) gives each sample's output gradients, and each
parameter's per-sample gradient is a sum of outer products whose squared norm needs only Gram matrices
(or the dense per-sample gradient, where that holds fewer numbers):

    G_i = sum_t a_it (x) b_it   =>   ||G_i||^2 = sum_{t,s} (a_it . a_is)(b_it . b_is)

A linear weight has a = output grad, b = input; an embedding has a = one-hot token, b = output grad;
a tied lm_head/embedding weight sums both, so its norm adds their cross term. Bias and RMSNorm weights
get their per-sample gradient directly. Any trainable parameter outside these kinds is reported, and
the learner falls back (loudly) to the reference loop.

The backward starts below the output layer, from the closed-form gradient of the logits that the
caller passes: a training engine's hooks on the logits (DeepSpeed's backward prologue and epilogue)
then see only the real loss backward. Where the output layer is fused with the log-softmax, the caller
passes a `HeadGradient` instead (`learner/vcpo/output_layer.py`): the output layer's share (the gradient at the
hidden states, its own norm, a tied embedding's cross term, book-keeping's update) is formed one vocabulary
chunk at a time, and no [tokens, vocabulary] tensor exists.

`ghost` (`squared_norms`) keeps only the norms; the caller's loss backward follows. `bookkeeping`
(`sample_gradients`) also keeps every per-sample gradient, so the caller forms the update
sum_i k_i G_i from them once it knows the coefficients, and no second backward is needed.

Products run on tensor cores (`learner/vcpo/products.py` holds the algebra): inputs and output gradients
stay in the model's dtype (no fp32 copy), every Gram and dense product is a GEMM in that dtype (fp32
accumulation inside the kernel; TF32 for an fp32 model on CUDA), and only the reductions of their results
to per-sample norms run in fp32. A bf16 norm is therefore exact to bf16 rounding of those products: each term
carries a relative error of about 2^-8, and the errors of the many terms of a norm are independent, so the
norm agrees with the per-sample loop (whose gradients are bf16 too) to about 1%.

A packed forward (the rows of a micro-batch laid end to end, `learner/packing.py`) passes its `Packing`:
each layer's input and output gradient, [1, N, ...], is laid back into rows, one [b, T_k, ...] per bucket of rows
of similar length (`Packing.buckets`), before its norms are formed. The output gradient has zeros where a row is
shorter, so the input's places there (its row's first token) add nothing to any product; layers that share their
input (q, k and v; gate and up) lay it out once. The buckets keep the Gram products' cost near the rows' own
lengths squared.

On a GPU a small model's step is bound by the host launching kernels, not by the kernels: the norms pass keeps
its operator calls few (each call's norms summed once per bucket at the end, not added one call at a time).

Reference (`per_sample_loop`): one backward per trajectory, as the official VCPO code does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from algorithms.errors import StableAsyncError
from learner.vcpo.output_layer import HeadGradient, HeadRows
from learner.vcpo.products import (
    Contribution,
    Factors,
    FoldedSums,
    InputGramSum,
    compact,
    folding_costs_less,
    squared_norm,
    tensor_core_products,
)
from learner.vcpo.sample_gradients import SampleGradients

if TYPE_CHECKING:
    from learner.micro_batches import Packing, RowBucket


# A row bucket's fixed cost (`learner.micro_batches.row_buckets`), per module whose per-sample products it
# runs: the operations a bucket adds (the unpacks, the products, their reductions: at most about 16) at a device's
# time per operation, in GEMM FLOPs at the rate the Gram products reach. From an H200 (bf16) with up to 4
# buckets chosen by Gram cost alone: a SmolLM2-135M VCPO step took 1.27 s against 0.82 s in one bucket (about
# 0.2 ms per bucket and module, the host launching kernels), and Qwen2.5-1.5B's Gram products on rows padded to
# the longest took about 0.75 s a micro-batch for 7.6e13 FLOPs (1e14 FLOP/s: widths like 1039 fit tensor-core
# tiles badly).
BUCKET_OPERATIONS_PER_MODULE = 16
OPERATION_SECONDS = {"cuda": 15e-6, "cpu": 20e-6}
GRAM_FLOPS_PER_SECOND = {"cuda": 1e14, "cpu": 5e10}


class UncoveredParameters(StableAsyncError, RuntimeError):
    """Trainable parameters that the ghost-norm path cannot account for."""


def _is_rms_norm(module: nn.Module) -> bool:
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and hasattr(module, "variance_epsilon")
        and getattr(module, "bias", None) is None
    )


def _covered_parameters(module: nn.Module) -> list[nn.Parameter]:
    # nn.Linear and nn.Embedding register their weight and bias as Parameters (torch types the attributes as
    # tensors), and _is_rms_norm checks that the weight is one
    if isinstance(module, nn.Linear):
        return [cast(nn.Parameter, p) for p in (module.weight, module.bias) if p is not None]
    if isinstance(module, nn.Embedding) or _is_rms_norm(module):
        return [cast(nn.Parameter, module.weight)]
    return []


def _trained_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The covered parameters that train (a LoRA model freezes its base layers: their norms do not count)."""
    return [p for p in _covered_parameters(module) if p.requires_grad]


@dataclass
class _Record:
    """One recorded module call: its input, and its output only where the backward needs the tensor."""

    module: nn.Module
    input: Tensor
    output: Tensor | None


class GhostGradNorms:
    """Per-sample squared gradient norms of a HF causal LM from one batched backward."""

    def __init__(self, model: nn.Module, fused_head: bool = False) -> None:
        """`fused_head`: the norms will start from the hidden states (`HeadGradient`), so book-keeping keeps
        no factors of the logits' gradient."""
        # a HF model's method, which nn.Module's typing would take for a tensor or submodule attribute
        output_layer = cast(Any, model).get_output_embeddings()
        if not isinstance(output_layer, nn.Linear):
            raise UncoveredParameters(f"output layer {type(output_layer).__name__} is not a linear layer")
        self.output_layer: nn.Linear = output_layer
        # the output layer is always recorded: the backward starts below it, through its weight, trained or not
        self.modules = [m for m in model.modules() if _trained_parameters(m) or m is self.output_layer]
        self.trained = [p for m in self.modules for p in _trained_parameters(m)]
        owned = {id(p) for p in self.trained}
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise UncoveredParameters(
                f"no ghost-norm rule for parameters {missing[:5]}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            )
        # a fused head's rule covers its weight alone or tied to an embedding (the cross term, `HeadRows`)
        head_weight = self.output_layer.weight
        sharing = [
            m for m in self.modules if m is not output_layer and any(p is head_weight for p in _trained_parameters(m))
        ]
        self.fused_head = fused_head and (not sharing or (len(sharing) == 1 and isinstance(sharing[0], nn.Embedding)))
        self._records: list[_Record | None] = []
        self._grad_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._consumer: Callable[[int, Tensor], None] | None = None

    def kept_bytes_per_sample(self, steps: int) -> int:
        """Bytes that book-keeping keeps per sequence of `steps` positions (`kept_bytes` without folding)."""
        return self.kept_bytes([(1, steps)])

    def kept_bytes(self, buckets: list[tuple[int, int]], basis_rows: int = 0) -> int:
        """Bytes that book-keeping keeps for buckets of (rows, positions each): for each covered parameter and row
        the smaller of its dense per-sample gradient and its factors, in the model's dtype (what `compact` keeps).
        With `basis_rows`, a linear weight used once that folds at a bucket's width (`FoldedSums.takes`) keeps
        none of that bucket's, and its fp32 sums [basis_rows, *shape] once."""
        uses = Counter(id(p) for module in self.modules for p in _trained_parameters(module))
        numbers = fp32_numbers = 0
        for module in self.modules:
            if not _trained_parameters(module):
                continue
            fused = module is self.output_layer and self.fused_head
            if isinstance(module, nn.Linear) and not fused:
                rows, cols = module.out_features, module.in_features
                folding = bool(basis_rows) and uses[id(module.weight)] == 1
                folded = [folding and folding_costs_less(steps, rows, cols, basis_rows) for _, steps in buckets]
                fp32_numbers += basis_rows * rows * cols if any(folded) else 0
                for (count, steps), gone in zip(buckets, folded):
                    numbers += count * (
                        (0 if gone else min(rows * cols, steps * (rows + cols)))
                        + (rows if module.bias is not None else 0)
                    )
                continue
            for count, steps in buckets:
                if fused:  # the hidden states, formed again by chunk
                    numbers += count * steps * self.output_layer.in_features
                elif isinstance(module, nn.Embedding):
                    rows, cols = module.weight.shape
                    numbers += count * (
                        rows * cols if rows * cols <= steps * steps else steps * (cols + 2)
                    )  # int64 ids
                else:  # RMSNorm (a Parameter weight, _is_rms_norm checked): its per-sample gradient, an fp32 vector
                    fp32_numbers += count * cast(nn.Parameter, module.weight).numel()
        return self.element_bytes * numbers + 4 * fp32_numbers

    def bucket_cost(self, device: torch.device) -> float:
        """A row bucket's fixed cost in the Gram products' unit, tokens^2 (`row_buckets`): its operations'
        time on `device`, as Gram-product FLOPs, over the FLOPs of the Gram products per token^2 of a row."""
        gram_flops = 0
        for module in self.modules:
            if isinstance(module, nn.Linear):
                gram_flops += 2 * (module.in_features + module.out_features)
            elif isinstance(module, nn.Embedding):
                gram_flops += 2 * module.embedding_dim
        kind = "cuda" if device.type == "cuda" else "cpu"
        fixed = len(self.modules) * BUCKET_OPERATIONS_PER_MODULE * OPERATION_SECONDS[kind] * GRAM_FLOPS_PER_SECOND[kind]
        return fixed / max(1, gram_flops)

    @property
    def element_bytes(self) -> int:
        """Bytes of one number of the model's dtype: what its activations, output gradients and kept
        per-sample gradients are held in."""
        return self.output_layer.weight.element_size()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record every covered module call of the forward inside, for one following norms backward.

        Each output gets its gradient hook now, so no output is kept alive for it; an input is held
        only until the backward has consumed its layer.
        """
        self._release()

        def keep(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            if not (torch.is_grad_enabled() and output.requires_grad):
                return
            index = len(self._records)
            first_or_head = index == 0 or module is self.output_layer
            self._records.append(_Record(module, inputs[0], output if first_or_head else None))
            if module is not self.output_layer:
                self._grad_hooks.append(output.register_hook(partial(self._on_output_grad, index)))

        handles = [m.register_forward_hook(keep) for m in self.modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _on_output_grad(self, index: int, grad: Tensor) -> None:
        if self._consumer is not None:  # a later loss backward passes here too: only the norms pass counts
            self._consumer(index, grad)

    def _release(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._records, self._grad_hooks, self._consumer = [], [], None

    def squared_norms(
        self, logits_grad: Tensor | HeadGradient, from_logits: bool = False, packed: Packing | None = None
    ) -> Tensor:
        """||grad_theta log pi(tau_i)||^2 for each sample, [B] fp32, given d(sum_i log pi(tau_i))/d logits
        ([B, L, V], e.g. `sequence_logprob_grad`), or what forms it by vocabulary chunk (`HeadGradient`, from a
        forward whose output layer was fused: the backward starts at the hidden states, and `from_logits` only
        frees the graph).

        By default the backward starts below the output layer (which needs its whole weight, so not
        under ZeRO-3) and the forward graph stays for the loss backward. `from_logits` starts at the
        logits and frees the graph: for a forward of its own under ZeRO-3, whose per-module backward
        hooks expect every backward to enter at the top. `packed`: the forward ran the rows packed, and
        `logits_grad` is [1, N, V].
        """
        return self._backward(logits_grad, from_logits, keep=False, packed=packed).squared_norms

    def sample_gradients(
        self, logits_grad: Tensor | HeadGradient, packed: Packing | None = None, folds: FoldedSums | None = None
    ) -> SampleGradients:
        """Book-keeping: the norms and every per-sample gradient from one backward, which frees the graph.

        The caller forms its update with `SampleGradients.weighted_sum` once it knows each sample's
        coefficient; no loss backward follows. Needs whole parameters (not ZeRO-3). With `folds` the linear
        weights it takes are folded into its sums instead of kept (`FoldedSums`).
        """
        return self._backward(logits_grad, from_logits=False, keep=True, packed=packed, folds=folds)

    def _backward(
        self,
        logits_grad: Tensor | HeadGradient,
        from_logits: bool,
        keep: bool,
        packed: Packing | None,
        folds: FoldedSums | None = None,
    ) -> SampleGradients:
        records = self._records
        device = logits_grad.hidden.device if isinstance(logits_grad, HeadGradient) else logits_grad.device
        try:
            with tensor_core_products(device):
                return self._run_backward(records, logits_grad, from_logits, keep, packed, folds)
        finally:
            records.clear()
            self._release()

    # long: its hooks share one backward pass's bucket state, and the layers' gradients arrive through them
    def _run_backward(
        self,
        records: list[_Record | None],
        logits_grad: Tensor | HeadGradient,
        from_logits: bool,
        keep: bool,
        packed: Packing | None,
        folds: FoldedSums | None,
    ) -> SampleGradients:
        fused = isinstance(logits_grad, HeadGradient)
        heads = [i for i, r in enumerate(records) if r is not None and r.module is self.output_layer]
        if len(heads) != (0 if fused else 1) or not records or (heads and heads[0] == 0):
            raise RuntimeError(
                f"squared_norms needs one recorded forward inside recording(), saw {len(heads)} calls of the output "
                "layer" + (" (its gradient was given from the hidden states, so it should not run)" if fused else "")
            )
        first = records[0]
        # recording() appends only records, and only the backward below consumes them; it keeps the output of
        # the first call and of the output layer
        assert first is not None and first.output is not None, "the first call's record keeps its output"
        head: _Record | None = None
        if not fused:
            head, records[heads[0]] = records[heads[0]], None
            assert head is not None and head.output is not None, "the output layer's record keeps its output"
        first_output = first.output
        if packed is not None and not packed.buckets:
            raise ValueError("the packed micro-batch has no row buckets: plan it with the norms' bucket_cost")
        rows_of = logits_grad.start if isinstance(logits_grad, HeadGradient) else logits_grad  # [B, ...] or packed
        batch = rows_of.shape[0] if packed is None else len(packed.lengths)
        calls = [r.module for r in records if r is not None] + [self.output_layer]
        uses = Counter(id(p) for module in calls for p in _trained_parameters(module))
        head_weight = self.output_layer.weight
        total = torch.zeros(batch, dtype=torch.float32, device=first_output.device)
        # packed rows are laid out bucket by bucket (rows of similar length, `Packing.buckets`): the Gram
        # products cost each bucket's width squared, not the longest row's
        buckets: list[RowBucket | None] = [None] if packed is None else list(packed.buckets)
        kept: list[dict[nn.Parameter, list[Contribution]]] = [{} for _ in buckets]
        # each bucket's per-row norms of each call, summed once at the end: one kernel per bucket, not per call
        bucket_norms: list[list[Tensor]] = [[] for _ in buckets]
        start: Tensor
        start_grad: Tensor
        head_rows: list[HeadRows] | None = None
        if isinstance(logits_grad, HeadGradient):
            if not self.fused_head:  # the constructor found no fused rule for this head (or was not asked)
                raise UncoveredParameters(
                    "a HeadGradient for norms made without fused_head, or whose output layer's weight is shared "
                    "beyond the embedding: no fused head rule"
                )
            start = logits_grad.start
            start_grad, head_norms, head_rows = logits_grad.norms_pass(buckets, batch, head_weight.requires_grad)
            for norms, own in zip(bucket_norms, head_norms, strict=True):
                if own is not None:
                    norms.append(own)
        else:
            assert head is not None and head.output is not None, "an unfused head's record was taken above"
            logits_grad = logits_grad.to(head.input.dtype)  # the model's dtype: products on tensor cores
            if from_logits:
                start, start_grad = head.output, logits_grad.to(head.output.dtype)
            else:
                start_grad = (logits_grad.to(head_weight.dtype) @ head_weight).to(head.input.dtype)
                start = head.input
        # the last input laid out in buckets: calls that share their input (q, k and v; gate and up) lay it out
        # once, and form its Gram once (`InputGramSum`). Only the output gradient needs zeros past a row's end
        # (`RowBucket.unpack`).
        laid_for: Tensor | None = None
        laid: list[Tensor] = []
        input_grams: list[InputGramSum] = [InputGramSum(len(buckets)) for _ in buckets]

        def finish_input() -> None:
            for norms, grams in zip(bucket_norms, input_grams, strict=True):
                shared = grams.squared_norms()
                if shared is not None:
                    norms.append(shared)

        def unpacked_input(x: Tensor) -> list[Tensor]:
            nonlocal laid_for, laid, input_grams
            if laid_for is not x:
                finish_input()
                detached = x.detach()
                laid_for, input_grams = x, [InputGramSum(len(buckets)) for _ in buckets]
                laid = (
                    [detached] if packed is None else [b.unpack(detached, zero_padding=False) for b in packed.buckets]
                )
            return laid

        def consume(module: nn.Module, x: Tensor, grad: Tensor) -> None:
            """Add a call's norm now unless its parameter is shared, and keep what the caller needs."""
            rows_xs = unpacked_input(x)
            for k, (bucket, rows_x, bucket_kept, norms, grams) in enumerate(
                zip(buckets, rows_xs, kept, bucket_norms, input_grams, strict=True)
            ):
                rows_grad = grad if bucket is None else bucket.unpack(grad)
                rows = batch if bucket is None else len(bucket.rows)
                for param, contribution in self._contributions(module, rows_x, rows_grad, rows):
                    if not param.requires_grad:  # a frozen output layer
                        continue
                    if head_rows is not None and param is head_weight:  # the embedding tied to a fused head
                        assert isinstance(contribution, Factors) and isinstance(logits_grad, HeadGradient)
                        cross = head_rows[k].cross_inner(logits_grad.weight, contribution, logits_grad.temperature)
                        norms.append(squared_norm([contribution]) + 2 * cross)
                        if keep:
                            bucket_kept.setdefault(param, []).append(compact(contribution))
                        continue
                    if folds is not None and folds.takes(contribution, uses[id(param)]):
                        assert isinstance(contribution, Factors), "only factors fold"
                        norms.append(folds.fold(param, contribution, None if bucket is None else bucket.rows))
                        continue
                    if keep:
                        contribution = compact(contribution)
                    if uses[id(param)] == 1 and not grams.add(contribution):
                        norms.append(squared_norm([contribution]))
                    if keep or uses[id(param)] > 1:
                        bucket_kept.setdefault(param, []).append(contribution)

        def on_grad(index: int, grad: Tensor) -> None:
            record, records[index] = records[index], None  # its input is not needed after this
            if record is not None:
                consume(record.module, record.input, grad)

        if head is not None:
            assert isinstance(logits_grad, Tensor), "an unfused head starts from the logits' gradient"
            consume(head.module, head.input, logits_grad)
        del head
        self._consumer = on_grad
        # Asking only for the first layer's output runs the whole backward below `start` while each
        # layer's hook consumes its gradient at once: one layer's output gradient alive at a time. Without a
        # trained embedding (LoRA) no one output is upstream of every recorded layer, and the backward asks
        # for the trained parameters themselves (adapter-sized, so their summed gradients cost little).
        upstream = [first_output] if isinstance(first.module, nn.Embedding) else self.trained
        torch.autograd.grad(
            start, upstream, grad_outputs=start_grad, retain_graph=not (from_logits or keep), allow_unused=True
        )
        missed = [type(r.module).__name__ for r in records if r is not None]
        if missed:
            raise UncoveredParameters(f"no gradient reached the outputs of {missed[:5]} on the way to the first layer")
        finish_input()
        laid_for, laid, input_grams = None, [], []
        for bucket, bucket_kept, norms in zip(buckets, kept, bucket_norms, strict=True):
            # a fused head's tied weight had its cross term when the embedding's gradient came (`consume`)
            norms += [
                squared_norm(parts)
                for param, parts in bucket_kept.items()
                if uses[id(param)] > 1 and not (head_rows is not None and param is head_weight)
            ]
            if norms:
                _add_rows(total, bucket, torch.stack(norms).sum(0))
        if not keep:
            return SampleGradients(total)
        fused_head = None
        if isinstance(logits_grad, HeadGradient) and head_weight.requires_grad:
            fused_head = (cast(nn.Parameter, head_weight), logits_grad)
        bucket_rows = None if packed is None else [bucket.rows for bucket in packed.buckets]
        return SampleGradients(total, kept, bucket_rows, fused_head, folds)

    @staticmethod
    def _contributions(
        module: nn.Module, x: Tensor, grad: Tensor, batch: int
    ) -> list[tuple[nn.Parameter, Contribution]]:
        """Each parameter's per-sample gradient of this call: factors in the model's dtype, or a direct
        [B, n] fp32 vector. (The weights and biases are Parameters, as in `_covered_parameters`.)"""
        if isinstance(module, nn.Embedding):
            ids = x.reshape(batch, -1)
            right = grad.reshape(batch, ids.shape[1], -1)
            if module.padding_idx is not None:  # that row gets no gradient
                right = right * (ids != module.padding_idx).unsqueeze(-1)
            return [(cast(nn.Parameter, module.weight), Factors(ids, right, module.num_embeddings))]
        grad = grad.reshape(batch, -1, grad.shape[-1])
        if isinstance(module, nn.Linear):
            out: list[tuple[nn.Parameter, Contribution]] = [
                (cast(nn.Parameter, module.weight), Factors(grad, _as_dtype(x.reshape(batch, -1, x.shape[-1]), grad)))
            ]
            if module.bias is not None:
                out.append((cast(nn.Parameter, module.bias), grad.sum(1, dtype=torch.float32)))
            return out
        # RMSNorm: weight * x / rms(x), the rms from an fp32 reduction (no fp32 copy of the activation)
        hidden = x.reshape(batch, -1, x.shape[-1])
        mean_square = torch.linalg.vector_norm(hidden, dim=-1, keepdim=True, dtype=torch.float32).square_()
        inverse_rms = torch.rsqrt(mean_square.div_(hidden.shape[-1]).add_(module.variance_epsilon))
        normalised = hidden * inverse_rms.to(hidden.dtype)
        return [(cast(nn.Parameter, module.weight), (grad.to(hidden.dtype) * normalised).sum(1, dtype=torch.float32))]


def _as_dtype(x: Tensor, like: Tensor) -> Tensor:
    """`x` in `like`'s dtype (no operator call where it is already: the norms pass makes thousands)."""
    return x if x.dtype == like.dtype else x.to(like.dtype)


def _add_rows(total: Tensor, bucket: RowBucket | None, norms: Tensor) -> None:
    """Add a bucket's per-row norms to the micro-batch's (all rows when there are no buckets)."""
    if bucket is None:
        total.add_(norms)
    else:
        total.index_add_(0, bucket.rows, norms)


def per_sample_loop_norms(sample_logp: Callable[[int], Tensor], count: int, parameters: list[nn.Parameter]) -> Tensor:
    """Reference: for each sample, its own forward (`sample_logp(i)`, a scalar log pi(tau_i)) and backward."""
    norms = []
    for i in range(count):
        grads = torch.autograd.grad(sample_logp(i), parameters, allow_unused=True)
        norms.append(sum((g.float().square().sum() for g in grads if g is not None), torch.zeros(())))
    return torch.stack(norms)
