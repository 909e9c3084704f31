"""The tensors every stabilizer reads, and the small masked reductions they share."""

from __future__ import annotations

import math
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
            # via uint8: a bool -> float conversion is several times slower on CPU than uint8 -> float
            self._cache["mask_float"] = self.mask.view(torch.uint8).float()
        return self._cache["mask_float"]

    @property
    def log_ratio(self) -> Tensor:
        """Detached token log-ratio log pi - log mu in fp32, zero on padding."""
        if "log_ratio" not in self._cache:
            diff = self.logprobs.detach().float() - self.behaviour_logprobs.float()
            # a select, not a multiply: a padded -inf behaviour log-prob must not leak a NaN
            self._cache["log_ratio"] = zero_outside_(diff, self.mask)
        return self._cache["log_ratio"]

    @property
    def ratio(self) -> Tensor:
        """Detached token ratio exp(min(l, LOG_RATIO_BOUND)) on loss tokens, 0 on padding, [B, T].

        Shared by the health metrics and the token-ratio stabilizers, so the step pays one exp; zero on
        padding so that it can be summed, capped or multiplied as a weight directly. Never modify it.
        """
        if "ratio" not in self._cache:
            self._cache["ratio"] = self.log_ratio.clamp(max=LOG_RATIO_BOUND).exp_().mul_(self.mask_float)
        return self._cache["ratio"]

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
    `mask` is boolean or float 0/1 (MIS builds it in float, which the loss then uses as it is).
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
    if (
        values.dtype == torch.float32
        and mask.dtype == torch.bool
        and values.shape == mask.shape
        and not values.requires_grad
    ):
        return zero_outside_(values.clone(), mask)
    # A 0-dim tensor operand is several times faster than a Python scalar in torch.where on CPU.
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def zero_outside_(values: Tensor, mask: Tensor) -> Tensor:
    """In-place `zero_outside` of a fresh fp32 tensor, bit for bit what torch.where gives.

    torch.where is not vectorised on CPU; ANDing each value's bits with all ones (True) or all zeros
    (False, giving +0.0) is about 4x faster and lets no NaN or inf through either.
    """
    keep_bits = mask.view(torch.uint8).to(torch.int32).neg_()
    values.view(torch.int32).bitwise_and_(keep_bits)
    return values


def count_above(values: Tensor, bound: float) -> Tensor:
    """How many entries exceed `bound`, as a 0-dim float: sign arithmetic, no boolean pass."""
    return torch.sub(values, bound).sign_().clamp_(min=0).sum()


def outside_band(values: Tensor, low: float, high: float) -> Tensor:
    """1.0 where `values` lies outside [low, high] (finite bounds), else 0.0, in float arithmetic.

    A value is inside exactly when clamping leaves it unchanged; boolean compares cost several times
    more on CPU than these four float passes on one fresh tensor.
    """
    return values.clamp(low, high).sub_(values).sign_().abs_()


def zero_where_set(values: Tensor, flags: Tensor) -> Tensor:
    """values * (1 - flags) for float 0/1 `flags`, written over `flags` (one pass, no new [B, T] tensor).

    `flags` must be a temporary the caller no longer needs; where a flag is set the result is exactly 0.
    """
    return torch.addcmul(values, values, flags, value=-1.0, out=flags)


def indices_above(values: Tensor, threshold: float, group: int = 8) -> Tensor:
    """Flat indices of the entries of `values` above `threshold`, in no particular order.

    Meant for a few such entries in a large tensor: a boolean nonzero over all of it costs two slow
    passes on CPU, so the column maxima of a [group, N / group] view (a vectorised reduction over
    contiguous rows) first narrow the search to the columns that hold one. A NaN column is searched.
    """
    flat = values.reshape(-1)
    width = flat.numel() // group
    if width == 0 or flat.numel() % group:
        return (flat > threshold).nonzero().squeeze(1)
    grid = flat.view(group, width)
    columns = (grid.amax(dim=0) <= threshold).logical_not_().nonzero().squeeze(1)
    rows, at = (grid.index_select(1, columns) > threshold).nonzero(as_tuple=True)
    return rows * width + columns[at]


def largest_entries(values: Tensor, above: float, columns: int, group: int = 16) -> tuple[Tensor, Tensor, float]:
    """The largest entries of `values` that exceed `above`, largest first, their flat indices, and a
    floor: every entry above both `above` and the floor is among them (the floor is -inf when that is
    all entries; otherwise the list is the top of the full one, normally at least `columns` long).

    Sorting a whole [B, T] tensor, or a boolean nonzero over it, costs far more on CPU than this: the
    column maxima of a [group, N / group] view (a vectorised reduction), the `columns` columns with the
    largest maxima, and a sort of their few entries above the largest maximum left out, the floor.
    """
    width = values.numel() // group
    if width <= columns or values.numel() % group:
        flat = values.reshape(-1)
        index = (flat > above).nonzero().squeeze(1)
        top, order = torch.sort(flat[index], descending=True)
        return top, index[order], -math.inf
    grid = values.reshape(group, width)
    maxima, column_index = torch.topk(grid.amax(dim=0), columns + 1)
    floor = maxima[columns].item()
    taken = grid.index_select(1, column_index)  # the column at the floor adds nothing above it
    cut = above if floor <= above else floor  # a NaN floor certifies nothing
    rows, at = (taken > cut).nonzero(as_tuple=True)
    top, order = torch.sort(taken[rows, at], descending=True)
    return top, (rows * width + column_index[at])[order], floor


def fraction(flags: Tensor, mask: Tensor) -> Tensor:
    """Share of selected entries whose flag is set (a clip or mask fraction)."""
    return masked_mean(flags.float(), mask)


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Dense group index in [0, G) for arbitrary group ids (in the order of the ids), and B >= G slots for
    per-group sums: slots past the last group stay empty, and every reader indexes the groups' own. The
    exact G would need a host sync on a GPU (torch.unique's output size), once per call in the step."""
    size = group_ids.numel()
    ordered, order = torch.sort(group_ids, stable=True)
    starts = torch.ones_like(ordered)
    starts[1:] = (ordered[1:] != ordered[:-1]).to(ordered.dtype)
    index = torch.empty_like(ordered).scatter_(0, order, starts.cumsum(0) - 1)
    return index, size


def group_sum(values: Tensor, index: Tensor, n_groups: int) -> Tensor:
    """Sum of `values` [B] within each group, [G]."""
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)
