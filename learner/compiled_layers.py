"""Regional compilation: each decoder layer of the policy compiled in place (`learner.compile: layers`).

A small model's step is bound by the host: every elementwise op, view and matmul of a layer's forward and backward
is an operator call the host makes while the GPU waits. `torch.compile` of a layer fuses its norms, rotary
embedding, activation and residual adds into a few kernels, and since every layer of a decoder runs the same
code, one compiled graph serves them all (its weights are inputs): compile time is a layer's, not the model's.

Compiled in place (`nn.Module.compile`), so parameter names, state dicts, checkpoints and published weights are
as before. Shapes are dynamic from the first call: a packed micro-batch's token count changes every step. The
packed attention runs outside the graph (`learner.packing` marks it), since the rows' lengths it takes are
Python numbers that would specialise a graph per micro-batch.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from algorithms.errors import StableAsyncError
from algorithms.stabilizer import Stabilizer

log = logging.getLogger("stableasync.learner")

COMPILE_BACKENDS = ("inductor", "aot_eager")  # aot_eager: traced and differentiated, no kernels generated


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules whose class transformers names as the model's unit that must not
    be split across devices (`_no_split_modules`: `LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...)."""
    unit_names = set(getattr(model, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in unit_names]


def refuse_with_sample_norms(stabilizer: Stabilizer) -> None:
    """Compiled layers and per-sample gradient norms do not go together: the norms hook every linear layer anew
    for each micro-batch, and a compiled layer would be compiled again for each until torch gives up on it."""
    if stabilizer.needs_grad_norms:
        raise StableAsyncError(
            f"learner.compile: layers cannot run with algorithm.stabilizer {stabilizer.name!r}, whose per-sample "
            "gradient norms hook each linear layer per micro-batch; set learner.compile: none"
        )


def compile_decoder_layers(model: Any, backend: str, rank: int) -> int:
    """Compiles each of `model`'s decoder layers in place with `backend`, dynamic shapes from the first call;
    how many it compiled (0: the model has no layers transformers names, and runs as it is)."""
    if backend not in COMPILE_BACKENDS:
        raise StableAsyncError(f"learner.compile_backend: {backend!r} is not one of {', '.join(COMPILE_BACKENDS)}")
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, dynamic=True)
    if rank == 0:
        log.info(
            "learner rank 0: %s",
            f"{len(layers)} decoder layers compiled ({backend})"
            if layers
            else f"{type(model).__name__} names no decoder layer (_no_split_modules): nothing compiled",
        )
    return len(layers)
