"""One DeepSpeed ZeRO learner rank: learner log-probs, the stabilized step, weight publishing.

A plain class: `cluster/` runs one per Ray actor. Every rank of a group runs every collective method
(`train_step`, `sft_step`, `state_dict_for_publish`) with its own share of the prompt groups. The step's
record types and pure helpers live in `learner/step.py`, the collectives in `learner/collectives.py`,
publishing in `learner/publishing.py` and checkpoints and model folders in `learner/checkpoint.py`; this
file sets the rank up and runs the step's passes.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from algorithms import registry
from algorithms.advantages import ADVANTAGES, group_mean_advantages
from algorithms.aggregation import aggregate_token_loss, loss_denominator, policy_loss
from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.diagnostics import health_metrics
from algorithms.proximal import trust_region_weights
from algorithms.regularizers import adapted_kl_coef, kl_penalty, sequence_kl
from learner import checkpoint, memory_budget, micro_batches
from learner.batch import TrainBatch, sequence_logprob_grad, token_logprobs, token_logprobs_and_entropy
from learner.collectives import Collectives, nonfinite_count
from learner.fused_head import FusedHead, fused_head
from learner.grad_norms import GhostGradNorms, SampleGradients, UncoveredParameters, per_sample_loop_norms
from learner.lora import LoraSpec, with_lora
from learner.lr_schedule import LRSchedule, lr_factor
from learner.models import without_dropout
from learner.packing import packed_token_logprobs, packing_support
from learner.publishing import Publisher
from learner.step import (CarriedGroup, NonFiniteUpdate, StepValues, causal_logits, check_one_coefficient_per_sequence,
                          config_values, prompt_group_shares, rows_of, sequence_coefficients, sequence_metrics)
from learner.weight_sync import PackedWeights, TensorSpec

log = logging.getLogger("stableasync.learner")


@dataclass(frozen=True)
class LearnerSpec:
    """Everything a rank needs, as plain values (the job schema stays on the driver)."""

    model_path: str
    zero_stage: int = 2
    learning_rate: float = 1e-6
    total_steps: int = 1
    lr_warmup_steps: int = 0
    lr_schedule: LRSchedule = "constant"
    lr_min_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    temperature: float = 1.0
    stabilizer_name: str = "tis_seq"
    stabilizer_config: Any = None
    advantage: str = "grpo"
    loss_aggregation: str = "token-mean"
    constant_tokens: int | None = None
    dtype: str = "float32"
    seed: int = 0
    backend: str = "gloo"
    # padded tokens per forward; "auto": what the rank's free memory holds (learner/memory_budget.py); None: the
    # rank's batch at once
    max_tokens_per_micro_batch: int | str | None = None
    max_sequence_tokens: int | None = None  # generator.max_model_len: the least an "auto" budget must hold
    device_share: float = 1.0  # learner.gpus_per_rank below 1: the share of a GPU that an "auto" budget plans on
    gradient_checkpointing: bool = False
    proximal: str = "behaviour"  # recompute: the decoupled objective (algorithms/proximal.py)
    proximal_eps_low: float = 0.2
    proximal_eps_high: float = 0.2
    mini_batches: int = 1  # recompute: optimizer updates per pass, each on its share of the prompt groups
    epochs: int = 1  # recompute: passes over the batch
    kl_coef: float = 0.0  # > 0: a frozen reference policy (the initial model) and a KL term to it
    kl_estimator: str = "low_var"  # algorithms/regularizers.py KL_TERMS
    kl_in: str = "loss"  # loss: a term of the loss; reward: subtracted from each sequence's reward
    kl_target: float | None = None  # adaptive coefficient: the KL per token it steers towards
    kl_horizon: int = 10000  # adaptive coefficient: sequences over which it moves by at most 20%
    entropy_coef: float = 0.0  # entropy bonus: minus coef times the aggregated token entropy in the loss
    lora: LoraSpec | None = None  # train a LoRA adapter only (learner/lora.py); None: every weight
    reference_path: str | None = None  # the KL reference's model folder; None: model_path
    # each micro-batch's rows as one sequence without padding (learner/packing.py), its budget counting real tokens;
    # VCPO's per-sample norms keep padded rows
    packed_micro_batches: bool = True

    @property
    def token_terms(self) -> bool:
        """Whether the loss has terms besides the policy gradient whose token coefficients differ within a
        sequence (a KL term, an entropy bonus): book-keeping, which forms whole-sequence gradients, cannot
        carry them."""
        return (self.kl_coef > 0 and self.kl_in == "loss") or self.entropy_coef > 0


class LearnerRank:
    """A ZeRO data-parallel rank of the policy."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM

        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_RANK="0" if spec.backend == "gloo" else os.environ.get("LOCAL_RANK", "0"),
        )
        deepspeed.init_distributed(dist_backend=spec.backend)
        torch.manual_seed(spec.seed)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        dtype = torch.float32 if spec.dtype == "float32" else torch.bfloat16
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            # each backward accumulates; step() is the boundary, so a step may take any number of micro-batches
            "managed_gradient_accumulation": False,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": spec.learning_rate, "weight_decay": spec.weight_decay, "eps": spec.adam_eps,
                           "torch_adam": True},
            },
            "zero_optimization": {"stage": spec.zero_stage},
            "gradient_clipping": spec.grad_clip,
            "bf16": {"enabled": spec.dtype == "bfloat16"},
            "steps_per_print": 10**9,
        }
        if spec.zero_stage == 3:
            # transformers loads under DeepSpeed's ZeRO-3 init while this object lives: each rank keeps only
            # its partition of every parameter, instead of the whole model before the engine partitions it
            from transformers.integrations import HfDeepSpeedConfig

            self._zero3_load = HfDeepSpeedConfig(config)
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=dtype)
        if spec.lora is not None:  # the base weights stay frozen: no gradients and no optimizer state for them
            model = with_lora(model, spec.lora)
        if without_dropout(model) and rank == 0:  # one function for a step's log-probs, ratios and passes
            log.info("learner rank 0: dropout set to 0 in the policy's forwards")
        if spec.gradient_checkpointing:  # activations recomputed in the backward, layer by layer
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
        )
        self.device = self.engine.device
        self.collectives = Collectives(world_size, self.device)
        self.publisher = Publisher(self.engine.module, spec.lora is not None, spec.zero_stage, rank)
        self.micro_batch_budget = memory_budget.resolve(spec, self.engine, self.device, rank, world_size)
        self.micro_batch_tokens = self.micro_batch_budget.tokens  # padded tokens per forward; None: the whole batch
        self.stabilizer = registry.build(spec.stabilizer_name, **config_values(spec.stabilizer_config))
        self.advantage_fn = ADVANTAGES[spec.advantage]
        # a stabilizer without the option (a user's own) gets the ghost path
        opob_impl = getattr(self.stabilizer.config, "opob_impl", "ghost")
        self.ghost_norms, self.grad_norm_fallback = self._ghost_norms(opob_impl)
        self.bookkeeping = self._uses_bookkeeping(opob_impl)
        # auto: book-keeping only for a micro-batch whose kept gradients fit the budget; bookkeeping: always
        self.bookkeeping_budget_bytes = self.micro_batch_budget.kept_gradient_bytes if opob_impl == "auto" else math.inf
        # book-keeping carries a group split across micro-batches in one pass, with a score buffer of one
        # fp32 gradient (the VCPO paper's two buffers; the other is the engine's own accumulation)
        self.carries_split_groups = self.bookkeeping and self.stabilizer.advantages_from_baseline(
            torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.long)) is not None
        self.score_buffer_bytes = 4 * sum(p.numel() for p in self.engine.module.parameters() if p.requires_grad)
        # with LoRA the reference is the same model with its adapter switched off: no second copy
        self.reference_config, self.dtype = config, dtype
        self.reference = (self._reference_model(spec.reference_path or spec.model_path)
                          if spec.kl_coef > 0 and spec.lora is None else None)
        # no [tokens, vocabulary] logits where the output layer fuses with the log-softmax (whole weights: not ZeRO-3)
        self.fused_head = self._fused_head(self.engine.module)
        self.reference_head = (self._fused_head(self.reference) if self.reference is not None
                               else self.fused_head if spec.kl_coef > 0 else None)
        self.kl_coef = spec.kl_coef  # moves each step with an adaptive coefficient; kept in checkpoints
        self.version = 0
        # the latest train_step's [B] sequence log-ratios, kept on the device until the rollout samples ask
        self.last_sequence_log_ratios = torch.zeros(0)

    def _reference_model(self, path: str) -> Any:
        """The frozen initial policy the KL term measures against, loaded a second time. Under ZeRO-3 it is a
        DeepSpeed engine without an optimizer, so each rank keeps only its partition (as OpenRLHF's reference
        does); otherwise a plain copy on the rank's device, which costs one more set of weights and no
        optimizer state."""
        from transformers import AutoModelForCausalLM

        config, dtype = self.reference_config, self.dtype
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).requires_grad_(False)
        if self.spec.zero_stage != 3:
            return model.to(self.device).eval()
        import deepspeed

        frozen = {key: config[key] for key in ("train_micro_batch_size_per_gpu", "zero_optimization", "bf16",
                                               "steps_per_print")}
        engine, *_ = deepspeed.initialize(model=model, config=frozen)
        engine.eval()  # DeepSpeed's eval() returns None
        return engine

    def load_reference(self, folder: str) -> None:
        """The KL reference from `folder` (the policy as RL starts, which the driver wrote after the warm-up),
        in place of the one loaded at start-up; a collective under ZeRO-3."""
        if self.reference is None:
            return
        self.reference = self._reference_model(folder)
        self.reference_head = self._fused_head(self.reference)
        if getattr(self, "_packing", False):  # packing was set up with the old reference: the new one's attention too
            self._packing, why = packing_support(getattr(self.reference, "module", self.reference))
            if not self._packing and self.rank == 0:
                log.info("learner rank 0: %s: padded micro-batches", why)

    def _fused_head(self, model: Any) -> FusedHead | None:
        """The model's fused output layer and log-softmax, or None (logged once) where its logits are kept."""
        if self.spec.zero_stage == 3:  # each rank holds a partition of the output layer's weight
            return None
        head, why = fused_head(model)
        if self.rank == 0:
            log.info("learner rank 0: %s", why)
        return head

    def _ghost_norms(self, opob_impl: str) -> tuple[GhostGradNorms | None, bool]:
        """The ghost-norm path when the stabilizer needs per-sample norms and every parameter has a rule;
        otherwise the per-sample loop, announced (a silent 10x slowdown would look like a hang)."""
        if not self.stabilizer.needs_grad_norms or opob_impl == "per_sample_loop":
            return None, False
        try:
            return GhostGradNorms(self.engine.module), False
        except UncoveredParameters as error:
            log.warning("learner rank %d: per-sample gradient norms fall back to one backward per sample: %s",
                        self.rank, error)
            return None, True

    def _uses_bookkeeping(self, opob_impl: str) -> bool:
        """Book-keeping forms the update from the kept per-sample gradients, which needs whole parameters:
        under ZeRO-3 the norms come from the two-pass ghost path instead (said once, here)."""
        if self.ghost_norms is None or opob_impl not in ("bookkeeping", "auto"):
            return False
        if self.spec.token_terms:  # the KL term or entropy bonus needs the model's own backward
            return False
        if self.spec.zero_stage == 3:
            if opob_impl == "bookkeeping":  # asked for by name: say why it is not used
                log.info("learner rank %d: ZeRO-3 partitions the parameters, so per-sample norms use the two-pass "
                         "ghost path instead of bookkeeping", self.rank)
            return False
        return True

    # ---- the RL step -------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's groups, in token-budget micro-batches; metrics averaged over ranks.

        A stabilizer that decides per row does so per micro-batch, one forward each; any other first gets
        the whole batch's learner log-probs from a no-grad pass (docs/stabilizers.md, "Passes over the batch").
        Either way the gradient is the single-pass step's, accumulated one micro-batch at a time.
        With `proximal: recompute` the first pass is always a no-grad one, and its log-probs are the proximal
        policy of the step's updates (`_decoupled_updates`).
        """
        start = time.perf_counter()
        self.engine.train()
        batch = batch.to(self.device)
        needs_norms = self.stabilizer.needs_grad_norms
        plan = micro_batches.plan(batch.sequence_lengths, batch.group_ids, self.micro_batch_tokens,
                                  keep_groups=needs_norms, packed=self._packs(needs_norms))
        one_pass = self.stabilizer.decides_per_row and (plan.groups_whole or not needs_norms
                                                        or self._carries_every_split_group(batch, plan))
        runs, one_pass = self._agreed_runs(plan, one_pass)
        reference = self._reference_logprobs(batch, runs)
        task_rewards = batch.rewards
        batch, reward_metrics = self._kl_in_reward(batch, reference)
        decoupled = self.spec.proximal == "recompute"
        if decoupled:
            step = self._decide_on_whole_batch(batch, runs, reference)
        elif one_pass or len(runs) == 1:  # one micro-batch is the whole batch: any stabilizer decides on it at once
            step = self._one_pass(batch, runs, reference)
        else:
            step = self._two_passes(batch, runs, reference)
        policy = PolicyBatch(step.logprobs, batch.behaviour_logprobs, step.advantages, batch.loss_mask)
        decision = step.decision or self.stabilizer.token_weights(policy)  # one pass: for the metrics only
        metrics = {**health_metrics(policy), **decision.metrics, **self._baseline_metrics(batch, step),
                   **reward_metrics, **self._kl_metrics(batch, step.logprobs, reference),
                   "rollout/reward_mean": task_rewards.mean()}
        self.last_sequence_log_ratios = policy.seq_log_ratio
        metrics["stability/entropy"] = (step.entropy * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)
        metrics["perf/micro_batches"] = self._scalar(len(plan))
        metrics["perf/learner_passes"] = self._scalar(
            1.0 + self.spec.epochs if decoupled else 1.0 if step.decision is None else 2.0)
        if step.squared_norms is not None:
            metrics["opob/bookkeeping_share"] = self._scalar(step.bookkept_micro_batches / len(runs))
            metrics["opob/carried_groups"] = self._scalar(step.carried_groups)
        global_log_w = self.collectives.gather(policy.seq_log_ratio[policy.token_lengths > 0])
        metrics.update(sequence_metrics(global_log_w))
        metrics.update(self.stabilizer.global_metrics(global_log_w))
        loss = step.loss
        if step.skipped:
            metrics["optim/lr"] = self._scalar(0.0)
            return self._finish(metrics, start, skipped=True, loss=loss, lr_scale=0.0, grad_norm=math.nan, batch=batch)
        lr_scale = self.stabilizer.lr_scale(global_log_w)
        schedule = lr_factor(self.version, self.spec.total_steps, self.spec.lr_warmup_steps, self.spec.lr_schedule,
                             self.spec.lr_min_ratio)
        metrics["optim/lr"] = self._scalar(self.spec.learning_rate * schedule * lr_scale)
        if decoupled:
            grad_norm, update_metrics = self._decoupled_updates(batch, step, lr_scale * schedule, reference)
            metrics.update(update_metrics)
            if update_metrics["optim/updates"] == 0:  # the first update was already non-finite
                return self._finish(metrics, start, skipped=True, loss=loss, lr_scale=0.0, grad_norm=math.nan,
                                    batch=batch)
            self.version += 1
        else:
            grad_norm = self._step_with_lr_scale(lr_scale * schedule)
        reduced = self._finish(metrics, start, skipped=False, loss=loss, lr_scale=lr_scale, grad_norm=grad_norm,
                               batch=batch)
        if reference is not None and self.spec.kl_target is not None:  # the same reduced KL on every rank
            self.kl_coef = adapted_kl_coef(self.kl_coef, reduced["stability/kl_ref_mean"], self.spec.kl_target,
                                           self.spec.kl_horizon, batch.size * self.world_size)
        return reduced

    def sequence_log_ratios(self) -> list[float]:
        """sum_t log pi_learner - log pi_behaviour of each row of the latest train_step's batch, in its order."""
        return self.last_sequence_log_ratios.tolist()

    def _agreed_runs(self, plan: micro_batches.MicroBatchPlan, one_pass: bool = True
                     ) -> tuple[list[micro_batches.MicroBatch], bool]:
        """The plan's micro-batches, padded with empty ones to the most any rank runs, and one pass only where
        every rank can take it: ZeRO's collectives in each forward and backward need all ranks to run the
        same passes over as many micro-batches."""
        wanted = torch.tensor([float(len(plan)), float(not one_pass)], device=self.device)
        most, any_two_passes = self.collectives.max(wanted).tolist()
        return [*plan.micro_batches, *[micro_batches.EMPTY] * (int(most) - len(plan))], any_two_passes == 0

    @staticmethod
    def _micro_batch(batch: TrainBatch, run: micro_batches.MicroBatch) -> TrainBatch:
        """The run's sub-batch without unused padding (its width known on the host); an empty run gives one
        row with nothing to train on."""
        if run.rows is not None:
            return batch.rows(run.rows).trimmed(run.width)
        empty = batch.rows(torch.zeros(1, dtype=torch.long, device=batch.input_ids.device)).trimmed(run.width)
        empty.loss_mask = torch.zeros_like(empty.loss_mask)
        empty.behaviour_logprobs = torch.zeros_like(empty.behaviour_logprobs)
        return empty

    def _packs(self, needs_norms: bool = False) -> bool:
        """Whether a pass's micro-batches run packed (learner.packed_micro_batches; learner/packing.py): not where
        VCPO's per-sample norms need padded rows, nor for a model whose attention has no varlen path here (the
        policy's and the reference's checked once, the answer logged)."""
        if not self.spec.packed_micro_batches:
            return False
        if not hasattr(self, "_packing"):  # the first step: each model's attention gets its packed wrapper
            models = [self.engine.module, *([] if self.reference is None else [getattr(self.reference, "module",
                                                                                        self.reference)])]
            checks = [packing_support(model) for model in models]
            self._packing = all(supported for supported, _ in checks)
            if self.rank == 0:
                log.info("learner rank 0: %s%s", "; ".join(why for ok, why in checks if not ok) or checks[0][1],
                         "" if self._packing else ": padded micro-batches")
        if needs_norms and self._packing and not getattr(self, "_said_norms_pad", False):
            self._said_norms_pad = True
            if self.rank == 0:
                log.info("learner rank 0: per-sample gradient norms need padded rows: this stabilizer's steps run "
                         "padded micro-batches")
        return self._packing and not needs_norms

    def _keeps_sample_gradients(self, micro: TrainBatch, extra_bytes: int = 0) -> bool:
        """Whether this micro-batch's update is formed by book-keeping (its kept gradients fit the budget)."""
        if not self.bookkeeping:
            return False
        kept = micro.size * self.ghost_norms.kept_bytes_per_sample(micro.input_ids.shape[1])
        return kept + extra_bytes <= self.bookkeeping_budget_bytes

    def _carries_every_split_group(self, batch: TrainBatch, plan: micro_batches.MicroBatchPlan) -> bool:
        """Whether each piece of a split group takes book-keeping with the score buffer within the budget."""
        if not self.carries_split_groups:
            return False
        pieces = [run for run in plan.micro_batches if run.group_rows is not None]
        return all(self._keeps_sample_gradients(self._micro_batch(batch, run), self.score_buffer_bytes)
                   for run in pieces)

    def _one_pass(self, batch: TrainBatch, runs: list[micro_batches.MicroBatch], reference: Tensor | None
                  ) -> StepValues:
        """Decide, weigh and backpropagate each micro-batch in one forward. Over several micro-batches the
        loss denominator is the loss mask's (a per-row stabilizer keeps it), known before any forward; in
        one, it comes from the decision on the whole batch."""
        step = StepValues.empty(batch, with_norms=self.stabilizer.needs_grad_norms)
        if not self.stabilizer.needs_grad_norms:  # advantages from the rewards alone, whole groups at once
            step.advantages = self._advantages(batch, step.logprobs, None)[0]
        mask_denominator = None if len(runs) == 1 else self._global_denominator(batch.loss_mask)
        carried: CarriedGroup | None = None
        # counted on the device and checked once after the loop: no host sync per micro-batch
        nonfinite = torch.zeros((), device=self.device)
        coefficient_gap = torch.zeros((), device=self.device)
        for run in runs:
            rows, micro = run.rows, self._micro_batch(batch, run)
            group_rows = run.group_rows if self.stabilizer.needs_grad_norms else None
            if group_rows is not None and carried is None:  # the first piece of a split group
                carried = CarriedGroup.start(self.stabilizer, batch, group_rows)
            record = self.ghost_norms is not None and self.spec.zero_stage != 3
            bookkeeping = group_rows is not None or self._keeps_sample_gradients(micro)
            step.bookkept_micro_batches += bookkeeping
            if self.stabilizer.needs_grad_norms:  # the norms start from the logits' gradient
                with self.ghost_norms.recording() if record else nullcontext():
                    logits = self._logits(micro, plain=bookkeeping)  # no loss backward through the engine follows
                logprobs, entropy = token_logprobs_and_entropy(logits, micro.input_ids, self.spec.temperature)
                sample_grads = self._sample_gradients(micro, logits, bookkeeping)
            else:
                logits, sample_grads = None, None
                logprobs, entropy = self._token_logprobs(micro, with_entropy=True, packing=run.packing)
            if rows is None:
                advantages, baseline = torch.zeros(1, device=self.device), None
            elif carried is not None:  # advantages at baseline 0; the baseline's part waits in the score buffer
                advantages, baseline = carried.at_zero[rows], None
            elif self.stabilizer.needs_grad_norms:
                advantages, baseline = self._advantages(micro, logprobs, sample_grads)
            else:
                advantages, baseline = step.advantages[rows], None
            policy = PolicyBatch(logprobs, micro.behaviour_logprobs, advantages, micro.loss_mask)
            decision = self.stabilizer.token_weights(policy)
            denominator = mask_denominator if mask_denominator is not None else self._global_denominator(decision.mask)
            loss = self._loss(policy, decision, denominator, entropy, rows_of(reference, rows, logprobs))
            slope = None if carried is None else policy_loss(
                PolicyBatch(logprobs, micro.behaviour_logprobs, carried.slope[rows], micro.loss_mask), decision,
                self.spec.loss_aggregation, denominator, self.spec.constant_tokens)
            bad = nonfinite_count(loss, decision.weights, *([] if slope is None else [slope]))
            nonfinite = nonfinite + bad
            # a non-finite micro-batch poisons the accumulated gradient, so that the engine's step finds a
            # non-finite norm and discards it all (checked in _discard_step)
            loss = loss * torch.where(bad > 0, math.nan, 1.0)
            if rows is not None:
                step.record(rows, logprobs, entropy.detach(), advantages, sample_grads, baseline)
            step.loss = step.loss + loss.detach()
            if carried is not None:
                gap = self._backward_piece(step, batch, carried, loss, slope, logprobs, sample_grads, micro.loss_mask)
                carried = None if carried.complete else carried
            else:
                gap = self._backward(loss, logprobs, sample_grads, micro.loss_mask)
            coefficient_gap = torch.maximum(coefficient_gap, gap)
            del logits, logprobs, entropy, sample_grads, policy, decision, loss  # before the next forward allocates
        nonfinite, coefficient_gap = self.collectives.max(torch.stack([nonfinite, coefficient_gap])).tolist()
        check_one_coefficient_per_sequence(coefficient_gap)
        if nonfinite:
            step.skipped = True
            self._discard_step()
        return step

    def _two_passes(self, batch: TrainBatch, runs: list[micro_batches.MicroBatch], reference: Tensor | None
                    ) -> StepValues:
        """A no-grad pass gives the whole batch's learner log-probs (and per-sample gradient norms), the
        stabilizer decides once on them, and the gradient pass backpropagates each micro-batch's share."""
        step = self._decide_on_whole_batch(batch, runs, reference)
        if not step.skipped:
            denominator = self._global_denominator(step.decision.mask)
            self._backpropagate(batch, runs, step.decision, step.advantages, denominator, reference=reference)
        return step

    def _decide_on_whole_batch(self, batch: TrainBatch, runs: list[micro_batches.MicroBatch], reference: Tensor | None
                               ) -> StepValues:
        """The first of two passes: the whole batch's learner log-probs (and per-sample gradient norms)
        without grad, the advantages, and the stabilizer's decision on them; no gradient yet. Skipped when
        the decision or the loss is not finite on some rank."""
        step = StepValues.empty(batch, with_norms=self.stabilizer.needs_grad_norms)
        for run in runs:
            rows, micro = run.rows, self._micro_batch(batch, run)
            if self.stabilizer.needs_grad_norms:
                logits, squared_norms = self._norms_forward(micro)
                sample_grads = SampleGradients(squared_norms)
                logprobs, entropy = token_logprobs_and_entropy(logits.detach(), micro.input_ids, self.spec.temperature)
                del logits
            else:
                with torch.no_grad():
                    (logprobs, entropy), sample_grads = self._token_logprobs(micro, True, run.packing), None
            if rows is not None:
                step.record(rows, logprobs, entropy, None, sample_grads, None)
        step.advantages, step.baseline = self._advantages(batch, step.logprobs, step.sample_grads())
        policy = PolicyBatch(step.logprobs, batch.behaviour_logprobs, step.advantages, batch.loss_mask)
        step.decision = self.stabilizer.token_weights(policy)
        denominator = self._global_denominator(step.decision.mask)
        step.loss = self._loss(policy, step.decision, denominator, step.entropy, reference).detach()
        if not self.collectives.all_finite(step.decision.weights, step.loss):
            step.skipped = True
            self.engine.zero_grad()
        return step

    def _backpropagate(self, batch: TrainBatch, runs: list[micro_batches.MicroBatch], decision: TokenWeights,
                       advantages: Tensor, denominator: Tensor, proximal_logprobs: Tensor | None = None,
                       reference: Tensor | None = None) -> float:
        """Each micro-batch's share of the loss of a decision made on the whole `batch`, into the engine's
        accumulated gradient; returns the loss tokens the trust region clipped.

        With the proximal policy's log-probs [B, L-1] (the decoupled objective) each token's weight also
        carries the trust region around them, and since the policy may have moved since the decision, a
        non-finite loss on any rank poisons the gradient so that the engine's step drops it (`_discard_step`).
        """
        clipped_tokens = 0.0
        for index, run in enumerate(runs):
            rows, micro = run.rows, self._micro_batch(batch, run)
            width = micro.loss_mask.shape[1]
            if rows is None:  # nothing to train on: zero weights on an empty mask
                weights, mask = micro.behaviour_logprobs, micro.loss_mask
                micro_advantages = torch.zeros(1, device=self.device)
            else:
                weights, mask = decision.weights[rows, :width], decision.mask[rows, :width]
                micro_advantages = advantages[rows]
            # the entropy costs an exp per logit: only where it is trained on
            logprobs, entropy = self._token_logprobs(micro, bool(self.spec.entropy_coef), run.packing)
            if proximal_logprobs is not None and rows is not None:
                trust, clipped = trust_region_weights(logprobs, proximal_logprobs[rows, :width], micro_advantages,
                                                      micro.loss_mask, self.spec.proximal_eps_low,
                                                      self.spec.proximal_eps_high)
                weights = weights * trust
                clipped_tokens += float(clipped.sum())
            share = PolicyBatch(logprobs, micro.behaviour_logprobs, micro_advantages, micro.loss_mask)
            loss = self._loss(share, TokenWeights(weights, mask, {}), denominator, entropy,
                              rows_of(reference, rows, logprobs))
            if proximal_logprobs is not None and not self.collectives.all_finite(loss):
                if index:  # poisons what the earlier micro-batches accumulated
                    self.engine.backward(loss * math.nan)
                else:
                    self.engine.zero_grad()
                raise NonFiniteUpdate(index)
            self.engine.backward(loss * self.world_size)
            del logprobs, entropy, share, loss
        return clipped_tokens

    def _decoupled_updates(self, batch: TrainBatch, step: StepValues, lr_scale: float, reference: Tensor | None
                           ) -> tuple[float, dict[str, Tensor]]:
        """`epochs` passes over the batch in `mini_batches` shares of whole prompt groups, one optimizer update
        per share: the stabilizer's decision at pi_prox (step.logprobs) times the trust region around pi_prox.
        Returns the largest update's gradient norm and the updates' metrics; after a non-finite share no
        further update runs (those before it stay applied)."""
        shares = prompt_group_shares(batch.group_ids, self.spec.mini_batches)
        norms: list[float] = []
        clipped_tokens = 0.0
        try:
            for _ in range(self.spec.epochs):
                for rows in shares:
                    share = batch.rows(rows)
                    decision = TokenWeights(step.decision.weights[rows], step.decision.mask[rows], {})
                    denominator = self._global_denominator(decision.mask)
                    plan = micro_batches.plan(share.sequence_lengths, share.group_ids,
                                              self.micro_batch_tokens, keep_groups=False, packed=self._packs())
                    runs = self._agreed_runs(plan)[0]
                    clipped_tokens += self._backpropagate(
                        share, runs, decision, step.advantages[rows], denominator, step.logprobs[rows],
                        None if reference is None else reference[rows])
                    norms.append(self._apply_update(lr_scale))
        except NonFiniteUpdate as error:
            if error.micro_batch:  # gradients accumulated before it: the engine's step must drop them
                self._discard_step()
        planned = self.spec.epochs * len(shares)
        tokens = float(batch.loss_mask.sum()) * len(norms)
        metrics = {"optim/updates": self._scalar(len(norms)),
                   "stability/skipped_updates": self._scalar(planned - len(norms)),
                   "stability/proximal_clip_frac": self._scalar(clipped_tokens / tokens if tokens else 0.0)}
        return (max(norms) if norms else math.nan), metrics

    def _loss(self, policy: PolicyBatch, decision: TokenWeights, denominator: Tensor, entropy: Tensor | None,
              reference: Tensor | None) -> Tensor:
        """The policy-gradient loss, plus the KL term to the reference and minus the entropy bonus when the job
        has them: all three aggregated over the decision's mask with one denominator."""
        loss = policy_loss(policy, decision, self.spec.loss_aggregation, denominator, self.spec.constant_tokens)
        mask = policy.mask_float if decision.mask is policy.mask else decision.mask
        terms = []
        if reference is not None and self.spec.kl_in == "loss":
            terms.append(self.kl_coef * kl_penalty(policy.logprobs, reference, self.spec.kl_estimator, mask))
        if self.spec.entropy_coef:
            terms.append(-self.spec.entropy_coef * entropy)
        if not terms:
            return loss
        return loss + aggregate_token_loss(sum(terms), mask, self.spec.loss_aggregation, denominator,
                                           self.spec.constant_tokens)

    @torch.no_grad()
    def _reference_logprobs(self, batch: TrainBatch, runs: list[micro_batches.MicroBatch]) -> Tensor | None:
        """[B, L-1] fp32 log-probs of the frozen reference, micro-batched like the policy's; None without a KL
        term. Every rank runs every micro-batch (ZeRO-3 gathers the reference's parameters in each forward)."""
        if self.spec.kl_coef <= 0:
            return None
        out = torch.zeros_like(batch.behaviour_logprobs)
        model = self.reference if self.reference is not None else self.engine.module  # LoRA: its adapter off
        for run in runs:
            rows, micro = run.rows, self._micro_batch(batch, run)
            with nullcontext() if self.reference is not None else model.disable_adapter():
                if run.packing is not None:
                    logprobs, _ = packed_token_logprobs(model, self.reference_head, micro, run.packing,
                                                        self.spec.temperature, False)
                elif self.reference_head is not None:
                    logprobs, _ = self.reference_head.token_logprobs(micro.input_ids, self.spec.temperature, False)
                else:
                    logprobs = token_logprobs(causal_logits(model, micro), micro.input_ids, self.spec.temperature)
            if rows is not None:
                out[rows, :micro.loss_mask.shape[1]] = logprobs
        return out

    def _kl_in_reward(self, batch: TrainBatch, reference: Tensor | None) -> tuple[TrainBatch, dict[str, Tensor]]:
        """With `kl in: reward`, the batch whose rewards lose coef x the sampled response's summed KL to the
        reference, from the behaviour log-probs the sampler recorded (known before the step, as verl's
        in-reward penalty uses the rollout's); otherwise the batch as it is."""
        if reference is None or self.spec.kl_in != "reward":
            return batch, {}
        penalty = self.kl_coef * sequence_kl(batch.behaviour_logprobs, reference, batch.loss_mask,
                                             self.spec.kl_estimator)
        shaped = replace(batch, rewards=batch.rewards - penalty)
        return shaped, {"rollout/kl_ref_penalty_mean": penalty.mean()}

    def _kl_metrics(self, batch: TrainBatch, logprobs: Tensor, reference: Tensor | None) -> dict[str, Tensor]:
        """The KL per loss token of the learner at the step's start to the reference, and the coefficient."""
        if reference is None:
            return {}
        tokens = kl_penalty(logprobs, reference, self.spec.kl_estimator, batch.loss_mask)
        return {"stability/kl_ref_mean": tokens.sum() / batch.loss_mask.sum().clamp(min=1),
                "stability/kl_ref_coef": self._scalar(self.kl_coef)}

    def _discard_step(self) -> None:
        """The engine's step on a poisoned gradient: ZeRO finds the non-finite norm and drops the gradient
        without an update. Anything else would train on it, so it is refused loudly."""
        self.engine.step()
        if self.engine.was_step_applied():
            raise RuntimeError(f"learner rank {self.rank}: DeepSpeed applied a step with a non-finite gradient")

    def _backward(self, loss: Tensor, logprobs: Tensor, sample_grads: SampleGradients | None,
                  loss_mask: Tensor) -> Tensor:
        """Gradients of the loss into the engine. DeepSpeed averages over ranks, so each rank's loss is
        its share of the global sum.

        With book-keeping the loss is sum_i k_i log pi(tau_i) (VCPO's weights and advantages are per
        sequence), so its gradient is sum_i k_i G_i of the kept per-sample gradients G_i; the engine's
        backward of <theta, that gradient> hands it to ZeRO's reduction without a pass through the model.
        Returns how far the token coefficients of a sequence differ (`sequence_coefficients`; 0 without
        book-keeping), for the caller to check once per step.
        """
        if sample_grads is None or sample_grads.parts is None:
            self.engine.backward(loss * self.world_size)
            return torch.zeros((), device=self.device)
        coefficients, gap = self._sequence_coefficients(loss, logprobs, loss_mask)
        self._backward_gradients(sample_grads.weighted_sum(coefficients))
        return gap

    def _backward_piece(self, step: StepValues, batch: TrainBatch, carried: CarriedGroup, loss: Tensor,
                        slope: Tensor, logprobs: Tensor, sample_grads: SampleGradients, loss_mask: Tensor) -> Tensor:
        """One piece of a group split across micro-batches. Its loss is loss(A) = loss(A0) - b * slope with A0
        the advantages at baseline 0 and b the group's baseline, known after its last piece: the engine
        takes the gradient of loss(A0) now, the score buffer the gradient of `slope`, and the last piece
        hands the engine -b times the buffer. Returns the larger coefficient gap of the two (see `_backward`)."""
        coefficients, gap = self._sequence_coefficients(loss, logprobs, loss_mask, keep_graph=True)
        slope_coefficients, slope_gap = self._sequence_coefficients(slope, logprobs, loss_mask)
        grads = sample_grads.weighted_sum(coefficients)
        slope_grads = sample_grads.weighted_sum(slope_coefficients, fp32=True)
        carried.add(len(loss_mask), slope_grads, slope.detach())
        if carried.complete:
            advantages, baseline = self._advantages(batch.rows(carried.rows), step.logprobs[carried.rows],
                                                    SampleGradients(step.squared_norms[carried.rows]))
            step.advantages[carried.rows], step.baseline[carried.rows] = advantages.float(), baseline.float()
            step.loss = step.loss - baseline[0].detach() * carried.slope_loss
            step.carried_groups += 1
            grads = carried.close(grads, baseline[0].detach())
        self._backward_gradients(grads)
        return torch.maximum(gap, slope_gap)

    def _sequence_coefficients(self, loss: Tensor, logprobs: Tensor, loss_mask: Tensor,
                               keep_graph: bool = False) -> tuple[Tensor, Tensor]:
        """[b] k_i of this rank's share of the global loss, sum_i k_i log pi(tau_i) (DeepSpeed averages), and
        how far its token coefficients differ within a sequence."""
        (token_coefficients,) = torch.autograd.grad(loss * self.world_size, logprobs, retain_graph=keep_graph)
        return sequence_coefficients(token_coefficients, loss_mask)

    def _backward_gradients(self, grads: dict[torch.nn.Parameter, Tensor]) -> None:
        """The engine's backward of <theta, grads>: hands `grads` to ZeRO's reduction without a model pass."""
        self.engine.backward(sum((param * grad).sum() for param, grad in grads.items()))

    def _advantages(self, batch: TrainBatch, logprobs: Tensor, sample_grads: SampleGradients | None
                    ) -> tuple[Tensor, Tensor | None]:
        """The stabilizer's own advantages (VCPO's baseline), else the job's estimator; with the baseline
        when one was formed. Only a baseline reads the log-probs, and it needs the per-sample norms."""
        log_w = ((logprobs.detach() - batch.behaviour_logprobs) * batch.loss_mask).sum(dim=1)
        lengths = batch.loss_mask.sum(dim=1).float()
        grad_sq_norms = None if sample_grads is None else sample_grads.squared_norms
        own = self.stabilizer.advantages(batch.rewards, log_w, grad_sq_norms, batch.group_ids, lengths)
        if own is None:
            return self.advantage_fn(batch.rewards, batch.group_ids), None
        if grad_sq_norms is None:
            return own, None
        return own, self.stabilizer.baseline(batch.rewards, log_w, grad_sq_norms, batch.group_ids, lengths)

    def _baseline_metrics(self, batch: TrainBatch, step: StepValues) -> dict[str, Tensor]:
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
            "opob/fallback_to_loop": self._scalar(self.grad_norm_fallback),
        }

    def _sample_gradients(self, batch: TrainBatch, logits: Tensor, bookkeeping: bool) -> SampleGradients:
        """||grad log pi(tau_i)||^2 of each of this micro-batch's sequences (with book-keeping, the per-sample
        gradients too); otherwise the graph stays for the loss backward."""
        if self.ghost_norms is not None and self.spec.zero_stage == 3:
            return SampleGradients(self._norms_forward(batch)[1])
        if self.ghost_norms is not None:
            logits_grad = sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, self.spec.temperature)
            if bookkeeping:
                return self.ghost_norms.sample_gradients(logits_grad)
            return SampleGradients(self.ghost_norms.squared_norms(logits_grad))
        return SampleGradients(self._per_sample_loop_norms(batch))

    def _per_sample_loop_norms(self, batch: TrainBatch) -> Tensor:
        def sample_logp(i: int) -> Tensor:  # the plain module: the engine's backward hooks stay out of it
            row = batch.rows(torch.tensor([i], device=self.device))
            row_logits = self._logits(row, plain=True)
            return (token_logprobs(row_logits, row.input_ids, self.spec.temperature) * row.loss_mask).sum()

        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        return per_sample_loop_norms(sample_logp, batch.size, params)

    def _norms_forward(self, batch: TrainBatch) -> tuple[Tensor, Tensor]:
        """A forward of its own for the per-sample norms, [B, L, V] logits (detached) and norms [B]. ZeRO-3's
        module hooks gather and release parameters per backward and need each backward to enter at the
        model's top, and the two-pass step has no loss backward to share a forward with."""
        if self.ghost_norms is None:
            with torch.no_grad():
                logits = self._logits(batch, plain=True)
            return logits, self._per_sample_loop_norms(batch)
        with self.ghost_norms.recording():
            logits = self._logits(batch, plain=True)
        logits_grad = sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, self.spec.temperature)
        return logits.detach(), self.ghost_norms.squared_norms(logits_grad, from_logits=True)

    def sft_step(self, batch: TrainBatch, learning_rate: float) -> dict[str, float]:
        """Supervised warm-up on demonstrations: token-mean cross-entropy of the completion tokens, in the
        same token-budget micro-batches as the RL step."""
        self.engine.train()
        batch = batch.to(self.device)
        plan = micro_batches.plan(batch.sequence_lengths, batch.group_ids, self.micro_batch_tokens,
                                  keep_groups=False, packed=self._packs())
        denominator = self.collectives.sum(batch.loss_mask.sum()).clamp(min=1)
        total = torch.zeros((), device=self.device)
        for run in self._agreed_runs(plan)[0]:
            micro = self._micro_batch(batch, run)
            logprobs, _ = self._token_logprobs(micro, with_entropy=False, packing=run.packing)
            loss = -(logprobs * micro.loss_mask).sum() / denominator
            self.engine.backward(loss * self.world_size)
            total = total + loss.detach()
        grad_norm = self._step_with_lr_scale(learning_rate / self.spec.learning_rate)
        metrics = {"sft/loss": total, "sft/grad_norm": self._scalar(grad_norm)}
        return self.collectives.reduce_metrics(metrics)

    def _token_logprobs(self, micro: TrainBatch, with_entropy: bool, packing: micro_batches.Packing | None = None
                        ) -> tuple[Tensor, Tensor | None]:
        """The policy's log-probs [b, L-1] fp32 of the micro-batch's next tokens and, `with_entropy`, its entropy
        at each position: through the fused output layer where the model has one (the bare module, whose
        parameters' gradients ZeRO reduces as the engine's would), else from the engine's logits; with the
        run's `packing`, from one forward of its rows without padding."""
        if packing is not None:
            return packed_token_logprobs(self.engine, self.fused_head, micro, packing, self.spec.temperature,
                                         with_entropy)
        if self.fused_head is not None:
            logprobs, entropy = self.fused_head.token_logprobs(micro.input_ids, self.spec.temperature, with_entropy)
            return logprobs, entropy if with_entropy else None
        logits = self._logits(micro)
        if with_entropy:
            return token_logprobs_and_entropy(logits, micro.input_ids, self.spec.temperature)
        return token_logprobs(logits, micro.input_ids, self.spec.temperature), None

    def _logits(self, batch: TrainBatch, plain: bool = False) -> Tensor:
        """[B, L, V] logits; `plain` runs the bare module, outside the engine's backward bookkeeping."""
        model = self.engine.module if plain else self.engine
        return causal_logits(model, batch)

    # ---- publishing and checkpoints (learner/publishing.py, learner/checkpoint.py) ------------------

    def publish_specs(self, dtype: str) -> list[TensorSpec]:
        """Name, whole shape and wire `dtype` of every published weight; no collective."""
        return self.publisher.specs(dtype)

    def published_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Each published weight, whole, one at a time (a collective under ZeRO-3: every rank iterates)."""
        return self.publisher.weights()

    def follow_publish(self) -> None:
        """A rank's part in rank 0's publishing (each parameter's gather under ZeRO-3)."""
        self.publisher.follow()

    def packed_weights_for_publish(self, dtype: str = "float32") -> PackedWeights | None:
        """The weights cast to `dtype` in one buffer for the generators (rank 0; None on the others)."""
        return self.publisher.packed(dtype)

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """`packed_weights_for_publish` as a name -> tensor dict (a copy; empty off rank 0)."""
        return self.publisher.state_dict()

    def save_model(self, folder: str) -> None:
        """The policy as a Hugging Face model folder that rank 0 writes; a collective under ZeRO-3."""
        checkpoint.save_model(self.publisher, self.spec.lora, self.spec.model_path, folder)

    def save_checkpoint(self, directory: str, tag: str) -> None:
        """Model, optimizer (each rank its ZeRO shard), policy version and RNG state; a collective."""
        client_state = {"version": self.version, "torch_rng": torch.get_rng_state(), "kl_coef": self.kl_coef}
        checkpoint.save_checkpoint(self.engine, directory, tag, self.rank, client_state)

    def load_checkpoint(self, directory: str, tag: str) -> int:
        """Restore what `save_checkpoint` wrote; returns the policy version. A collective."""
        client_state = checkpoint.load_checkpoint(self.engine, directory, tag, self.rank)
        self.version = int(client_state["version"])
        self.kl_coef = float(client_state.get("kl_coef", self.spec.kl_coef))
        torch.set_rng_state(client_state["torch_rng"])
        return self.version

    # ---- helpers -----------------------------------------------------------------------------

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

    def _finish(self, metrics: dict[str, Tensor], start: float, *, skipped: bool, loss: Tensor, lr_scale: float,
                grad_norm: float, batch: TrainBatch) -> dict[str, float]:
        metrics = dict(metrics)
        metrics["optim/loss"] = loss.detach() * self.world_size  # a share of the global loss; ranks average
        metrics["optim/grad_norm"] = self._scalar(grad_norm)
        metrics["stability/lr_scale"] = self._scalar(lr_scale)
        metrics["stability/skipped_step"] = self._scalar(skipped)
        metrics.setdefault("rollout/reward_mean", batch.rewards.mean())  # the task's, before any KL shaping
        metrics["rollout/response_len"] = batch.loss_mask.float().sum(1).mean()
        metrics["time/learner_step_s"] = self._scalar(time.perf_counter() - start)
        metrics["perf/learner_tokens_per_s"] = batch.attention_mask.sum() / metrics["time/learner_step_s"]
        return self.collectives.reduce_metrics(metrics, token_weight=batch.loss_mask.sum())

    def _scalar(self, value: float) -> Tensor:
        """A 0-dim fp32 tensor on this rank's device (a host tensor would cost a copy, or meet a device one)."""
        return torch.tensor(float(value), device=self.device)

    def _global_denominator(self, mask: Tensor) -> Tensor:
        """The loss denominator of `mask` summed over the ranks, so each rank's loss is its share of the global one."""
        return self.collectives.sum(loss_denominator(mask, self.spec.loss_aggregation, self.spec.constant_tokens))
