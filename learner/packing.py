"""Padding-free forwards: a micro-batch's rows run as one sequence, without the padding a right-padded batch
carries, and each row's log-probs come back in the micro-batch's [b, width - 1] layout.

The rows are laid end to end (`learner.micro_batches.Packing`, formed with the plan), position ids restart at
0 in each row, and attention stays within a row:

- `flash_attention_2`/`_3`: transformers' varlen kernels, given the rows' `cu_seq_lens` and longest row.
- `sdpa` (the default, on the CPU and on a GPU without flash-attn), through an attention function of its own:
  on a GPU in bf16/fp16, PyTorch's own varlen kernel (`torch.nn.attention.varlen.varlen_attn`, flash
  attention over the rows' `cu_seq_lens`, grouped-query heads as they are, `enable_gqa` where the PyTorch
  asks for it) in one call per layer, which meta tensors trace on any machine;
  elsewhere `rows_sdpa`, SDPA's causal kernel once per layer on the rows laid out as a right-padded batch
  (gathered from the packed sequence and back). Every row attends to itself alone, and no [N, N] mask is
  built or computed (a document mask would cost attention over the whole micro-batch). A loop over the rows
  made one call per row and layer: on an H200 5-8 ms per layer against about 1 ms for the varlen kernel, for
  16 rows of 512-1024 tokens; on the CPU a fifth of a SmolLM2 step's operator calls.

The model's mask is passed ready-made (None for each layer type), so transformers neither builds one nor
reads the position ids on the host to find the rows (`find_packed_sequence_indices` does), and the step's
micro-batch loop still reads nothing from the device. A model that does not route its attention through
transformers' attention functions, or uses sliding-window layers, keeps padded rows (`packing_support`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from algorithms.errors import StableAsyncError
from learner.batch import TrainBatch, token_logprobs, token_logprobs_and_entropy
from learner.fused_head import FusedHead, fused_logprobs_and_gradient, fused_token_logprobs
from learner.micro_batches import Packing
from learner.vcpo.output_layer import HeadGradient

PACKED = "stableasync_packed_"  # + the model's own attention implementation: its packed wrapper's name
VARLEN = ("sdpa", "flash_attention_2", "flash_attention_3")
FLASH = ("flash_attention_2", "flash_attention_3")


def rows_sdpa(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    row_spans: Tensor,
    row_places: Tensor,
    longest: int,
    dropout: float,
    scaling: float | None,
) -> Tensor:
    """SDPA's causal kernel on the packed [1, heads, N, head_dim] query, key and value laid out as one right-padded
    batch of rows `longest` tokens wide (`Packing.row_spans`, `row_places`), [1, N, heads, head_dim] as
    transformers' attention functions return. A row's real positions see none of its padding (it comes after
    them), and the padding's outputs are dropped, so they take no gradient: each row attends to itself alone, in
    one kernel call per layer."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def in_rows(packed: Tensor) -> Tensor:  # [1, h, N, d] -> [b, h, longest, d]
        heads, head_dim = packed.shape[1], packed.shape[3]
        return packed[0].index_select(1, row_spans).view(heads, -1, longest, head_dim).transpose(0, 1)

    output = sdpa_attention_forward(
        module, in_rows(query), in_rows(key), in_rows(value), None, dropout=dropout, scaling=scaling, is_causal=True
    )[0]  # [b, longest, heads, head_dim]
    return output.flatten(0, 1).index_select(0, row_places).unsqueeze(0)


VARLEN_DEVICES = ("cuda", "meta")  # meta: shapes only, through the same Python layer and the op's fake kernel


def varlen_serves(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether PyTorch's varlen flash kernel serves a packed attention: CUDA (or meta, whose tensors trace the
    CUDA path on any machine) in bf16/fp16 with head_dim up to 256, in a PyTorch that has the kernel."""
    return (
        device_type in VARLEN_DEVICES
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim <= 256
        and _varlen_kernel() is not None
    )


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., Any], bool] | None:
    """`torch.nn.attention.varlen.varlen_attn` and whether it takes `enable_gqa` (torch 2.13 does, and refuses
    grouped-query heads without it; torch 2.11 has no such keyword and takes them as they are); None before it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_length: int, scaling: float | None
) -> Tensor:
    """Causal attention within each row of the packed [1, heads, N, head_dim] query and [1, kv_heads, N, head_dim]
    key and value in one varlen call, [1, N, heads, head_dim]; grouped-query heads (kv_heads < heads) pass as they
    are, with `enable_gqa` where the PyTorch asks for it. The caller has checked `varlen_serves`."""
    kernel = _varlen_kernel()
    assert kernel is not None, "varlen_serves said the kernel serves"
    varlen_attn, takes_gqa = kernel
    grouped = {"enable_gqa": True} if takes_gqa and key.shape[1] != query.shape[1] else {}
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, heads, head_dim]
    causal = (-1, 0)  # every position sees all before it in its row and none after
    output = varlen_attn(
        q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, scale=scaling, window_size=causal, **grouped
    )
    assert isinstance(output, Tensor)  # without return_aux: the output alone
    return output.unsqueeze(0)


