"""What a norms pass gives the step: each sample's squared gradient norm and, from book-keeping, its per-sample
gradients (kept parts, folded sums, the fused head's) from which any per-sample weighting forms the update."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from learner.vcpo.output_layer import HeadGradient
from learner.vcpo.products import Contribution, FoldedSums, weighted_sum


@dataclass
class SampleGradients:
    """||grad log pi(tau_i)||^2 per sample and, from the bookkeeping pass, the per-sample gradients
    themselves (dense or factored, per parameter) so that any per-sample weighting forms the update."""

    squared_norms: Tensor
    # per row bucket (one for right-padded rows; a packed micro-batch's `Packing.buckets`), each parameter's
    # per-sample gradients of that bucket's rows
    parts: list[dict[nn.Parameter, list[Contribution]]] | None = None
    bucket_rows: list[Tensor] | None = None  # each bucket's rows in the micro-batch; None: one bucket of all
    # the output layer's weight and its per-sample gradients, formed again by vocabulary chunk (a fused head)
    head: tuple[nn.Parameter, HeadGradient] | None = None
    folded: FoldedSums | None = None  # the linear weights whose per-sample gradients were folded as they came

    def weighted_sum(self, coefficients: Tensor, fp32: bool = False) -> dict[nn.Parameter, Tensor]:
        """Each parameter's sum_i c_i grad log pi(tau_i), in the parameter's dtype (or fp32, to accumulate)."""
        if self.parts is None:
            raise RuntimeError("these sample gradients kept norms only (ghost or per-sample loop), not the gradients")
        coefficients = coefficients.float()
        sums: dict[nn.Parameter, Tensor] = {}
        for k, bucket in enumerate(self.parts):
            scale = coefficients if self.bucket_rows is None else coefficients[self.bucket_rows[k]]
            scales: dict[torch.dtype, Tensor] = {}  # the bucket's coefficients in each dtype its parts have, once
            for param, parts in bucket.items():
                for part in parts:
                    dtype = part.dtype if isinstance(part, Tensor) else part.right.dtype
                    if dtype not in scales:
                        scales[dtype] = scale.to(dtype)
                    sums[param] = weighted_sum(part, scales[dtype], param.shape, sums.get(param))
        if self.head is not None:
            param, gradient = self.head
            sums[param] = gradient.weighted_sum(coefficients, sums.get(param))
        return {param: total.to(torch.float32 if fp32 else param.dtype) for param, total in sums.items()}
