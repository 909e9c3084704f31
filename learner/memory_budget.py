"""`learner.max_tokens_per_micro_batch: auto`: the tokens a micro-batch may hold on this rank's device (real
tokens when its rows are packed, rows x longest row when padded: what its forward runs).

A micro-batch's memory grows linearly with its tokens: every decoder layer keeps its activations
for the backward, and the logits path holds [tokens, vocab] tensors (learner/batch.py: the logits in the
model's dtype and their gradient; with per-sample gradient norms also `sequence_logprob_grad`'s fp32
logits gradient, and book-keeping's kept per-sample gradients, learner/vcpo/ghost_norms.py). Beside it a step
holds a fixed amount: the gradients and ZeRO's buckets, the chunked log-softmax's and the Gram matrices'
temporaries. The per-token figures come from the model's config, the fixed one from its parameter count;
on the CPU both were calibrated against measured peaks and err on the large side; on a CUDA device they are
fitted to the peaks an H200 measured (`CudaCalibration`, docs/performance.md), within 20% of each.

Everything above `read_free_bytes` is plain arithmetic, unit tested without a model; the rest reads the
device and the host.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from algorithms.errors import StableAsyncError
from learner.batch import CHUNK_LOGIT_ELEMENTS
from learner.vcpo.products import CHUNK_ELEMENTS

log = logging.getLogger("stableasync.learner")

# The share of the free memory a budget may plan on: a GPU is the rank's own; host memory is shared with
# the generators (which start after the learner), the driver and Ray's object store.
USABLE_SHARE_CUDA = 0.85
USABLE_SHARE_HOST = 0.5
# fp32 chunks alive at once of the chunked log-softmax (learner/batch.py) and of the ghost norms' Gram
# matrices (learner/vcpo/ghost_norms.py): a chunk and the temporaries of its arithmetic.
LIVE_CHUNKS = 3
# The [rows, 1, T, T] attention mask and the attention's own temporaries: bytes per token per position of its
# row (measured on CPU's scaled_dot_product_attention: about 10).
MASK_BYTES_PER_POSITION = 12
# Gradients and ZeRO's gradient buckets and partitions, in fp32 numbers per trained parameter (measured: ~3).
GRADIENT_COPIES = 4
# VCPO's bookkeeping_budget_mb auto: the share of what a step may use beyond its fixed bytes that book-keeping's
# kept per-sample gradients may take (the rest is the micro-batch's activations and logits).
KEPT_GRADIENT_SHARE = 0.5


@dataclass(frozen=True)
class CudaCalibration:
    """The memory model on a CUDA device, fitted to the peaks an H200 measured (bf16, ZeRO-2, the fused output
    layer, flash attention without a mask; docs/performance.md, "The memory model against the card"): a step
    keeps fewer activation bytes than the CPU's count (about 1.18 x its attention and norm terms and 0.48 x its
    MLP terms), its gradients and ZeRO's buckets take `gradient_bytes_per_parameter`, and VCPO's norms (ghost or
    book-keeping) add `per_sample_norm_share` of every linear layer's output gradient per token, in the model's
    dtype. Three tis_seq rows set the first three; the other ten rows, of four commits, fall within 8%."""

    attention_and_norm_scale: float = 1.18
    mlp_scale: float = 0.48
    gradient_bytes_per_parameter: float = 5.2
    per_sample_norm_share: float = 0.85


CUDA = CudaCalibration()


class MicroBatchBudgetTooSmall(StableAsyncError, MemoryError):
    """Not even one sequence fits the memory left on the rank's device."""


@dataclass(frozen=True)
class ModelShape:
    """What a decoder-only transformer's activations scale with, from its config."""

    hidden: int
    intermediate: int
    layers: int
    query_width: int  # attention heads x head dim
    key_value_width: int  # key-value heads x head dim
    vocab: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """A Hugging Face config (its text part, for a multimodal one)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            layers=text.num_hidden_layers,
            query_width=heads * head_dim,
            key_value_width=kv_heads * head_dim,
            vocab=text.vocab_size,
        )


def layer_activation_numbers(shape: ModelShape, calibration: CudaCalibration | None = None) -> float:
    """Numbers one decoder layer keeps per token for its backward: two RMSNorms (input, upcast, normalised),
    q/k/v and their rotated copies, keys and values repeated to every head, the attention output and o_proj,
    two residuals, and the MLP's gate, up, activation and product; on CUDA scaled by `calibration`."""
    attention_and_norms = 8 * shape.hidden + 2 * (shape.query_width + 2 * shape.key_value_width) + 4 * shape.query_width
    mlp = 4 * shape.intermediate
    if calibration is None:
        return attention_and_norms + mlp
    return calibration.attention_and_norm_scale * attention_and_norms + calibration.mlp_scale * mlp


