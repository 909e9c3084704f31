"""Token-budget micro-batch plans, the chunked log-softmax, and which stabilizers may decide per row."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import registry
from algorithms.batch import PolicyBatch
from learner import batch as learner_batch
from learner import micro_batches


def _plan(lengths, groups, budget, keep_groups=False):
    return micro_batches.plan(torch.tensor(lengths), torch.tensor(groups), budget, keep_groups)


def _plan_packed(lengths, groups, budget, keep_groups=False):
    return micro_batches.plan(torch.tensor(lengths), torch.tensor(groups), budget, keep_groups, packed=True)


def test_every_row_runs_once_within_the_budget():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 60, (37,), generator=gen)
    groups = torch.arange(37) // 4
    for budget in (60, 100, 333, 1000):
        plan = micro_batches.plan(lengths, groups, budget, keep_groups=False)
        rows = torch.cat(plan.rows).sort().values
        assert torch.equal(rows, torch.arange(37)), budget
        for part in plan.rows:
            assert len(part) * int(lengths[part].max()) <= budget, budget


def test_rows_of_similar_length_share_a_micro_batch():
    plan = _plan([10, 50, 11, 49, 12, 48], [0, 0, 1, 1, 2, 2], budget=150)
    assert [part.tolist() for part in plan.rows] == [[1, 3, 5], [0, 2, 4]]
    assert not plan.groups_whole


def test_whole_groups_stay_together_and_a_group_too_long_for_the_budget_is_split():
    plan = _plan([10, 50, 11, 49, 12, 48], [0, 0, 1, 1, 2, 2], budget=100, keep_groups=True)
    assert plan.groups_whole
    assert sorted(part.tolist() for part in plan.rows) == [[0, 1], [2, 3], [4, 5]]
    split = _plan([10, 50, 11, 49], [0, 0, 0, 0], budget=100, keep_groups=True)
    assert not split.groups_whole and len(split) == 2


def test_a_split_group_runs_in_consecutive_pieces_of_its_own_rows_and_other_groups_stay_whole():
    plan = _plan([10, 50, 11, 49, 5, 6], [0, 0, 0, 0, 1, 1], budget=100, keep_groups=True)
    assert not plan.groups_whole
    # group 0 (200 padded tokens) in two pieces, longest rows first; group 1 would fit beside the second
    # piece but does not join it, so the learner meets each split group's pieces with nothing between
    assert [part.tolist() for part in plan.rows] == [[1, 3], [0, 2], [4, 5]]


def test_no_budget_or_a_batch_that_fits_is_one_micro_batch():
    assert len(_plan([5, 9, 7], [0, 0, 1], None)) == 1
    assert len(_plan([5, 9, 7], [0, 0, 1], 27)) == 1
    assert len(_plan([5, 9, 7], [0, 0, 1], 26)) == 2


def test_a_packed_plan_counts_real_tokens_and_fits_more_rows_under_the_same_budget():
    gen = torch.Generator().manual_seed(0)
    # log-normal lengths with a wide spread: a padded micro-batch pays for its longest row in every row
    lengths = (torch.exp(torch.randn(64, generator=gen) * 0.7) * 60).clamp(8, 400).long()
    groups = torch.arange(64) // 8
    budget = 3200  # 8 of the longest rows
    padded = micro_batches.plan(lengths, groups, budget, keep_groups=False)
    packed = micro_batches.plan(lengths, groups, budget, keep_groups=False, packed=True)
    assert torch.equal(torch.cat(packed.rows).sort().values, torch.arange(64))
    for micro in packed.micro_batches:
        assert int(lengths[micro.rows].sum()) <= budget
        assert micro.packing is not None and micro.packing.lengths == tuple(lengths[micro.rows].tolist())
    assert all(micro.packing is None for micro in padded.micro_batches)
    assert 64 / len(packed) >= 1.4 * 64 / len(padded)  # rows per micro-batch: 32 against 21
    padded_tokens = sum(len(micro.rows) * micro.width for micro in padded.micro_batches)
    assert padded_tokens >= 1.2 * int(lengths.sum())
    # fewer micro-batches than the real tokens need at this budget would be impossible; first fit stays close
    assert len(packed) <= int(lengths.sum()) // budget + 2


def test_a_packed_plan_keeps_groups_whole_and_splits_a_group_over_the_budget_by_its_real_tokens():
    plan = _plan_packed([10, 50, 11, 49, 12, 48], [0, 0, 1, 1, 2, 2], budget=120, keep_groups=True)
    assert plan.groups_whole and sorted(part.tolist() for part in plan.rows) == [[0, 1, 2, 3], [4, 5]]
    split = _plan_packed([10, 50, 11, 49], [0, 0, 0, 0], budget=100, keep_groups=True)
    assert not split.groups_whole and [part.tolist() for part in split.rows] == [[1, 3], [0, 2]]
    assert all(micro.group_rows.tolist() == [0, 1, 2, 3] for micro in split.micro_batches)


def test_packing_lays_the_rows_end_to_end_and_puts_each_scored_position_in_its_padded_place():
    samples = [
        dict(
            prompt_ids=[1, 2],
            completion_ids=list(range(10, 10 + k)),
            behaviour_logprobs=[-1.0] * k,
            reward=0.0,
            group_id=0,
            version=0,
        )
        for k in (1, 5, 3)
    ]
    batch = learner_batch.collate(samples, 0)
    (micro,) = micro_batches.plan(batch.sequence_lengths, batch.group_ids, None, False, packed=True).micro_batches
    packing = micro.packing
    assert packing.lengths == (3, 7, 5) and micro.width == 7
    packed_ids = batch.input_ids.reshape(-1)[packing.tokens]
    assert torch.equal(packed_ids, torch.cat([batch.input_ids[row, :n] for row, n in enumerate((3, 7, 5))]))
    assert packing.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]]
    assert packing.cu_seqlens.tolist() == [0, 3, 10, 15] and packing.max_length == 7
    # each scored position's next token is its row's next token: the padded [b, width - 1] target at targets_at
    padded_targets = batch.input_ids[:, 1:].reshape(-1)
    assert torch.equal(packed_ids[packing.scored + 1], padded_targets[packing.targets_at])
    assert len(packing.scored) == 15 - 3  # every position but each row's last
    covered = torch.zeros(3 * 6, dtype=torch.bool)
    covered[packing.targets_at] = True
    assert torch.equal(covered.view(3, 6)[batch.loss_mask], torch.ones(int(batch.loss_mask.sum()), dtype=torch.bool))
    # the rows as a right-padded [3, 7] batch of packed positions, padding repeating each row's start, and back
    assert packing.row_spans.view(3, 7).tolist() == [
        [0, 1, 2, 0, 0, 0, 0],
        [3, 4, 5, 6, 7, 8, 9],
        [10, 11, 12, 13, 14, 10, 10],
    ]
    assert torch.equal(packing.row_spans[packing.row_places], torch.arange(15))


def _gram_cost(lengths, groups):
    return sum(len(group) * max(lengths[i] for i in group) ** 2 for group in groups)


def _best_gram_cost(lengths, buckets, bucket_cost=0.0):
    """Brute force: every split of the rows sorted by length into at most `buckets` runs, each costing
    `bucket_cost` besides its Gram cost."""
    import itertools

    ordered = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = None
    for count in range(1, buckets + 1):
        for cuts in itertools.combinations(range(1, len(ordered)), count - 1):
            bounds = [0, *cuts, len(ordered)]
            groups = [ordered[a:b] for a, b in itertools.pairwise(bounds)]
            cost = _gram_cost(lengths, groups) + count * bucket_cost
            best = cost if best is None else min(best, cost)
    return best


def test_row_buckets_keep_equal_rows_together_and_spread_rows_near_the_least_gram_cost():
    assert micro_batches.row_buckets([30] * 8) == [list(range(8))]
    gen = torch.Generator().manual_seed(1)
    for trial in range(5):
        lengths = torch.randint(2, 300, (10,), generator=gen).tolist()
        groups = micro_batches.row_buckets(lengths)
        assert sorted(i for group in groups for i in group) == list(range(10)), trial
        assert len(groups) <= micro_batches.MAX_ROW_BUCKETS
        cost, best = _gram_cost(lengths, groups), _best_gram_cost(lengths, micro_batches.MAX_ROW_BUCKETS)
        assert best <= cost <= 1.1 * best, (trial, lengths, groups)
        assert cost < _gram_cost(lengths, [list(range(10))]), trial  # one bucket of all would pad to the longest


def test_a_bucket_that_costs_more_than_its_padding_saves_is_not_made():
    lengths = [10, 12, 300, 310, 600, 620]
    assert len(micro_batches.row_buckets(lengths, bucket_cost=0.0)) == 3
    for bucket_cost in (1e5, 4e5, 1e6):  # each bucket's fixed cost counts: the least total, within the slack
        groups = micro_batches.row_buckets(lengths, bucket_cost=bucket_cost)
        best = _best_gram_cost(lengths, micro_batches.MAX_ROW_BUCKETS, bucket_cost)
        assert best <= _gram_cost(lengths, groups) + len(groups) * bucket_cost <= 1.1 * best, bucket_cost
    assert micro_batches.row_buckets(lengths, bucket_cost=1e7) == [list(range(6))]  # more than any split saves
    assert micro_batches.row_buckets(lengths, bucket_cost=math.inf) == [list(range(6))]
    packing = micro_batches.Packing.of(lengths, 620, torch.device("cpu"))  # no per-sample products: no buckets
    assert packing.buckets == ()


def test_a_row_bucket_unpacks_its_own_rows_from_the_packed_sequence():
    lengths = [2, 60, 7, 25, 40, 3, 13, 55]
    packing = micro_batches.Packing.of(lengths, max(lengths), torch.device("cpu"), bucket_cost=0.0)
    assert len(packing.buckets) > 1
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    packed = torch.arange(1.0, sum(lengths) + 1).view(1, -1, 1).expand(1, -1, 3)  # [1, N, 3], no zero token
    seen = []
    for bucket in packing.buckets:
        rows = bucket.rows.tolist()
        assert bucket.width == max(lengths[r] for r in rows)
        laid = bucket.unpack(packed)
        unzeroed = bucket.unpack(packed, zero_padding=False)
        assert laid.shape == unzeroed.shape == (len(rows), bucket.width, 3)
        for slot, row in enumerate(rows):
            want = torch.arange(starts[row] + 1.0, starts[row] + lengths[row] + 1)
            assert torch.equal(laid[slot, : lengths[row], 0], want), row
            assert torch.equal(unzeroed[slot, : lengths[row], 0], want), row
            assert not laid[slot, lengths[row] :].any(), row  # zeros past the row's end
            # or, unzeroed, the row's own first token: a bad value in one row reaches no other row's products
            assert (unzeroed[slot, lengths[row] :] == starts[row] + 1.0).all(), row
        seen += rows
    assert sorted(seen) == list(range(len(lengths)))


def test_trimming_drops_only_the_padding_no_row_uses():
    samples = [
        dict(
            prompt_ids=[1, 2], completion_ids=[3] * k, behaviour_logprobs=[-1.0] * k, reward=0.0, group_id=0, version=0
        )
        for k in (2, 9)
    ]
    batch = learner_batch.collate(samples, 0)
    short = batch.rows(torch.tensor([0])).trimmed()
    assert short.input_ids.shape == (1, 4) and short.loss_mask.shape == (1, 3)
    assert torch.equal(short.loss_mask[0], batch.loss_mask[0, :3]) and batch.loss_mask[0, 3:].sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_their_gradient_equal_the_plain_log_softmax(monkeypatch, dtype):
    monkeypatch.setattr(learner_batch, "CHUNK_LOGIT_ELEMENTS", 3 * 50)  # 3 positions per chunk: many chunks
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, 50, generator=gen).to(dtype).requires_grad_()
    ids = torch.randint(0, 50, (4, 9), generator=gen)
    weights = torch.randn(4, 8, generator=gen)
    got = learner_batch.token_logprobs(logits, ids, temperature=0.7)
    (got * weights).sum().backward()
    got_grad, logits.grad = logits.grad.clone(), None
    plain = torch.log_softmax(logits[:, :-1].float() / 0.7, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (plain * weights).sum().backward()
    assert got.dtype == torch.float32
    assert torch.allclose(got, plain, atol=1e-5)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got_grad.float(), logits.grad.float(), atol=tolerance)


def test_chunked_logprob_gradient_equals_autograd_of_the_masked_sum(monkeypatch):
    """VCPO's closed-form d/d logits of sum_t mask * log pi, written in chunks of 2 positions (rows cross)."""
    monkeypatch.setattr(learner_batch, "CHUNK_LOGIT_ELEMENTS", 2 * 30)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 30, generator=gen, requires_grad=True)
    ids = torch.randint(0, 30, (3, 7), generator=gen)
    mask = torch.rand(3, 6, generator=gen) > 0.3
    plain = torch.log_softmax(logits[:, :-1] / 0.8, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (want,) = torch.autograd.grad((plain * mask).sum(), logits)
    got = learner_batch.sequence_logprob_grad(logits, ids, mask, temperature=0.8)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6)


