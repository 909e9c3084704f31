"""The parts of a learner step that need per-sample gradient norms ||grad log pi(tau_i)||^2 (VCPO's baseline).

Apart from the passes (`learner/passes.py`), which ask this class for a micro-batch's forward with its norms and
for its backward: which path forms the norms (ghost norms from the layers' inputs and output gradients, or one
backward per sample where a parameter has no ghost rule), and whether a micro-batch's update is formed by
book-keeping from its kept per-sample gradients (ZeRO-1/2, within a budget) instead of the engine's backward.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from algorithms.advantages import ADVANTAGES, group_mean_advantages
from algorithms.aggregation import policy_loss
from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.stabilizer import Stabilizer
from learner.batch import TrainBatch, sequence_logprob_grad, token_logprobs, token_logprobs_and_entropy
from learner.collectives import Collectives
from learner.memory_budget import KeptGradientBudget
from learner.micro_batches import MicroBatch, MicroBatchPlan, Packing
from learner.packing import packed_ids, packed_logits_logprobs, packed_loss_mask
from learner.policy import PolicyForwards
from learner.spec import LearnerSpec
from learner.step import (
    CarriedGroup,
    StepValues,
    affine_advantages,
    device_scalar,
    sequence_coefficients,
    step_advantages,
    sub_batch,
)
from learner.vcpo.folding import FoldingMicroBatch
from learner.vcpo.ghost_norms import GhostGradNorms, UncoveredParameters, per_sample_loop_norms
from learner.vcpo.output_layer import HeadGradient
from learner.vcpo.products import FoldedSums
from learner.vcpo.sample_gradients import SampleGradients

log = logging.getLogger("stableasync.learner")


class PerSampleNorms:
    """How a rank's steps get per-sample gradient norms, decided once from the stabilizer's `opob_impl` (a
    stabilizer without the option, a user's own, gets the ghost path) and the engine's model."""

    def __init__(
        self,
        spec: LearnerSpec,
        engine: Any,
        stabilizer: Stabilizer,
        forwards: PolicyForwards,
        collectives: Collectives,
        kept_gradients: KeptGradientBudget,
        rank: int,
    ) -> None:
        self.spec, self.engine, self.stabilizer, self.forwards, self.collectives = (
            spec,
            engine,
            stabilizer,
            forwards,
            collectives,
        )
        self.rank, self.world_size, self.device = rank, collectives.world_size, collectives.device
        self.advantage_estimator = ADVANTAGES[spec.advantage]
        # the norms start from the hidden states where the output layer fuses (no [tokens, vocabulary] logits);
        # ZeRO-3 has no fused head (each rank holds a partition of its weight)
        fusable = forwards.head is not None and spec.zero_stage != 3
        opob_impl = getattr(stabilizer.config, "opob_impl", "ghost")
        self.ghost, self.fallback_to_loop = self._ghost_norms(opob_impl, fusable)
        self.fuses_head = self.ghost is not None and self.ghost.fused_head
        # packed rows' buckets of similar length for the norms' products (`micro_batches.row_buckets`)
        self.bucket_cost = math.inf if self.ghost is None else self.ghost.bucket_cost(self.device)
        self.bookkeeping = self._uses_bookkeeping(opob_impl)
        # auto: book-keeping only for a micro-batch whose kept gradients fit the budget; bookkeeping: always
        self.bookkeeping_budget = kept_gradients if opob_impl == "auto" else KeptGradientBudget(math.inf)
        # book-keeping carries a group split across micro-batches in one pass, with a score buffer of one
        # fp32 gradient (the VCPO paper's two buffers; the other is the engine's own accumulation)
        self.carries_split_groups = (
            self.bookkeeping
            and stabilizer.advantages_from_baseline(torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.long))
            is not None
        )
        self.trained = [p for p in engine.module.parameters() if p.requires_grad]  # the model's order
        self.score_buffer_bytes = 4 * sum(p.numel() for p in self.trained)

    def _ghost_norms(self, opob_impl: str, fused_head: bool) -> tuple[GhostGradNorms | None, bool]:
        """The ghost-norm path when every parameter has a rule; otherwise the per-sample loop, announced (a silent
        10x slowdown would look like a hang)."""
        if opob_impl == "per_sample_loop":
            return None, False
        try:
            return GhostGradNorms(self.engine.module, fused_head=fused_head), False
        except UncoveredParameters as error:
            log.warning(
                "learner rank %d: per-sample gradient norms fall back to one backward per sample: %s", self.rank, error
            )
            return None, True

    def _uses_bookkeeping(self, opob_impl: str) -> bool:
        """Book-keeping forms the update from the kept per-sample gradients, which needs whole parameters:
        under ZeRO-3 the norms come from the two-pass ghost path instead (said once, here)."""
        if self.ghost is None or opob_impl not in ("bookkeeping", "auto"):
            return False
        if self.spec.token_terms:  # the KL term or entropy bonus needs the model's own backward
            return False
        if self.spec.zero_stage == 3:
            if opob_impl == "bookkeeping":  # asked for by name: say why it is not used
                log.info(
                    "learner rank %d: ZeRO-3 partitions the parameters, so per-sample norms use the two-pass "
                    "ghost path instead of bookkeeping",
                    self.rank,
                )
            return False
        return True

    # ---- which path a micro-batch takes ----------------------------------------------------------

    def keeps_sample_gradients(
        self, micro: TrainBatch, packing: Packing | None = None, extra_bytes: int = 0, basis_rows: int = 0
    ) -> bool:
        """Whether this micro-batch's update is formed by book-keeping (its kept gradients fit the budget).
        Packed rows keep what their row buckets' widths need, padded ones what the micro-batch's width does;
        with `basis_rows`, the weights that fold keep their sums instead (`GhostGradNorms.kept_bytes`)."""
        if not self.bookkeeping or self.ghost is None:
            return False
        if packing is None:
            tokens, buckets = micro.size * micro.input_ids.shape[1], [(micro.size, micro.input_ids.shape[1])]
        else:
            tokens, buckets = sum(packing.lengths), [(len(bucket.rows), bucket.width) for bucket in packing.buckets]
        kept = self.ghost.kept_bytes(buckets, basis_rows)
        return kept + extra_bytes <= self.bookkeeping_budget.bytes_for(tokens)

    def carries_every_split_group(self, batch: TrainBatch, plan: MicroBatchPlan) -> bool:
        """Whether each piece of a split group takes book-keeping with the score buffer within the budget."""
        if not self.carries_split_groups:
            return False
        pieces = [run for run in plan.micro_batches if run.group_rows is not None]
        return all(
            self.keeps_sample_gradients(sub_batch(batch, run), run.packing, self.score_buffer_bytes) for run in pieces
        )

    # ---- forwards with the norms -----------------------------------------------------------------

    def forward(
        self, micro: TrainBatch, bookkeeping: bool, packing: Packing | None = None
    ) -> tuple[Tensor, Tensor, SampleGradients]:
        """One micro-batch's forward with grad for one pass: its log-probs and entropy, and its per-sample norms
        (with book-keeping, its per-sample gradients too), which start from the logits' gradient. With the
        run's `packing` the forward runs its rows without padding."""
        recording = self.ghost is not None and self.spec.zero_stage != 3
        if recording and (bookkeeping or self.fuses_head):  # a fused head's forward is the bare module's either way
            logprobs, entropy, start = self.recorded_forward(micro, packing)
            return logprobs, entropy, self._ghost_gradients(start, bookkeeping, packing)
        with self.ghost.recording() if self.ghost is not None and recording else nullcontext():
            # no loss backward through the engine follows book-keeping
            logits = self.forwards.logits(micro, plain=bookkeeping, packing=packing)
        logprobs, entropy = self._logprobs_and_entropy(micro, logits, packing)
        return logprobs, entropy, self._sample_gradients(micro, logits, bookkeeping, packing)

    def recorded_forward(
        self, micro: TrainBatch, packing: Packing | None
    ) -> tuple[Tensor, Tensor, Tensor | HeadGradient]:
        """A forward recorded for the norms pass, through the bare module: the log-probs and entropy, and what the
        norms pass starts from (the logits' gradient, or the fused head's `HeadGradient`)."""
        assert self.ghost is not None, "book-keeping takes the ghost path"
        with self.ghost.recording():
            if self.fuses_head:
                return self.forwards.head_forward(micro, packing)
            logits = self.forwards.logits(micro, plain=True, packing=packing)
        logprobs, entropy = self._logprobs_and_entropy(micro, logits, packing)
        return logprobs, entropy, self._logits_grad(micro, logits, packing)

    def folded_gradients(
        self, folding: FoldingMicroBatch, coefficients: Tensor, slope_coefficients: Tensor
    ) -> SampleGradients:
        """The norms pass of a folding micro-batch's `recorded_forward`, its linear weights folded into the sums of
        the basis its coefficients at baseline 0 and slopes make (`FoldedSums`)."""
        assert self.ghost is not None, "book-keeping takes the ghost path"
        folds = FoldedSums(folding.basis(coefficients, slope_coefficients))
        return self.ghost.sample_gradients(folding.norms_start, packed=folding.run.packing, folds=folds)

    def _logprobs_and_entropy(
        self, micro: TrainBatch, logits: Tensor, packing: Packing | None
    ) -> tuple[Tensor, Tensor]:
        """[b, L-1] log-probs and entropy from [b, L, V] logits or, packed, from [1, N, V]."""
        if packing is None:
            return token_logprobs_and_entropy(logits, micro.input_ids, self.spec.temperature)
        logprobs, entropy = packed_logits_logprobs(logits, micro, packing, self.spec.temperature, with_entropy=True)
        assert entropy is not None, "asked for with the log-probs"
        return logprobs, entropy

    def _logits_grad(self, micro: TrainBatch, logits: Tensor, packing: Packing | None) -> Tensor:
        """d(sum_i log pi(tau_i))/d logits, in the logits' layout (padded rows, or packed)."""
        if packing is None:
            return sequence_logprob_grad(logits, micro.input_ids, micro.loss_mask, self.spec.temperature)
        return sequence_logprob_grad(
            logits, packed_ids(micro, packing), packed_loss_mask(micro, packing), self.spec.temperature
        )

    def _sample_gradients(
        self, batch: TrainBatch, logits: Tensor, bookkeeping: bool, packing: Packing | None
    ) -> SampleGradients:
        """||grad log pi(tau_i)||^2 of each of this micro-batch's sequences (with book-keeping, the per-sample
        gradients too); otherwise the graph stays for the loss backward."""
        if self.ghost is not None and self.spec.zero_stage == 3:
            return SampleGradients(self.norms_forward(batch, packing)[2])
        if self.ghost is not None:
            return self._ghost_gradients(self._logits_grad(batch, logits, packing), bookkeeping, packing)
        return SampleGradients(self._per_sample_loop_norms(batch))

    def _ghost_gradients(
        self, logits_grad: Tensor | HeadGradient, bookkeeping: bool, packing: Packing | None
    ) -> SampleGradients:
        """The ghost path's norms (with book-keeping, the per-sample gradients too) from the logits' gradient."""
        assert self.ghost is not None, "the caller takes the ghost path"
        if bookkeeping:
            return self.ghost.sample_gradients(logits_grad, packed=packing)
        return SampleGradients(self.ghost.squared_norms(logits_grad, packed=packing))

    def _per_sample_loop_norms(self, batch: TrainBatch) -> Tensor:
        """The norms from one backward per sample (no ghost rule for some parameter, or asked for)."""

        def sample_logp(i: int) -> Tensor:  # the plain module: the engine's backward hooks stay out of it
            row = batch.rows(torch.tensor([i], device=self.device))
            row_logits = self.forwards.logits(row, plain=True)
            return (token_logprobs(row_logits, row.input_ids, self.spec.temperature) * row.loss_mask).sum()

        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        return per_sample_loop_norms(sample_logp, batch.size, params)

    def norms_forward(self, batch: TrainBatch, packing: Packing | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """A forward of its own for the per-sample norms: [B, L-1] log-probs and entropy (detached) and the
        norms [B]. ZeRO-3's module hooks gather and release parameters per backward and need each backward
        to enter at the model's top, and the two-pass step has no loss backward to share a forward with."""
        if self.ghost is None:
            with torch.no_grad():
                logits = self.forwards.logits(batch, plain=True, packing=packing)
                logprobs, entropy = self._logprobs_and_entropy(batch, logits, packing)
            return logprobs, entropy, self._per_sample_loop_norms(batch)
        if self.fuses_head:
            with self.ghost.recording():
                logprobs, entropy, head_gradient = self.forwards.head_forward(batch, packing)
            squared_norms = self.ghost.squared_norms(head_gradient, from_logits=True, packed=packing)
            return logprobs.detach(), entropy.detach(), squared_norms
        with self.ghost.recording():
            logits = self.forwards.logits(batch, plain=True, packing=packing)
        logits_grad = self._logits_grad(batch, logits, packing)
        squared_norms = self.ghost.squared_norms(logits_grad, from_logits=True, packed=packing)
        del logits_grad
        logprobs, entropy = self._logprobs_and_entropy(batch, logits.detach(), packing)
        return logprobs, entropy, squared_norms

    # ---- backwards from the kept per-sample gradients ------------------------------------------------

    def backward(self, loss: Tensor, logprobs: Tensor, sample_grads: SampleGradients, loss_mask: Tensor) -> Tensor:
        """Gradients of the loss into the engine. DeepSpeed averages over ranks, so each rank's loss is
        its share of the global sum.

        With book-keeping the loss is sum_i k_i log pi(tau_i) (VCPO's weights and advantages are per
        sequence), so its gradient is sum_i k_i G_i of the kept per-sample gradients G_i; the engine's
        backward of <theta, that gradient> hands it to ZeRO's reduction without a pass through the model.
        Returns how far the token coefficients of a sequence differ (`sequence_coefficients`; 0 without
        book-keeping), for the caller to check once per step.
        """
        if sample_grads.parts is None:
            self.engine.backward(loss * self.world_size)
            return torch.zeros((), device=self.device)
        coefficients, gap = self._sequence_coefficients(loss, logprobs, loss_mask)
        self._backward_gradients(sample_grads.weighted_sum(coefficients))
        return gap

    def backward_piece(
        self,
        step: StepValues,
        batch: TrainBatch,
        carried: CarriedGroup,
        loss: Tensor,
        slope: Tensor,
        logprobs: Tensor,
        sample_grads: SampleGradients | None,
        loss_mask: Tensor,
        folding: FoldingMicroBatch | None = None,
    ) -> Tensor:
        """One piece of a group split across micro-batches. Its loss is loss(A) = loss(A0) - b * slope with A0
        the advantages at baseline 0 and b the group's baseline, known after its last piece: the engine
        takes the gradient of loss(A0) now, the score buffer the gradient of `slope`, and the last piece
        hands the engine -b times the buffer. A `folding` piece runs its norms pass here, its linear weights
        folded into those two sums. Returns the larger coefficient gap of the two (see `backward`)."""
        coefficients, gap = self._sequence_coefficients(loss, logprobs, loss_mask, keep_graph=True)
        slope_coefficients, slope_gap = self._sequence_coefficients(slope, logprobs, loss_mask)
        if folding is not None:  # the basis [u, s]: the piece is one group's rows
            sample_grads = self.folded_gradients(folding, coefficients, slope_coefficients)
            assert folding.run.rows is not None, "a piece has rows"
            step.record(folding.run.rows, logprobs, None, None, sample_grads, None)
        assert sample_grads is not None, "a piece's norms come from its forward or its folding"
        grads = sample_grads.weighted_sum(coefficients)
        slope_grads = sample_grads.weighted_sum(slope_coefficients, fp32=True)
        if sample_grads.folded is not None:
            sample_grads.folded.add_into(grads, 0)
            sample_grads.folded.add_into(slope_grads, 1, fp32=True)
        carried.add(len(loss_mask), slope_grads, slope.detach())
        if carried.complete:
            squared_norms, baselines = step.squared_norms, step.baseline
            assert squared_norms is not None and baselines is not None, "a step with norms records them"
            advantages, baseline = step_advantages(
                self.stabilizer,
                self.advantage_estimator,
                batch.rows(carried.rows),
                step.logprobs[carried.rows],
                SampleGradients(squared_norms[carried.rows]),
            )
            assert baseline is not None, "a carried group's stabilizer forms its baseline from the norms"
            step.advantages[carried.rows], baselines[carried.rows] = advantages.float(), baseline.float()
            step.loss = step.loss - baseline[0].detach() * carried.slope_loss
            step.carried_groups += 1
            grads = carried.close(grads, baseline[0].detach())
        self._backward_gradients(grads)
        return torch.maximum(gap, slope_gap)

    def backward_folded(
        self,
        step: StepValues,
        folding: FoldingMicroBatch,
        micro: TrainBatch,
        loss: Tensor,
        slope: Tensor,
        logprobs: Tensor,
    ) -> Tensor:
        """A folding micro-batch's norms pass and update. Its loss at baseline 0 and its slope give each sample's
        coefficients u_i and s_i, the basis whose sums the norms pass folds the linear weights' per-sample
        gradients into; the norms give the baselines b_g, and the update is the sums' combination 1, -b_g (and
        sum_i (u_i - b_g s_i) G_i for the parts kept). Returns the larger coefficient gap (see `backward`)."""
        coefficients, gap = self._sequence_coefficients(loss, logprobs, micro.loss_mask, keep_graph=True)
        slope_coefficients, slope_gap = self._sequence_coefficients(slope, logprobs, micro.loss_mask)
        sample_grads = self.folded_gradients(folding, coefficients, slope_coefficients)
        advantages, baseline = step_advantages(self.stabilizer, self.advantage_estimator, micro, logprobs, sample_grads)
        assert baseline is not None and sample_grads.folded is not None, "a folding stabilizer forms its baseline"
        baseline = baseline.float()
        grads = sample_grads.weighted_sum(coefficients - baseline * slope_coefficients)
        sample_grads.folded.add_into(grads, folding.basis_weights(baseline))
        assert folding.run.rows is not None, "an empty micro-batch does not fold"
        step.record(folding.run.rows, logprobs, None, advantages, sample_grads, baseline)
        step.loss = step.loss - folding.loss_at(micro, logprobs, baseline * folding.slope, self.spec)
        self._backward_gradients(grads)
        return torch.maximum(gap, slope_gap)

    def _sequence_coefficients(
        self, loss: Tensor, logprobs: Tensor, loss_mask: Tensor, keep_graph: bool = False
    ) -> tuple[Tensor, Tensor]:
        """[b] k_i of this rank's share of the global loss, sum_i k_i log pi(tau_i) (DeepSpeed averages), and
        how far its token coefficients differ within a sequence."""
        (token_coefficients,) = torch.autograd.grad(loss * self.world_size, logprobs, retain_graph=keep_graph)
        return sequence_coefficients(token_coefficients, loss_mask)

    def _backward_gradients(self, grads: dict[torch.nn.Parameter, Tensor]) -> None:
        """The engine's backward of a scalar whose gradient is `grads`: hands them to ZeRO's reduction without
        a model pass, through one autograd node (not a product and a sum per parameter). In the model's order:
        ZeRO reduces gradients in buckets as they come, which must be the same on every rank, and which weights
        fold depends on a rank's own row lengths."""
        params = [param for param in self.trained if param in grads]
        self.engine.backward(GivenGradients.apply([grads[param] for param in params], *params))

    def micro_batches(self, step: StepValues, batch: TrainBatch) -> NormedMicroBatches:
        """The one-pass step's micro-batch paths with the norms, for `step` over `batch`."""
        return NormedMicroBatches(self, step, batch)

    def baseline_metrics(self, batch: TrainBatch, step: StepValues) -> dict[str, Tensor]:
        """How far VCPO's baseline moved from the group mean, and the per-sample gradient norms (all ranks')."""
        if step.squared_norms is None:
            return {}
        norms = self.collectives.gather(step.squared_norms).sqrt()
        if step.baseline is None:
            return {}
        group_mean = batch.rewards - group_mean_advantages(batch.rewards, batch.group_ids)
        return {
            "opob/baseline_mean": step.baseline.mean(),
            "opob/group_mean_baseline_mean": group_mean.mean(),
            "opob/baseline_shift_abs": (step.baseline - group_mean).abs().mean(),
            "opob/sample_grad_norm_mean": norms.mean(),
            "opob/sample_grad_norm_median": norms.median(),
            "opob/sample_grad_norm_max": norms.max(),
            "opob/fallback_to_loop": device_scalar(self.fallback_to_loop, self.device),
        }


class NormedMicroBatches:
    """A one-pass VCPO step's micro-batches (`learner.step.MicroBatchPaths`): each forward forms its per-sample
    norms (with book-keeping, its per-sample gradients too), each micro-batch's advantages come from its whole
    groups' norms, and a group split across micro-batches is carried: its pieces train at baseline 0 while the
    baseline's part (the `slope` loss) waits in the score buffer until its last piece."""

    def __init__(self, norms: PerSampleNorms, step: StepValues, batch: TrainBatch) -> None:
        self.norms, self.step, self.batch = norms, step, batch
        self.carried: CarriedGroup | None = None
        self.folding: FoldingMicroBatch | None = None

    def forward(self, run: MicroBatch, micro: TrainBatch) -> tuple[Tensor, Tensor, SampleGradients | None]:
        norms = self.norms
        if run.group_rows is not None and self.carried is None:  # the first piece of a split group
            self.carried = CarriedGroup.start(norms.stabilizer, self.batch, run.group_rows)
        # folding where its sums fit the budget, else book-keeping as it keeps every per-sample gradient
        # a carried piece folds into the group's two sums beside the score buffer
        extra = norms.score_buffer_bytes if self.carried is not None else 0
        folds = norms.carries_split_groups and run.group_slots is not None
        folds = folds and norms.keeps_sample_gradients(micro, run.packing, extra, basis_rows=1 + run.groups)
        bookkeeping = run.group_rows is not None or folds or norms.keeps_sample_gradients(micro, run.packing)
        self.step.bookkept_micro_batches += bookkeeping
        self.step.folded_micro_batches += folds
        if folds:
            logprobs, entropy, start = norms.recorded_forward(micro, run.packing)  # its norms pass comes in `backward`
            if self.carried is not None and run.rows is not None:  # the whole group's advantages, not the piece's
                affine = self.carried.at_zero[run.rows], self.carried.slope[run.rows]
            else:
                affine = affine_advantages(norms.stabilizer, micro)
            self.folding = FoldingMicroBatch(run, start, *affine)
            return logprobs, entropy, None
        return norms.forward(micro, bookkeeping, run.packing)

    def advantages(
        self, run: MicroBatch, micro: TrainBatch, logprobs: Tensor, sample_grads: SampleGradients | None
    ) -> tuple[Tensor, Tensor | None]:
        if run.rows is None:  # an empty micro-batch: nothing to train on
            return torch.zeros(1, device=self.norms.device), None
        if self.carried is not None:  # advantages at baseline 0; the baseline's part waits in the score buffer
            return self.carried.at_zero[run.rows], None
        if self.folding is not None:  # at baseline 0 too: the norms, and so the baseline, come in `backward`
            return self.folding.at_zero, None
        return step_advantages(self.norms.stabilizer, self.norms.advantage_estimator, micro, logprobs, sample_grads)

    def extra_losses(
        self, run: MicroBatch, micro: TrainBatch, logprobs: Tensor, decision: TokenWeights, denominator: Tensor
    ) -> list[Tensor]:
        """The slope of a carried piece or a folding micro-batch: the loss's derivative in its groups' baselines
        (summed over them), at the same weights."""
        if self.carried is None and self.folding is None:
            return []
        spec = self.norms.spec
        if self.folding is not None:
            self.folding.decision, self.folding.denominator = decision, denominator
            slope = self.folding.slope
        else:
            assert self.carried is not None and run.rows is not None, "a carried piece has rows"
            slope = self.carried.slope[run.rows]
        policy = PolicyBatch(logprobs, micro.behaviour_logprobs, slope, micro.loss_mask)
        return [policy_loss(policy, decision, spec.loss_aggregation, denominator, spec.constant_tokens)]

    def backward(
        self,
        micro: TrainBatch,
        loss: Tensor,
        extra_losses: list[Tensor],
        logprobs: Tensor,
        sample_grads: SampleGradients | None,
    ) -> Tensor:
        """The micro-batch's gradient into the engine (`PerSampleNorms.backward`, or `backward_piece` for a carried
        group's piece); how far a sequence's token coefficients differ, for the step's one check."""
        folding, self.folding = self.folding, None
        carried = self.carried
        if carried is None and folding is not None:
            (slope,) = extra_losses
            return self.norms.backward_folded(self.step, folding, micro, loss, slope, logprobs)
        if carried is None:
            assert sample_grads is not None, "every forward with the norms gives them"
            return self.norms.backward(loss, logprobs, sample_grads, micro.loss_mask)
        (slope,) = extra_losses
        gap = self.norms.backward_piece(
            self.step, self.batch, carried, loss, slope, logprobs, sample_grads, micro.loss_mask, folding
        )
        self.carried = None if carried.complete else carried
        return gap


class GivenGradients(torch.autograd.Function):
    """A zero scalar whose gradient with respect to each parameter is the one given, times the gradient the
    scalar receives (the engine's 1 / accumulation steps and loss scale): one multiply over all of them."""

    @staticmethod
    def forward(ctx: Any, grads: list[Tensor], *params: Tensor) -> Tensor:
        ctx.grads = grads
        return torch.zeros((), dtype=torch.float32, device=grads[0].device)

    @staticmethod
    def backward(ctx: Any, scale: Tensor) -> tuple[Tensor | None, ...]:
        grads, ctx.grads = ctx.grads, None
        return (None, *torch._foreach_mul(grads, scale))
