"""The published architectures the GPU benchmarks build with random weights (benchmarks/model_configs.py): their
sizes match the model cards, every value reaches the transformers config (which accepts misspelt keys
silently), and the folder they save loads as LearnerRank loads a model."""

from __future__ import annotations

import json

import pytest
import torch

# name -> (parameters, parameters besides the embeddings), as the model cards give them
PUBLISHED_PARAMETERS = {
    "smollm2-135m": (134.5e6, None),
    "qwen2.5-1.5b": (1.54e9, 1.31e9),
    "qwen2.5-7b": (7.61e9, 6.53e9),
}
TINY = (
    "llama",
    dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_each_named_config_has_its_published_parameter_count(name):
    """Counted on the meta device (7B parameters, no memory): a wrong layer count, width or tying is off by
    several percent, which these tolerances do not allow."""
    from benchmarks import model_configs

    assert set(PUBLISHED_PARAMETERS) == set(model_configs.ARCHITECTURES)  # every config has its card's count
    total, besides_embeddings = PUBLISHED_PARAMETERS[name]
    config = model_configs.transformers_config(name)
    count = model_configs.parameter_count(name)
    assert count == pytest.approx(total, rel=0.003)
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    if besides_embeddings is not None:
        assert count - embeddings == pytest.approx(besides_embeddings, rel=0.003)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_every_value_of_a_named_config_reaches_the_transformers_config(name):
    from benchmarks import model_configs

    model_type, values = model_configs.ARCHITECTURES[name]
    config = model_configs.transformers_config(name)
    assert config.model_type == model_type
    for key, value in values.items():
        read_back = getattr(config, key)
        if isinstance(value, dict):
            assert value.items() <= read_back.items(), key
        else:
            assert read_back == value, key
    assert config.hidden_size // config.num_attention_heads == {"smollm2-135m": 64}.get(name, 128)  # head_dim


def test_an_unknown_name_is_refused_naming_the_known_ones(tmp_path):
    from benchmarks import model_configs

    for call in (
        lambda: model_configs.transformers_config("qwen3-8b"),
        lambda: model_configs.model_folder("qwen3-8b", "bfloat16"),
        lambda: model_configs.model_folder(str(tmp_path), "float32"),
    ):  # a folder without config.json
        with pytest.raises(ValueError, match=r"choose from smollm2-135m, qwen2.5-1.5b, qwen2.5-7b"):
            call()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_built_folder_loads_as_the_learner_loads_it_and_is_built_once(tmp_path, monkeypatch, dtype):
    """A tiny architecture in place of a real one: the same builder, seconds instead of minutes."""
    from transformers import AutoModelForCausalLM

    from benchmarks import model_configs

    monkeypatch.setitem(model_configs.ARCHITECTURES, "tiny-test", TINY)
    monkeypatch.setenv("STABLEASYNC_CACHE", str(tmp_path))
    expected = tmp_path / "models" / f"random-tiny-test-{dtype}"
    folder = model_configs.model_folder("tiny-test", dtype)
    assert folder == str(expected)
    built = {path.name: path.stat().st_mtime_ns for path in expected.iterdir()}
    assert model_configs.model_folder("tiny-test", dtype) == folder  # cached: nothing rewritten
    assert {path.name: path.stat().st_mtime_ns for path in expected.iterdir()} == built
    assert json.loads((expected / "config.json").read_text())["dtype"] == dtype

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.rope_parameters["rope_theta"] == 100000.0 and model.config.tie_word_embeddings
    assert model_configs.model_folder(folder, dtype) == folder  # a model folder is used as it is
