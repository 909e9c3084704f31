"""What a learner rank needs from the job, as plain values: the driver builds a `LearnerSpec` from the job file
and every rank builds its engine, budget and step from it (the job schema stays on the driver)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from algorithms.config import LossAggregation
from learner.lora import LoraSpec
from learner.lr_schedule import LRSchedule


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
    stabilizer_config: Any = None  # the job's validated config dataclass of the stabilizer (None: its defaults)
    advantage: str = "grpo"
    loss_aggregation: LossAggregation = "token-mean"
    constant_tokens: int | None = None
    dtype: str = "float32"
    seed: int = 0
    backend: str = "gloo"
    # tokens per forward (real tokens packed, rows x longest row padded); "auto": what the rank's free memory
    # holds (learner/memory_budget.py); None: the rank's batch at once
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
    # each micro-batch's rows as one sequence without padding (learner/packing.py), its budget counting real tokens
    packed_micro_batches: bool = True
    # the output layer and log-softmax by chunks, no [tokens, vocabulary] logits (learner/fused_head.py)
    fused_output_layer: bool = True
    # each decoder layer compiled in place with this torch.compile backend (learner/compiled_layers.py); None: eager
    compiled_layers: str | None = None

    @property
    def token_terms(self) -> bool:
        """Whether the loss has terms besides the policy gradient whose token coefficients differ within a
        sequence (a KL term, an entropy bonus): book-keeping, which forms whole-sequence gradients, cannot
        carry them."""
        return (self.kl_coef > 0 and self.kl_in == "loss") or self.entropy_coef > 0