def output_gradient_numbers(shape: ModelShape) -> int:
    """Every linear layer's outputs per token (q, k, v, o, gate, up, down): what VCPO's norms hold the gradient
    of, the inputs being activations already."""
    q, kv, h, i = shape.query_width, shape.key_value_width, shape.hidden, shape.intermediate
    return shape.layers * (q + 2 * kv + h + 2 * i + h)


def activation_bytes_per_token(
    shape: ModelShape, dtype_bytes: int, gradient_checkpointing: bool, calibration: CudaCalibration | None = None
) -> int:
    """Activations a token holds through the backward: every layer's, or with checkpointing each layer's
    input plus one layer recomputed at a time; and the gradients of the layer the backward is in."""
    per_layer = layer_activation_numbers(shape, calibration)
    if gradient_checkpointing:
        return math.ceil(dtype_bytes * (shape.layers * shape.hidden + 2 * per_layer))
    return math.ceil(dtype_bytes * (shape.layers + 1) * per_layer)


def logits_bytes_per_token(
    shape: ModelShape, dtype_bytes: int, per_sample_norms: bool, fused_head: bool = False
) -> int:
    """The [tokens, vocab] logits and their gradient in the model's dtype; per-sample norms add
    `sequence_logprob_grad`'s fp32 logits gradient and the norms' own backward from it. A fused output layer
    (learner/fused_head.py) forms the logits a chunk at a time (the capped terms): per token, the gradient at
    the hidden states, and for the norms their fp32 start and the hidden states laid out in row buckets."""
    if fused_head:
        return dtype_bytes * shape.hidden + ((4 + dtype_bytes) * shape.hidden if per_sample_norms else 0)
    numbers = 2 * dtype_bytes * shape.vocab
    return numbers + (4 * (shape.vocab + shape.hidden) if per_sample_norms else 0)


def kept_gradient_bytes_per_token(shape: ModelShape, fused_head: bool = False) -> int:
    """Book-keeping without a budget: each linear weight's per-sample gradient factors, (out + in) fp32
    numbers per token (the dense form, when smaller, is kept instead: this is the bound), and the output
    layer's (a fused one keeps only its input, learner/vcpo/output_layer.py) and the embedding's."""
    q, kv, h, i = shape.query_width, shape.key_value_width, shape.hidden, shape.intermediate
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + i)
    head = h if fused_head else shape.vocab + h
    return 4 * (shape.layers * per_layer + head + h + 2)


@dataclass(frozen=True)
class StepMemory:
    """What one micro-batch of a step costs, as a function of its tokens: `bytes_per_token` without
    bound, `fixed_bytes` regardless of size, and `capped` terms (bytes per token, at most bytes) that stop
    growing: temporaries made one chunk at a time, and book-keeping's kept gradients within their budget."""

    bytes_per_token: int
    fixed_bytes: int
    capped: tuple[tuple[int, float], ...] = ()

    def bytes_for(self, tokens: int) -> float:
        return (
            self.fixed_bytes
            + tokens * self.bytes_per_token
            + sum(min(cap, tokens * per_token) for per_token, cap in self.capped)
        )


def step_memory(
    shape: ModelShape,
    dtype_bytes: int,
    trained_parameters: int,
    sequence_tokens: int,
    *,
    gradient_checkpointing: bool,
    per_sample_norms: bool,
    kept_gradient_cap_bytes: float = 0.0,
    later_bytes: int = 0,
    fused_head: bool = False,
    on_cuda: bool = False,
) -> StepMemory:
    """The step's memory model for rows of up to `sequence_tokens`. `kept_gradient_cap_bytes`: what
    book-keeping may keep (VCPO's bookkeeping_budget_mb under `auto`, which counts the score buffer too;
    0 without book-keeping; infinite when book-keeping is forced, and then also the score buffer).
    `later_bytes`: what the rank takes after the budget is chosen, so not yet gone from the free memory:
    AdamW's moments (torch makes them at the first step) and a KL term's reference copy. `fused_head`: the
    output layer runs fused with the log-softmax (`learner.policy.fused_head_of` found it does). `on_cuda`: the
    model fitted to a CUDA card (`CudaCalibration`); else the CPU's, which errs on the large side."""
    if on_cuda:
        return cuda_step_memory(
            shape,
            dtype_bytes,
            trained_parameters,
            gradient_checkpointing,
            per_sample_norms,
            kept_gradient_cap_bytes,
            later_bytes,
            fused_head,
        )
    per_token = (
        activation_bytes_per_token(shape, dtype_bytes, gradient_checkpointing)
        + logits_bytes_per_token(shape, dtype_bytes, per_sample_norms, fused_head)
        + MASK_BYTES_PER_POSITION * sequence_tokens
    )
    fixed = 4 * GRADIENT_COPIES * trained_parameters + later_bytes
    capped: list[tuple[int, float]] = [(LIVE_CHUNKS * 4 * shape.vocab, LIVE_CHUNKS * 4 * CHUNK_LOGIT_ELEMENTS)]
    if per_sample_norms:  # a [rows, T, T] Gram chunk is T numbers per token
        capped.append((LIVE_CHUNKS * 4 * sequence_tokens, LIVE_CHUNKS * 4 * CHUNK_ELEMENTS))
        if kept_gradient_cap_bytes > 0:
            capped.append((kept_gradient_bytes_per_token(shape, fused_head), kept_gradient_cap_bytes))
        if math.isinf(kept_gradient_cap_bytes):
            fixed += 4 * trained_parameters  # the score buffer of a group carried across micro-batches
    return StepMemory(per_token, fixed, tuple(capped))