def varlen_sdpa(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_length: int, scaling: float | None
) -> Tensor | None:
    """`varlen_attention` where the varlen kernel serves (`varlen_serves`), else None (then `rows_sdpa`)."""
    if not varlen_serves(query.device.type, query.dtype, query.shape[-1]):
        return None
    return varlen_attention(query, key, value, cu_seqlens, max_length, scaling)


def _packed_attention(implementation: str) -> Callable[..., tuple[Tensor, Any]]:
    """The model's own attention function `implementation`, and for a packed forward (`packed_longest` given)
    the same attention within each row: flash's varlen kernel on the rows' `cu_seq_lens`, or `rows_sdpa`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attention(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        packed_longest: int | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Any]:
        own = ALL_ATTENTION_FUNCTIONS[implementation]
        if packed_longest is None:  # a padded forward: the model's attention as it was
            return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if implementation in FLASH:  # the cu_seq_lens and longest row in kwargs: transformers' varlen path
            return own(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
        if not dropout and "cu_seq_lens_q" in kwargs:
            output = varlen_sdpa(query, key, value, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scaling)
            if output is not None:
                return output, None
        spans, places = kwargs["packed_row_spans"], kwargs["packed_row_places"]
        return rows_sdpa(module, query, key, value, spans, places, packed_longest, dropout, scaling), None

    # outside any compiled layer's graph (learner/compiled_layers.py): the rows' lengths are Python numbers, which
    # would specialise a graph per micro-batch
    return torch.compiler.disable(attention)


def _base_model(model: Any) -> Any:
    """The transformers model under a DeepSpeed engine (its `.module`) and a peft wrapper (the adapted model)."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def packing_support(model: Any) -> tuple[bool, str]:
    """Whether the model's packed forwards give its padded log-probs, and why not. A supported model's attention
    is switched to `_packed_attention` of its own (registered with transformers), which runs padded forwards
    exactly as before (the same function and masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = _base_model(model)
    config = getattr(base, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    can_set = getattr(type(base), "_can_set_attn_implementation", None)
    if config is None or can_set is None or not can_set():
        return False, f"{type(base).__name__} does not call its attention through transformers' AttentionInterface"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"]):
        return False, f"{type(base).__name__} has sliding-window layers (layer_types)"
    if isinstance(implementation, str) and implementation.startswith(PACKED):
        return True, f"packed micro-batches (attention: {implementation[len(PACKED) :]} within each row)"
    if implementation not in VARLEN:
        return False, f"attention {implementation!r} has no varlen path here (sdpa and flash_attention_2/3 have)"
    AttentionInterface.register(PACKED + implementation, _packed_attention(implementation))
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED + implementation, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    config._attn_implementation = PACKED + implementation
    return True, f"packed micro-batches (attention: {implementation} within each row)"


class UnpackedAttention(StableAsyncError, RuntimeError):
    """A packed forward of a model whose attention `packing_support` did not switch: its own attention would
    take the placeholder mask as attend-everywhere, and every row would see the others."""


def _attention_kwargs(model: Any, packing: Packing) -> dict[str, Any]:
    """The model's keyword arguments for a packed forward: position ids, the rows for the attention function,
    and a placeholder 4D mask, which transformers passes on as it is instead of building one (and reading the
    position ids on the host to find the rows, as `find_packed_sequence_indices` does). `model` (a DeepSpeed
    engine, a peft or transformers model) must run the packed attention wrapper."""
    base = _base_model(model)
    implementation = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if not (isinstance(implementation, str) and implementation.startswith(PACKED)):
        raise UnpackedAttention(
            f"a packed forward of {type(base).__name__}, whose attention is {implementation!r}, would attend across "
            "rows: learner.packing.packing_support(model) switches it to the packed wrapper (or run padded rows)"
        )
    device = packing.position_ids.device
    return {
        "position_ids": packing.position_ids,
        "use_cache": False,
        # the longest row, not each row's length: a compiled layer (learner/compiled_layers.py) would guard on
        # how many rows a tuple holds and compile again for each count
        "packed_longest": packing.max_length,
        "packed_row_spans": packing.row_spans,
        "packed_row_places": packing.row_places,
        "attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
        "cu_seq_lens_q": packing.cu_seqlens,
        "cu_seq_lens_k": packing.cu_seqlens,
        "max_length_q": packing.max_length,
        "max_length_k": packing.max_length,
    }


def packed_token_logprobs(
    model: Any, head: FusedHead | None, micro: TrainBatch, packing: Packing, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The micro-batch's next-token log-probs [b, width - 1] fp32 (and, `with_entropy`, the entropy at each
    position) from one packed forward: through the fused output layer `head` when given, else from `model`'s
    logits (an engine or module). Padding positions hold 0, the rows' real positions their padded forward's values."""
    if head is None:
        return packed_logits_logprobs(packed_logits(model, micro, packing), micro, packing, temperature, with_entropy)
    ids = packed_ids(micro, packing)
    hidden = head.decoder(input_ids=ids, **_attention_kwargs(head.decoder, packing)).last_hidden_state
    logprobs, entropy = fused_token_logprobs(hidden, head.head.weight, ids, temperature, with_entropy)
    return _in_rows(logprobs, micro, packing), _in_rows(entropy, micro, packing) if with_entropy else None


