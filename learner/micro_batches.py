"""Token-budget micro-batches: which rows of a rank's batch go through the model together.

A padded micro-batch costs its rows times its longest row in padded tokens; `plan` keeps that within the
budget, longest rows first so that rows of similar length share a micro-batch and padding stays small.
A packed micro-batch (`packed=True`) runs its rows as one sequence without padding (learner/packing.py)
and costs its real tokens, so the same budget holds more rows. Pure torch (numpy for the packing's indices),
no model: the learner asks it once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# At most this many row buckets for a packed micro-batch's per-sample products: each one adds a set of
# kernels per layer to the norms pass, and past a few the padding they save is small.
MAX_ROW_BUCKETS = 4


@dataclass(frozen=True)
class RowBucket:
    """Rows of a packed micro-batch of similar length, laid out as [rows, width] for the per-sample products
    (VCPO's norms), whose Gram matrices cost the width squared: one bucket per micro-batch would pad every
    row to the longest."""

    rows: Tensor  # [b] long: the bucket's rows, as indices into the micro-batch's rows
    width: int  # its longest row
    # [b * width] long: the packed position each place of the bucket's [b, width] takes its value from; a place
    # past its row's end takes its own row's first token, so a non-finite token reaches no other row's norm
    source: Tensor
    padding: Tensor  # [p] long: the places past their row's end, flattened (empty when the rows are equal)
    # its rows are the micro-batch's, in order, each `width` long: the packed sequence is [b, width] already
    whole: bool = False

    def unpack(self, packed: Tensor, zero_padding: bool = True) -> Tensor:
        """A packed forward's [1, N, ...] tensor (a layer's input or output gradient) as this bucket's
        [b, width, ...]: one gather, and zeros past each row's end. A per-sample product of a layer's input and
        its output gradient needs zeros in one of them only: `zero_padding=False` leaves the input's places
        past a row's end holding that row's first token, one kernel fewer. A `whole` bucket is a view of
        `packed`: no copy, and no kernel."""
        shape = (len(self.rows), self.width, *packed.shape[2:])
        if self.whole:
            return packed.view(shape)
        out = packed.index_select(1, self.source)
        if zero_padding and len(self.padding):
            out.index_fill_(1, self.padding, 0)
        return out.view(shape)


def row_buckets(
    lengths: list[int], bucket_cost: float = 0.0, max_buckets: int = MAX_ROW_BUCKETS, slack: float = 0.1
) -> list[list[int]]:
    """Rows grouped by length, each bucket a run of the rows sorted by length (a dynamic programme), for the
    least of sum over buckets of rows x width^2 (the Gram products' cost, in tokens^2) plus `bucket_cost` for
    each bucket (its fixed cost in the same unit: kernels launched per layer), within `slack` in as few
    buckets as that allows: equal lengths, or an infinite `bucket_cost`, stay one bucket."""
    n = len(lengths)
    if n == 0 or math.isinf(bucket_cost):
        return [list(range(n))]
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    square = np.asarray(lengths, dtype=np.float64)[order] ** 2
    starts = np.arange(n + 1, dtype=np.float64)
    # least[j]: least cost of the first j sorted rows in the buckets so far; cuts[k][j]: where the k-th
    # bucket of that best split starts (the last one ends at j, its width the j-th row's)
    least = np.full(n + 1, np.inf)
    least[0] = 0.0
    totals, cuts = [], []
    for count in range(1, min(max_buckets, n) + 1):
        step, cut = np.full(n + 1, np.inf), np.zeros(n + 1, dtype=np.int64)
        for j in range(1, n + 1):
            values = least[:j] + (j - starts[:j]) * square[j - 1]
            cut[j] = int(np.argmin(values))
            step[j] = values[cut[j]]
        least = step
        totals.append(step[n] + count * bucket_cost)
        cuts.append(cut)
    buckets = next(k for k, total in enumerate(totals) if total <= min(totals) * (1 + slack)) + 1
    groups, stop = [], n
    for k in range(buckets - 1, -1, -1):
        start = int(cuts[k][stop])
        groups.append([int(i) for i in order[start:stop]])
        stop = start
    return groups[::-1]


def padded_spans(sizes: np.ndarray, starts: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `sizes` tokens starting at `starts` in a packed sequence, as a right-padded [b, width] layout of
    packed positions (padding repeating each row's start), and where that layout is inside a row."""
    place = np.arange(width)[None, :]
    inside = place < sizes[:, None]
    return starts[:, None] + np.where(inside, place, 0), inside


@dataclass(frozen=True)
class Packing:
    """Where a packed micro-batch's tokens come from and where their log-probs go, built with the plan so that
    the step's loop reads nothing from the device. Its rows, in their order in the micro-batch, are laid end to
    end as one sequence of N tokens, each row's positions counting from 0."""

    lengths: tuple[int, ...]  # each row's real tokens, in the micro-batch's row order (host)
    width: int  # the micro-batch's padded width, its longest row
    tokens: Tensor  # [N] long: each packed token's flat index into the micro-batch's [b, width] input_ids
    position_ids: Tensor  # [1, N] long: its position within its own row
    scored: Tensor  # [M] long: the packed positions whose next token is in their row (all but each row's last)
    targets_at: Tensor  # [M] long: where their log-probs go in the micro-batch's [b, width - 1], flattened
    cu_seqlens: Tensor  # [b + 1] int32: where each row starts in the packed sequence, and N (varlen attention)
    # the rows as one right-padded [b, L] batch, L the longest (attention without a varlen kernel):
    row_spans: Tensor  # [b * L] long: row r's packed positions at r * L onwards, its padding repeating its start
    row_places: Tensor  # [N] long: each packed token's place in that [b, L] layout
    buckets: tuple[RowBucket, ...]  # the rows by length, for the per-sample products (none for a step without)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @classmethod
    def of(cls, lengths: list[int], width: int, device: torch.device, bucket_cost: float = math.inf) -> Packing:
        """Formed on the host (numpy: no tensor read the step's host-read count would see) and copied to
        `device` at once, before the step's loop. `bucket_cost`: see `row_buckets`; infinite for a step without
        per-sample products, which then gets no buckets (their indices would be a transfer for nothing)."""
        sizes = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        row = np.repeat(np.arange(len(sizes)), sizes)  # [N] each packed token's row
        position = np.arange(int(ends[-1])) - starts[row]
        scored = np.flatnonzero(position < sizes[row] - 1)
        longest = int(sizes.max())
        row_spans, _ = padded_spans(sizes, starts, longest)
        groups = [] if math.isinf(bucket_cost) else row_buckets(lengths, bucket_cost)
        bucket_parts: list[np.ndarray] = []
        for members in groups:
            spans, inside = padded_spans(sizes[members], starts[members], int(sizes[members].max()))
            bucket_parts += [np.asarray(members), spans.reshape(-1), np.flatnonzero(~inside.reshape(-1))]
        row_places = row * longest + position
        indices = np.concatenate(
            [
                row * width + position,
                position,
                scored,
                row[scored] * (width - 1) + position[scored],
                row_spans.reshape(-1),
                row_places,
                *bucket_parts,
            ]
        )
        split = [len(row), len(row), len(scored), len(scored), row_spans.size, len(row)]
        split += [len(part) for part in bucket_parts]
        on_device = torch.from_numpy(indices).to(device).split(split)
        tokens, position_ids, scored_at, targets_at, spans_at, places_at = on_device[:6]
        on_device = on_device[6:]
        cu_seqlens = torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32)).to(device)
        equal = bool((sizes == sizes[0]).all())  # one bucket then, its rows in order (a stable sort)
        buckets = tuple(
            RowBucket(
                on_device[3 * k],
                int(sizes[members].max()),
                on_device[3 * k + 1],
                on_device[3 * k + 2],
                whole=equal and members == list(range(len(sizes))),
            )
            for k, members in enumerate(groups)
        )
        return cls(
            tuple(lengths),
            width,
            tokens,
            position_ids[None],
            scored_at,
            targets_at,
            cu_seqlens,
            spans_at,
            places_at,
            buckets,
        )


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch, with what the learner needs of it known on the host: reading it from the device
    inside the step's loop would stall the GPU once per micro-batch."""

    rows: Tensor | None  # [b] long: indices into the rank's batch, ascending; None: an empty micro-batch
    width: int  # tokens of its longest row: its width without the padding no row of it uses
    group_rows: Tensor | None = None  # every row of the prompt group it is a piece of, when the plan split that group
    packing: Packing | None = None  # its rows packed without padding; None: right-padded rows [b, width]
    # [b] long: each row's prompt group as 0 .. groups - 1 in order of first appearance, and how many there are
    group_slots: Tensor | None = None
    groups: int = 0


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