def cuda_step_memory(
    shape: ModelShape,
    dtype_bytes: int,
    trained_parameters: int,
    gradient_checkpointing: bool,
    per_sample_norms: bool,
    kept_gradient_cap_bytes: float,
    later_bytes: int,
    fused_head: bool,
    calibration: CudaCalibration = CUDA,
) -> StepMemory:
    """`step_memory` on a CUDA device: activations and gradients as `calibration` fits them, the output layer's
    (a fused one: its input's gradient; else the logits and their gradient), no attention mask (flash and varlen
    attention take none), and VCPO's norms' output gradients, whichever path forms them; what book-keeping keeps
    beyond them is what `KeptGradientBudget` leaves (`kept_gradient_cap_bytes` counts only a forced book-keeping's
    score buffer here)."""
    per_token = activation_bytes_per_token(shape, dtype_bytes, gradient_checkpointing, calibration)
    per_token += dtype_bytes * (shape.hidden if fused_head else 2 * shape.vocab)
    fixed = math.ceil(calibration.gradient_bytes_per_parameter * trained_parameters) + later_bytes
    capped: list[tuple[int, float]] = [(LIVE_CHUNKS * 4 * shape.vocab, LIVE_CHUNKS * 4 * CHUNK_LOGIT_ELEMENTS)]
    if per_sample_norms:  # measured alike for the ghost path and book-keeping (61.0 and 60.2 GiB on Qwen2.5-1.5B)
        per_token += math.ceil(calibration.per_sample_norm_share * dtype_bytes * output_gradient_numbers(shape))
        if math.isinf(kept_gradient_cap_bytes):
            fixed += 4 * trained_parameters  # the score buffer of a group carried across micro-batches
    return StepMemory(per_token, fixed, tuple(capped))


@dataclass(frozen=True)
class KeptGradientBudget:
    """What VCPO's book-keeping may keep for one micro-batch under opob_impl auto: at most `most_bytes` (0: never;
    inf: no bound) and, with bookkeeping_budget_mb auto, no more than a micro-batch of its tokens leaves of the
    usable memory under the step's `memory` (without kept gradients): a micro-batch smaller than the budget
    leaves room that a full one would take."""

    most_bytes: float
    usable_bytes: float = math.inf
    memory: StepMemory | None = None

    def bytes_for(self, tokens: int) -> float:
        """What a micro-batch of `tokens` (what its forward runs) may keep."""
        if self.memory is None:
            return self.most_bytes
        return max(0.0, min(self.most_bytes, self.usable_bytes - self.memory.bytes_for(tokens)))


@dataclass(frozen=True)
class MicroBatchBudget:
    """A rank's micro-batch budget and why: the job's number, or what the free memory holds."""

    tokens: int | None  # tokens per forward; None: the rank's whole batch at once
    why: str
    kept_gradients: KeptGradientBudget = KeptGradientBudget(0.0)


