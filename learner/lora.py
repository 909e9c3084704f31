"""LoRA training with `peft`: only adapter weights train, and only adapter weights travel to the generators.

The learner wraps the policy in a peft model; the generators hold the base model and load each policy
version's adapter through vLLM's LoRA support (`actors/generator.py`). A run's saved model is the merged
model (what transformers and vLLM load as they are) with the adapter beside it in `adapter/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ADAPTER_FOLDER = "adapter"  # inside a saved model folder: the adapter alone (peft's layout)
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSpec:
    """The adapter's shape, as plain values (the job's model.lora)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    def peft_config(self) -> Any:
        from peft import LoraConfig

        # peft annotates lora_alpha as an int, but it is the numerator of a float scale (alpha / r): a fraction works
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,  # type: ignore[arg-type]
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            task_type="CAUSAL_LM",
        )


def with_lora(model: Any, spec: LoraSpec) -> Any:
    """`model` wrapped in a peft model whose adapter weights are the only trainable parameters (B starts at 0, so
    the wrapped policy is the base model until it trains)."""
    from peft import get_peft_model

    return get_peft_model(model, spec.peft_config())


def adapter_weights(peft_model: Any) -> dict[str, Tensor]:
    """The adapter's tensors under the names peft saves them with (and vLLM's LoRA loader reads); views."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model)


def write_adapter_folder(tensors: dict[str, Tensor], spec: LoraSpec, base_model: str, folder: str | Path) -> Path:
    """An adapter folder (peft's config and safetensors) from the published tensors: what vLLM's LoRARequest and
    peft's PeftModel.from_pretrained load."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / ADAPTER_WEIGHTS))
    config = spec.peft_config().to_dict()
    config["base_model_name_or_path"] = base_model
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder


def merged_state_dict(peft_model: Any) -> dict[str, Tensor]:
    """The base model's weights with the adapter merged in (W + scale B A), under the base model's names, on the
    host; the peft model itself is left as it was."""
    merged: dict[str, Tensor] = {}
    base = peft_model.get_base_model()
    lora_layers = {name: module for name, module in base.named_modules() if hasattr(module, "get_delta_weight")}
    for name, param in base.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if ".lora_" in name:
            continue
        layer_name = owner.removesuffix(".base_layer")
        layer = lora_layers.get(layer_name)
        value = param.detach().to("cpu", torch.float32, copy=True)
        if layer is not None and owner.endswith(".base_layer") and leaf == "weight":
            for adapter in layer.active_adapters:
                value += layer.get_delta_weight(adapter).detach().to("cpu", torch.float32)
        merged[layer_name + "." + leaf if owner.endswith(".base_layer") else name] = value
    return merged


def missing_target_modules(config: Any, target_modules: tuple[str, ...]) -> list[str]:
    """The names in `target_modules` that match no linear layer of the model of `config` (a transformers config,
    or a model folder or hub id to read one from), built on the meta device, so nothing is loaded: peft would
    refuse them only once the learner starts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, str):
        config = AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    leaves = {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    return [target for target in target_modules if target not in leaves]
