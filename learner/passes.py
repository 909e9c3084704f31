"""One rank's RL step and supervised warm-up step, as passes over token-budget micro-batches.

A stabilizer that decides per row does so per micro-batch, one forward each (`one_pass`); any other first gets
the whole batch's learner log-probs from a no-grad pass (`two_passes`; docs/stabilizers.md, "Passes over the
batch"). Either way the gradient is the single-pass step's, accumulated one micro-batch at a time. With
`proximal: recompute` the first pass is always a no-grad one, and its log-probs are the proximal policy of the
step's updates (`decoupled_updates`). The forwards come from `learner/policy.py`, the per-sample norms' paths
from `learner/vcpo/step.py`, the records and pure helpers from `learner/step.py`, the KL and entropy terms
from `learner/loss_terms.py`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from torch import Tensor

from algorithms.advantages import ADVANTAGES
from algorithms.aggregation import loss_denominator
from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.diagnostics import health_metrics, zero_std_share
from algorithms.proximal import trust_region_weights
from algorithms.regularizers import adapted_kl_coef
from algorithms.stabilizer import Stabilizer
from learner import micro_batches
from learner.batch import TrainBatch
from learner.collectives import Collectives, nonfinite_count
from learner.loss_terms import kl_in_reward, kl_metrics, step_loss
from learner.lr_schedule import lr_factor
from learner.micro_batch_paths import MicroBatchPaths, PlainMicroBatches
from learner.micro_batches import MicroBatch
from learner.packing import packing_support
from learner.policy import PolicyForwards, Reference
from learner.spec import LearnerSpec
from learner.step import (
    NonFiniteUpdate,
    StepValues,
    check_one_coefficient_per_sequence,
    device_scalar,
    prompt_group_shares,
    rows_of,
    sequence_metrics,
    step_advantages,
    sub_batch,
)
from learner.vcpo.sample_gradients import SampleGradients
from learner.vcpo.step import PerSampleNorms

log = logging.getLogger("stableasync.learner")


class LearnerStep:
    """The steps of one rank's engine and what they carry from one step to the next: the policy `version`, the
    KL coefficient (an adaptive one moves each step) and the latest batch's sequence log-ratios.

    `packs` says whether micro-batches run packed (learner.packed_micro_batches, where the policy's and the
    reference's attention have a packed path); VCPO's per-sample norms (`norms`) lay each layer's packed
    inputs and output gradients back into rows to form their products.
    """

    def __init__(
        self,
        spec: LearnerSpec,
        engine: Any,
        optimizer: Any,
        collectives: Collectives,
        stabilizer: Stabilizer,
        forwards: PolicyForwards,
        reference: Reference | None,
        norms: PerSampleNorms | None,
        micro_batch_tokens: int | None,
        packs: bool,
        rank: int,
    ) -> None:
        self.spec, self.engine, self.optimizer, self.collectives = spec, engine, optimizer, collectives
        self.stabilizer, self.forwards, self.reference, self.norms = stabilizer, forwards, reference, norms
        self.micro_batch_tokens, self.packs, self.rank = micro_batch_tokens, packs, rank
        self.world_size, self.device = collectives.world_size, collectives.device
        self.advantage_estimator = ADVANTAGES[spec.advantage]
        self.version = 0
        # RL steps taken, skipped ones too (the driver's step index): the learning-rate schedule's clock, which
        # the SFT warm-up's updates (new policy versions all the same) do not move
        self.rl_steps = 0
        self.kl_coef = spec.kl_coef
        # the latest train_step's [B] sequence log-ratios, kept on the device until the rollout samples ask
        self.last_sequence_log_ratios = torch.zeros(0)

    def use_reference(self, reference: Reference) -> None:
        """A new KL reference; where micro-batches run packed, its attention gets its packed path too."""
        self.reference = reference
        if self.packs:
            self.packs, why = packing_support(reference.module)
            if not self.packs and self.rank == 0:
                log.info("learner rank 0: %s: padded micro-batches", why)

    # ---- the RL step -------------------------------------------------------------------------

    # long: the step in the order it runs: plan, reference, passes, metrics, update
    def train(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step (or with `proximal: recompute`, its updates) on this rank's groups; metrics averaged
        over ranks. The step publishes one policy version."""
        start = time.perf_counter()
        schedule = lr_factor(
            self.rl_steps,
            self.spec.total_steps,
            self.spec.lr_warmup_steps,
            self.spec.lr_schedule,
            self.spec.lr_min_ratio,
        )
        self.rl_steps += 1
        self.engine.train()
        batch = batch.to(self.device)
        needs_norms = self.norms is not None
        plan = micro_batches.plan(
            batch.sequence_lengths,
            batch.group_ids,
            self.micro_batch_tokens,
            keep_groups=needs_norms,
            packed=self.packs,
            bucket_cost=math.inf if self.norms is None else self.norms.bucket_cost,
        )
        one_pass = self.stabilizer.decides_per_row and (
            plan.groups_whole or self.norms is None or self.norms.carries_every_split_group(batch, plan)
        )
        runs, one_pass = self.collectives.agreed_runs(plan, one_pass)
        reference = None if self.reference is None else self.reference.logprobs(batch, runs)
        task_rewards = batch.rewards
        batch, reward_metrics = kl_in_reward(self.spec, self.kl_coef, batch, reference)
        decoupled = self.spec.proximal == "recompute"
        if decoupled:
            step = self.decide_on_whole_batch(batch, runs, reference)
        elif one_pass or len(runs) == 1:  # one micro-batch is the whole batch: any stabilizer decides on it at once
            step = self.one_pass(batch, runs, reference)
        else:
            step = self.two_passes(batch, runs, reference)
        policy = PolicyBatch(step.logprobs, batch.behaviour_logprobs, step.advantages, batch.loss_mask)
        decision = step.decision or self.stabilizer.token_weights(policy)  # one pass: for the metrics only
        metrics = {
            **health_metrics(policy),
            **decision.metrics,
            **(self.norms.baseline_metrics(batch, step) if self.norms is not None else {}),
            **reward_metrics,
            **kl_metrics(self.spec, self.kl_coef, batch, step.logprobs, reference),
            "rollout/reward_mean": task_rewards.mean(),
            "rollout/zero_std_share": zero_std_share(task_rewards, batch.group_ids, batch.loss_mask.any(dim=1)),
        }
        self.last_sequence_log_ratios = policy.seq_log_ratio
        metrics["stability/entropy"] = (step.entropy * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)
        metrics["perf/micro_batches"] = self._scalar(len(plan))
        metrics["perf/learner_passes"] = self._scalar(
            1.0 + self.spec.epochs if decoupled else 1.0 if step.decision is None else 2.0
        )
        if step.squared_norms is not None:
            metrics["opob/bookkeeping_share"] = self._scalar(step.bookkept_micro_batches / len(runs))
            metrics["opob/folded_share"] = self._scalar(step.folded_micro_batches / len(runs))
            metrics["opob/carried_groups"] = self._scalar(step.carried_groups)
        global_log_w = self.collectives.gather(policy.seq_log_ratio[policy.token_lengths > 0])
        metrics.update(sequence_metrics(global_log_w))
        metrics.update(self.stabilizer.global_metrics(global_log_w))
        loss = step.loss
        if step.skipped:
            metrics["optim/lr"] = self._scalar(0.0)
            return self._finish(metrics, start, skipped=True, loss=loss, lr_scale=0.0, grad_norm=math.nan, batch=batch)
        lr_scale = self.stabilizer.lr_scale(global_log_w)
        metrics["optim/lr"] = self._scalar(self.spec.learning_rate * schedule * lr_scale)
        if decoupled:
            grad_norm, update_metrics = self.decoupled_updates(batch, step, lr_scale * schedule, reference)
            metrics.update(update_metrics)
            if update_metrics["optim/updates"] == 0:  # the first update was already non-finite
                return self._finish(
                    metrics, start, skipped=True, loss=loss, lr_scale=0.0, grad_norm=math.nan, batch=batch
                )
            self.version += 1
        else:
            grad_norm = self._step_with_lr_scale(lr_scale * schedule)
        reduced = self._finish(
            metrics, start, skipped=False, loss=loss, lr_scale=lr_scale, grad_norm=grad_norm, batch=batch
        )
        if reference is not None and self.spec.kl_target is not None:  # the same reduced KL on every rank
            self.kl_coef = adapted_kl_coef(
                self.kl_coef,
                reduced["stability/kl_ref_mean"],
                self.spec.kl_target,
                self.spec.kl_horizon,
                batch.size * self.world_size,
            )
        return reduced

    def one_pass(self, batch: TrainBatch, runs: list[MicroBatch], reference: Tensor | None) -> StepValues:
        """Decide, weigh and backpropagate each micro-batch in one forward. Over several micro-batches the
        loss denominator is the loss mask's (a per-row stabilizer keeps it), known before any forward; in
        one, it comes from the decision on the whole batch. `paths`: the plain step's forward, advantages and
        backward, or VCPO's with its per-sample norms (`learner.vcpo.step.NormedMicroBatches`)."""
        step = StepValues.empty(batch, with_norms=self.norms is not None)
        paths: MicroBatchPaths
        if self.norms is None:
            advantages = self._advantages(batch, step.logprobs, None)[0]
            paths = PlainMicroBatches(self.forwards, self.engine, self.world_size, advantages)
        else:
            paths = self.norms.micro_batches(step, batch)
        mask_denominator = None if len(runs) == 1 else self._global_denominator(batch.loss_mask)
        # counted on the device and checked once after the loop: no host sync per micro-batch
        nonfinite = torch.zeros((), device=self.device)
        coefficient_gap = torch.zeros((), device=self.device)
        for run in runs:
            rows, micro = run.rows, sub_batch(batch, run)
            logprobs, entropy, sample_grads = paths.forward(run, micro)
            advantages, baseline = paths.advantages(run, micro, logprobs, sample_grads)
            policy = PolicyBatch(logprobs, micro.behaviour_logprobs, advantages, micro.loss_mask)
            decision = self.stabilizer.token_weights(policy)
            denominator = mask_denominator if mask_denominator is not None else self._global_denominator(decision.mask)
            loss = step_loss(
                self.spec, self.kl_coef, policy, decision, denominator, entropy, rows_of(reference, rows, logprobs)
            )
            extra_losses = paths.extra_losses(run, micro, logprobs, decision, denominator)
            bad = nonfinite_count(loss, decision.weights, *extra_losses)
            nonfinite = nonfinite + bad
            # a non-finite micro-batch poisons the accumulated gradient, so that the engine's step finds a
            # non-finite norm and discards it all (checked in _discard_step)
            loss = loss * torch.where(bad > 0, math.nan, 1.0)
            if rows is not None:
                step.record(rows, logprobs, entropy, advantages, sample_grads, baseline)
            step.loss = step.loss + loss.detach()
            gap = paths.backward(micro, loss, extra_losses, logprobs, sample_grads)
            coefficient_gap = torch.maximum(coefficient_gap, gap)
            del logprobs, entropy, sample_grads, policy, decision, loss  # before the next forward allocates
        nonfinite_found, largest_gap = self.collectives.max(torch.stack([nonfinite, coefficient_gap])).tolist()
        check_one_coefficient_per_sequence(largest_gap)
        if nonfinite_found:
            step.skipped = True
            self._discard_step()
        return step

    def two_passes(self, batch: TrainBatch, runs: list[MicroBatch], reference: Tensor | None) -> StepValues:
        """A no-grad pass gives the whole batch's learner log-probs (and per-sample gradient norms), the
        stabilizer decides once on them, and the gradient pass backpropagates each micro-batch's share."""
        step = self.decide_on_whole_batch(batch, runs, reference)
        if not step.skipped and step.decision is not None:
            denominator = self._global_denominator(step.decision.mask)
            self.backpropagate(batch, runs, step.decision, step.advantages, denominator, reference=reference)
        return step

    def decide_on_whole_batch(self, batch: TrainBatch, runs: list[MicroBatch], reference: Tensor | None) -> StepValues:
        """The first of two passes: the whole batch's learner log-probs (and per-sample gradient norms)
        without grad, the advantages, and the stabilizer's decision on them; no gradient yet. Skipped when
        the decision or the loss is not finite on some rank."""
        step = StepValues.empty(batch, with_norms=self.norms is not None)
        for run in runs:
            rows, micro = run.rows, sub_batch(batch, run)
            sample_grads: SampleGradients | None = None
            entropy: Tensor | None
            if self.norms is not None:
                logprobs, entropy, squared_norms = self.norms.norms_forward(micro, run.packing)
                sample_grads = SampleGradients(squared_norms)
            else:
                with torch.no_grad():
                    logprobs, entropy = self.forwards.token_logprobs(micro, True, run.packing)
            if rows is not None:
                step.record(rows, logprobs, entropy, None, sample_grads, None)
        step.advantages, step.baseline = self._advantages(batch, step.logprobs, step.sample_grads())
        policy = PolicyBatch(step.logprobs, batch.behaviour_logprobs, step.advantages, batch.loss_mask)
        step.decision = self.stabilizer.token_weights(policy)
        denominator = self._global_denominator(step.decision.mask)
        step.loss = step_loss(
            self.spec, self.kl_coef, policy, step.decision, denominator, step.entropy, reference
        ).detach()
        if not self.collectives.all_finite(step.decision.weights, step.loss):
            step.skipped = True
            self.engine.zero_grad()
        return step

    def backpropagate(
        self,
        batch: TrainBatch,
        runs: list[MicroBatch],
        decision: TokenWeights,
        advantages: Tensor,
        denominator: Tensor,
        proximal_logprobs: Tensor | None = None,
        reference: Tensor | None = None,
    ) -> float:
        """Each micro-batch's share of the loss of a decision made on the whole `batch`, into the engine's
        accumulated gradient; returns the loss tokens the trust region clipped.

        With the proximal policy's log-probs [B, L-1] (the decoupled objective) each token's weight also
        carries the trust region around them, and since the policy may have moved since the decision, a
        non-finite loss on any rank poisons the gradient so that the engine's step drops it (`_discard_step`).
        """
        clipped_tokens = 0.0
        for index, run in enumerate(runs):
            rows, micro = run.rows, sub_batch(batch, run)
            width = micro.loss_mask.shape[1]
            if rows is None:  # nothing to train on: zero weights on an empty mask
                weights, mask = micro.behaviour_logprobs, micro.loss_mask
                micro_advantages = torch.zeros(1, device=self.device)
            else:
                weights, mask = decision.weights[rows, :width], decision.mask[rows, :width]
                micro_advantages = advantages[rows]
            # the entropy costs an exp per logit: only where it is trained on
            logprobs, entropy = self.forwards.token_logprobs(micro, bool(self.spec.entropy_coef), run.packing)
            if proximal_logprobs is not None and rows is not None:
                trust, clipped = trust_region_weights(
                    logprobs,
                    proximal_logprobs[rows, :width],
                    micro_advantages,
                    micro.loss_mask,
                    self.spec.proximal_eps_low,
                    self.spec.proximal_eps_high,
                )
                weights = weights * trust
                clipped_tokens += float(clipped.sum())
            share = PolicyBatch(logprobs, micro.behaviour_logprobs, micro_advantages, micro.loss_mask)
            loss = step_loss(
                self.spec,
                self.kl_coef,
                share,
                TokenWeights(weights, mask, {}),
                denominator,
                entropy,
                rows_of(reference, rows, logprobs),
            )
            if proximal_logprobs is not None and not self.collectives.all_finite(loss):
                if index:  # poisons what the earlier micro-batches accumulated
                    self.engine.backward(loss * math.nan)
                else:
                    self.engine.zero_grad()
                raise NonFiniteUpdate(index)
            self.engine.backward(loss * self.world_size)
            del logprobs, entropy, share, loss
        return clipped_tokens

    def decoupled_updates(
        self, batch: TrainBatch, step: StepValues, lr_scale: float, reference: Tensor | None
    ) -> tuple[float, dict[str, Tensor]]:
        """`epochs` passes over the batch in `mini_batches` shares of whole prompt groups, one optimizer update
        per share: the stabilizer's decision at pi_prox (step.logprobs) times the trust region around pi_prox.
        Returns the largest update's gradient norm and the updates' metrics; after a non-finite share no
        further update runs (those before it stay applied)."""
        assert step.decision is not None, "the decoupled updates follow the decision on the whole batch"
        shares = prompt_group_shares(batch.group_ids, self.spec.mini_batches)
        norms: list[float] = []
        clipped_tokens = 0.0
        try:
            for _ in range(self.spec.epochs):
                for rows in shares:
                    share = batch.rows(rows)
                    decision = TokenWeights(step.decision.weights[rows], step.decision.mask[rows], {})
                    denominator = self._global_denominator(decision.mask)
                    plan = micro_batches.plan(
                        share.sequence_lengths,
                        share.group_ids,
                        self.micro_batch_tokens,
                        keep_groups=False,
                        packed=self.packs,
                    )
                    runs = self.collectives.agreed_runs(plan)[0]
                    clipped_tokens += self.backpropagate(
                        share,
                        runs,
                        decision,
                        step.advantages[rows],
                        denominator,
                        step.logprobs[rows],
                        None if reference is None else reference[rows],
                    )
                    norms.append(self._apply_update(lr_scale))
        except NonFiniteUpdate as error:
            if error.micro_batch:  # gradients accumulated before it: the engine's step must drop them
                self._discard_step()
        planned = self.spec.epochs * len(shares)
        tokens = float(batch.loss_mask.sum()) * len(norms)
        metrics = {
            "optim/updates": self._scalar(len(norms)),
            "stability/skipped_updates": self._scalar(planned - len(norms)),
            "stability/proximal_clip_frac": self._scalar(clipped_tokens / tokens if tokens else 0.0),
        }
        return (max(norms) if norms else math.nan), metrics

    def _advantages(
        self, batch: TrainBatch, logprobs: Tensor, sample_grads: SampleGradients | None
    ) -> tuple[Tensor, Tensor | None]:
        return step_advantages(self.stabilizer, self.advantage_estimator, batch, logprobs, sample_grads)

    # ---- the supervised warm-up --------------------------------------------------------------

    def sft(self, batch: TrainBatch, learning_rate: float) -> dict[str, float]:
        """Supervised warm-up on demonstrations: token-mean cross-entropy of the completion tokens, in the
        same token-budget micro-batches as the RL step."""
        self.engine.train()
        batch = batch.to(self.device)
        plan = micro_batches.plan(
            batch.sequence_lengths, batch.group_ids, self.micro_batch_tokens, keep_groups=False, packed=self.packs
        )
        denominator = self.collectives.sum(batch.loss_mask.sum()).clamp(min=1)
        total = torch.zeros((), device=self.device)
        for run in self.collectives.agreed_runs(plan)[0]:
            micro = sub_batch(batch, run)
            logprobs, _ = self.forwards.token_logprobs(micro, with_entropy=False, packing=run.packing)
            loss = -(logprobs * micro.loss_mask).sum() / denominator
            self.engine.backward(loss * self.world_size)
            total = total + loss.detach()
        grad_norm = self._step_with_lr_scale(learning_rate / self.spec.learning_rate)
        metrics = {"sft/loss": total, "sft/grad_norm": self._scalar(grad_norm)}
        return self.collectives.reduce_metrics(metrics)

    # ---- updates and what every step ends with -------------------------------------------------

    def _step_with_lr_scale(self, lr_scale: float) -> float:
        """The step's one update at lr * lr_scale: a new policy version."""
        norm = self._apply_update(lr_scale)
        self.version += 1
        return norm

    def _apply_update(self, lr_scale: float) -> float:
        """optimizer.step at lr * lr_scale for this update only, then the base LR is restored; the gradient norm."""
        groups = self.optimizer.param_groups
        base = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            self.engine.step()
        finally:
            for group, lr in zip(groups, base):
                group["lr"] = lr
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def _discard_step(self) -> None:
        """The engine's step on a poisoned gradient: ZeRO finds the non-finite norm and drops the gradient
        without an update. Anything else would train on it, so it is refused loudly."""
        self.engine.step()
        if self.engine.was_step_applied():
            raise RuntimeError(f"learner rank {self.rank}: DeepSpeed applied a step with a non-finite gradient")

    def _finish(
        self,
        metrics: dict[str, Tensor],
        start: float,
        *,
        skipped: bool,
        loss: Tensor,
        lr_scale: float,
        grad_norm: float,
        batch: TrainBatch,
    ) -> dict[str, float]:
        metrics = dict(metrics)
        metrics["optim/loss"] = loss.detach() * self.world_size  # a share of the global loss; ranks average
        metrics["optim/grad_norm"] = self._scalar(grad_norm)
        metrics["stability/lr_scale"] = self._scalar(lr_scale)
        metrics["stability/skipped_step"] = self._scalar(skipped)
        metrics.setdefault("rollout/reward_mean", batch.rewards.mean())  # the task's, before any KL shaping
        metrics["rollout/response_len"] = batch.loss_mask.float().sum(1).mean()
        metrics["time/learner_step_s"] = self._scalar(time.perf_counter() - start)
        metrics["perf/learner_tokens_per_s"] = batch.attention_mask.sum() / metrics["time/learner_step_s"]
        return self.collectives.reduce_metrics(
            metrics, token_weight=batch.loss_mask.sum(), sample_weight=batch.loss_mask.any(dim=1).sum()
        )

    def _scalar(self, value: float) -> Tensor:
        return device_scalar(value, self.device)

    def _global_denominator(self, mask: Tensor) -> Tensor:
        """The loss denominator of `mask` summed over the ranks, so each rank's loss is its share of the global one."""
        return self.collectives.sum(loss_denominator(mask, self.spec.loss_aggregation, self.spec.constant_tokens))