def choose_budget(
    memory: StepMemory, free_bytes: int, usable_share: float, sequence_tokens: int, gradient_checkpointing: bool
) -> MicroBatchBudget:
    """The most tokens whose step fits `usable_share` of `free_bytes`; an error naming the knobs when
    not even one sequence (`sequence_tokens`, generator.max_model_len) fits."""
    usable = usable_share * free_bytes
    low, high = 0, max(0, int((usable - memory.fixed_bytes) // memory.bytes_per_token))
    while low < high:  # bytes_for grows with the tokens
        middle = (low + high + 1) // 2
        low, high = (middle, high) if memory.bytes_for(middle) <= usable else (low, middle - 1)
    if low < sequence_tokens:
        needed = memory.bytes_for(sequence_tokens)
        advice = "" if gradient_checkpointing else ", set learner.gradient_checkpointing: true"
        raise MicroBatchBudgetTooSmall(
            f"learner.max_tokens_per_micro_batch auto: one sequence of {sequence_tokens} tokens "
            f"(generator.max_model_len) needs about {needed / 2**30:.2f} GiB ({memory.bytes_per_token / 2**20:.2f} "
            f"MiB per token, {memory.fixed_bytes / 2**30:.2f} GiB per step), but {usable_share:.0%} of the "
            f"{free_bytes / 2**30:.2f} GiB free on the rank's device is {usable / 2**30:.2f} GiB; lower "
            f"generator.max_model_len, give the rank more memory{advice}, or set "
            "learner.max_tokens_per_micro_batch to a number of your own"
        )
    capped = memory.bytes_for(low) - memory.fixed_bytes - low * memory.bytes_per_token
    why = (
        f"{low} tokens per micro-batch (learner.max_tokens_per_micro_batch auto): {usable_share:.0%} of "
        f"{free_bytes / 2**30:.2f} GiB free, less {memory.fixed_bytes / 2**30:.2f} GiB per step and "
        f"{capped / 2**30:.2f} GiB of chunked temporaries and kept gradients, at "
        f"{memory.bytes_per_token / 2**20:.2f} MiB per token"
    )
    return MicroBatchBudget(low, why)


def kept_gradient_cap(memory: StepMemory, usable_bytes: float, tokens: int | None) -> float:
    """bookkeeping_budget_mb auto: `KEPT_GRADIENT_SHARE` of what a step may use beyond its fixed bytes
    (`memory` without kept gradients), and with a token budget no more than its micro-batch leaves."""
    cap = KEPT_GRADIENT_SHARE * (usable_bytes - memory.fixed_bytes)
    if tokens is not None:
        cap = min(cap, usable_bytes - memory.bytes_for(tokens))
    return max(0.0, cap)


def host_available_bytes(meminfo: str, cgroup_limit: str | None, cgroup_usage: str | None) -> int:
    """MemAvailable of /proc/meminfo, or less when a cgroup memory limit leaves less (its usage counts the
    page cache, so this errs low)."""
    available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    if cgroup_limit is None or cgroup_usage is None or not cgroup_limit.strip().isdigit():
        return available  # "max" (v2) or no cgroup file
    limit = int(cgroup_limit)
    if limit >= 1 << 60:  # v1's "no limit" is a huge number
        return available
    return max(0, min(available, limit - int(cgroup_usage)))


# ---- reading the device --------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def read_host_available_bytes() -> int:
    """Host memory this process may still use (cgroup v2, else v1, else none)."""
    limit, usage = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit is None:
        limit, usage = (
            _read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
            _read("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
        )
    return host_available_bytes(Path("/proc/meminfo").read_text(), limit, usage)


def read_free_bytes(device: Any, ranks_on_host: int, device_share: float) -> tuple[int, float]:
    """Free bytes on `device` (a torch.device) for this rank and the share a budget may plan on: a GPU's free
    memory plus what torch's allocator caches unused, within the rank's share of the GPU (generators that
    share it start later); on CPU the host's, split among its ranks."""
    import torch

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return min(free + cached, int(device_share * total)), USABLE_SHARE_CUDA
    return read_host_available_bytes() // ranks_on_host, USABLE_SHARE_HOST


# long: one collective over the ranks: the device read, both budgets and their reasons agree
def resolve(
    spec: Any, engine: Any, device: Any, rank: int, world_size: int, fused_head: bool = False
) -> MicroBatchBudget:
    """The rank's micro-batch budget and what book-keeping may keep of it: the job's numbers as given, or
    with "auto" what the memory left after the model and optimizer holds, the least over the ranks so that
    all plan alike (a collective: every rank resolves at once). `fused_head`: no [tokens, vocabulary] logits."""
    from algorithms import registry

    stabilizer = registry.from_config(spec.stabilizer_name, spec.stabilizer_config)
    per_sample_norms = stabilizer.needs_grad_norms
    kept = _kept_gradient_cap_bytes(spec, stabilizer.config) if per_sample_norms else 0.0
    tokens = spec.max_tokens_per_micro_batch
    if tokens != "auto" and kept is not None:  # nothing to read from the device
        return _job_budget(tokens, KeptGradientBudget(kept))
    import torch
    import torch.distributed as dist

    sequence_tokens = spec.max_sequence_tokens or 1
    dtype_bytes = 4 if spec.dtype == "float32" else 2
    # whole counts: a ZeRO-3 partition's own numel is its share
    numels = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in engine.module.parameters()]
    trained = sum(numel for numel, grad in numels if grad)
    later = unallocated_adam_bytes(engine, trained, spec.zero_stage, world_size)
    if spec.kl_coef > 0 and spec.lora is None:  # the reference copy (LoRA's is the base with its adapter off)
        later += dtype_bytes * sum(numel for numel, _ in numels) // (world_size if spec.zero_stage == 3 else 1)

    def memory_with(kept_bytes: float) -> StepMemory:
        return step_memory(
            ModelShape.from_config(engine.module.config),
            dtype_bytes,
            trained,
            sequence_tokens,
            gradient_checkpointing=spec.gradient_checkpointing,
            per_sample_norms=per_sample_norms,
            kept_gradient_cap_bytes=kept_bytes,
            later_bytes=later,
            fused_head=fused_head,
            on_cuda=device.type == "cuda",
        )

    hosts: list[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(hosts, os.uname().nodename)
    free_bytes, share = read_free_bytes(device, max(1, hosts.count(hosts[rank])), spec.device_share)

    def least(value: float) -> float:
        """The least of `value` over the ranks."""
        if world_size == 1:
            return value
        tensor = torch.tensor(value, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return float(tensor)

    kept_why = ""
    kept_gradients = KeptGradientBudget(0.0 if kept is None else kept)
    if kept is None:  # bookkeeping_budget_mb auto: what each micro-batch's tokens leave, within a share
        usable, without_kept = least(share * free_bytes), memory_with(0.0)
        kept = kept_gradient_cap(without_kept, usable, None)
        kept_gradients = KeptGradientBudget(kept, usable, without_kept)
        full = (
            ""
            if not isinstance(tokens, int)
            else f", {kept_gradients.bytes_for(tokens) / 2**30:.2f} GiB beside a full one"
        )
        kept_why = (
            f"; book-keeping may keep up to {kept / 2**30:.2f} GiB per micro-batch, what its tokens leave{full} "
            "(bookkeeping_budget_mb auto)"
        )
    if tokens != "auto":
        budget = _job_budget(tokens, kept_gradients)
    else:
        budget = choose_budget(memory_with(kept), free_bytes, share, sequence_tokens, spec.gradient_checkpointing)
        assert budget.tokens is not None, "choose_budget always picks a number of tokens"
        fewest = int(least(float(budget.tokens)))
        why = (
            budget.why if fewest == budget.tokens else f"{fewest}, the least over the ranks; this rank's: {budget.why}"
        )
        budget = MicroBatchBudget(fewest, why, kept_gradients)
    budget = dataclasses.replace(budget, why=budget.why + kept_why)
    log.info("learner rank %d: %s", rank, budget.why)
    return budget


def _job_budget(tokens: int | None, kept_gradients: KeptGradientBudget) -> MicroBatchBudget:
    """The job's own number of tokens per micro-batch (None: the whole batch at once), as the log states it."""
    why = (
        "the whole batch in one micro-batch"
        if tokens is None
        else f"{tokens} tokens per micro-batch (learner.max_tokens_per_micro_batch)"
    )
    return MicroBatchBudget(tokens, why, kept_gradients)


def unallocated_adam_bytes(engine: Any, trained_parameters: int, zero_stage: int, world_size: int) -> int:
    """AdamW's two fp32 moments of this rank's share of the parameters (ZeRO-1 and up partition them), less
    what the optimizer already holds."""
    import torch

    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps torch's optimizer
    held = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )
    share = trained_parameters // (world_size if zero_stage >= 1 else 1)
    return max(0, 2 * 4 * share - held)


def _kept_gradient_cap_bytes(spec: Any, stabilizer_config: Any) -> float | None:
    """What book-keeping may keep: VCPO's budget under `auto` (None: bookkeeping_budget_mb auto, read from the
    device), unbounded when forced, none otherwise (ghost, the per-sample loop, ZeRO-3, a KL term or entropy
    bonus in the loss)."""
    impl = getattr(stabilizer_config, "opob_impl", "ghost")
    if impl not in ("auto", "bookkeeping") or spec.zero_stage == 3 or spec.token_terms:
        return 0.0
    if impl == "bookkeeping":
        return math.inf
    budget_mb = stabilizer_config.bookkeeping_budget_mb
    return None if budget_mb == "auto" else 2**20 * budget_mb
