"""Group-relative advantage estimators over the responses of each prompt.

`group_ids` [B] marks which responses share a prompt; ids need not be contiguous or sorted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from algorithms.batch import group_index, group_sum


def _group_moments(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, group size and population variance, each [B]."""
    index, n_groups = group_index(group_ids)
    rewards = rewards.float()
    count = group_sum(torch.ones_like(rewards), index, n_groups)
    mean = group_sum(rewards, index, n_groups) / count
    centred = rewards - mean[index]
    variance = group_sum(centred * centred, index, n_groups) / count
    return mean[index], count[index], variance[index]


def group_std(rewards: Tensor, group_ids: Tensor, unbiased: bool = False) -> Tensor:
    """Per-sample reward std of its group; unbiased uses n - 1 (0 for singleton groups)."""
    _, count, variance = _group_moments(rewards, group_ids)
    if unbiased:
        variance = torch.where(count > 1, variance * count / (count - 1).clamp(min=1), torch.zeros_like(variance))
    return variance.sqrt()


def group_mean_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """R - group mean: group-mean REINFORCE and Dr.GRPO (no std normalisation)."""
    mean, _, _ = _group_moments(rewards, group_ids)
    return rewards.float() - mean


def grpo_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, unbiased_std: bool = True) -> Tensor:
    """GRPO: (R - group mean) / (group std + eps); a constant-reward group gives 0."""
    return group_mean_advantages(rewards, group_ids) / (group_std(rewards, group_ids, unbiased_std) + eps)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: R_i minus the mean of the other responses of its group (0 for a singleton group)."""
    _, count, _ = _group_moments(rewards, group_ids)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return group_mean_advantages(rewards, group_ids) * scale


ADVANTAGES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": group_mean_advantages,
    "reinforce": group_mean_advantages,
    "rloo": rloo_advantages,
}
"""Advantage estimators by name, for the job file's `algorithm.advantage`."""
