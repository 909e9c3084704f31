"""One DeepSpeed ZeRO learner rank: the facade that `cluster/` runs one of per Ray actor.

A plain class that sets the rank up (the engine, the KL reference, the micro-batch budget) and hands the work
on: the steps' passes to `LearnerStep` (`learner/passes.py`, with the forwards of `learner/policy.py` and VCPO's
per-sample norms of `learner/vcpo/step.py`), publishing to `Publisher` (`learner/publishing.py`) and checkpoints
to `learner/checkpoint.py`. Every rank of a group runs every collective method (`train_step`, `sft_step`,
`state_dict_for_publish`, ...) with its own share of the prompt groups.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from algorithms import registry
from learner import checkpoint, memory_budget
from learner.batch import TrainBatch
from learner.collectives import Collectives
from learner.compiled_layers import compile_decoder_layers, refuse_with_sample_norms
from learner.lora import with_lora
from learner.models import without_dropout
from learner.passes import LearnerStep
from learner.policy import PolicyForwards, Reference, fused_head_of, load_frozen_model, packs_micro_batches
from learner.publishing import Publisher
from learner.spec import LearnerSpec
from learner.vcpo.step import PerSampleNorms
from learner.weight_sync import PackedWeights, TensorSpec

__all__ = ["LearnerRank", "LearnerSpec"]

log = logging.getLogger("stableasync.learner")


def engine_config(spec: LearnerSpec) -> dict[str, Any]:
    """The DeepSpeed config of a rank's engine: AdamW under ZeRO `spec.zero_stage`, any number of micro-batches
    per step."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        # each backward accumulates; step() is the boundary, so a step may take any number of micro-batches
        "managed_gradient_accumulation": False,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": spec.learning_rate,
                "weight_decay": spec.weight_decay,
                "eps": spec.adam_eps,
                "torch_adam": True,
            },
        },
        "zero_optimization": {"stage": spec.zero_stage},
        "gradient_clipping": spec.grad_clip,
        "bf16": {"enabled": spec.dtype == "bfloat16"},
        "steps_per_print": 10**9,
    }


