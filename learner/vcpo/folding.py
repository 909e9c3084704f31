"""A book-kept VCPO micro-batch whose linear weights' per-sample gradients fold into sums as its norms pass forms
them (`learner.vcpo.products.FoldedSums`): what it holds between its forward and its backward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from algorithms.aggregation import policy_loss
from algorithms.batch import PolicyBatch, TokenWeights
from learner.batch import TrainBatch
from learner.micro_batches import MicroBatch
from learner.spec import LearnerSpec
from learner.vcpo.output_layer import HeadGradient


@dataclass
class FoldingMicroBatch:
    """A book-kept micro-batch of whole prompt groups whose linear weights' per-sample gradients fold into sums
    (`FoldedSums`): it trains at baseline 0, and its norms pass waits for the loss, whose coefficients at
    baseline 0 and slopes in each group's baseline are the sums' basis. VCPO's advantages are affine in the
    baseline, A = A0 - b * slope, and the loss is linear in them."""

    run: MicroBatch
    norms_start: Tensor | HeadGradient  # what the norms pass starts from (`PerSampleNorms.recorded_forward`)
    at_zero: Tensor  # [b] fp32: the advantages at baseline 0
    slope: Tensor  # [b] fp32: at_zero minus the advantages at baseline 1
    decision: TokenWeights | None = None  # the loss's, for its value at the final advantages
    denominator: Tensor | None = None

    def basis(self, coefficients: Tensor, slope_coefficients: Tensor) -> Tensor:
        """[1 + groups, b] fp32: the coefficients at baseline 0, then each group's slope coefficients (0 off it)."""
        slots = self.run.group_slots
        assert slots is not None, "a planned micro-batch knows its rows' groups"
        per_group = coefficients.new_zeros(self.run.groups, len(slots), dtype=torch.float32)
        per_group.scatter_(0, slots[None], slope_coefficients.float()[None])
        return torch.cat([coefficients.float()[None], per_group])

    def basis_weights(self, baseline: Tensor) -> Tensor:
        """[1 + groups]: 1 for the sum at baseline 0, then minus each group's baseline."""
        slots = self.run.group_slots
        assert slots is not None, "a planned micro-batch knows its rows' groups"
        per_group = baseline.new_zeros(self.run.groups).scatter_(0, slots, baseline)  # a group's rows share it
        return torch.cat([baseline.new_ones(1), -per_group])

    def loss_at(self, micro: TrainBatch, logprobs: Tensor, advantages: Tensor, spec: LearnerSpec) -> Tensor:
        """The loss's value at `advantages` with the micro-batch's weights (detached): the loss is linear in them."""
        assert self.decision is not None and self.denominator is not None, "the slope loss recorded them"
        policy = PolicyBatch(logprobs.detach(), micro.behaviour_logprobs, advantages, micro.loss_mask)
        return policy_loss(
            policy, self.decision, spec.loss_aggregation, self.denominator, spec.constant_tokens
        ).detach()
