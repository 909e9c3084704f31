"""The learner ranks' collectives: sums, maxima, finiteness, gathers, the step's metrics and the agreed runs.

Kept apart from the passes (`learner/passes.py`) so the step reads as what it computes; each method is a
collective (every rank calls it, in the same order) and costs nothing on a single rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from learner.micro_batches import EMPTY, MicroBatch, MicroBatchPlan

# Metrics computed from the gathered global batch: the same on every rank, so averaged without token weights.
GLOBAL_METRICS = {
    "stability/ess_ratio",
    "stability/chi2_seq",
    "stability/ess_ratio_clipped",
    "stability/lr_scale",
    "stability/skipped_step",
}


def nonfinite_count(*tensors: Tensor) -> Tensor:
    """[] fp32 on the tensors' device: how many of them hold a NaN or infinity (no host sync)."""
    flags = [(~torch.isfinite(t.detach())).any().float() for t in tensors]
    return torch.stack(flags).sum()


class Collectives:
    """The rank's group: `world_size` ranks, this one's tensors on `device`."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size, self.device = world_size, device

    def sum(self, value: Tensor) -> Tensor:
        """A detached fp32 copy of `value` summed over the ranks."""
        value = value.detach().float().clone()
        if self.world_size > 1:
            dist.all_reduce(value)
        return value

    def max(self, values: Tensor) -> Tensor:
        """A detached fp32 copy of `values`, elementwise the largest over the ranks."""
        values = values.detach().float().clone()
        if self.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values

    def all_finite(self, *tensors: Tensor) -> bool:
        """Whether every rank's tensors are finite: a collective, so all ranks skip together."""
        return self.sum(nonfinite_count(*tensors)).item() == 0

    def agreed_runs(self, plan: MicroBatchPlan, one_pass: bool = True) -> tuple[list[MicroBatch], bool]:
        """The plan's micro-batches, padded with empty ones to the most any rank runs, and one pass only where
        every rank can take it: ZeRO's collectives in each forward and backward need all ranks to run the
        same passes over as many micro-batches."""
        wanted = torch.tensor([float(len(plan)), float(not one_pass)], device=self.device)
        most, any_two_passes = self.max(wanted).tolist()
        return [*plan.micro_batches, *[EMPTY] * (int(most) - len(plan))], any_two_passes == 0

    def gather(self, values: Tensor) -> Tensor:
        """Concatenate a 1-D tensor of possibly different lengths from every rank."""
        values = values.detach().float().to(self.device)
        if self.world_size == 1:
            return values
        size = torch.tensor([values.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        width = int(max(s.item() for s in sizes))
        padded = values.new_zeros(width)
        padded[: values.numel()] = values
        gathered = [values.new_zeros(width) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return torch.cat([g[: int(s.item())] for g, s in zip(gathered, sizes)])

    def reduce_metrics(
        self, metrics: dict[str, Tensor], token_weight: Tensor | None = None, sample_weight: Tensor | None = None
    ) -> dict[str, float]:
        """Average over ranks: `stability/` token statistics weighted by each rank's loss tokens (so they equal
        the global token mean), `rollout/` sample statistics by its trained rows (ranks may hold unequal shares
        of a short batch, or none), everything else plainly. Sequence statistics computed from the gathered
        global batch are the same on every rank."""
        names = sorted(metrics)
        values = torch.stack([metrics[name].detach().float().reshape(()).to(self.device) for name in names])
        if self.world_size == 1:
            return dict(zip(names, values.tolist()))
        weights = torch.ones_like(values)
        for prefix, weight in (("stability/", token_weight), ("rollout/", sample_weight)):
            if weight is not None:
                weighted = torch.tensor(
                    [n.startswith(prefix) and n not in GLOBAL_METRICS for n in names], device=self.device
                )
                weights[weighted] = weight.float().to(self.device)
        totals = torch.stack([values * weights, weights])
        dist.all_reduce(totals)
        return dict(zip(names, (totals[0] / totals[1]).tolist()))