class LearnerRank:
    """A ZeRO data-parallel rank of the policy."""

    # long: the rank's parts in the order each needs the one before: engine, head, budget, norms, step
    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM

        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK="0" if spec.backend == "gloo" else os.environ.get("LOCAL_RANK", "0"),
        )
        deepspeed.init_distributed(dist_backend=spec.backend)
        torch.manual_seed(spec.seed)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.dtype = torch.float32 if spec.dtype == "float32" else torch.bfloat16
        self.config = engine_config(spec)
        if spec.zero_stage == 3:
            # transformers loads under DeepSpeed's ZeRO-3 init while this object lives: each rank keeps only
            # its partition of every parameter, instead of the whole model before the engine partitions it
            from transformers.integrations import HfDeepSpeedConfig

            self._zero3_load = HfDeepSpeedConfig(self.config)
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=self.dtype)
        if spec.lora is not None:  # the base weights stay frozen: no gradients and no optimizer state for them
            model = with_lora(model, spec.lora)
        if without_dropout(model) and rank == 0:  # one function for a step's log-probs, ratios and passes
            log.info("learner rank 0: dropout set to 0 in the policy's forwards")
        if spec.gradient_checkpointing:  # activations recomputed in the backward, layer by layer
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=self.config
        )
        self.device = self.engine.device
        self.collectives = Collectives(world_size, self.device)
        self.publisher = Publisher(self.engine.module, spec.lora is not None, spec.zero_stage, rank)
        # no [tokens, vocabulary] logits where the output layer fuses with the log-softmax (whole weights: not ZeRO-3)
        self.forwards = PolicyForwards(self.engine, fused_head_of(self.engine.module, spec, rank), spec.temperature)
        self.micro_batch_budget = memory_budget.resolve(
            spec, self.engine, self.device, rank, world_size, fused_head=self.forwards.head is not None
        )
        self.micro_batch_tokens = self.micro_batch_budget.tokens  # padded tokens per forward; None: the whole batch
        self.stabilizer = registry.from_config(spec.stabilizer_name, spec.stabilizer_config)
        if spec.compiled_layers is not None:
            refuse_with_sample_norms(self.stabilizer)
            compile_decoder_layers(self.engine.module, spec.compiled_layers, rank)
        self.norms = (
            PerSampleNorms(
                spec,
                self.engine,
                self.stabilizer,
                self.forwards,
                self.collectives,
                self.micro_batch_budget.kept_gradients,
                rank,
            )
            if self.stabilizer.needs_grad_norms
            else None
        )
        reference = self._reference(spec.reference_path or spec.model_path) if spec.kl_coef > 0 else None
        # decided once, after the reference exists: each model's attention gets its packed wrapper
        own_reference = [] if reference is None or reference.own_model is None else [reference.module]
        packs = spec.packed_micro_batches and packs_micro_batches([self.engine.module, *own_reference], rank)
        self.step = LearnerStep(
            spec,
            self.engine,
            self.optimizer,
            self.collectives,
            self.stabilizer,
            self.forwards,
            reference,
            self.norms,
            self.micro_batch_tokens,
            packs,
            rank,
        )

    def _reference(self, path: str) -> Reference:
        """The frozen policy the KL term measures against, loaded from `path` a second time (a collective under
        ZeRO-3, where each rank keeps its partition); with LoRA the policy with its adapter switched off."""
        if self.spec.lora is not None:
            return Reference(None, self.engine.module, self.forwards.head, self.spec.temperature)
        model = load_frozen_model(path, self.dtype, self.device, self.config if self.spec.zero_stage == 3 else None)
        return Reference(model, self.engine.module, fused_head_of(model, self.spec, self.rank), self.spec.temperature)

    def load_reference(self, folder: str) -> None:
        """The KL reference from `folder` (the policy as RL starts, which the driver wrote after the warm-up),
        in place of the one loaded at start-up; a collective under ZeRO-3. Nothing to load without a KL term or
        with LoRA, whose reference is the policy without its adapter."""
        if self.spec.kl_coef > 0 and self.spec.lora is None:
            self.step.use_reference(self._reference(folder))

    # ---- the steps (learner/passes.py) ---------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One RL step on this rank's groups, in token-budget micro-batches (`LearnerStep.train`); metrics averaged
        over ranks."""
        return self.step.train(batch)

    def sft_step(self, batch: TrainBatch, learning_rate: float) -> dict[str, float]:
        """Supervised warm-up on demonstrations at `learning_rate` (`LearnerStep.sft`)."""
        return self.step.sft(batch, learning_rate)

    def sequence_log_ratios(self) -> list[float]:
        """sum_t log pi_learner - log pi_behaviour of each row of the latest train_step's batch, in its order."""
        return self.step.last_sequence_log_ratios.tolist()

    @property
    def version(self) -> int:
        """The policy version: one per step (RL or SFT) since the start, or since the checkpoint loaded."""
        return self.step.version

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
        client_state = {
            "version": self.step.version,
            "rl_steps": self.step.rl_steps,
            "torch_rng": torch.get_rng_state(),
            "kl_coef": self.step.kl_coef,
        }
        checkpoint.save_checkpoint(self.engine, directory, tag, self.rank, client_state)

    def load_checkpoint(self, directory: str, tag: str) -> int:
        """Restore what `save_checkpoint` wrote; returns the policy version. A collective."""
        client_state = checkpoint.load_checkpoint(self.engine, directory, tag, self.rank)
        self.step.version = int(client_state["version"])
        # a checkpoint from before the count was kept: its version, which counted SFT steps too
        self.step.rl_steps = int(client_state.get("rl_steps", self.step.version))
        self.step.kl_coef = float(client_state.get("kl_coef", self.spec.kl_coef))
        torch.set_rng_state(client_state["torch_rng"])
        return self.step.version
