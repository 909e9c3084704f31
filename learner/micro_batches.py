"""Token-budget micro-batches: which rows of a rank's batch go through the model together.

A micro-batch costs its rows times its longest row in padded tokens; `plan` keeps that within the
budget, longest rows first so that rows of similar length share a micro-batch and padding stays small.
Pure torch, no model: the learner asks it once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch, with what the learner needs of it known on the host: reading it from the device
    inside the step's loop would stall the GPU once per micro-batch."""

    rows: Tensor | None  # [b] long: indices into the rank's batch, ascending; None: an empty micro-batch
    width: int  # tokens of its longest row: its width without the padding no row of it uses
    group_rows: Tensor | None = None  # every row of the prompt group it is a piece of, when the plan split that group


EMPTY = MicroBatch(None, 2)
"""A micro-batch with nothing to train on: a rank with fewer micro-batches runs these so that every rank runs
as many forwards and backwards (ZeRO's collectives)."""


@dataclass(frozen=True)
class MicroBatchPlan:
    """The micro-batches, in the order they run."""

    micro_batches: list[MicroBatch]
    groups_whole: bool  # every prompt group sits inside one micro-batch (its baseline needs no other pass)

    @property
    def rows(self) -> list[Tensor]:
        """Each micro-batch's rows."""
        return [micro.rows for micro in self.micro_batches if micro.rows is not None]

    def __len__(self) -> int:
        return len(self.micro_batches)


def plan(sequence_lengths: Tensor, group_ids: Tensor, max_tokens: int | None, keep_groups: bool) -> MicroBatchPlan:
    """Micro-batches of at most `max_tokens` padded tokens (None: one micro-batch of every row).

    With `keep_groups`, whole prompt groups are packed, so that anything computed per group (VCPO's
    baseline) sees the group at once; a group longer than the budget on its own is split into pieces of
    its own rows that run one after another (no other group between them), and the plan says so.
    """
    size = int(sequence_lengths.shape[0])
    device = sequence_lengths.device
    lengths = sequence_lengths.tolist()  # the plan's one read from the device
    if max_tokens is None or size == 0 or size * max(lengths, default=0) <= max_tokens:
        return MicroBatchPlan([MicroBatch(torch.arange(size, device=device), max([2, *lengths]))], groups_whole=True)
    group_list = group_ids.tolist()
    units = _groups(group_list) if keep_groups else [[row] for row in range(size)]
    units.sort(key=lambda unit: (-max(lengths[r] for r in unit), unit[0]))
    batches: list[list[int]] = []
    split_groups: dict[int, list[int]] = {}  # batch index -> every row of the group it is a piece of
    width = 0  # the current micro-batch's longest row: its first unit's, as units come longest first
    groups_whole = keep_groups
    for unit in units:
        unit_width = max(lengths[r] for r in unit)
        if len(unit) * unit_width > max_tokens:  # a group alone over the budget: its pieces, longest rows first
            groups_whole = False
            pieces = _pieces(sorted(unit, key=lambda r: (-lengths[r], r)), lengths, max_tokens)
            if keep_groups and len(pieces) > 1:
                split_groups.update({len(batches) + k: unit for k in range(len(pieces))})
            batches += pieces
            width = max_tokens + 1  # nothing joins the last piece
            continue
        if batches and (len(batches[-1]) + len(unit)) * max(width, unit_width) <= max_tokens:
            batches[-1].extend(unit)
            continue
        batches.append(list(unit))
        width = unit_width

    def indices(rows: list[int]) -> Tensor:
        return torch.tensor(sorted(rows), dtype=torch.long, device=device)

    return MicroBatchPlan([
        MicroBatch(indices(rows), max([2, *(lengths[r] for r in rows)]),
                   indices(split_groups[k]) if k in split_groups else None)
        for k, rows in enumerate(batches)
    ], groups_whole)


def _pieces(rows: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of `rows` (longest first) that each fit the budget."""
    pieces: list[list[int]] = []
    for row in rows:
        if pieces and (len(pieces[-1]) + 1) * lengths[pieces[-1][0]] <= max_tokens:
            pieces[-1].append(row)
        else:
            pieces.append([row])
    return pieces


def _groups(group_ids: list[int]) -> list[list[int]]:
    """Rows of each prompt group, groups in order of first appearance."""
    members: dict[int, list[int]] = {}
    for row, group in enumerate(group_ids):
        members.setdefault(group, []).append(row)
    return list(members.values())
