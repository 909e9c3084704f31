"""Published model architectures with random weights, for the learner benchmarks on a machine that cannot
download weights (a lent GPU has no network).

A learner step's time and memory depend on the model's shapes, not on its weights, so a model built from the
published configuration numbers measures what the real one would. `model_folder` saves one as a model folder
(config and safetensors, no tokenizer: the benchmarks draw token ids at random) that LearnerRank loads like
any other, cached per name, dtype and transformers version.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# name -> (transformers model type, its config's values), from each model's published config.json
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": (
        "llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        ),
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "qwen2.5-7b": (
        "qwen2",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformers_config(name: str):  # -> transformers.PretrainedConfig
    """The named architecture's transformers config; an unknown name is a ValueError naming the known ones."""
    from transformers import AutoConfig

    if name not in ARCHITECTURES:
        raise ValueError(
            f"no model config named {name!r}: choose from {', '.join(ARCHITECTURES)}, or give a model folder"
        )
    model_type, values = ARCHITECTURES[name]
    return AutoConfig.for_model(model_type, **values)


def parameter_count(name: str) -> int:
    """The named model's parameters (tied embeddings once), counted on the meta device: no memory for them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(name))
    return sum(parameter.numel() for parameter in model.parameters())


def model_folder(name_or_path: str, dtype: str) -> str:
    """A model folder for a named architecture (random weights in `dtype`, built once into the cache, on the
    GPU when there is one: initialising billions of weights is slow on CPU), or an existing folder unchanged."""
    if name_or_path not in ARCHITECTURES:
        if (Path(name_or_path) / "config.json").is_file():
            return str(Path(name_or_path).resolve())
        transformers_config(name_or_path)  # raises, naming the known configs
    import transformers

    from learner.models import atomic_build, default_cache

    def build(folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(transformers_config(name_or_path), dtype=DTYPES[dtype])
        model.save_pretrained(folder)
        del model
        torch.cuda.empty_cache()  # the benchmark's own processes measure this GPU's memory

    model_type, values = ARCHITECTURES[name_or_path]
    params = {"model_type": model_type, "config": values, "dtype": dtype, "transformers": transformers.__version__}
    return str(atomic_build(default_cache() / "models" / f"random-{name_or_path}-{dtype}", params, build))


def benchmark_model(
    parser: Any, model_config: str | None, dtype: str, fallback: Callable[[], str]
) -> tuple[str, str, int]:
    """The model a learner benchmark measures: `--model-config`'s folder (a bad name is the parser's usage
    error), else `fallback()`'s; with how to name it in the printed header, and its vocabulary size."""
    from transformers import AutoConfig

    if model_config:
        try:
            path = model_folder(model_config, dtype)
        except ValueError as error:
            parser.error(f"--model-config: {error}")
        label = f"{model_config} (random weights, {path})" if model_config in ARCHITECTURES else path
    else:
        label = path = fallback()
    return path, label, AutoConfig.from_pretrained(path).vocab_size