def plan(
    sequence_lengths: Tensor,
    group_ids: Tensor,
    max_tokens: int | None,
    keep_groups: bool,
    packed: bool = False,
    bucket_cost: float = math.inf,
) -> MicroBatchPlan:
    """Micro-batches of at most `max_tokens` padded tokens (None: one micro-batch of every row); `packed`: of at
    most `max_tokens` real tokens, each micro-batch's rows packed into one sequence (its `packing`, whose row
    buckets for per-sample products weigh `bucket_cost`, `row_buckets`).

    With `keep_groups`, whole prompt groups are packed, so that anything computed per group (VCPO's
    baseline) sees the group at once; a group longer than the budget on its own is split into pieces of
    its own rows that run one after another (no other group between them), and the plan says so.
    """
    size = int(sequence_lengths.shape[0])
    device = sequence_lengths.device
    lengths, group_list = torch.stack([sequence_lengths, group_ids.to(sequence_lengths.dtype)]).tolist()  # one read
    cost = _packed_cost if packed else _padded_cost
    if max_tokens is None or size == 0 or cost(range(size), lengths) <= max_tokens:
        batches = [list(range(size))]
        groups_whole = True
        split_groups: dict[int, list[int]] = {}
    else:
        batches, split_groups, groups_whole = _fill(lengths, group_list, max_tokens, keep_groups, cost, packed)

    def indices(rows: list[int]) -> Tensor:
        return torch.tensor(sorted(rows), dtype=torch.long, device=device)

    def micro_batch(k: int, rows: list[int]) -> MicroBatch:
        width = max([2, *(lengths[r] for r in rows)])
        packing = (
            Packing.of([lengths[r] for r in sorted(rows)], width, device, bucket_cost) if packed and rows else None
        )
        slots: dict[int, int] = {}
        for r in sorted(rows):
            slots.setdefault(group_list[r], len(slots))
        group_slots = torch.tensor([slots[group_list[r]] for r in sorted(rows)], dtype=torch.long, device=device)
        split = indices(split_groups[k]) if k in split_groups else None
        return MicroBatch(indices(rows), width, split, packing, group_slots, len(slots))

    return MicroBatchPlan([micro_batch(k, rows) for k, rows in enumerate(batches)], groups_whole)


