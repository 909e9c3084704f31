"""The tensors every stabilizer reads, and the small masked reductions they share."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from algorithms.config import LOG_RATIO_BOUND


@dataclass
class PolicyBatch:
    """One learner micro-batch of B responses padded to T tokens.

    `logprobs` are the learner's (they carry the graph); `behaviour_logprobs` are the generator's
    processed log-probs for the same tokens. `advantages` may be per sequence [B] or per token [B, T].
    """

    logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    _cache: dict[str, Tensor] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(self.logprobs.shape)}")
        for name in ("behaviour_logprobs", "mask"):
            shape = getattr(self, name).shape
            if shape != self.logprobs.shape:
                raise ValueError(f"{name} has shape {tuple(shape)}, logprobs {tuple(self.logprobs.shape)}")
        if self.advantages.shape not in (self.logprobs.shape[:1], self.logprobs.shape):
            raise ValueError(f"advantages must be [B] or [B, T], got {tuple(self.advantages.shape)}")
        self.mask = self.mask.bool()

    @property
    def token_advantages(self) -> Tensor:
        """Advantages broadcast to [B, T]."""
        if self.advantages.dim() == 1:
            return self.advantages.unsqueeze(1).expand_as(self.logprobs)
        return self.advantages

    @property
    def seq_advantages(self) -> Tensor:
        """One advantage per sequence: the masked token mean when advantages are per token."""
        if self.advantages.dim() == 1:
            return self.advantages
        return masked_seq_mean(self.advantages, self.mask)

    @property
    def mask_float(self) -> Tensor:
        """The loss mask as fp32 0/1, [B, T]."""
        if "mask_float" not in self._cache:
            self._cache["mask_float"] = self.mask.float()
        return self._cache["mask_float"]

    @property
    def log_ratio(self) -> Tensor:
        """Detached token log-ratio log pi - log mu in fp32, zero on padding."""
        if "log_ratio" not in self._cache:
            diff = self.logprobs.detach().float() - self.behaviour_logprobs.float()
            # where, not a multiply: a padded -inf behaviour log-prob must not leak a NaN
            self._cache["log_ratio"] = zero_outside(diff, self.mask)
        return self._cache["log_ratio"]

    @property
    def token_lengths(self) -> Tensor:
        """Number of loss tokens per sequence, [B] float."""
        if "token_lengths" not in self._cache:
            self._cache["token_lengths"] = self.mask_float.sum(dim=1)
        return self._cache["token_lengths"]

    @property
    def token_count(self) -> Tensor:
        """Number of loss tokens in the batch (at least 1, so it can divide)."""
        if "token_count" not in self._cache:
            self._cache["token_count"] = self.token_lengths.sum().clamp(min=1)
        return self._cache["token_count"]

    def token_mean(self, values: Tensor) -> Tensor:
        """Mean of `values` [B, T] over the loss tokens; `values` must already be 0 on padding."""
        return values.sum() / self.token_count

    @property
    def seq_log_ratio(self) -> Tensor:
        """Detached sequence log-weight sum_t (log pi - log mu), [B]."""
        if "seq_log_ratio" not in self._cache:
            self._cache["seq_log_ratio"] = self.log_ratio.sum(dim=1)
        return self._cache["seq_log_ratio"]


@dataclass
class TokenWeights:
    """What a stabilizer decides for one batch.

    `weights` [B, T] are detached coefficients: the learner's policy gradient is
    sum weights * A * grad log pi, aggregated over `mask`. A token with weight 0 but mask True gets no
    gradient yet still counts in the loss denominator (IcePop, M2PO, OPSM); mask False removes it.
    """

    weights: Tensor
    mask: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def safe_exp(log_value: Tensor) -> Tensor:
    """exp after clamping to +-LOG_RATIO_BOUND, so huge log-ratios give large but finite weights."""
    return torch.exp(log_value.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over True entries; 0 when nothing is selected (never NaN)."""
    mask = mask.bool()
    return zero_outside(values, mask).sum() / mask.sum().clamp(min=1)


def masked_seq_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence mean over the True tokens of each row, [B]; 0 for an empty row."""
    mask = mask.bool()
    return zero_outside(values, mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def zero_outside(values: Tensor, mask: Tensor) -> Tensor:
    """`values` where `mask` is True, 0 elsewhere (a NaN or inf outside the mask does not leak)."""
    # A 0-dim tensor operand is several times faster than a Python scalar in torch.where on CPU.
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Share of selected entries whose flag is set (a clip or mask fraction)."""
    return masked_mean(flags.float(), mask)


def broadcast_seq(values: Tensor, like: Tensor) -> Tensor:
    """Repeat a per-sequence [B] tensor over the token axis of `like` [B, T]."""
    return values.unsqueeze(1).expand_as(like)


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense group index in [0, G) for arbitrary group ids, and G."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def group_sum(values: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Sum of `values` [B] within each group, [G]."""
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)