def packed_head_forward(
    head: FusedHead, micro: TrainBatch, packing: Packing, temperature: float
) -> tuple[Tensor, Tensor, HeadGradient]:
    """One packed forward through the fused output layer for VCPO's norms: the log-probs and entropy [b, width - 1]
    (as `packed_token_logprobs`) and the gradient of the masked log-prob sum at the logits, never formed whole
    (`fused_logprobs_and_gradient`)."""
    ids = packed_ids(micro, packing)
    hidden = head.decoder(input_ids=ids, **_attention_kwargs(head.decoder, packing)).last_hidden_state
    places = torch.arange(ids.shape[1], dtype=packing.cu_seqlens.dtype, device=ids.device)
    rows = torch.searchsorted(packing.cu_seqlens[1:], places, right=True)  # each packed position's row
    logprobs, entropy, gradient = fused_logprobs_and_gradient(
        hidden, head.head.weight, ids, packed_loss_mask(micro, packing), rows, temperature
    )
    return _in_rows(logprobs, micro, packing), _in_rows(entropy, micro, packing), gradient


def packed_logits_logprobs(
    logits: Tensor, micro: TrainBatch, packing: Packing, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """`packed_token_logprobs` from a packed forward's [1, N, V] logits (VCPO's norms need the logits too)."""
    ids = packed_ids(micro, packing)
    if not with_entropy:
        return _in_rows(token_logprobs(logits, ids, temperature), micro, packing), None
    logprobs, entropy = token_logprobs_and_entropy(logits, ids, temperature)
    return _in_rows(logprobs, micro, packing), _in_rows(entropy, micro, packing)


def packed_ids(micro: TrainBatch, packing: Packing) -> Tensor:
    """The micro-batch's tokens laid end to end, [1, N]."""
    return micro.input_ids.reshape(-1)[packing.tokens][None]


def packed_logits(model: Any, micro: TrainBatch, packing: Packing) -> Tensor:
    """[1, N, V] logits of one packed forward of the micro-batch's rows (VCPO's norms start from their gradient)."""
    return model(input_ids=packed_ids(micro, packing), **_attention_kwargs(model, packing)).logits


def packed_loss_mask(micro: TrainBatch, packing: Packing) -> Tensor:
    """The loss mask in the packed layout, [1, N - 1]: each scored position's mask, 0 at each row's last."""
    mask = micro.loss_mask.new_zeros(packing.tokens.shape[0] - 1)
    return mask.index_put((packing.scored,), micro.loss_mask.reshape(-1)[packing.targets_at])[None]


def _in_rows(values: Tensor, micro: TrainBatch, packing: Packing) -> Tensor:
    """Per-position values of a packed forward, [1, N - 1], in the micro-batch's [b, width - 1] (0 at padding;
    differentiable)."""
    shape = micro.loss_mask.shape
    flat = values.new_zeros(shape.numel())
    return flat.index_put((packing.targets_at,), values[0, packing.scored]).view(shape)
