"""A learner rank's checkpoints and model folders, and the storage rules they share.

Apart from `learner/rank.py` because `stableasync export` (`learner/export.py`) and the driver's checkpoint
code need them without a rank: a checkpoint folder is loaded only when this user alone owns it (DeepSpeed
unpickles it), and any failure to write comes out as an OSError, which the driver reads as storage trouble.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from learner.lora import ADAPTER_FOLDER, LoraSpec, adapter_weights, merged_state_dict, write_adapter_folder
from learner.publishing import Publisher


def check_owned_by_me(path: Path) -> None:
    """Refuse a checkpoint folder that holds anything another user owns or can write: loading it unpickles
    its files, and a pickle can run code."""
    for item in [path, *path.rglob("*")]:
        info = item.lstat()
        if info.st_uid != os.getuid():
            raise PermissionError(
                f"refusing to load checkpoint {path}: {item} belongs to another user (uid {info.st_uid})"
            )
        if info.st_mode & 0o002:
            raise PermissionError(f"refusing to load checkpoint {path}: {item} is writable by every user")


@contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Any failure while writing `what` comes out as an OSError, which the driver treats as storage trouble
    (an alert for a checkpoint, a reported model error): a full disk surfaces from torch.save as a
    RuntimeError ("unexpected pos") and from safetensors as a SafetensorError, neither an OSError."""
    try:
        yield
    except OSError:
        raise
    except Exception as error:
        raise OSError(f"writing {what} failed: {type(error).__name__}: {error}") from error


def save_model_folder(
    model: Any, tokenizer_source: str, folder: str, state_dict: dict[str, Tensor] | None = None
) -> None:
    """`model` (or its config with `state_dict`) and the tokenizer of `tokenizer_source` as a Hugging Face
    folder that transformers and vLLM load as it is; any failure to write it is an OSError (`storage_errors`)."""
    from transformers import AutoTokenizer

    with storage_errors(f"the model folder {folder}"):
        model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)
    if not (Path(folder) / "config.json").is_file() or not any(Path(folder).glob("*.safetensors")):
        # save_pretrained only logs, and returns, when `folder` is not a directory it can use
        raise NotADirectoryError(f"{folder}: save_pretrained wrote no config.json and weights there")


def save_lora_model_folder(peft_model: Any, lora: LoraSpec, base_model: str, folder: str) -> None:
    """A LoRA policy as the merged model folder, with its adapter alone in `folder/adapter`: what a run saves
    and what `stableasync export` writes from a checkpoint."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    save_model_folder(base, base_model, folder, merged_state_dict(peft_model))
    with storage_errors(f"the adapter in {folder}"):
        tensors = {name: t.detach().to("cpu", torch.float32) for name, t in adapter_weights(peft_model).items()}
        write_adapter_folder(tensors, lora, base_model, Path(folder) / ADAPTER_FOLDER)


def save_model(publisher: Publisher, lora: LoraSpec | None, model_path: str, folder: str) -> None:
    """The policy of `publisher`'s rank as a Hugging Face model folder (config, safetensors, the tokenizer of
    `model_path`) that transformers and vLLM load as they are; rank 0 writes it. A collective under ZeRO-3,
    which gathers the parameters."""
    module, rank = publisher.module, publisher.rank
    if lora is not None:  # the merged model, with the adapter alone beside it
        if rank == 0:
            save_lora_model_folder(module, lora, model_path, folder)
        return
    if publisher.zero_stage != 3:
        if rank == 0:
            save_model_folder(module, model_path, folder)
        return
    # one parameter gathered at a time; rank 0 copies each to host memory, so no rank holds the model
    if rank != 0:
        publisher.follow()
        return
    state = {name: tensor.to("cpu", copy=True) for name, tensor in publisher.weights()}
    save_model_folder(module, model_path, folder, state)


def save_checkpoint(engine: Any, directory: str, tag: str, rank: int, client_state: dict[str, Any]) -> None:
    """The engine's model and optimizer (each rank its ZeRO shard) with `client_state` under `directory/tag`;
    a collective."""
    with storage_errors(f"learner rank {rank}'s checkpoint to {directory}"):
        engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)


def load_checkpoint(engine: Any, directory: str, tag: str, rank: int) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote into the engine (model, optimizer, LR scheduler) once this user
    alone owns the folder; returns its client state. A collective."""
    path = Path(directory) / tag
    check_owned_by_me(path)  # DeepSpeed unpickles its checkpoint files
    loaded, client_state = engine.load_checkpoint(
        directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise FileNotFoundError(f"learner rank {rank}: no checkpoint in {path}")
    return dict(client_state)