def _padded_cost(rows: Iterable[int], lengths: list[int]) -> int:
    """Rows times the longest row: the tokens of a right-padded micro-batch."""
    rows = list(rows)
    return len(rows) * max((lengths[r] for r in rows), default=0)


def _packed_cost(rows: Iterable[int], lengths: list[int]) -> int:
    """The rows' real tokens: what a packed micro-batch runs."""
    return sum(lengths[r] for r in rows)


def _fill(
    lengths: list[int],
    group_list: list[int],
    max_tokens: int,
    keep_groups: bool,
    cost: Callable[[Iterable[int], list[int]], int],
    packed: bool,
) -> tuple[list[list[int]], dict[int, list[int]], bool]:
    """The micro-batches' rows, longest units (rows or whole groups) first; a padded unit joins the latest
    micro-batch (rows of similar length together), a packed one the first with room for it (any lengths pack
    alike). Also each split group's micro-batches and whether every group stayed whole."""
    units = _groups(group_list) if keep_groups else [[row] for row in range(len(lengths))]
    units.sort(key=lambda unit: (-max(lengths[r] for r in unit), unit[0]))
    batches: list[list[int]] = []
    split_groups: dict[int, list[int]] = {}  # batch index -> every row of the group it is a piece of
    closed = 0  # batches before this index take no more units (the pieces of a split group)
    groups_whole = keep_groups
    for unit in units:
        if cost(unit, lengths) > max_tokens:  # a group alone over the budget: its pieces, longest rows first
            groups_whole = False
            pieces = _pieces(sorted(unit, key=lambda r: (-lengths[r], r)), lengths, max_tokens, cost)
            if keep_groups and len(pieces) > 1:
                split_groups.update({len(batches) + k: unit for k in range(len(pieces))})
            batches += pieces
            closed = len(batches)  # nothing joins the last piece
            continue
        candidates = range(closed, len(batches)) if packed else range(max(closed, len(batches) - 1), len(batches))
        fits = next((k for k in candidates if cost([*batches[k], *unit], lengths) <= max_tokens), None)
        if fits is None:
            batches.append(list(unit))
        else:
            batches[fits].extend(unit)
    return batches, split_groups, groups_whole


def _pieces(
    rows: list[int], lengths: list[int], max_tokens: int, cost: Callable[[Iterable[int], list[int]], int]
) -> list[list[int]]:
    """Consecutive runs of `rows` (longest first) that each fit the budget."""
    pieces: list[list[int]] = []
    for row in rows:
        if pieces and cost([*pieces[-1], row], lengths) <= max_tokens:
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
