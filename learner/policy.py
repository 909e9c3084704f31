"""The models a step reads log-probs from: the policy (through the engine, its fused output layer or one packed
forward) and the frozen KL reference.

Apart from the passes (`learner/passes.py`) so that a pass asks for a micro-batch's log-probs and entropy and
gets them by the cheapest forward the model allows: no [tokens, vocabulary] logits where the fused output layer
serves (`learner/fused_head.py`), no padding where packing serves (`learner/packing.py`).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from learner.batch import TrainBatch, token_logprobs, token_logprobs_and_entropy
from learner.fused_head import FusedHead, fused_head, fused_logprobs_and_gradient
from learner.micro_batches import MicroBatch, Packing
from learner.packing import packed_head_forward, packed_logits, packed_token_logprobs, packing_support
from learner.spec import LearnerSpec
from learner.step import causal_logits, sub_batch
from learner.vcpo.output_layer import HeadGradient

log = logging.getLogger("stableasync.learner")


def fused_head_of(model: Any, spec: LearnerSpec, rank: int) -> FusedHead | None:
    """The model's fused output layer and log-softmax, or None (logged once) where its logits are kept: when the
    job says so (learner.fused_output_layer false), under ZeRO-3, where each rank holds a partition of the output
    layer's weight, and where the probe finds no fusion."""
    if spec.zero_stage == 3 or not spec.fused_output_layer:
        return None
    head, why = fused_head(model)
    if rank == 0:
        log.info("learner rank 0: %s", why)
    return head


def packs_micro_batches(models: list[Any], rank: int) -> bool:
    """Whether every one of `models` runs packed forwards (each one's attention is switched to its packed
    wrapper, which runs padded forwards as before); the answer logged once."""
    checks = [packing_support(model) for model in models]
    packs = all(supported for supported, _ in checks)
    if rank == 0:
        log.info(
            "learner rank 0: %s%s",
            "; ".join(why for ok, why in checks if not ok) or checks[0][1],
            "" if packs else ": padded micro-batches",
        )
    return packs


def load_frozen_model(path: str, dtype: torch.dtype, device: torch.device, zero3_config: dict[str, Any] | None) -> Any:
    """A frozen copy of the model at `path` (the KL reference). With `zero3_config` a DeepSpeed engine without an
    optimizer, so each rank keeps only its partition (as OpenRLHF's reference does); otherwise a plain copy on
    `device`, which costs one more set of weights and no optimizer state."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).requires_grad_(False)
    if zero3_config is None:
        return model.to(device).eval()
    import deepspeed

    frozen = {
        key: zero3_config[key]
        for key in ("train_micro_batch_size_per_gpu", "zero_optimization", "bf16", "steps_per_print")
    }
    engine, *_ = deepspeed.initialize(model=model, config=frozen)
    engine.eval()  # DeepSpeed's eval() returns None
    return engine


class PolicyForwards:
    """The policy's forwards as the passes ask for them: per-token log-probs and entropy of a micro-batch, or its
    [B, L, V] logits where a pass needs them (the per-sample norms start from the logits' gradient)."""

    def __init__(self, engine: Any, head: FusedHead | None, temperature: float) -> None:
        self.engine, self.head, self.temperature = engine, head, temperature

    def token_logprobs(
        self, micro: TrainBatch, with_entropy: bool, packing: Packing | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """The policy's log-probs [b, L-1] fp32 of the micro-batch's next tokens and, `with_entropy`, its entropy
        at each position: through the fused output layer where the model has one (the bare module, whose
        parameters' gradients ZeRO reduces as the engine's would), else from the engine's logits; with the
        run's `packing`, from one forward of its rows without padding."""
        if packing is not None:
            return packed_token_logprobs(self.engine, self.head, micro, packing, self.temperature, with_entropy)
        if self.head is not None:
            logprobs, entropy = self.head.token_logprobs(micro.input_ids, self.temperature, with_entropy)
            return logprobs, entropy if with_entropy else None
        logits = self.logits(micro)
        if with_entropy:
            return token_logprobs_and_entropy(logits, micro.input_ids, self.temperature)
        return token_logprobs(logits, micro.input_ids, self.temperature), None

    def head_forward(self, micro: TrainBatch, packing: Packing | None = None) -> tuple[Tensor, Tensor, HeadGradient]:
        """Through the fused output layer (the bare module, as `token_logprobs`): the log-probs and entropy
        [b, L-1] and the gradient of the masked log-prob sum at the logits, which VCPO's per-sample norms start
        from, without the [tokens, vocabulary] logits."""
        assert self.head is not None, "the caller checked that the model's output layer fuses"
        if packing is not None:
            return packed_head_forward(self.head, micro, packing, self.temperature)
        hidden = self.head.decoder(input_ids=micro.input_ids).last_hidden_state
        batch, length = micro.input_ids.shape
        rows = torch.arange(batch, device=hidden.device).repeat_interleave(length)
        return fused_logprobs_and_gradient(
            hidden, self.head.head.weight, micro.input_ids, micro.loss_mask, rows, self.temperature
        )

    def logits(self, batch: TrainBatch, plain: bool = False, packing: Packing | None = None) -> Tensor:
        """[B, L, V] logits, or with `packing` the rows' [1, N, V] without padding; `plain` runs the bare module,
        outside the engine's backward bookkeeping."""
        model = self.engine.module if plain else self.engine
        return causal_logits(model, batch) if packing is None else packed_logits(model, batch, packing)


class Reference:
    """The frozen policy the KL term measures against: a model of its own (`own_model`), or with LoRA, where
    `own_model` is None, the policy's `module` with its adapter switched off (no second copy)."""

    def __init__(self, own_model: Any | None, module: Any, head: FusedHead | None, temperature: float) -> None:
        self.own_model, self.head, self.temperature = own_model, head, temperature
        self.model = own_model if own_model is not None else module

    @property
    def module(self) -> Any:
        """The bare model (a ZeRO-3 engine's module), whose attention packing switches."""
        return getattr(self.model, "module", self.model)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, runs: list[MicroBatch]) -> Tensor:
        """[B, L-1] fp32 log-probs of the reference, micro-batched like the policy's. Every rank runs every
        micro-batch (ZeRO-3 gathers the reference's parameters in each forward)."""
        out = torch.zeros_like(batch.behaviour_logprobs)
        for run in runs:
            rows, micro = run.rows, sub_batch(batch, run)
            with nullcontext() if self.own_model is not None else self.model.disable_adapter():
                if run.packing is not None:
                    logprobs, _ = packed_token_logprobs(
                        self.model, self.head, micro, run.packing, self.temperature, False
                    )
                elif self.head is not None:
                    logprobs, _ = self.head.token_logprobs(micro.input_ids, self.temperature, False)
                else:
                    logprobs = token_logprobs(causal_logits(self.model, micro), micro.input_ids, self.temperature)
            if rows is not None:
                out[rows, : micro.loss_mask.shape[1]] = logprobs
        return out
