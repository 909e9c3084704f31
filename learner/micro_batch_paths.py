"""How a one-pass step runs each micro-batch apart from the stabilizer's decision and the loss, which
`learner.passes.LearnerStep.one_pass` owns: so the plain step reads as forward, advantages, weights, loss,
backward, and VCPO's per-sample norms (`learner.vcpo.step.NormedMicroBatches`) are one path beside it."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from algorithms.batch import TokenWeights
from learner.batch import TrainBatch
from learner.micro_batches import MicroBatch
from learner.policy import PolicyForwards
from learner.vcpo.sample_gradients import SampleGradients


class MicroBatchPaths(Protocol):
    """A micro-batch's forward, its advantages, any loss beside the step's, and its backward (which returns how
    far a sequence's token coefficients differ: 0 where the engine's backward forms the gradient)."""

    def forward(self, run: MicroBatch, micro: TrainBatch) -> tuple[Tensor, Tensor, SampleGradients | None]: ...

    def advantages(
        self, run: MicroBatch, micro: TrainBatch, logprobs: Tensor, sample_grads: SampleGradients | None
    ) -> tuple[Tensor, Tensor | None]: ...

    def extra_losses(
        self, run: MicroBatch, micro: TrainBatch, logprobs: Tensor, decision: TokenWeights, denominator: Tensor
    ) -> list[Tensor]: ...

    def backward(
        self,
        micro: TrainBatch,
        loss: Tensor,
        extra_losses: list[Tensor],
        logprobs: Tensor,
        sample_grads: SampleGradients | None,
    ) -> Tensor: ...


class PlainMicroBatches:
    """A plain step's micro-batches: the policy's forward, advantages from the rewards (whole groups, formed
    before any forward) and the engine's backward of each micro-batch's share of the loss."""

    def __init__(self, forwards: PolicyForwards, engine: Any, world_size: int, advantages: Tensor) -> None:
        self.forwards, self.engine, self.world_size = forwards, engine, world_size
        self.batch_advantages, self.device = advantages, advantages.device
        self.no_gap = torch.zeros((), device=self.device)  # one coefficient per sequence by construction

    def forward(self, run: MicroBatch, micro: TrainBatch) -> tuple[Tensor, Tensor, SampleGradients | None]:
        logprobs, entropy = self.forwards.token_logprobs(micro, with_entropy=True, packing=run.packing)
        assert entropy is not None, "asked for with the log-probs"
        return logprobs, entropy, None

    def advantages(
        self, run: MicroBatch, micro: TrainBatch, logprobs: Tensor, sample_grads: SampleGradients | None
    ) -> tuple[Tensor, Tensor | None]:
        if run.rows is None:  # an empty micro-batch: nothing to train on
            return torch.zeros(1, device=self.device), None
        return self.batch_advantages[run.rows], None

    def extra_losses(
        self, run: MicroBatch, micro: TrainBatch, logprobs: Tensor, decision: TokenWeights, denominator: Tensor
    ) -> list[Tensor]:
        return []

    def backward(
        self,
        micro: TrainBatch,
        loss: Tensor,
        extra_losses: list[Tensor],
        logprobs: Tensor,
        sample_grads: SampleGradients | None,
    ) -> Tensor:
        """The engine's backward (DeepSpeed averages over ranks: each rank's loss is its share of the sum)."""
        self.engine.backward(loss * self.world_size)
        return self.no_gap
