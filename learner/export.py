"""A run checkpoint's policy as a Hugging Face model folder, on one CPU process, with no Ray and no learner.

A checkpoint holds each learner rank's DeepSpeed ZeRO state; DeepSpeed's own `zero_to_fp32` merges the
shards (any ZeRO stage, any number of ranks) into full fp32 weights, which go into the job's model class
and are saved with its tokenizer: the same kind of folder a finished run leaves in `RUN_DIR/model`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from learner.checkpoint import check_owned_by_me, save_lora_model_folder, save_model_folder
from learner.lora import LoraSpec, with_lora


def save_checkpoint_model(
    learner_dir: Path, tag: str, base_model: str, folder: str, lora: LoraSpec | None = None
) -> None:
    """Write the policy of the checkpoint in `learner_dir` (DeepSpeed's save folder, state under `tag`) to
    `folder`; `base_model` is the job's model folder, for the architecture and the tokenizer. A LoRA run's
    checkpoint becomes the merged model, with its adapter alone in `folder/adapter`."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM

    check_owned_by_me(learner_dir / tag)  # DeepSpeed unpickles its checkpoint files
    weights = get_fp32_state_dict_from_zero_checkpoint(str(learner_dir), tag=tag)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    peft_model = with_lora(model, lora) if lora is not None else None
    missing, unexpected = (model if peft_model is None else peft_model).load_state_dict(weights, strict=False)
    prefix = "base_model.model." if peft_model is not None else ""  # peft's names of the base model's weights
    tied = {prefix + key for key in getattr(model, "_tied_weights_keys", None) or []}
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"checkpoint {learner_dir} does not fit the job's model {base_model}: "
            f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}"
        )
    if lora is None:  # and so no peft_model
        save_model_folder(model, base_model, folder)
    else:
        save_lora_model_folder(peft_model, lora, base_model, folder)