def test_chunked_entropy_equals_the_whole_softmax(monkeypatch):
    monkeypatch.setattr(learner_batch, "CHUNK_LOGIT_ELEMENTS", 2 * 30)
    logits = torch.randn(3, 7, 30, generator=torch.Generator().manual_seed(1))
    log_p = torch.log_softmax(logits[:, :-1] / 1.3, dim=-1)
    assert torch.allclose(learner_batch.token_entropy(logits, 1.3), -(log_p.exp() * log_p).sum(-1), atol=1e-6)


def _policy(rows: int = 12, width: int = 10) -> PolicyBatch:
    gen = torch.Generator().manual_seed(2)
    behaviour = -2.0 + torch.randn(rows, width, generator=gen)
    learner = behaviour + 0.4 * torch.randn(rows, width, generator=gen)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    advantages = torch.randn(rows, generator=gen)
    return PolicyBatch(learner * mask, behaviour * mask, advantages, mask)


PER_ROW = [name for name in sorted(registry.STABILIZERS) if registry.get(name).decides_per_row]


@pytest.mark.parametrize("name", PER_ROW)
def test_a_stabilizer_that_decides_per_row_decides_the_same_on_any_rows(name):
    """The learner trusts `decides_per_row` to decide per micro-batch with the loss mask's denominator: the
    decision on any set of rows must be the whole batch's on them, and keep the batch's mask."""
    stabilizer = registry.build(name)
    policy = _policy()
    whole = stabilizer.token_weights(policy)
    assert torch.equal(whole.mask.bool(), policy.mask)
    for rows in (torch.tensor([0, 5, 7]), torch.tensor([11]), torch.arange(6, 12)):
        part = stabilizer.token_weights(
            PolicyBatch(
                policy.logprobs[rows], policy.behaviour_logprobs[rows], policy.advantages[rows], policy.mask[rows]
            )
        )
        assert torch.allclose(part.weights, whole.weights[rows], rtol=1e-6, atol=0), rows
        assert torch.equal(part.mask.bool(), policy.mask[rows])


def test_the_rules_that_take_a_no_grad_pass_are_the_whole_batch_and_denominator_ones():
    """M2PO's trust region and BAPO's bounds depend on every token of the batch; the MIS rules drop tokens
    from the loss denominator, which must be known before the first backward."""
    assert set(registry.STABILIZERS) - set(PER_ROW) == {"m2po", "bapo", "mis_token", "mis_seq", "mis_geo"}


def test_rows_of_equal_length_unpack_as_a_view_of_the_packed_tensor():
    """Equal rows are already [b, width] end to end: no zeros, no copy (no kernels on a GPU)."""
    packing = micro_batches.Packing.of([4, 4, 4], 4, torch.device("cpu"), bucket_cost=0.0)
    (bucket,) = packing.buckets
    packed = torch.randn(1, 12, 3)
    laid = bucket.unpack(packed)
    assert bucket.whole and laid.data_ptr() == packed.data_ptr()
    assert torch.equal(laid, packed.view(3, 4, 3))
    other = micro_batches.Packing.of([4, 3, 4], 4, torch.device("cpu"), bucket_cost=1e12).buckets[0]
    assert not other.whole and other.unpack(packed[:, :11]).data_ptr() != packed.data_ptr()
